"""megashard.replication: the local tier's versions replicated to ranks on other nodes, and a restart
that takes a lost node's versions from those replicas (4 gloo ranks on CPU, 2 simulated nodes).

Ranks 0, 1 are node "n0", ranks 2, 3 node "n1" (``MEGASHARD_NODE_ID``); each node's local directory
is its own. ``--replication-jump 2 --replication-factor 2``: replica groups {0, 2} and {1, 3}.
"""
from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch

from distributed import all_ok, run_ranks
from megashard import api, localtier, replication, storage
from megashard.transport import SOLO, Comm

LAYOUT = "w4-tp1-pp1-ep1-vp1"
NODES = {"0": {"MEGASHARD_NODE_ID": "n0"}, "1": {"MEGASHARD_NODE_ID": "n0"},
         "2": {"MEGASHARD_NODE_ID": "n1"}, "3": {"MEGASHARD_NODE_ID": "n1"}}


def state(rank: int, it: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + it)
    return {"w": torch.randn(1000, generator=g), "b": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "iteration": it}


def files_of(d: str) -> dict:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def save_own(root: str, rank: int, it: int) -> None:
    localtier.prepare(root, LAYOUT, rank)
    api.save(state(rank, it), localtier.version_dir(root, LAYOUT, rank, it), process_group=SOLO, fsync=False)
    localtier.after_commit(root, LAYOUT, rank, it)


def load_own(root: str, rank: int, it: int) -> dict:
    out = {"w": torch.empty(1000), "b": torch.empty(3, 7, dtype=torch.bfloat16), "iteration": None}
    api.load(out, localtier.version_dir(root, LAYOUT, rank, it), process_group=SOLO)
    return out


def dead_temp(final: str) -> str:
    """What a replication SIGKILLed mid-way leaves: a temporary with a partial file, its owner gone."""
    tmp = storage.make_temp_dir(final, "deadbeef")
    owner = os.path.join(tmp, storage.OWNER_NAME)
    record = json.loads(open(owner).read()) | {"pid": 2**22 + 1}  # a process of this machine that is gone
    with open(owner, "w") as f:
        json.dump(record, f)
    with open(os.path.join(tmp, "shard.tensors"), "wb") as f:
        f.write(b"\0" * 100)
    return tmp


def _scenarios(rank: int, world: int, base: str) -> dict:
    import torch.distributed as dist

    node = os.environ["MEGASHARD_NODE_ID"]
    root = os.path.join(base, node)
    comm = Comm()
    peer = (rank + 2) % 4
    out: dict = {}

    # a J that puts a replica on the same node is refused on every rank
    with pytest.raises(Exception) as bad:
        replication.Replicator(root, LAYOUT, 1, 2, comm)
    out["bad_jump"] = str(bad.value)

    rep = replication.Replicator(root, LAYOUT, 2, 2, comm)
    assert rep.peers == [peer]
    for it in (1, 2, 3):
        rep.wait()
        save_own(root, rank, it)
        dist.barrier()
        rep.start(it)
    rep.wait()
    assert not rep.broken and not any(h["errors"] for h in rep.history), rep.history
    dist.barrier()
    # the peer's version, replicated on this node: bit-exact, committed, the last two only, 0600
    peer_root = os.path.join(base, "n1" if node == "n0" else "n0")
    held = localtier.replica_dir(root, LAYOUT, peer)
    assert sorted(os.listdir(held)) == ["iter_0000002", "iter_0000003"], os.listdir(held)
    got = localtier.replica_version_dir(root, LAYOUT, peer, 3)
    assert files_of(got) == files_of(localtier.version_dir(peer_root, LAYOUT, peer, 3))
    assert {stat.S_IMODE(os.stat(os.path.join(got, f)).st_mode) for f in os.listdir(got)} == {0o600}
    assert localtier.complete_replica_iterations(root, LAYOUT, rank) == []  # never on its own node
    dist.barrier()

    # node n1 loses its own versions: the restart restores them from n0's replicas, bit-exact
    if node == "n1":
        shutil.rmtree(localtier.rank_dir(root, LAYOUT, rank))
    dist.barrier()
    assert replication.resolve(comm, root, LAYOUT, -1, (2, 2)) == (3, "")
    loaded = load_own(root, rank, 3)
    want = state(rank, 3)
    assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"])
    dist.barrier()

    # iteration 4 saved everywhere, its replication SIGKILLed mid-way (a partial temporary on n0):
    # n1 loses its versions again: the previous version (3) is restored, never the incomplete 4
    save_own(root, rank, 4)
    if node == "n0":
        dead_temp(localtier.replica_version_dir(root, LAYOUT, peer, 4))
    dist.barrier()
    if node == "n1":
        shutil.rmtree(localtier.rank_dir(root, LAYOUT, rank))
    dist.barrier()
    assert replication.resolve(comm, root, LAYOUT, -1, (2, 2)) == (3, "")
    assert torch.equal(load_own(root, rank, 3)["w"], state(rank, 3)["w"])
    # not newer than the persistent checkpoint: the local tier is not used
    it, why = replication.resolve(comm, root, LAYOUT, 3, (2, 2))
    assert it is None and "is not newer than the persistent one (iteration 3)" in why
    dist.barrier()

    # every copy of rank 3's versions lost (its own and the replica on n0): fall back, no transfer
    if rank == 3:
        shutil.rmtree(localtier.rank_dir(root, LAYOUT, rank))
    if rank == 1:
        shutil.rmtree(localtier.replica_dir(root, LAYOUT, 3))
    dist.barrier()
    out["lost"] = replication.resolve(comm, root, LAYOUT, -1, (2, 2))
    return out


def test_replicate_restore_from_peers_and_fall_back(tmp_path):
    res = all_ok(run_ranks(_scenarios, 4, str(tmp_path), env=NODES, timeout=120))
    for r in res:
        assert "rank 0 and its replica rank 1 are on the same node 'n0'" in r["bad_jump"] or \
            "rank 2 and its replica rank 3 are on the same node 'n1'" in r["bad_jump"], r["bad_jump"]
        assert "set --replication-jump to the number of ranks per node" in r["bad_jump"]
        assert r["lost"] == (None, "no complete local checkpoint on rank 3")


def test_replica_groups_are_megatrons():
    # blocks of J*F ranks; inside one, r, r+J, ..., r+(F-1)J
    assert [replication.replica_group(r, 8, 2, 2) for r in range(8)] == [
        [0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert replication.replica_group(5, 12, 2, 3) == [1, 3, 5]
    with pytest.raises(Exception, match="must divide the world size 6"):
        replication.replica_group(0, 6, 2, 2)
    # rank 0 decides who sends whom what; never a mix of iterations
    reports = [{"own": [3, 4], "replicas": {"2": [2, 3]}}, {"own": [3, 4], "replicas": {"3": [3]}},
               {"own": [], "replicas": {"0": [3, 4]}}, {"own": [4], "replicas": {"1": [3, 4]}}]
    assert replication.decide(reports, -1) == [
        {"iteration": 3, "why": "", "fetch_from": None, "serve": [2]},
        {"iteration": 3, "why": "", "fetch_from": None, "serve": [3]},
        {"iteration": 3, "why": "", "fetch_from": 0, "serve": []},
        {"iteration": 3, "why": "", "fetch_from": 1, "serve": []}]

"""megashard.replication: the local tier's versions replicated to ranks on other nodes, and a restart
that takes a lost node's versions from those replicas (4 gloo ranks on CPU, 2 simulated nodes).

Ranks 0, 1 are node "n0", ranks 2, 3 node "n1" (``MEGASHARD_NODE_ID``); each node's local directory
is its own. ``--replication-jump 2 --replication-factor 2``: replica groups {0, 2} and {1, 3}.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat

import pytest
import torch

from distributed import all_ok, run_ranks
from megashard import api, localtier, replication, storage
from megashard.transport import SOLO, Comm

LAYOUT = "w4-tp1-pp1-ep1-vp1"
NODES = {"0": {"MEGASHARD_NODE_ID": "n0"}, "1": {"MEGASHARD_NODE_ID": "n0"},
         "2": {"MEGASHARD_NODE_ID": "n1"}, "3": {"MEGASHARD_NODE_ID": "n1"}}


def state(rank: int, it: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + it)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "iteration": it}


def files_of(d: str) -> dict:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def save_own(root: str, rank: int, it: int, n: int = 1000) -> None:
    localtier.prepare(root, LAYOUT, rank)
    api.save(state(rank, it, n), localtier.version_dir(root, LAYOUT, rank, it), process_group=SOLO, fsync=False)
    localtier.after_commit(root, LAYOUT, rank, it)


def load_own(root: str, rank: int, it: int, n: int = 1000) -> dict:
    out = {"w": torch.empty(n), "b": torch.empty(3, 7, dtype=torch.bfloat16), "iteration": None}
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


BIG = 1 << 16  # 256 KiB per version, sent in 16 KiB messages: a kill lands mid-stream
# the job's timeout (seconds) in the stalled-peer test. It bounds every wait of that job, also the healthy
# replications of iterations 2 and 3: 5 s was short for 4 ranks on a loaded 2-core CI box. 15 s is still
# far below the side group's own 30 min, which a replication that ignored the job's timeout would wait.
STALL_TIMEOUT = 15.0


def _killed_mid_replication(rank: int, world: int, base: str, how: str = "kill") -> dict:
    """Iterations 2 and 3 saved and replicated; 4 saved everywhere, then rank 3 stops in the middle of
    its replication (part of rank 1's version written on n1, part of its own sent to n0): SIGKILLed
    (``how="kill"``), or its replication thread stalled for longer than the job's timeout ("stall")."""
    import time

    import torch.distributed as dist

    root = os.path.join(base, os.environ["MEGASHARD_NODE_ID"])
    replication.CHUNK = 16 << 10
    rep = replication.Replicator(root, LAYOUT, 2, 2, Comm(timeout=STALL_TIMEOUT if how == "stall" else None))
    for it in (2, 3, 4):
        rep.wait()
        save_own(root, rank, it, BIG)
        dist.barrier()
        if it == 4 and rank == 3:
            write, seen = replication._Incoming.write, []

            def stop(self, i, off, buf):
                write(self, i, off, buf)
                seen.append(off)
                if len(seen) == 4:
                    if how == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(2 * STALL_TIMEOUT)

            replication._Incoming.write = stop
        rep.start(it)
    rep.wait()  # a survivor: never a hang past the job's timeout
    return {"broken": rep.broken, "history": rep.history}


def _restart_after_kill(rank: int, world: int, bases: dict) -> dict:
    """A restarted job on each copy of the nodes' directories: resolve, load bit-exact, replicate on."""
    import torch.distributed as dist

    node = os.environ["MEGASHARD_NODE_ID"]
    comm = Comm()
    out = {}
    for case, base in sorted(bases.items()):
        root = os.path.join(base, node)
        it, why = replication.resolve(comm, root, LAYOUT, -1, (2, 2))
        out[case] = it
        loaded, want = load_own(root, rank, it, BIG), state(rank, it, BIG)
        assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"]), case
        dist.barrier()
    # training goes on from 4: the next replication replaces the partial temporaries the kill left
    root = os.path.join(bases["kept"], node)
    replication.CHUNK = 16 << 10
    rep = replication.Replicator(root, LAYOUT, 2, 2, comm)
    save_own(root, rank, 5, BIG)
    dist.barrier()
    rep.start(5)
    rep.wait()
    assert not rep.broken and not any(h["errors"] for h in rep.history), rep.history
    dist.barrier()
    held = localtier.replica_dir(root, LAYOUT, (rank + 2) % 4)
    out["replicas"] = sorted(os.listdir(held))
    return out


def _fewer_ranks(rank: int, world: int, root: str) -> dict:
    """Two ranks on node n0, where a job of four ranks left its versions and replicas."""
    comm = Comm()
    return {"newer": replication.resolve(comm, root, "w2-tp1-pp1-ep1-vp1", 3, None),
            "older": replication.resolve(comm, root, "w2-tp1-pp1-ep1-vp1", 4, None)}


def test_sigkill_mid_replication_keeps_previous_versions_and_replicas(tmp_path):
    res = run_ranks(_killed_mid_replication, 4, str(tmp_path / "job"), env=NODES, timeout=120)
    assert res[3] == (False, "exit code -9"), res[3]
    (ok0, r0), (ok1, r1), (ok2, r2) = res[:3]
    assert ok0 and ok1 and ok2, res
    # rank 1 (rank 3's peer) reports the dead peer; ranks 0 and 2 replicated 4 to each other
    assert r1["broken"] and "replication of iteration 4" in r1["broken"], r1
    for r in (r0, r2):
        assert not r["broken"] and [h["iteration"] for h in r["history"]] == [2, 3, 4], r
        assert not any(h["errors"] for h in r["history"]), r
    job = tmp_path / "job"
    partial = [n for n in os.listdir(localtier.replica_dir(str(job / "n0"), LAYOUT, 3)) if ".tmp-" in n]
    assert localtier.complete_replica_iterations(str(job / "n0"), LAYOUT, 3) == [2, 3] and partial, partial
    assert localtier.complete_replica_iterations(str(job / "n1"), LAYOUT, 1) == [2, 3]
    assert localtier.complete_iterations(str(job / "n1"), LAYOUT, 3) == [3, 4]  # committed before replicating
    bases = {}
    for case, lost in (("kept", None), ("n0 lost", "n0"), ("n1 lost", "n1")):
        bases[case] = str(tmp_path / case.replace(" ", "-"))
        shutil.copytree(job, bases[case])
        if lost:  # the node replaced by an empty one
            shutil.rmtree(os.path.join(bases[case], lost))
            os.mkdir(os.path.join(bases[case], lost))
    res = all_ok(run_ranks(_restart_after_kill, 4, bases, env=NODES, timeout=120))
    for rank, r in enumerate(res):
        # nothing lost: the newest (4, every rank's own); a node lost: 3, from the replicas of the
        # other node, since the killed replication of 4 left only a temporary there
        assert (r["kept"], r["n0 lost"], r["n1 lost"]) == (4, 3, 3), r
        assert r["replicas"] == ["iter_0000004", "iter_0000005"] if rank in (0, 2) else \
            ["iter_0000003", "iter_0000005"], r
    # restarted on fewer nodes (n1 gone, 2 ranks on n0): the versions of 4 ranks are not resharded;
    # the job falls back to the persistent checkpoint, saying why, on every rank alike
    res = all_ok(run_ranks(_fewer_ranks, 2, os.path.join(bases["n1 lost"], "n0"), timeout=120))
    for r in res:
        assert r["newer"] == (None, "layout changed from w4-tp1-pp1-ep1-vp1 (local iteration 4) to "
                                    "w2-tp1-pp1-ep1-vp1: local versions are not resharded"), r
        assert r["older"] == (None, "no complete local checkpoint on any rank"), r


def test_stalled_peer_mid_replication_fails_within_the_jobs_timeout(tmp_path):
    """A peer that stops answering (a node gone without closing its connections) fails the replication
    on the survivor within the job's timeout, not the side group's own (30 min for gloo)."""
    # ~45 s on a loaded 2-core box: the stalled rank sleeps 2 * STALL_TIMEOUT before its side ends
    res = all_ok(run_ranks(_killed_mid_replication, 4, str(tmp_path), "stall", env=NODES, timeout=240))
    assert f"no answer within {STALL_TIMEOUT:.0f} s" in (res[1]["broken"] or ""), res[1]
    assert [h["iteration"] for h in res[1]["history"]] == [2, 3], res[1]
    assert [h["iteration"] for h in res[0]["history"]] == [2, 3, 4] and not res[0]["broken"], res[0]
    assert localtier.complete_replica_iterations(str(tmp_path / "n0"), LAYOUT, 3) == [2, 3]


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
    assert replication.decide(reports, -1, LAYOUT) == [
        {"iteration": 3, "why": "", "fetch_from": None, "serve": [2]},
        {"iteration": 3, "why": "", "fetch_from": None, "serve": [3]},
        {"iteration": 3, "why": "", "fetch_from": 0, "serve": []},
        {"iteration": 3, "why": "", "fetch_from": 1, "serve": []}]
    # the layout changed (4 ranks before, 2 now): no version of this layout; the other one is named
    moved = [{"own": [], "replicas": {}, "other": {"w4-tp2-pp1-ep1-vp1": 6, "w2-tp1-pp1-ep1-vp1": 2}},
             {"own": [], "replicas": {}, "other": {"w4-tp2-pp1-ep1-vp1": 5}}]
    why = "layout changed from w4-tp2-pp1-ep1-vp1 (local iteration 6) to w2-tp2-pp1-ep1-vp1: local versions " \
          "are not resharded"
    assert replication.decide(moved, 4, "w2-tp2-pp1-ep1-vp1") == [{"iteration": None, "why": why}] * 2
    # ... unless they are not newer than the persistent checkpoint: then the usual reason
    assert replication.decide(moved, 6, "w2-tp2-pp1-ep1-vp1") == [
        {"iteration": None, "why": "no complete local checkpoint on any rank"}] * 2

"""Multi-node claims re-proved on a cluster of Linux namespaces (``tests/cluster.py``): 2 nodes with
their own hostname, network, /dev/shm and node-local disk, SeaweedFS on a rate-limited storage host
(FUSE mount on every node, S3 gateway), torchrun's c10d rendezvous between the nodes, 2 ranks each.

One cluster serves every test here but one; one torchrun job (``tests/scripts/cluster_job.py``) most of
them, the Megatron example, the two concurrent saving jobs and the node kill launch their own. The
local-tier restart builds its own cluster of 3 nodes (one of them replaced by a fresh node). Without
root (or FUSE, or the weed binary) the module skips with the reason; CI runs as root, where
``MEGASHARD_CLUSTER_REQUIRED=1`` (set by ``.ci/run``) turns that skip into a failure.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Tuple

import pytest

import cluster
from layouts import Layout, model_state
from test_megatron_lm_install import mlm_tree  # noqa: F401 - a fixture (Megatron-LM's training tree)

if TYPE_CHECKING:
    from megatron_helpers.mlm_tree import Tree
    from megatron_helpers.runner import Run

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
JOB = HERE / "scripts" / "cluster_job.py"
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
SAVED, RESHARDED = Layout(tp=2, dp=2), Layout(tp=4)  # as in tests/scripts/cluster_job.py
CASES = ("save_shared", "scatter", "reshard", "local_save", "local_copy", "s3")

_why = cluster.missing_prerequisites()
if _why and os.environ.get("MEGASHARD_CLUSTER_REQUIRED") == "1":
    raise RuntimeError(f"MEGASHARD_CLUSTER_REQUIRED=1 but {_why}")
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


@pytest.fixture(scope="module")
def the_cluster() -> Iterator[cluster.Cluster]:
    with cluster.Cluster(nodes=NNODES) as c:
        yield c


@pytest.fixture(scope="module")
def job(the_cluster: cluster.Cluster, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[dict]]:
    """Run the job on both nodes once; per case, every rank's result (by rank)."""
    c = the_cluster
    out = tmp_path_factory.mktemp("cluster-job")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "MEGASHARD_HUGEPAGES": "0", **c.s3_env()}
    codes = c.torchrun(str(JOB), ["--shared-dir", str(c.shared), "--node-local-dir", str(c.local),
                                  "--s3-url", "s3://megashard-cluster/job/ckpt", "--results", str(out)],
                       nproc=NPROC, env=env, name="job")
    assert codes == [0] * NNODES, f"agents exited {codes}\n{c.job_logs('job')}"
    results: Dict[str, List[dict]] = {}
    for case in CASES:
        files = [out / f"{case}-rank{r}.json" for r in range(WORLD)]
        missing = [f.name for f in files if not f.exists()]
        assert not missing, f"no result from {missing}\n{c.job_logs('job')}"
        results[case] = [json.loads(f.read_text()) for f in files]
    return results


def _ok(results: List[dict]) -> None:
    bad = [f"rank {r['rank']} on {r['host']}: {r['failed']}" for r in results if "failed" in r]
    assert not bad, "\n".join(bad)


def _by_host(results: List[dict]) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for r in results:
        out.setdefault(r["host"], []).append(r)
    return out


def _node_unique_bytes(layout: Layout, ranks: List[int]) -> int:
    """Bytes of the checkpoint that the given ranks (one node) need, each region once."""
    regions = {(sh.key, sh.global_offset, tuple(sh.data.shape)): sh.data.numel() * sh.data.element_size()
               for r in ranks for chunk in model_state(layout, r, empty=True).values() for sh in chunk.values()}
    return sum(regions.values())


def _assert_one_reader_per_node(results: List[dict], layout: Layout) -> None:
    """Bit-exact on every rank; per node (hostname), every byte it needs left storage exactly once
    (``bytes_read`` summed over the node's ranks: the reader's, and its peers' reads through the
    reader's passed descriptors)."""
    _ok(results)
    nodes = _by_host(results)
    assert sorted(nodes) == [f"node{i}" for i in range(NNODES)], f"hostnames seen: {sorted(nodes)}"
    for host, ranks in nodes.items():
        assert sorted(r["local_rank"] for r in ranks) == list(range(NPROC)), (host, ranks)
        for r in ranks:
            assert r["mismatches"] == [], f"rank {r['rank']} on {host}: loaded data differs: {r['mismatches']}"
            assert r["mode"] == "scatter", (host, r)
        unique = _node_unique_bytes(layout, [r["rank"] for r in ranks])
        assert sum(r["bytes_read"] for r in ranks) == unique, (host, unique, ranks)


def test_cluster_nodes_are_separate_hosts_sharing_one_file_system(the_cluster: cluster.Cluster) -> None:
    c = the_cluster
    c.run_in_node(0, ["sh", "-c", f"echo from-node0 > {c.shared}/probe && echo local0 > {c.local}/probe "
                                  "&& echo shm0 > /dev/shm/probe"])
    seen = c.run_in_node(1, ["sh", "-c", f"hostname; cat {c.shared}/probe; ls -A {c.local} /dev/shm; "
                                         f"getent hosts node0"]).stdout.split()
    c.run_in_node(0, ["rm", f"{c.shared}/probe", f"{c.local}/probe", "/dev/shm/probe"])
    assert seen[:2] == ["node1", "from-node0"], seen  # own hostname; the FUSE mount is shared
    assert "probe" not in seen, f"node 1 sees node 0's node-local dir or /dev/shm: {seen}"
    assert cluster.node_ip(0) in seen, seen
    # storage is the bottleneck: its link is rate-limited below the node links
    rates = c.egress_mbit()
    assert rates == {"storage": c.storage_mbit, **{f"node{i}": c.node_mbit for i in range(NNODES)}}, rates
    assert c.storage_mbit < c.node_mbit


def test_save_from_two_nodes_to_the_shared_mount(job: Dict[str, List[dict]]) -> None:
    results = job["save_shared"]
    _ok(results)
    for r in results:
        assert r["error"] == {"raised": None}, f"rank {r['rank']} on {r['host']}: {r['error']}"
        assert r["listing"] == ["ckpt"], f"rank {r['rank']} on {r['host']} sees {r['listing']}"
    assert sorted({r["host"] for r in results}) == ["node0", "node1"]


def test_scatter_one_reader_per_node_and_dev_shm_empty(the_cluster: cluster.Cluster,
                                                       job: Dict[str, List[dict]]) -> None:
    results = job["scatter"]
    _assert_one_reader_per_node(results, SAVED)
    for r in results:
        if r["local_rank"] == 0:
            assert r["bytes_received"] == 0 and r["bytes_read"] > 0, r
    for i in range(NNODES):  # the job is over: nothing of it left in any node's /dev/shm
        left = the_cluster.run_in_node(i, ["ls", "-A", "/dev/shm"]).stdout.split()
        assert left == [], f"node {i}'s /dev/shm after the job: {left}"


def test_scatter_reshard_from_the_shared_mount(job: Dict[str, List[dict]]) -> None:
    _assert_one_reader_per_node(job["reshard"], RESHARDED)


def test_node_local_save_refused_on_every_rank(job: Dict[str, List[dict]]) -> None:
    results = job["local_save"]
    _ok(results)
    first_host = results[0]["host"]
    blind = [r["rank"] for r in results if r["host"] != first_host]  # rank 0's directory is not theirs
    blind_host = results[blind[0]]["host"]
    for r in results:
        assert r["raised"] == "DistributedCheckpointError" and r["megashard_error"], (
            f"rank {r['rank']} on {r['host']}: a node-local save was not refused: {r}")
        assert f"failed on rank(s) {', '.join(map(str, blind))}:" in r["message"], r["message"]
        assert f"on this host ({blind_host}) is another directory than on rank 0" in r["message"], r["message"]
        assert "save to a shared filesystem every rank sees" in r["message"], r["message"]
        # nothing committed and no temporary left on any node's local disk
        assert r["listing"] == [], f"rank {r['rank']} on {r['host']}: {r['listing']}"


def test_node_local_copies_load_with_scatter(job: Dict[str, List[dict]]) -> None:
    """Each node loads its own copy on its own disk (``L/copy``: another directory on each node)."""
    _assert_one_reader_per_node(job["local_copy"], SAVED)


def test_s3_scatter_only_node_readers_talk_to_the_store(job: Dict[str, List[dict]]) -> None:
    results = job["s3"]
    _assert_one_reader_per_node(results, SAVED)
    for r in results:
        if r["local_rank"] == 0:
            assert r["requests"].get("GET", 0) > 0 and r["bytes_received"] == 0, r
        else:
            assert sum(r["requests"].values()) == 0, f"rank {r['rank']} on {r['host']} talked to S3: {r['requests']}"
            assert r["bytes_read"] == 0 and r["bytes_received"] == r["needed_bytes"], r


MLM_ITERS = ["--train-iters", "6", "--lr-decay-iters", "6", "--save-interval", "3"]


def _start_pretrain(c: cluster.Cluster, name: str, args: List[str], port: int) -> List[subprocess.Popen]:
    """``examples/pretrain_gpt.py`` (Megatron, tiny GPT, CPU) started on both nodes x 2 ranks."""
    from megatron_helpers.runner import EXAMPLE, FAST_EXIT, TINY

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(HERE), os.environ.get("PYTHONPATH")])),
           "MEGASHARD_HUGEPAGES": "0", "PYTHONWARNINGS": "ignore"}
    return c.start_torchrun("-m", [FAST_EXIT, EXAMPLE, *TINY, *args], nproc=NPROC, env=env, name=name, port=port)


def _pretrain_result(c: cluster.Cluster, name: str, args: List[str], agents: List[subprocess.Popen]) -> "Run":
    """The run's output parsed (losses and digests are logged by rank 0, on whichever node it landed)."""
    from megatron_helpers.runner import parse

    codes = c.wait_torchrun(agents, 300, name)
    out = "\n".join((c.logs / f"{name}-node{i}.log").read_text(errors="replace") for i in range(NNODES))
    assert codes == [0] * NNODES, f"{name}: agents exited {codes}\n{c.job_logs(name)}"
    return parse(args, 0, out)


def test_megatron_example_on_two_nodes_resume_reshard_async(the_cluster: cluster.Cluster, tmp_path: Path) -> None:
    """The Megatron example (``examples/pretrain_gpt.py``) on 2 nodes x 2 ranks, TP=2 x DP=2 (one
    replica per node), checkpoints on the shared FUSE mount. Three launches (2 and 3 at once):

    1. 6 iterations with ``--async-save`` (saves at 3 and 6, each committed while training goes on);
    2. same layout, resumed from iteration 3 with ``--megashard-load-mode readonce`` (each file read
       on one node, exchanged over gloo between the nodes): losses 4-6 identical to run 1's and
       the loaded parameters' digest equal to what run 1 saved;
    3. resharded to TP=1 x DP=4 from iteration 3 (``auto``): the loaded model and optimizer state,
       re-saved with ``--dump-loaded-state``, equal iteration 3's global tensors bit for bit, and
       losses 4-6 within 1e-5 of run 1's."""
    pytest.importorskip("megatron.core")
    from megatron_helpers.runner import compare_checkpoints

    c = the_cluster
    root, dump = c.shared / "mlm", c.shared / "mlm-dump"
    args = ["--tensor-model-parallel-size", "2", "--save", str(root), "--async-save", *MLM_ITERS]
    base = _pretrain_result(c, "mlm-save", args, _start_pretrain(c, "mlm-save", args, 29430))
    assert sorted(base.losses) == [1, 2, 3, 4, 5, 6], base.output[-3000:]
    for it in (3, 6):
        assert f"saved checkpoint at iteration {it} to {root}/iter_{it:07d} (committed)" in base.output, \
            base.output[-3000:]
    tracker = c.run_in_node(1, ["cat", f"{root}/latest_checkpointed_iteration.txt"]).stdout.strip()
    assert tracker == "6", tracker  # seen from the other node
    left = c.run_in_node(1, ["ls", "-A", str(root)]).stdout.split()
    assert sorted(left) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"], left

    # the resume and the reshard run at once (two jobs on the same nodes: each reads iteration 3)
    runs = {"mlm-resume": ["--tensor-model-parallel-size", "2", "--load", str(root), "--ckpt-step", "3",
                           "--megashard-load-mode", "readonce", *MLM_ITERS],
            "mlm-reshard": ["--tensor-model-parallel-size", "1", "--load", str(root), "--ckpt-step", "3",
                            "--dump-loaded-state", str(dump), *MLM_ITERS]}
    agents = {name: _start_pretrain(c, name, args, port) for (name, args), port in zip(runs.items(), (29440, 29450))}
    resumed, resharded = (_pretrain_result(c, name, runs[name], agents[name]) for name in runs)
    assert f"{root}/iter_0000003 (iteration 3, full state" in (resumed.started or ""), resumed.output[-3000:]
    assert resumed.digests["start"] == base.digests["saved@3"]
    assert {i: resumed.losses[i] for i in (4, 5, 6)} == {i: base.losses[i] for i in (4, 5, 6)}
    assert {i: resumed.lrs[i] for i in (4, 5, 6)} == {i: base.lrs[i] for i in (4, 5, 6)}

    assert "(iteration 3, full state" in (resharded.started or ""), resharded.output[-3000:]
    for i in (4, 5, 6):
        assert abs(resharded.losses[i] - base.losses[i]) < 1e-5, (i, resharded.losses, base.losses)
    # compared here: the mount exists only in the nodes, whose mount namespaces see this machine's tmp_path
    got = {}
    for name, where in (("saved", f"{root}/iter_0000003"), ("loaded", f"{dump}/iter_0000003")):
        c.run_in_node(0, ["cp", "-r", where, str(tmp_path / name)])
        got[name] = str(tmp_path / name)
    cmp = compare_checkpoints(got["saved"], got["loaded"])
    assert cmp["only_a"] == [] and cmp["only_b"] == [] and cmp["differ"] == {}, cmp
    assert any(k.startswith("optimizer.state.exp_avg.") for k in cmp["compared"]), cmp["compared"]
    assert any(k.startswith("decoder.layers.") for k in cmp["compared"]), cmp["compared"]


LT_NODES, LT_NPROC, LT_VICTIM = 3, 2, 0
LT_TIER = "/dev/shm/megashard-tier"  # --non-persistent-local-ckpt-dir: the same path on every node, its own tmpfs
# Megatron's replica groups need J*F to divide the world size, so J=2 (ranks per node), F=2 is refused on 6
# ranks; J=3, F=2 pairs rank r with r+3: 0-3 and 1-4 (nodes 0-1, 0-2), 2-5 (nodes 1-2), every pair on two nodes
LT_REPLICATION = ["--replication", "--replication-jump", "3", "--replication-factor", "2"]
LT_LAYOUT = "megashard-w6-tp2-pp1-ep1-vp1"


def _tier(c: cluster.Cluster, i: int) -> Dict[str, List[str]]:
    """{directory under the local tier: its entries} on node ``i`` (ranks' versions and replicas)."""
    out = c.run_in_node(i, ["sh", "-c", f"cd {LT_TIER}/{LT_LAYOUT} 2>/dev/null && ls -d rank*/* replicas/*/* "
                                        "2>/dev/null || true"]).stdout.split()
    tree: Dict[str, List[str]] = {}
    for p in out:
        d, name = p.rsplit("/", 1)
        tree.setdefault(d, []).append(name)
    return {d: sorted(v) for d, v in sorted(tree.items())}


def test_megatron_local_tier_restart_on_a_replaced_node(mlm_tree: "Tree", tmp_path: Path) -> None:  # noqa: F811
    """Megatron-LM's ``pretrain_gpt.py`` on its own cluster of 3 nodes x 2 ranks (TP=2 in a node x DP=3),
    ``--non-persistent-ckpt-type local`` in each node's /dev/shm every 2 steps, replicated to another
    node (``--replication-jump 3 --replication-factor 2``), persistent saves to the shared FUSE mount
    every 4. SIGKILLed in step 8 (local versions 2 and 6 on every node, each replicated; persistent 4),
    node 0 (rank 0, the rendezvous host) destroyed and replaced by a fresh node with an empty /dev/shm;
    the restart resumes from the local tier at 6: ranks 0 and 1 get their versions from the replicas
    on nodes 1 and 2, byte for byte what node 0 held; step 7's loss equals the killed run's, every digit."""
    pytest.importorskip("megatron.core")
    from megatron_helpers.runner import FAST_EXIT
    from test_megatron_lm_install import ARGS, SCRIPT, lm_losses

    model = list(ARGS)
    model[model.index("--global-batch-size") + 1] = "6"  # micro-batch 2 x DP 3
    with cluster.Cluster(nodes=LT_NODES) as c:
        root = c.shared / "mlm-local"
        args = [*model, "--train-iters", "8", "--save-interval", "4", "--non-persistent-save-interval", "2",
                "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", LT_TIER, *LT_REPLICATION,
                "--save-format", "tensors", "--save", str(root), "--load", str(root)]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(HERE), os.environ.get("PYTHONPATH")])),
               "MEGASHARD_HUGEPAGES": "0", "PYTHONWARNINGS": "ignore", "MEGATRON_LM_DIR": mlm_tree.path,
               "CUDA_DEVICE_MAX_CONNECTIONS": "1"}

        def run(name: str, port: int, extra: Dict[str, str]) -> Tuple[List[int], str]:
            agents = c.start_torchrun("-m", [FAST_EXIT, str(SCRIPT), *args], nproc=LT_NPROC, env=env | extra,
                                      name=name, port=port)
            codes = c.wait_torchrun(agents, 300, name)
            return codes, "\n".join((c.logs / f"{name}-node{i}.log").read_text(errors="replace")
                                    for i in range(LT_NODES))

        codes, killed = run("lt-killed", 29460, {"MEGASHARD_TEST_KILL_AT": "7"})  # every rank, in step 8
        assert all(codes), f"the job was not killed: agents exited {codes}\n{c.job_logs('lt-killed')}"
        losses = lm_losses(killed)
        assert sorted(losses) == list(range(1, 8)), killed[-4000:]
        assert c.run_in_node(1, ["cat", f"{root}/latest_checkpointed_iteration.txt"]).stdout.strip() == "4"
        for i in range(LT_NODES):  # each node: its 2 ranks' versions 2 and 6, and the replicas it keeps
            held = _tier(c, i)
            ranks = [2 * i, 2 * i + 1]  # torchrun's c10d rendezvous orders the nodes by address
            peers = sorted((r + 3) % 6 for r in ranks)
            assert held == {**{f"rank{r:05d}": ["iter_0000002", "iter_0000006"] for r in ranks},
                            **{f"replicas/rank{r:05d}": ["iter_0000002", "iter_0000006"] for r in peers}}, (i, held)
        before = tmp_path / "node0-before"
        c.run_in_node(LT_VICTIM, ["cp", "-a", f"{LT_TIER}/{LT_LAYOUT}", str(before)])

        c.replace_node(LT_VICTIM)
        assert c.run_in_node(LT_VICTIM, ["ls", "-A", "/dev/shm"]).stdout.split() == []
        codes, resumed = run("lt-resumed", 29470, {})
        assert codes == [0] * LT_NODES, f"agents exited {codes}\n{c.job_logs('lt-resumed')}"
        restored = sorted(re.findall(r"restored rank (\d+)'s local checkpoint of iteration (\d+) "
                                     r"from rank (\d+)'s replica", resumed))
        assert restored == [("0", "6", "3"), ("1", "6", "4")], resumed[-4000:]
        loaded = re.findall(r"loaded local checkpoint \S+/rank(\d+)/iter_0000006 at iteration 6 "
                            r"\(optimizer loaded, rng loaded\)", resumed)
        assert "00000" in loaded, resumed[-4000:]  # rank 0 logs it
        again = lm_losses(resumed)
        assert sorted(again) == [7, 8], resumed[-4000:]
        assert again[7] == losses[7], (again, losses)
        assert c.run_in_node(1, ["cat", f"{root}/latest_checkpointed_iteration.txt"]).stdout.strip() == "8"
        # node 0's restored versions: the files node 0 held before it was destroyed, byte for byte
        assert _tier(c, LT_VICTIM) == {"rank00000": ["iter_0000006"], "rank00001": ["iter_0000006"]}
        after = tmp_path / "node0-after"
        c.run_in_node(LT_VICTIM, ["cp", "-a", f"{LT_TIER}/{LT_LAYOUT}", str(after)])
    for r in (0, 1):
        old, new = before / f"rank{r:05d}" / "iter_0000006", after / f"rank{r:05d}" / "iter_0000006"
        names = sorted(os.listdir(old))
        assert "manifest.json" in names and sorted(os.listdir(new)) == names, (r, names, os.listdir(new))
        for n in names:
            assert (old / n).read_bytes() == (new / n).read_bytes(), f"rank {r}: {n} differs"


TWO_SAVES = HERE / "scripts" / "cluster_two_saves.py"
TWO_ROUNDS = 3


COMMIT_RACE = HERE / "scripts" / "cluster_commit_race.py"
RACE_SAVES = 12


def test_two_nodes_committing_one_name_as_fast_as_they_can(the_cluster: cluster.Cluster, tmp_path: Path) -> None:
    """Both nodes save one directory of the shared mount 12 times each, back to back, starting
    together (``tests/scripts/cluster_commit_race.py``). ``weed mount`` renames directories entry by
    entry, so each node may see the other's commit half arrived, or get EIO from a raced rename
    (before the fix: about 1 save in 5 of 50 failed). Every save commits; the directory holds
    exactly one of the two last saves, bit for bit."""
    c = the_cluster
    race = c.shared / "race"
    race.mkdir()
    start = time.time() + 3
    procs = [subprocess.Popen(c.node_cmd(i, [sys.executable, str(COMMIT_RACE), "--node", str(i),
                                             "--dir", str(race / "ckpt"), "--start", str(start),
                                             "--saves", str(RACE_SAVES), "--out", str(tmp_path / f"node{i}.json")]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO), MEGASHARD_HUGEPAGES="0"))
             for i in range(NNODES)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {i}: exit {p.returncode}\n{out[-3000:]}"
        errors = json.loads((tmp_path / f"node{i}.json").read_text())["errors"]
        assert errors == [], f"node {i}: {errors}"
    c.run_in_node(0, [sys.executable, str(COMMIT_RACE), "--node", "0", "--dir", str(race / "ckpt"), "--start", "0",
                      "--saves", str(RACE_SAVES), "--out", str(tmp_path / "verify.json"), "--verify"], timeout=120)
    assert json.loads((tmp_path / "verify.json").read_text())["equals"] in ([0], [1])


def test_two_jobs_save_to_the_shared_mount_at_once(the_cluster: cluster.Cluster, tmp_path: Path) -> None:
    """Two torchrun jobs (each 2 nodes x 1 rank) start together and save 3 times each, alternating
    their own directory and one directory both use (``tests/scripts/cluster_two_saves.py``). Every
    save commits (a save of a name another save holds moves it aside and commits after it: last
    commit wins); each job's own checkpoint is its last save, bit for bit; the common one is
    exactly one of the jobs' last saves, bit for bit, never a mixture; nothing is left beside them."""
    c = the_cluster
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "MEGASHARD_HUGEPAGES": "0"}
    jobs = {"jobA": 29410, "jobB": 29420}
    agents = {j: c.start_torchrun(str(TWO_SAVES), ["--job", j, "--peer", next(k for k in jobs if k != j),
                                                   "--shared-dir", str(c.shared), "--results", str(tmp_path),
                                                   "--rounds", str(TWO_ROUNDS)],
                                  nproc=1, env=env, name=j, port=port)
              for j, port in jobs.items()}
    for j, procs in agents.items():
        codes = c.wait_torchrun(procs, 240, j)
        assert codes == [0] * NNODES, f"{j}: agents exited {codes}\n{c.job_logs(j)}"
    results = {j: [json.loads((tmp_path / f"{j}-rank{r}.json").read_text()) for r in range(NNODES)] for j in jobs}
    for j, rs in results.items():
        assert sorted(r["host"] for r in rs) == ["node0", "node1"], rs
        for r in rs:
            assert "failed" not in r, f"{j} rank {r['rank']}: {r['failed']}\n{c.job_logs(j)}"
            assert len(r["saves"]) == 2 * TWO_ROUNDS
            for sv in r["saves"]:
                assert sv["raised"] is None, f"{j} rank {r['rank']}: saving {sv['path']} raised {sv['raised']}"
            assert r["own"] == {"raised": None, "equals": [j, TWO_ROUNDS - 1],
                                "meta": {"job": j, "round": TWO_ROUNDS - 1}}, (j, r["own"])
            assert r["listing"][j] == ["ckpt"] and r["listing"]["same"] == ["ckpt"], r["listing"]
    # the saves of the common name overlapped in time (both jobs saved it while the other did)
    windows = {j: (min(sv["start"] for r in rs for sv in r["saves"][1::2]),
                   max(sv["end"] for r in rs for sv in r["saves"][1::2])) for j, rs in results.items()}
    (a0, a1), (b0, b1) = windows.values()
    assert a0 < b1 and b0 < a1, f"the two jobs' saves did not overlap: {windows}"
    same = {json.dumps(r["same"]) for rs in results.values() for r in rs}
    assert len(same) == 1, f"the ranks loaded different things from the common checkpoint: {same}"
    got = results["jobA"][0]["same"]
    assert got["raised"] is None and got["equals"] in ([j, TWO_ROUNDS - 1] for j in jobs), got
    assert got["meta"] == {"job": got["equals"][0], "round": TWO_ROUNDS - 1}, got


KILL_JOB = HERE / "scripts" / "cluster_kill_save.py"
KILL_TIMEOUT_S = 30  # the survivors' save(timeout=...)


def test_node_killed_mid_save_leaves_previous_checkpoint_loadable(the_cluster: cluster.Cluster,
                                                                 job: Dict[str, List[dict]],
                                                                 tmp_path: Path) -> None:
    """Last here: it kills a node of the shared cluster. Every rank re-saves ``S/ckpt`` (committed by
    the job's ``save_shared``) with other values; the node without rank 0 stops after writing its
    files, before the commit, and every process of it is killed (ranks, torchrun agent, weed mount).
    The surviving ranks raise, each well within its timeout; then each loads the previous
    checkpoint alone (``process_group=SOLO``: its group lost a node), bit-exact."""
    c = the_cluster
    _ok(job["save_shared"])  # the previous checkpoint exists
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "MEGASHARD_HUGEPAGES": "0"}
    agents = c.start_torchrun(str(KILL_JOB), ["--shared-dir", str(c.shared), "--results", str(tmp_path),
                                              "--timeout", str(KILL_TIMEOUT_S)], nproc=NPROC, env=env, name="kill")
    blocked: List[Path] = []
    deadline = time.monotonic() + 240
    while len(blocked) < NPROC and all(a.poll() is None for a in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
        blocked = sorted(tmp_path.glob("blocked-rank*"))
    assert len(blocked) == NPROC, f"the victim node's ranks never stopped mid-save: {blocked}\n{c.job_logs('kill')}"
    hosts = {p.read_text() for p in blocked}
    assert len(hosts) == 1, hosts
    victim = int(hosts.pop().removeprefix("node"))
    assert c.kill_node(victim), f"nothing to kill on node {victim}"
    survivor = 1 - victim
    deadline = time.monotonic() + KILL_TIMEOUT_S + 120
    while (len(list(tmp_path.glob("survivor-rank*.json"))) < NPROC and any(a.poll() is None for a in agents)
           and time.monotonic() < deadline):
        time.sleep(0.1)
    for a in agents:  # the survivor's agent may wait for its lost peer: ours to stop
        try:
            a.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("survivor-rank*.json"))]
    assert len(results) == NPROC, f"the surviving ranks did not raise: {results}\n{c.job_logs('kill')}"
    for r in results:
        assert r["host"] == f"node{survivor}", r
        assert r["raised"] == "DistributedError" and r["megashard_error"], f"rank {r['rank']}: the save did not fail: {r}"
        assert f"megashard save failed on rank(s) {r['rank']}:" in r["message"], r["message"]
        assert "a peer rank failed or exited" in r["message"], r["message"]
        assert r["previous"] == [], f"rank {r['rank']}: the previous checkpoint does not load bit-exact: {r['previous']}"
        assert r["seconds"] < KILL_TIMEOUT_S + 15, f"rank {r['rank']} raised only after {r['seconds']} s: {r}"


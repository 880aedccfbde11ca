"""The local checkpoint tier inside Megatron-LM's own ``pretrain_gpt.py`` (2 ranks, CPU):
``--non-persistent-ckpt-type local`` with ``--save-format tensors``, without nvidia-resiliency-ext,
replicated with ``--replication --replication-jump 1 --replication-factor 2``.

Each rank is its own node (``MEGASHARD_NODE_ID``) with its own local directory. A run SIGKILLed in
step 7 (persistent save at 4, local saves every step, each replicated to the other node) resumes with
node 1's local directory emptied: rank 1's version of 6 comes from node 0's replica; with both
nodes' directories emptied, the same killed run falls back to the persistent checkpoint at 4; both
reach the same state at step 8, bit for bit. Restarted with TP=1, the TP=2 versions are not resharded:
one line names the layout change and the job loads the persistent checkpoint at 4.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat

from megatron_helpers.runner import compare_checkpoints, torchrun
from test_megatron_lm_install import ARGS, SCRIPT, mlm, mlm_tree  # noqa: F401 - mlm_tree is a fixture

LOCAL = ["--train-iters", "8", "--save-interval", "4", "--non-persistent-save-interval", "1",
         "--non-persistent-ckpt-type", "local", "--save-format", "tensors",
         "--replication", "--replication-jump", "1", "--replication-factor", "2"]


def local_args(save, load=None):
    # relative: with MEGASHARD_TEST_RANK_CWD, each rank's (each node's) own local directory
    return [*LOCAL, "--save", str(save), "--non-persistent-local-ckpt-dir", "local",
            *(["--load", str(load)] if load else [])]


def versions(local):
    """{directory: sorted version names} under one node's local directory."""
    out = {}
    for layout in sorted(os.listdir(local)):
        for rank in sorted(os.listdir(local / layout)):
            if rank == "replicas":
                for src in sorted(os.listdir(local / layout / rank)):
                    out[f"{layout}/replicas/{src}"] = sorted(os.listdir(local / layout / rank / src))
            else:
                out[f"{layout}/{rank}"] = sorted(os.listdir(local / layout / rank))
    return out


def test_resume_from_local_tier_and_peer_replica_after_sigkill_then_fallback(mlm_tree, tmp_path):  # noqa: F811
    assert importlib.util.find_spec("nvidia_resiliency_ext") is None  # the point: not needed
    save, nodes = tmp_path / "a", tmp_path / "nodes"
    local = [nodes / "rank0" / "local", nodes / "rank1" / "local"]
    for d in local:
        d.parent.mkdir(parents=True)
    env = {"MEGASHARD_TEST_RANK_CWD": str(nodes), "MEGASHARD_TEST_NODE_PER_RANK": "1"}
    killed = torchrun(SCRIPT, [*ARGS, *local_args(save)], timeout=300,
                      env=env | {"MEGATRON_LM_DIR": mlm_tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                                 "MEGASHARD_TEST_KILL_AT": "6"})
    assert killed.returncode != 0, killed.output[-3000:]
    assert "to its local tier in" in killed.output
    assert "saved local checkpoint at iteration 6" in killed.output, killed.output[-3000:]
    assert "iteration        7/" not in killed.output  # killed in step 7
    assert open(save / "latest_checkpointed_iteration.txt").read().strip() == "4"
    # each node: its rank's last two versions (1, 2, 3, 5 removed by the saves that replaced them) and
    # the other node's rank's, replicated; directories 0700, files 0600, megashard's files only
    layout = "megashard-w2-tp2-pp1-ep1-vp1"
    for r in (0, 1):
        held = versions(local[r])
        assert held == {f"{layout}/rank0000{r}": ["iter_0000005", "iter_0000006"],
                        f"{layout}/replicas/rank0000{1 - r}": ["iter_0000005", "iter_0000006"]}, held
        for d, v in ((local[r] / layout / f"rank0000{r}", None),
                     (local[r] / layout / "replicas" / f"rank0000{1 - r}", local[1 - r] / layout / f"rank0000{1 - r}")):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
            files = os.listdir(d / "iter_0000006")
            assert "manifest.json" in files and all(f.endswith(".tensors") or f.startswith("manifest") for f in files)
            assert {stat.S_IMODE(os.stat(d / "iter_0000006" / f).st_mode) for f in files} == {0o600}
            if v is not None:  # the replica: the other node's version, byte for byte
                assert {f: (d / "iter_0000006" / f).read_bytes() for f in files} == \
                    {f: (v / "iter_0000006" / f).read_bytes() for f in os.listdir(v / "iter_0000006")}
    keep = tmp_path / "kept"
    shutil.copytree(nodes, keep)

    shutil.rmtree(local[1])  # node 1's local directory lost: its rank's bytes come from node 0's replica
    local[1].mkdir()
    resumed, losses = mlm(mlm_tree, local_args(tmp_path / "b", load=save), env=env)
    assert "restored rank 1's local checkpoint of iteration 6 from rank 0's replica" in resumed.output, \
        resumed.output[-3000:]
    assert re.search(r"loaded local checkpoint \S+rank0000\d/iter_0000006 at iteration 6 "
                     r"\(optimizer loaded, rng loaded\)", resumed.output), resumed.output[-3000:]
    assert sorted(losses) == [7, 8]

    # restarted with another layout (TP=1, the same 2 nodes, their versions of 5 and 6 kept): the versions
    # hold TP=2 shards and are not resharded; one line on rank 0 says so, the job loads --save at 4
    shutil.rmtree(nodes)
    shutil.copytree(keep, nodes)
    moved, moved_losses = mlm(mlm_tree, [*local_args(tmp_path / "d", load=save), "--tensor-model-parallel-size", "1"],
                              env=env)
    line = (f"local checkpoint tier local/megashard-w2-tp1-pp1-ep1-vp1: layout changed from w2-tp2-pp1-ep1-vp1 "
            f"(local iteration 6) to w2-tp1-pp1-ep1-vp1: local versions are not resharded; loading --load {save} "
            f"at iteration 4")
    assert moved.output.count("layout changed from") == 1 and line in moved.output, moved.output[-3000:]
    # (the RNG state is ignored after a change of (TP, PP), as Megatron does)
    assert "at iteration 4 (optimizer loaded, rng not loaded)" in moved.output and sorted(moved_losses) == [5, 6, 7, 8]

    shutil.rmtree(nodes)  # both nodes' local copies lost
    shutil.copytree(keep, nodes)
    for d in local:
        shutil.rmtree(d)
        d.mkdir()
    fallback, fb_losses = mlm(mlm_tree, local_args(tmp_path / "c", load=save), env=env)
    assert "no complete local checkpoint on any rank; loading --load" in fallback.output, fallback.output[-3000:]
    assert "loaded checkpoint" in fallback.output and "at iteration 4 (optimizer loaded, rng loaded)" in fallback.output
    assert sorted(fb_losses) == [5, 6, 7, 8]
    # the resume from the persistent checkpoint is bit-exact with an uninterrupted run
    # (tests/test_megatron_lm_install.py); the resume from the local tier matches it: the step after the
    # resume logs its loss, and the state after the last step (model and optimizer, every tensor) is its
    # state, bit for bit (the logged loss of the second step after any resume is not a reliable check on
    # this CPU shim: it differs from the uninterrupted run's although every later state is the same)
    assert losses[7] == fb_losses[7], (losses, fb_losses)
    cmp = compare_checkpoints(str(tmp_path / "b" / "iter_0000008"), str(tmp_path / "c" / "iter_0000008"))
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], cmp
    assert any(k.startswith("optimizer.state.exp_avg.") for k in cmp["compared"])

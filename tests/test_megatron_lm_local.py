"""The local checkpoint tier inside Megatron-LM's own ``pretrain_gpt.py`` (2 ranks, CPU):
``--non-persistent-ckpt-type local`` with ``--save-format tensors``, without nvidia-resiliency-ext.

A run SIGKILLed in step 7 (persistent save at 4, local saves every step) resumes from the local tier
at 6; with the local directory emptied, the same killed run falls back to the persistent checkpoint
at 4; both reach the same state at step 8, bit for bit.
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
         "--non-persistent-ckpt-type", "local", "--save-format", "tensors"]


def local_args(save, local, load=None):
    return [*LOCAL, "--save", str(save), "--non-persistent-local-ckpt-dir", str(local),
            *(["--load", str(load)] if load else [])]


def versions(local):
    """{rank dir: sorted version names} under the local directory."""
    out = {}
    for layout in sorted(os.listdir(local)):
        for rank in sorted(os.listdir(local / layout)):
            out[f"{layout}/{rank}"] = sorted(os.listdir(local / layout / rank))
    return out


def test_resume_from_local_tier_after_sigkill_then_fallback(mlm_tree, tmp_path):  # noqa: F811
    assert importlib.util.find_spec("nvidia_resiliency_ext") is None  # the point: not needed
    save, local = tmp_path / "a", tmp_path / "local"
    env = {"MEGATRON_LM_DIR": mlm_tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "MEGASHARD_TEST_KILL_AT": "6"}
    killed = torchrun(SCRIPT, [*ARGS, *local_args(save, local)], env=env, timeout=300)
    assert killed.returncode != 0, killed.output[-3000:]
    assert "to its local tier in" in killed.output
    assert "saved local checkpoint at iteration 6" in killed.output, killed.output[-3000:]
    assert "iteration        7/" not in killed.output  # killed in step 7
    assert open(save / "latest_checkpointed_iteration.txt").read().strip() == "4"
    # each rank: only the last two versions (1, 2, 3, 5 removed by the saves that replaced them),
    # its directory 0700, its files 0600, megashard's files only
    held = versions(local)
    assert held == {"megashard-w2-tp2-pp1-ep1-vp1/rank00000": ["iter_0000005", "iter_0000006"],
                    "megashard-w2-tp2-pp1-ep1-vp1/rank00001": ["iter_0000005", "iter_0000006"]}, held
    for rank_dir in held:
        d = local / rank_dir
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        files = os.listdir(d / "iter_0000006")
        assert "manifest.json" in files and all(f.endswith(".tensors") or f.startswith("manifest") for f in files)
        assert {stat.S_IMODE(os.stat(d / "iter_0000006" / f).st_mode) for f in files} == {0o600}

    resumed, losses = mlm(mlm_tree, local_args(tmp_path / "b", local, load=save))
    assert re.search(r"loaded local checkpoint \S+rank0000\d/iter_0000006 at iteration 6 "
                     r"\(optimizer loaded, rng loaded\)", resumed.output), resumed.output[-3000:]
    assert sorted(losses) == [7, 8]

    for rank_dir in versions(local):  # the node's local copies lost
        for v in os.listdir(local / rank_dir):
            shutil.rmtree(local / rank_dir / v)
    fallback, fb_losses = mlm(mlm_tree, local_args(tmp_path / "c", local, load=save))
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

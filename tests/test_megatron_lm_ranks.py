"""megashard.megatron never strands a rank, inside Megatron-LM's own ``pretrain_gpt.py``.

Each case is a real 2-rank (TP=2) torchrun job of ``tests/megatron_helpers/mlm_pretrain_gpt.py``
(see test_megatron_lm_install.py for where Megatron-LM's training code comes from). A
failure must reach every rank as one DistributedError, promptly: each rank records how
``pretrain()`` ended (``MEGASHARD_TEST_OUTCOME``), and a rank that was still waiting when
torchrun tore the job down records nothing. Checkpoints that only some ranks see, or that
exist only as an interrupted re-save's ``.iter_N.old-*`` copy, resume bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from megatron_helpers.runner import TESTS, compare_checkpoints, torchrun
from test_megatron_lm_install import ARGS, mlm_base, mlm_tree  # noqa: F401 - fixtures

SCRIPT = os.path.join(TESTS, "megatron_helpers", "mlm_pretrain_gpt.py")
TRACKER = "latest_checkpointed_iteration.txt"
# "promptly": a rank left waiting in a collective would be freed only by the process-group timeout, which
# job() sets to 3 minutes (--distributed-timeout-minutes 3). A rank's seconds count from before Megatron-LM's
# imports (then its initialization, the model, one step or the load): 23 s for a whole test here beside a CI run;
# 60 s was tight for a loaded 2-core CI box; 120 s still falls well short of the 180 s a stranded rank waits.
PROMPT_S = 120


@pytest.fixture(scope="module")
def base(mlm_base):  # noqa: F811
    """6 iterations, saved at 3 and 6 (the reference for bit-exact resumes): test_megatron_lm_install.py's
    run, shared (one launch)."""
    return mlm_base[0]


def job(tree, args, tmp_path, env=None):
    """The job, plus each rank's outcome (None: the rank never finished; it was left waiting)."""
    out = tmp_path / "outcome"
    out.mkdir()
    e = {"MEGATRON_LM_DIR": tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "MEGASHARD_TEST_OUTCOME": str(out),
         **(env or {})}
    t0 = time.monotonic()
    run = torchrun(SCRIPT, [*ARGS, "--distributed-timeout-minutes", "3", *args], env=e, timeout=400)
    seconds = time.monotonic() - t0
    outcomes = []
    for r in range(2):
        p = out / f"rank{r}.json"
        outcomes.append(json.loads(p.read_text()) if p.exists() else None)
    return run, outcomes, seconds


def assert_all_raised(run, outcomes, *parts):
    """Every rank raised one DistributedError whose message holds ``parts``, promptly."""
    assert run.returncode != 0
    for r, o in enumerate(outcomes):
        assert o is not None, f"rank {r} never finished (left waiting):\n{run.output[-5000:]}"
        assert not o["ok"] and "DistributedError" in o["mro"], (r, o)
        for part in parts:
            assert part in o["message"], (r, part, o["message"])
        assert o["seconds"] < PROMPT_S, (r, o["seconds"])


def assert_resumed_bit_exact(run, base, save):
    assert run.returncode == 0, run.output[-6000:]
    assert "holds a megashard checkpoint: loading with megashard" in run.output
    assert "at iteration 3 (optimizer loaded, rng loaded)" in run.output
    cmp = compare_checkpoints(str(base / "iter_0000006"), str(save / "iter_0000006"))
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], cmp
    assert any(k.startswith("optimizer.state.exp_avg.") for k in cmp["compared"])


def test_tracker_write_failure_raises_on_every_rank(mlm_tree, tmp_path):  # noqa: F811
    """Rank 0 cannot write the tracker (a directory sits at its name): both ranks raise one
    DistributedError naming rank 0 and the tracker file; the checkpoint itself is committed."""
    root = tmp_path / "save"
    (root / TRACKER).mkdir(parents=True)
    run, outcomes, _ = job(mlm_tree, ["--train-iters", "1", "--save-interval", "1", "--save", str(root),
                                            "--save-format", "tensors"], tmp_path)
    assert_all_raised(run, outcomes, "rank(s) 0", f"cannot write tracker file {root / TRACKER}")
    assert all(o["type"] == "DistributedCheckpointError" for o in outcomes), outcomes
    assert os.path.isfile(root / "iter_0000001" / "manifest.json")


def test_checkpoint_only_rank0_sees_resumes_in_scatter_mode(mlm_tree, base, tmp_path):  # noqa: F811
    """One node (one node id), two ranks; ``--load ckpt`` is relative and only rank 0's working
    directory holds it, so rank 1 cannot see the checkpoint: the node's reader (rank 0)
    streams rank 1 its bytes (scatter), and the resumed run ends bit-exact."""
    cwd = tmp_path / "cwd"
    (cwd / "rank0").mkdir(parents=True)
    (cwd / "rank1").mkdir()
    os.symlink(base, cwd / "rank0" / "ckpt")
    save = tmp_path / "b"
    run, outcomes, _ = job(
        mlm_tree, ["--train-iters", "6", "--save-interval", "3", "--load", "ckpt", "--ckpt-step", "3",
                   "--megashard-load-mode", "scatter", "--save", str(save), "--save-format", "tensors"],
        tmp_path, env={"MEGASHARD_TEST_RANK_CWD": str(cwd), "MEGASHARD_NODE_ID": "node0"})
    assert outcomes[0] and outcomes[0]["ok"] and outcomes[1] and outcomes[1]["ok"], (outcomes, run.output[-6000:])
    assert_resumed_bit_exact(run, base, save)
    assert not os.path.exists(cwd / "rank1" / "ckpt")


def test_resume_from_interrupted_resave_copy(mlm_tree, base, tmp_path):  # noqa: F811
    """A re-save of iter_0000003 crashed mid-commit: only ``.iter_0000003.old-<token>`` is
    left, which megashard.load reads. install()'s routing and the adapter find it too, resume
    from it bit-exact, and leave it where it is (loading changes nothing)."""
    root = tmp_path / "c"
    root.mkdir()
    old = root / ".iter_0000003.old-0123456789abcdef"
    shutil.copytree(base / "iter_0000003", old)
    (root / TRACKER).write_text("3")
    save = tmp_path / "b"
    run, outcomes, _ = job(
        mlm_tree, ["--train-iters", "6", "--save-interval", "3", "--load", str(root), "--save", str(save),
                   "--save-format", "tensors"], tmp_path)
    assert_resumed_bit_exact(run, base, save)
    assert sorted(os.listdir(root)) == [old.name, TRACKER]


@pytest.mark.parametrize("step", ["load_optimizer_state", "restore_rng_state"])
def test_restore_failure_on_one_rank_raises_on_every_rank(mlm_tree, base, tmp_path, step):  # noqa: F811
    """Restoring the optimizer / RNG state fails on rank 1 only: rank 0 does not wait in a
    collective for it; both ranks raise one DistributedError naming rank 1, promptly."""
    run, outcomes, _ = job(
        mlm_tree, ["--train-iters", "6", "--load", str(base), "--ckpt-step", "3", "--save-format", "tensors"],
        tmp_path, env={"MEGASHARD_TEST_FAIL": f"{step}@1"})
    assert_all_raised(run, outcomes, "rank(s) 1", f"injected failure in {step} on rank 1")

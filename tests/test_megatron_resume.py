"""megashard.megatron end to end: real Megatron training (examples/pretrain_gpt.py), 2 ranks, CPU/gloo.

Every test compares outcomes: losses of a resumed run against the uninterrupted run
(exactly for the same layout, within 1e-5 after a layout change), and the global
model/optimizer tensors of a checkpoint against the state another layout loaded from it
(bit for bit, by re-saving what was loaded with ``--dump-loaded-state``).
"""
from __future__ import annotations


import megashard
import os

import pytest

pytest.importorskip("megatron.core")

from megatron_helpers.runner import compare_checkpoints, pretrain  # noqa: E402

ITERS = ["--train-iters", "6", "--lr-decay-iters", "6", "--save-interval", "3"]
PP_VP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def ckpt(root, it: int) -> str:
    return os.path.join(str(root), f"iter_{it:07d}")


def assert_state_equal(saved: str, reloaded: str) -> None:
    """Every model and optimizer tensor of ``saved`` equals what the new layout loaded."""
    cmp = compare_checkpoints(saved, reloaded)
    assert not cmp["only_a"] and not cmp["only_b"], cmp
    assert cmp["differ"] == {}, f"tensors differ after resharding: {cmp['differ']}"
    keys = cmp["compared"]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in keys)
    assert any(k.startswith("decoder.layers.") for k in keys)


# --------------------------------------------------------------------------------------
# TP=2 (plain Adam)
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    run = pretrain(["--tensor-model-parallel-size", "2", "--save", str(root), *ITERS]).check()
    assert sorted(run.losses) == [1, 2, 3, 4, 5, 6]
    return root, run


def test_tp2_layout_on_disk(tp2):
    root, _ = tp2
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip() == "6"
    for it in (3, 6):
        files = sorted(os.listdir(ckpt(root, it)))
        assert "manifest.json" in files
        # one .tensors file per (TP, PP, VP) model chunk, plus one per rank for the rest
        assert [f for f in files if f.startswith("model_")] == [
            "model_tp00_pp000_vp0-r00000.tensors", "model_tp01_pp000_vp0-r00001.tensors"]
        assert len([f for f in files if f.startswith("state_")]) == 2
        assert not [f for f in files if f.endswith((".pt", ".pth", ".pkl", ".distcp"))], files
    keys = set(megashard.read_manifest(ckpt(root, 3)).tensors)
    assert "embedding.word_embeddings.weight" in keys and "optimizer.state.exp_avg.embedding.word_embeddings.weight" in keys


def test_tp2_same_layout_resume_is_bit_exact(tp2):
    root, base = tp2
    # --ckpt-step 3 overrides the tracker (which says 6), as in Megatron; megashard's load
    # options from add_arguments() are passed through (scatter: rank 0 reads, streams to rank 1)
    run = pretrain(["--tensor-model-parallel-size", "2", "--load", str(root), "--ckpt-step", "3",
                    "--megashard-load-mode", "scatter", "--megashard-verify-on-load", *ITERS]).check()
    assert f"{ckpt(root, 3)} (iteration 3, full state" in run.started
    assert sorted(run.losses) == [4, 5, 6]
    assert {i: run.losses[i] for i in (4, 5, 6)} == {i: base.losses[i] for i in (4, 5, 6)}
    assert {i: run.lrs[i] for i in (4, 5, 6)} == {i: base.lrs[i] for i in (4, 5, 6)}
    assert run.digests["start"] == base.digests["saved@3"]


def test_async_save_resume_is_bit_exact(tp2, tmp_path):
    """--async-save: training continues while iteration 3 is written; resuming from it
    reproduces the synchronous run's losses exactly, and the tracker names the last save."""
    _, base = tp2
    root = tmp_path / "async"
    run = pretrain(["--tensor-model-parallel-size", "2", "--save", str(root), "--async-save", *ITERS]).check()
    assert run.losses == base.losses  # snapshotting never perturbs training
    # the log says "save started" at the snapshot and "saved checkpoint" only once it is committed
    lines = run.output.splitlines()
    started = [i for i, ln in enumerate(lines) if ln.startswith(f"save started at iteration 3 to {ckpt(root, 3)}")]
    saved = [i for i, ln in enumerate(lines) if ln == f"saved checkpoint at iteration 3 to {ckpt(root, 3)} (committed)"]
    assert len(started) == 1 and len(saved) == 1 and started[0] < saved[0], run.output[-3000:]
    assert not [ln for ln in lines if ln.startswith("saved checkpoint at iteration 3") and "digest" in ln]
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip() == "6"
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # nothing abandoned
    resumed = pretrain(["--tensor-model-parallel-size", "2", "--load", str(root), "--ckpt-step", "3",
                        "--megashard-verify-on-load", *ITERS]).check()
    assert run.digests["saved@3"] == base.digests["saved@3"] == resumed.digests["start"]
    assert {i: resumed.losses[i] for i in (4, 5, 6)} == {i: base.losses[i] for i in (4, 5, 6)}


def test_direct_io_save_writes_the_same_files(tp2, tmp_path):
    """--megashard-direct-io: the same training writes byte-identical shard files (their
    bulk with O_DIRECT), and the run's checkpointed state digests match."""
    root0, base = tp2
    root = tmp_path / "direct"
    run = pretrain(["--tensor-model-parallel-size", "2", "--save", str(root), "--megashard-direct-io",
                    *ITERS]).check()
    assert run.digests["saved@3"] == base.digests["saved@3"]
    names = sorted(f for f in os.listdir(ckpt(root0, 3)) if f.startswith("model_"))
    assert names and names == sorted(f for f in os.listdir(ckpt(root, 3)) if f.startswith("model_"))
    for f in names:
        with open(os.path.join(ckpt(root0, 3), f), "rb") as a, open(os.path.join(ckpt(root, 3), f), "rb") as b:
            assert a.read() == b.read(), f


def test_tp2_to_tp1_dp2_reshards_model_and_optimizer_exactly(tp2, tmp_path):
    root, base = tp2
    dump = tmp_path / "reloaded"
    run = pretrain(["--tensor-model-parallel-size", "1", "--load", str(root), "--ckpt-step", "3",
                    "--dump-loaded-state", str(dump), *ITERS]).check()
    assert "(iteration 3, full state" in run.started
    assert_state_equal(ckpt(root, 3), ckpt(dump, 3))
    assert abs(run.losses[4] - base.losses[4]) < 1e-5
    for i in (5, 6):
        assert abs(run.losses[i] - base.losses[i]) < 1e-5


def test_finetune_loads_weights_only(tp2):
    root, base = tp2
    run = pretrain(["--tensor-model-parallel-size", "2", "--load", str(root), "--finetune",
                    "--train-iters", "2", "--lr-decay-iters", "6"]).check()
    # latest checkpoint (iteration 6), iteration counter reset, optimizer/scheduler not loaded
    assert f"{ckpt(root, 6)} (iteration 0, weights only" in run.started
    assert sorted(run.losses) == [1, 2]
    assert run.digests["start"] == base.digests["saved@6"]
    assert run.lrs[1] == base.lrs[1]            # fresh scheduler: warm-up starts again
    assert run.losses[1] < base.losses[1] - 1e-3  # but the model is the trained one


def test_no_load_optim_keeps_weights_resets_optimizer(tp2):
    root, base = tp2
    run = pretrain(["--tensor-model-parallel-size", "2", "--load", str(root), "--ckpt-step", "3",
                    "--no-load-optim", *ITERS]).check()
    assert "(iteration 3, without optimizer" in run.started
    assert run.digests["start"] == base.digests["saved@3"]
    assert run.losses[4] == base.losses[4]   # forward of the loaded weights: identical
    assert run.losses[5] != base.losses[5]   # fresh Adam moments and scheduler: a different update
    assert run.lrs[4] != base.lrs[4]


@pytest.fixture(scope="module")
def noopt(tmp_path_factory):
    """1 rank, 2 iterations, --load of an empty directory, saved there with --no-save-optim."""
    root = tmp_path_factory.mktemp("noopt")
    args = ["--train-iters", "2", "--lr-decay-iters", "4", "--save-interval", "2"]
    run = pretrain([*args, "--load", str(root), "--save", str(root), "--no-save-optim"], nproc=1).check()
    return root, run


def test_a_checkpoint_without_optimizer_resumes_saying_so(noopt):
    """Saved with --no-save-optim: the resume loads no optimizer state and says so (not "full state")."""
    root, _ = noopt
    run = pretrain(["--train-iters", "3", "--lr-decay-iters", "4", "--load", str(root)], nproc=1).check()
    assert run.started.startswith(f"started from checkpoint {ckpt(root, 2)} (iteration 2, without optimizer "
                                  "(the checkpoint holds none: saved with --no-save-optim), "), run.started


def test_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "nothing"
    empty.mkdir()
    run = pretrain(["--load", str(empty), "--exit-on-missing-checkpoint", "--train-iters", "1"], nproc=1)
    assert run.returncode != 0
    assert "exit-on-missing-checkpoint" in run.output
    assert not run.losses


def test_empty_load_directory_starts_from_scratch(noopt):
    """Without --exit-on-missing-checkpoint, an empty --load directory means a fresh start (the run that
    saved ``noopt``: one launch for both tests)."""
    _, run = noopt
    assert run.started == "started from scratch (no checkpoint)" and sorted(run.losses) == [1, 2]


# --------------------------------------------------------------------------------------
# RNG: dropout > 0, so resuming is exact only if every RNG state is restored
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dropout(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout")
    args = ["--tensor-model-parallel-size", "2", "--hidden-dropout", "0.2", "--attention-dropout", "0.2",
            "--train-iters", "4", "--lr-decay-iters", "4", "--save-interval", "2"]
    run = pretrain([*args, "--save", str(root)]).check()
    return root, run, args


def test_rng_restored_with_dropout(dropout):
    root, base, args = dropout
    run = pretrain([*args, "--load", str(root), "--ckpt-step", "2"]).check()
    assert run.rng["start"] == base.rng["saved@2"]
    assert {i: run.losses[i] for i in (3, 4)} == {i: base.losses[i] for i in (3, 4)}


def test_no_load_rng_starts_from_the_seeded_rng(dropout):
    root, base, args = dropout
    run = pretrain([*args, "--load", str(root), "--ckpt-step", "2", "--no-load-rng"]).check()
    assert run.digests["start"] == base.digests["saved@2"]   # weights loaded
    assert run.rng["start"] == base.rng["start"]             # RNG as freshly seeded, not as saved
    assert run.rng["start"] != base.rng["saved@2"]
    assert run.losses[3] != base.losses[3]                   # other dropout masks


# --------------------------------------------------------------------------------------
# PP=2 with 2 virtual-pipeline chunks (interleaved 1F1B schedule)
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ppvp(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppvp")
    run = pretrain([*PP_VP, "--save", str(root), *ITERS]).check()
    files = sorted(f for f in os.listdir(ckpt(root, 3)) if f.startswith("model_"))
    assert files == ["model_tp00_pp000_vp0-r00000.tensors", "model_tp00_pp000_vp1-r00000.tensors",
                     "model_tp00_pp001_vp0-r00001.tensors", "model_tp00_pp001_vp1-r00001.tensors"]
    return root, run


def test_pp2_vp2_same_layout_resume_is_bit_exact(ppvp):
    root, base = ppvp
    run = pretrain([*PP_VP, "--load", str(root), "--ckpt-step", "3", "--megashard-load-mode", "own", *ITERS]).check()
    assert {i: run.losses[i] for i in (4, 5, 6)} == {i: base.losses[i] for i in (4, 5, 6)}
    assert run.digests["start"] == base.digests["saved@3"]


def test_pp2_vp2_to_pp1_reshards_exactly(ppvp, tmp_path):
    root, base = ppvp
    dump = tmp_path / "reloaded"
    run = pretrain(["--load", str(root), "--ckpt-step", "3", "--dump-loaded-state", str(dump), *ITERS]).check()
    assert_state_equal(ckpt(root, 3), ckpt(dump, 3))
    for i in (4, 5, 6):
        assert abs(run.losses[i] - base.losses[i]) < 1e-5


# --------------------------------------------------------------------------------------
# DistributedOptimizer (flattened shards), DP=2
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def distopt(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    run = pretrain(["--use-distributed-optimizer", "--save", str(root), *ITERS]).check()
    return root, run


def test_distributed_optimizer_same_layout_resume_is_bit_exact(distopt):
    root, base = distopt
    run = pretrain(["--use-distributed-optimizer", "--load", str(root), "--ckpt-step", "3", *ITERS]).check()
    assert {i: run.losses[i] for i in (4, 5, 6)} == {i: base.losses[i] for i in (4, 5, 6)}


def test_distributed_optimizer_dp2_to_tp2_reshards_exactly(distopt, tmp_path):
    root, base = distopt
    dump = tmp_path / "reloaded"
    run = pretrain(["--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--load", str(root),
                    "--ckpt-step", "3", "--dump-loaded-state", str(dump), *ITERS]).check()
    assert_state_equal(ckpt(root, 3), ckpt(dump, 3))
    for i in (4, 5, 6):
        assert abs(run.losses[i] - base.losses[i]) < 1e-5


def test_save_to_and_resume_from_s3(tp2, s3):
    """``--save s3://…`` / ``--load s3://…`` (a local S3 endpoint): the tracker is an object, the
    resumed run reproduces the uninterrupted run's losses exactly. The resume is in scatter mode (rank 0
    fetches, streams to rank 1; both ranks' object-store clients ran in the save): each load mode over
    S3 is test_s3_checkpoint.py::test_two_ranks_save_and_reshard_with_exact_request_counts, each mode
    inside Megatron a local resume above (own: test_pp2_vp2_same_layout_resume_is_bit_exact)."""
    from megashard.storage.s3.client import ObjectStore

    _, base = tp2
    root = s3.url("megatron/run")
    run = pretrain(["--tensor-model-parallel-size", "2", "--save", root, *ITERS]).check()
    assert run.losses == base.losses
    store, key = ObjectStore.for_url(root)
    data, _ = store.get_bytes(f"{key}/latest_checkpointed_iteration.txt", 100)
    assert data.strip() == b"6"
    resumed = pretrain(["--tensor-model-parallel-size", "2", "--load", root, "--ckpt-step", "3",
                        "--megashard-load-mode", "scatter", *ITERS]).check()
    assert resumed.digests["start"] == base.digests["saved@3"]
    assert {i: resumed.losses[i] for i in (4, 5, 6)} == {i: base.losses[i] for i in (4, 5, 6)}

"""``megashard.megatron.install()`` inside Megatron-LM's own training loop (``pretrain_gpt.py``).

Needs a Megatron-LM source tree matching the installed megatron-core (the wheel ships
only ``megatron/core``): set ``MEGATRON_LM_DIR`` to a checkout of NVIDIA/Megatron-LM at
tag ``core_v0.16.1`` (only ``megatron/training``, ``megatron/legacy``,
``megatron/post_training``, ``megatron/rl`` and the top-level ``pretrain_gpt.py``,
``gpt_builders.py``, ``model_provider.py`` are used). Skipped when absent.

The runs use Megatron-LM's real ``pretrain()``: its argument parser (with
``extra_args_provider=megashard.megatron.add_arguments``), ``initialize_megatron``,
``setup_model_and_optimizer`` → ``load_checkpoint``, ``train()`` →
``save_checkpoint_and_time`` → ``save_checkpoint``, mock GPT data, on CPU with gloo.
"""
from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("megatron.core")

from megatron_helpers.runner import TESTS, compare_checkpoints, torchrun  # noqa: E402

CANDIDATES = [os.environ.get("MEGATRON_LM_DIR"), "/work/shared/Megatron-LM-core_v0.16.1", "/tmp/mlm"]
MLM = next((d for d in CANDIDATES if d and os.path.isfile(os.path.join(d, "megatron", "training", "checkpointing.py"))
            and os.path.isfile(os.path.join(d, "pretrain_gpt.py"))), None)
pytestmark = pytest.mark.skipif(MLM is None, reason="no Megatron-LM source tree (set MEGATRON_LM_DIR)")

SCRIPT = os.path.join(TESTS, "megatron_helpers", "mlm_pretrain_gpt.py")
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--lr-decay-iters", "6", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--transformer-impl", "local", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--tensor-model-parallel-size", "2"]
ENV = {"MEGATRON_LM_DIR": MLM or "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def mlm(args):
    run = torchrun(SCRIPT, [*ARGS, *args], env=ENV, timeout=300)
    assert run.returncode == 0, run.output[-6000:]
    losses = {int(m.group(1)): m.group(2) for m in
              re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", run.output)}
    return run, losses


def test_version_matches_installed_megatron_core():
    import megatron.core

    info = os.path.join(MLM, "megatron", "core", "package_info.py")
    if os.path.isfile(info):
        text = open(info).read()
        ver = ".".join(re.search(rf"{k}\s*=\s*(\d+)", text).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
        assert megatron.core.__version__.startswith(ver)


def test_megatron_lm_saves_and_resumes_through_megashard(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    base, base_losses = mlm(["--train-iters", "6", "--save-interval", "3", "--save", str(a),
                             "--save-format", "tensors"])
    assert "megashard installed into megatron.training.checkpointing, megatron.training.training" in base.output
    assert sorted(base_losses) == [1, 2, 3, 4, 5, 6]
    # Megatron-LM's layout, megashard's files, tracker written last
    assert open(a / "latest_checkpointed_iteration.txt").read().strip() == "6"
    for it in (3, 6):
        files = os.listdir(a / f"iter_{it:07d}")
        assert "manifest.json" in files and any(f.endswith(".tensors") for f in files)
        assert not any(f.endswith((".distcp", ".pt")) or f == "metadata.json" for f in files), files
    saved_args = json.load(open(a / "iter_0000003" / "manifest.json"))
    assert "model" in json.dumps(saved_args["trees"])[:100000]

    resumed, losses = mlm(["--train-iters", "6", "--save-interval", "3", "--load", str(a), "--ckpt-step", "3",
                           "--save", str(b), "--save-format", "tensors"])
    assert "holds a megashard checkpoint: loading with megashard" in resumed.output
    assert "at iteration 3 (optimizer loaded, rng loaded)" in resumed.output
    assert sorted(losses) == [4, 5, 6]
    assert losses[4] == base_losses[4]
    # the final model and optimizer state equal the uninterrupted run's, bit for bit
    cmp = compare_checkpoints(str(a / "iter_0000006"), str(b / "iter_0000006"))
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], cmp
    assert any(k.startswith("optimizer.state.exp_avg.") for k in cmp["compared"])


def test_other_formats_still_go_to_megatron(tmp_path):
    d = tmp_path / "td"
    run, _ = mlm(["--train-iters", "4", "--save-interval", "2", "--exit-interval", "2", "--save", str(d),
                  "--save-format", "torch_dist"])
    files = os.listdir(d / "iter_0000002")
    assert "metadata.json" in files and any(f.endswith(".distcp") for f in files), files   # Megatron's writer
    run, losses = mlm(["--train-iters", "4", "--load", str(d)])
    assert "loading with megashard" not in run.output
    assert "successfully loaded checkpoint from" in run.output and sorted(losses) == [3, 4]

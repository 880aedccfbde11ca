"""DistributedOptimizer state across ``megashard convert``, through Megatron-LM's own ``pretrain_gpt.py``
(CPU, gloo, 2 ranks at TP1·DP2 so the optimizer state is sharded, bf16 so it holds fp32 main params),
on whichever megatron-core release is installed.

Megatron-LM saves torch_dist DistributedOptimizer state as ``dp_reshardable`` by default (0.16 and
0.19: the optimizer's internal buckets, one flat tensor each) or, with
``--dist-ckpt-optim-fully-reshardable``, as ``fully_reshardable`` (one tensor per parameter and state,
in the parameter's shape); megashard saves ``fully_sharded_model_space``. Checked here:

* torch_dist (either format) -> ``megashard convert`` -> resume with ``--save-format tensors``: the
  losses and the final checkpoint (model, exp_avg, exp_avg_sq, fp32 main params) equal an
  uninterrupted megashard run's bit for bit;
* a converted ``dp_reshardable`` checkpoint at another TP is refused with a message that says what to do;
* megashard -> ``convert --to torch_dist`` -> Megatron-LM resumes the model with its own loader; the
  DistributedOptimizer and RNG state it cannot load (convert says so, and how to resume).
"""
from __future__ import annotations

import os

import pytest

from megatron_helpers.runner import compare_checkpoints, torchrun
from test_megatron_lm_install import ARGS, SCRIPT, mlm, mlm_tree  # noqa: F401 - the fixture is used by name

import megashard
from megashard.convert import convert

DISTOPT = ["--use-distributed-optimizer", "--bf16", "--tensor-model-parallel-size", "1"]
TRAIN = ["--train-iters", "4", "--save-interval", "2"]


@pytest.fixture(scope="module")
def base(mlm_tree, tmp_path_factory):  # noqa: F811
    """An uninterrupted megashard run: checkpoints at iterations 2 and 4, and its losses."""
    d = tmp_path_factory.mktemp("base") / "ckpt"
    _, losses = mlm(mlm_tree, [*DISTOPT, *TRAIN, "--save", str(d), "--save-format", "tensors"])
    assert sorted(losses) == [1, 2, 3, 4]
    return d, losses


def _same(a, b, what: str) -> dict:
    cmp = compare_checkpoints(str(a), str(b))
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], (what, cmp)
    keys = cmp["compared"]
    for state in ("exp_avg", "exp_avg_sq", "fp32_param"):  # bf16: fp32 main params of their own
        assert any(k.startswith(f"optimizer.state.{state}.") and "linear_fc1" in k for k in keys), (state, keys)
    return cmp


def _torch_dist_converted(tree, tmp_path, flags):
    """Megatron-LM saves iteration 2 as torch_dist (and stops); ``convert`` makes it megashard."""
    td, ms = tmp_path / "td", tmp_path / "ms"
    mlm(tree, [*DISTOPT, *flags, *TRAIN, "--exit-interval", "2", "--save", str(td), "--save-format", "torch_dist"])
    res = convert(str(td), str(ms))
    assert res.source_format == "torch_dist" and res.iteration == 2
    return ms, set(megashard.read_manifest(str(ms / "iter_0000002")).tensors)


def _resume_bit_exact(tree, ms, tmp_path, base):
    """Resume the converted checkpoint with megashard to iteration 4: the same run as ``base``."""
    out = tmp_path / "resumed"
    run, losses = mlm(tree, [*DISTOPT, *TRAIN, "--load", str(ms), "--save", str(out), "--save-format", "tensors"])
    assert "holds a megashard checkpoint: loading with megashard" in run.output
    assert "at iteration 2 (optimizer loaded, rng loaded)" in run.output
    # the first iteration after the resume logs the same loss (the next line is not compared: Megatron-LM's
    # resumed runs log a different loss there whatever the checkpoint, see test_megatron_lm_configs.py);
    # the final checkpoint holds the uninterrupted run's training state
    assert sorted(losses) == [3, 4] and losses[3] == base[1][3]
    _same(base[0] / "iter_0000004", out / "iter_0000004", "converted, resumed")


def test_dp_reshardable_default_converted_and_resumed(mlm_tree, base, tmp_path):  # noqa: F811
    ms, keys = _torch_dist_converted(mlm_tree, tmp_path, [])
    # Megatron-LM's default: the optimizer's buckets, not one tensor per parameter
    assert any(k.startswith("optimizer.distributed.") and k.endswith(".exp_avg_sq") for k in keys), keys
    assert not any(k.startswith("optimizer.state.") for k in keys), keys
    _resume_bit_exact(mlm_tree, ms, tmp_path, base)
    # the buckets are TP-specific: another TP is refused, saying what to do (and nothing is trained)
    env = {"MEGATRON_LM_DIR": mlm_tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    run = torchrun(SCRIPT, [*ARGS, *DISTOPT, *TRAIN, "--tensor-model-parallel-size", "2", "--load", str(ms),
                            "--save-format", "tensors"], env=env, timeout=300)
    assert run.returncode != 0
    assert (f"{ms / 'iter_0000002'} stores DistributedOptimizer state as 'dp_reshardable' (Megatron-LM's "
            "default for torch_dist), which follows the optimizer's internal buckets and loads only at the TP "
            "and PP it was saved with (TP1·PP1; this run: TP2·PP1): resume at TP1·PP1") in run.output
    assert "--dist-ckpt-optim-fully-reshardable" in run.output and "--no-load-optim" in run.output
    assert "iteration        3/" not in run.output


def test_fully_reshardable_converted_and_resumed(mlm_tree, base, tmp_path):  # noqa: F811
    ms, keys = _torch_dist_converted(mlm_tree, tmp_path, ["--dist-ckpt-optim-fully-reshardable"])
    # one tensor per parameter and state, in the parameter's shape
    assert any(k.startswith("optimizer.state.exp_avg_sq.") and "linear_fc1" in k for k in keys), keys
    assert not any(k.startswith("optimizer.distributed.") for k in keys), keys
    _resume_bit_exact(mlm_tree, ms, tmp_path, base)


def test_megashard_converted_to_torch_dist_resumed_by_megatron_without_optimizer(mlm_tree, base, tmp_path):  # noqa: F811
    """megashard -> torch_dist: Megatron-LM resumes the model with its own loader. Its DistributedOptimizer
    state (``fully_sharded_model_space``: megatron-core 0.16+ builds flattened ShardedTensors for it and
    then refuses them, "ShardedTensor.flattened_range is not supported") and the RNG state (megashard's
    JSON form) it cannot load: convert says so and how to resume."""
    td = tmp_path / "td"
    res = convert(str(base[0]), str(td), to="torch_dist", iteration=2)
    assert res.target_format == "torch_dist" and res.iteration == 2
    assert any("DistributedOptimizer state, saved as 'fully_sharded_model_space'" in d and "--no-load-optim" in d
               for d in res.dropped), res.dropped
    assert any("RNG state" in d and "--no-load-rng" in d for d in res.dropped), res.dropped
    run, losses = mlm(mlm_tree, [*DISTOPT, *TRAIN, "--load", str(td), "--no-load-optim", "--no-load-rng",
                                 "--save-format", "tensors"])
    assert "loading with megashard" not in run.output  # Megatron-LM's own loader
    assert "successfully loaded checkpoint from" in run.output
    # the model is the uninterrupted run's at iteration 2: the same loss at iteration 3 (the optimizer is
    # fresh, so the step after it differs)
    assert sorted(losses) == [3, 4] and losses[3] == base[1][3]
    assert os.path.isdir(base[0] / "iter_0000002")  # the source is untouched


def test_distrib_optim_shardings_megashard_loads_or_refuses():
    """Which saved DistributedOptimizer shardings a run loads, and the refusals' advice (no run needed)."""
    from megashard.errors import CheckpointError
    from megashard.megatron.state import check_distrib_optim_load

    md = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True,
          "singleton_local_shards": False}
    assert check_distrib_optim_load("C", md, (2, 1), (1, 2)) == {
        "distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}
    for kind in ("fully_sharded_model_space", "dp_reshardable"):
        assert check_distrib_optim_load("C", {"distrib_optim_sharding_type": kind}, (2, 1), (2, 1)) == {
            "distrib_optim_sharding_type": kind}
    assert check_distrib_optim_load("C", {}, (2, 1), (1, 1)) == {}
    with pytest.raises(CheckpointError, match=r"^C stores DistributedOptimizer state as 'dp_reshardable' .*"
                                              r"\(TP2·PP1; this run: TP2·PP2\): resume at TP2·PP1 .*"
                                              r"--dist-ckpt-optim-fully-reshardable .* --no-load-optim"):
        check_distrib_optim_load("C", {"distrib_optim_sharding_type": "dp_reshardable"}, (2, 1), (2, 2))
    with pytest.raises(CheckpointError, match=r"^C stores DistributedOptimizer state as 'dp_zero_gather_scatter', "
                                              r"which megashard cannot load .*--no-load-optim"):
        check_distrib_optim_load("C", {"distrib_optim_sharding_type": "dp_zero_gather_scatter"}, (1, 1), (1, 1))

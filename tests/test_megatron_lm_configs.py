"""The configurations people train with, through Megatron-LM's own ``pretrain_gpt.py`` (CPU, gloo, 2 ranks),
on whichever megatron-core release is installed (0.16.1 in the Python 3.11 leg, 0.19 in the 3.12 leg).

* Llama blocks in bf16 with the DistributedOptimizer at TP=2: a resume is bit-exact (every model and
  optimizer tensor of the final checkpoint equals the uninterrupted run's); TP2 -> TP1·DP2 reshards
  exactly (the resharded run's checkpoint of the same iteration holds the same global tensors).
* Mixture-of-Experts, EP=2 (allgather dispatcher): resume bit-exact (plain Adam); with plain Adam and
  with the DistributedOptimizer, EP2 -> EP1 reshards every model and optimizer tensor exactly and EP1 -> EP2, training on,
  gives the uninterrupted EP2 run's checkpoint bit for bit. megatron-core chains a second optimizer for
  the experts only when EP>1, so the optimizer's param groups and step are regrouped on load
  (``megashard.megatron.state.regroup_optimizer_state``); the RNG state, whose layout changes with EP,
  is ignored with a warning, as Megatron does.
* Expert tensor parallelism cannot run here: megatron-core requires sequence parallelism with MoE and
  TP>1 ("ValueError: During training, performance may degrade if MoE and tensor parallelismare enabled
  without also enabling sequence parallelism."), and without Transformer Engine its torch LayerNorm refuses
  it ("AssertionError: sequence parallel not supported by torch LayerNorm when instantiating
  WrappedTorchNorm when instantiating TransformerLayer").

A reshard is checked as Megatron-LM saves it: the run loads iteration 2 in the new layout with
``--train-iters 2`` and saves it again at the end of ``pretrain()``; both checkpoints' global tensors
must be equal bit for bit.
"""
from __future__ import annotations

from megatron_helpers.runner import compare_checkpoints
from test_megatron_lm_install import mlm, mlm_tree  # noqa: F401 - the fixture is used by name

LLAMA = ["--bf16", "--use-distributed-optimizer", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--no-rope-fusion", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         # the padded vocabulary (a multiple of 128 x TP) must not change from TP=2 to TP=1: 256 either
         # way (NullTokenizer's vocabulary is --vocab-size on core_v0.19, one more on core_v0.16)
         "--vocab-size", "200"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather"]
SAVE = ["--save-format", "tensors"]


def _same(a, b, what: str, prefixes=None) -> dict:
    cmp = compare_checkpoints(str(a), str(b), prefixes)
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], (what, cmp)
    return cmp


def _train(tree, tmp_path, flags, layout):
    """Train 4 iterations (saving at 2 and 4), then resume from 2 to 4: the final checkpoints are equal."""
    a, b = tmp_path / "a", tmp_path / "b"
    _, base = mlm(tree, [*flags, *layout, *SAVE, "--train-iters", "4", "--save-interval", "2", "--save", str(a)])
    run, resumed = mlm(tree, [*flags, *layout, *SAVE, "--train-iters", "4", "--save-interval", "2",
                              "--load", str(a), "--ckpt-step", "2", "--save", str(b)])
    assert "at iteration 2 (optimizer loaded, rng loaded)" in run.output
    # the first iteration after the resume logs the same loss; later lines are not compared: with MoE,
    # Megatron-LM's resumed run logs at iteration 4 the mean of iterations 3 and 4 (its loss
    # accumulator, not the training state: the final checkpoints are compared below)
    assert sorted(resumed) == [3, 4] and resumed[3] == base[3]
    return a, _same(a / "iter_0000004", b / "iter_0000004", "same-layout resume")


def _reshard(tree, src, dst, flags, layout):
    """Load ``src``'s iteration 2 in ``layout`` (model and optimizer) and save it again: the same
    global tensors."""
    run, losses = mlm(tree, [*flags, *layout, *SAVE, "--train-iters", "2", "--save-interval", "1000",
                             "--override-opt-param-scheduler", "--load", str(src),
                             "--ckpt-step", "2", "--save", str(dst)])
    assert losses == {} and "(optimizer loaded" in run.output
    cmp = _same(src / "iter_0000002", dst / "iter_0000002", f"reshard to {layout}")
    assert any(k.startswith("optimizer.") for k in cmp["compared"])
    assert any(k.startswith(("embedding.", "decoder.", "output_layer.")) for k in cmp["compared"])
    return run


def test_llama_bf16_distributed_optimizer_tp2(mlm_tree, tmp_path):  # noqa: F811
    a, cmp = _train(mlm_tree, tmp_path, LLAMA, ["--tensor-model-parallel-size", "2"])
    keys = cmp["compared"]
    assert any("linear_fc1" in k for k in keys) and any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in keys)  # bf16: fp32 main params
    assert any("output_layer" in k for k in keys)  # untied: its own output layer
    _reshard(mlm_tree, a, tmp_path / "tp1dp2", LLAMA, ["--tensor-model-parallel-size", "1"])


EP2 = ["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2"]
EP1 = ["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1"]


def _ep2_to_ep1_and_back(tree, a, tmp_path, flags):
    """``a`` holds iterations 2 and 4 of an EP2 run. EP2 -> EP1 reshards every model and optimizer
    tensor of iteration 2; EP1 -> EP2, training on to iteration 4, gives the EP2 run's iteration 4."""
    # EP2 -> EP1: two optimizers (dense, experts) become one
    run = _reshard(tree, a, tmp_path / "ep1", flags, EP1)
    assert "RNG state layout changed (PP1xTP1xDP2 in the checkpoint, PP1xTP1 (EP1) in this run): " \
           "RNG state will be ignored" in run.output
    assert "optimizer state saved by 2 chained optimizers, loaded into one optimizer" in run.output
    # EP1 -> EP2, training on to iteration 4: the same checkpoint as the uninterrupted EP2 run's, so the
    # optimizer's step and param groups came back into both optimizers too (the scheduler's decay
    # lengths follow --train-iters, which the EP1 run saved as 2)
    ep2b = tmp_path / "ep2"
    run, losses = mlm(tree, [*flags, *EP2, *SAVE, "--train-iters", "4", "--save-interval", "2",
                             "--override-opt-param-scheduler",
                             "--load", str(tmp_path / "ep1"), "--ckpt-step", "2", "--save", str(ep2b)])
    assert "at iteration 2 (optimizer loaded, rng not loaded)" in run.output
    assert "RNG state layout changed (PP1xTP1 (EP1) in the checkpoint, PP1xTP1xDP2 in this run): " \
           "RNG state will be ignored" in run.output
    assert "optimizer state saved by one optimizer, loaded into 2 chained optimizers" in run.output
    assert sorted(losses) == [3, 4]
    cmp = _same(a / "iter_0000004", ep2b / "iter_0000004", "EP2 -> EP1 -> EP2, trained on")
    assert any(k.startswith("optimizer.state.exp_avg_sq.") and ".experts." in k for k in cmp["compared"])


def test_moe_ep2_resume_and_reshard_to_ep1_and_back(mlm_tree, tmp_path):  # noqa: F811
    a, cmp = _train(mlm_tree, tmp_path, MOE, EP2)
    assert any(".experts." in k for k in cmp["compared"]) and any(".router." in k for k in cmp["compared"])
    _ep2_to_ep1_and_back(mlm_tree, a, tmp_path, MOE)


def test_moe_distributed_optimizer_reshards_ep2_to_ep1_and_back(mlm_tree, tmp_path):  # noqa: F811
    flags, a = [*MOE, "--use-distributed-optimizer"], tmp_path / "a"
    mlm(mlm_tree, [*flags, *EP2, *SAVE, "--train-iters", "4", "--save-interval", "2", "--save", str(a)])
    _ep2_to_ep1_and_back(mlm_tree, a, tmp_path, flags)

"""SwiGLU ``linear_fc1`` with the DistributedOptimizer, real megatron-core (0.16.1 and 0.19), 2 gloo ranks.

megatron-core builds fc1's ``fully_sharded_model_space`` optimizer state through SwiGLU's sharded
factory, whose build function ignores ``flattened_range``: it halves the flat DP piece and labels
each half a 1-D slice of the weight's row axis (global shape = the piece's length), so two DP ranks
holding pieces of different lengths disagree on the global shape and the save is refused (same
lengths: both claim the same elements). megashard turns those into flattened shards of fc1's two
halves (:func:`megashard.megatron.state.flatten_swiglu_optimizer_factories`).

The model is bf16 (fp32 main params are separate) with one layer sized so that fc1 is split
unevenly between the two DP ranks. Every rank sets its optimizer state to functions of the main
param (``exp_avg = 2 p + 1``, ``exp_avg_sq = p * p + 0.5``), so after saving at TP1·DP2 and loading at
TP2·DP1 (fc1's rows now split over TP into w/v halves, each whole on its rank) every element must
still satisfy them and ``fp32_param`` must equal the loaded bf16 weight: a misplaced element fails.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import all_ok, run_ranks  # noqa: E402

FC1 = "decoder.layers.mlp.linear_fc1.weight"


def _build(tp: int):
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megashard.megatron import cpu_compat

    cpu_compat.apply()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, kv_channels=8,
        tensor_model_parallel_size=tp, pipeline_dtype=torch.bfloat16, params_dtype=torch.bfloat16, bf16=True,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=128, max_sequence_length=16, share_embeddings_and_output_weights=False,
                   position_embedding_type="rope")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True, check_for_nan_in_grad=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))
    top = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                 params_dtype=torch.bfloat16, use_distributed_optimizer=True),
                                 [model])
    (opt,) = getattr(top, "chained_optimizers", [top])   # one DistributedOptimizer (0.16.1 chains even one)
    opt.init_state_fn(opt.optimizer, opt.config)
    for g in opt.optimizer.param_groups:
        for p in g["params"]:
            opt.optimizer.state[p]["step"] = torch.tensor(1.0)
    return model, top, opt


def _ranges(opt):
    """(name, model param, start, stop) of every parameter this rank's optimizer holds a piece of."""
    out = []
    for maps in opt.gbuf_ranges:
        for per_dtype in maps.values():
            for gbuf_range_map in per_dtype:
                for p, r in gbuf_range_map["param_map"].items():
                    out.append((p, r["param"].start, r["param"].end))
    return out


def _names(model):
    return {p: n for n, p in model.named_parameters()}


def _adapter_args(path: str, use_for: str) -> types.SimpleNamespace:
    """The few Megatron-LM args :mod:`megashard.megatron.checkpointing` reads (no RNG state)."""
    return types.SimpleNamespace(**{use_for: path}, use_distributed_optimizer=True, no_save_rng=True,
                                 no_load_rng=True, num_layers=1, hidden_size=32, num_attention_heads=4)


@contextlib.contextmanager
def _saving_as_before_the_fix():
    """megashard's saves before the SwiGLU fix: megatron-core's fc1 optimizer state, no marker."""
    from megashard.megatron import state as st

    flatten, build = st.flatten_swiglu_optimizer_factories, st.build_state_dict

    def build_unmarked(*a, **k):
        sd = build(*a, **k)
        del sd["content_metadata"][st.SWIGLU_OPTIM_KEY]
        return sd

    st.flatten_swiglu_optimizer_factories, st.build_state_dict = (lambda *a, **k: 0), build_unmarked
    try:
        yield
    finally:
        st.flatten_swiglu_optimizer_factories, st.build_state_dict = flatten, build


def _worker(rank: int, world: int, tp: int, mode: str, path: str, legacy_out: str = ""):
    """``mode``: save / load / load-legacy (:mod:`megashard.megatron.state` requests, as before),
    save-adapter-legacy / load-adapter (``megashard.megatron``'s save_checkpoint / load_checkpoint)."""
    import megashard
    from megatron.core import parallel_state as mpu

    import megashard.megatron as msm
    from megashard.megatron import state as st

    model, top, opt = _build(tp)
    names = _names(model)
    args = None
    if mode.startswith("save"):
        with torch.no_grad():
            for p, s, e in _ranges(opt):
                cur = opt._get_main_param_and_optimizer_states(p)
                main = cur["param"]
                assert torch.equal(main, p.detach().view(-1)[s:e].float())
                cur["exp_avg"].copy_(2 * main + 1)
                cur["exp_avg_sq"].copy_(main * main + 0.5)
        if mode == "save-adapter-legacy":
            with _saving_as_before_the_fix():
                msm.save_checkpoint(1, [model], top, None, args=_adapter_args(path, "save"), async_save=False)
        else:
            sd = st.build_state_dict(args, [st.unwrap_model(model)], top, None,
                                     st.StateRequest(metadata=st.sharded_sd_metadata(True)), iteration=1)
            megashard.save(st.prepare_for_save(sd), path)
        fc1 = [(s, e, p.numel()) for p, s, e in _ranges(opt) if names[p].endswith("linear_fc1.weight")]
        mpu.destroy_model_parallel()
        return fc1
    # load: start from zeros everywhere, so everything checked below came from the checkpoint
    with torch.no_grad():
        for p, s, e in _ranges(opt):
            for k, t in opt._get_main_param_and_optimizer_states(p).items():
                if k != "step":
                    t.zero_()
        for p in model.parameters():
            p.zero_()
    if mode == "load-adapter":  # the layout is the checkpoint's to tell (its content_metadata)
        assert msm.load_checkpoint([model], top, None, args=_adapter_args(path, "load")) == (1, 0)
    else:
        template = st.build_state_dict(args, [st.unwrap_model(model)], top, None,
                                       st.StateRequest(is_loading=True, rng=False, scheduler=False,
                                                       metadata=st.sharded_sd_metadata(True),
                                                       legacy_swiglu_optim=mode == "load-legacy"))
        for key in ("args", "checkpoint_version", "content_metadata"):
            template.pop(key, None)
        prepared = st.prepare_for_load(template)
        with torch.no_grad():
            loaded = st.finish_load(megashard.load(prepared.request, path), prepared)
        st.load_model_state([model], loaded)
        st.load_optimizer_state(top, loaded["optimizer"])
    checked = {}
    for p, s, e in _ranges(opt):
        cur = opt._get_main_param_and_optimizer_states(p)
        main = cur["param"]
        name = names[p]
        assert torch.equal(main, p.detach().view(-1)[s:e].float()), f"fp32_param of {name}"
        assert torch.equal(cur["exp_avg"], 2 * main + 1), f"exp_avg of {name}"
        assert torch.equal(cur["exp_avg_sq"], main * main + 0.5), f"exp_avg_sq of {name}"
        checked[name] = int((main != 0).sum())
    if legacy_out:  # save as megashard did before the fix: megatron-core's fc1 state, no marker
        with _saving_as_before_the_fix():
            sd = st.build_state_dict(args, [st.unwrap_model(model)], top, None,
                                     st.StateRequest(metadata=st.sharded_sd_metadata(True)), iteration=1)
        megashard.save(st.prepare_for_save(sd), legacy_out)
    mpu.destroy_model_parallel()
    return checked


def test_swiglu_fc1_optimizer_state_uneven_over_dp_saves_and_reshards_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    fc1 = all_ok(run_ranks(_worker, 2, 1, "save", path))
    # precondition: fc1 is split between the two DP ranks, in pieces of different lengths
    assert [len(f) for f in fc1] == [1, 1], fc1
    (s0, e0, n), (s1, e1, _) = fc1[0][0], fc1[1][0]
    assert n == 128 * 32 and sorted([(s0, e0), (s1, e1)])[0][0] == 0 and e0 - s0 + e1 - s1 == n, fc1
    assert e0 - s0 != e1 - s1 and 0 < e0 - s0 < n, fc1

    import megashard

    m = megashard.read_manifest(path)
    for state in ("exp_avg", "exp_avg_sq", "fp32_param"):
        assert m.tensors[f"optimizer.state.{state}.{FC1}"].global_shape == m.tensors[FC1].global_shape == (1, 128, 32)

    legacy = str(tmp_path / "legacy")
    checked = all_ok(run_ranks(_worker, 2, 2, "load", path, legacy))
    for rank in range(2):  # TP=2: each rank holds its own rows of w and v, all nonzero after the load
        fc1_name = [k for k in checked[rank] if k.endswith("linear_fc1.weight")]
        assert len(fc1_name) == 1 and checked[rank][fc1_name[0]] == 64 * 32

    # a checkpoint saved before the fix (TP2·DP1: each fc1 piece a whole weight, so it saved) holds
    # megatron-core's 1-D layout; the adapter requests the same elements from it at TP1·DP2
    m = megashard.read_manifest(legacy)
    assert m.tensors[f"optimizer.state.exp_avg.{FC1}"].global_shape == (1, 128 * 32)
    assert "megashard_swiglu_optim" not in json.dumps(megashard.load_common(legacy, ["content_metadata"]))
    checked = all_ok(run_ranks(_worker, 2, 1, "load-legacy", legacy))
    assert sum(v for r in checked for k, v in r.items() if k.endswith("linear_fc1.weight")) == 128 * 32



def test_checkpoint_saved_before_the_fix_resumes_through_save_and_load_checkpoint(tmp_path):
    """The adapter's own load_checkpoint reads the pre-fix layout: it tells it from the checkpoint's
    ``content_metadata`` (DistributedOptimizer ``fully_sharded_model_space``, no marker), nobody passes
    ``legacy_swiglu_optim``. Saved at TP2·DP1 by save_checkpoint with the fix patched out (what
    megashard before the fix wrote), loaded at TP1·DP2, where fc1 is split unevenly over DP."""
    import megashard

    root = str(tmp_path / "run")
    all_ok(run_ranks(_worker, 2, 2, "save-adapter-legacy", root))
    ckpt = os.path.join(root, "iter_0000001")
    md = megashard.load_common(ckpt, ["content_metadata"])["content_metadata"]
    assert md["distrib_optim_sharding_type"] == "fully_sharded_model_space" and "megashard_swiglu_optim" not in md
    m = megashard.read_manifest(ckpt)
    assert m.tensors[f"optimizer.state.exp_avg.{FC1}"].global_shape == (1, 128 * 32)  # the 1-D layout
    checked = all_ok(run_ranks(_worker, 2, 1, "load-adapter", root))
    fc1 = [v for r in checked for k, v in r.items() if k.endswith("linear_fc1.weight")]
    assert len(fc1) == 2 and sum(fc1) == 128 * 32 and 0 not in fc1, checked

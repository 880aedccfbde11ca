"""Dump the sharded-state metadata REAL megatron-core builds, for tests/test_scale_models.py.

Run under torchrun (gloo, CPU): ``scale_dump.py OUT_DIR SCENARIOS_JSON``. For every scenario
(model name from scripts/scale_models.py MODELS, tp, pp, dp, ep, vp, distributed_optimizer)
it builds megatron-core's GPTModel (local spec, bf16 via Float16Module), Megatron's DDP and
optimizer, then the state dict exactly as megashard.megatron saves it
(``state.build_state_dict`` + ``state.prepare_for_save``), and writes this rank's
:func:`describe` of it to ``OUT_DIR/<scenario index>-r<rank>.json``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, REPO)


def _rid(r: Any) -> List[int]:
    return [int(x) for x in r] if isinstance(r, (tuple, list)) else [int(r)]


def describe(sd: Dict[str, Any]) -> Dict[str, List[Any]]:
    """Sorted metadata of every ShardedTensor / ShardedObject leaf, with its path."""
    tensors, objects = [], []

    def walk(x: Any, path: List[str]) -> None:
        name = type(x).__name__
        if name == "ShardedTensor":
            fr = x.flattened_range
            local = list(x.local_shape) if getattr(x, "local_shape", None) is not None else list(x.data.shape)
            tensors.append(["/".join(path), x.key, str(x.dtype), list(x.global_shape), list(x.global_offset),
                            local, [fr.start, fr.stop] if fr is not None else None, _rid(x.replica_id),
                            int(x.prepend_axis_num)])
        elif name == "ShardedObject":
            objects.append(["/".join(path), x.key, list(x.global_shape), list(x.global_offset),
                            _rid(x.replica_id)])
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + [str(k)])
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, path + [str(i)])

    walk(sd, [])
    return {"tensors": sorted(tensors), "objects": sorted(objects),
            "top": sorted(str(k) for k in sd)}


def _build(name: str, tp: int, pp: int, dp: int, ep: int, vp: Any, dist_opt: bool) -> Dict[str, Any]:
    from types import SimpleNamespace

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.module import Float16Module

    import scale_models as sm
    from megashard.megatron import state as st

    spec = sm.MODELS[name]
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    kw: Dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
        pipeline_dtype=torch.bfloat16, params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=spec.swiglu, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    if spec.num_experts:
        kw.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                  moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                  moe_layer_freq=list(spec.moe_layer_freq) or 1, moe_router_topk=2,
                  moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
                  moe_router_score_function="sigmoid" if spec.moe_router_enable_expert_bias else "softmax",
                  moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall")
    if spec.mla:
        kw.update(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_head_dim,
                  qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim, v_head_dim=spec.v_head_dim,
                  multi_latent_attention=True)
        config = MLATransformerConfig(**kw)
    else:
        config = TransformerConfig(**kw)
    vp_size = vp or 1
    chunks = []
    for v in range(vp_size):
        vkw = dict(vp_stage=v) if vp_size > 1 else {}
        if spec.non_homogeneous:
            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                    vp_stage=v if vp_size > 1 else None)
        else:
            layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts, normalization="RMSNorm",
                                                  multi_latent_attention=spec.mla)
        m = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=spec.padded_vocab(tp),
                     max_sequence_length=32, pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, **vkw),
                     post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, **vkw),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     vp_stage=v if vp_size > 1 else None)
        m.vp_stage = v
        chunks.append(m)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=dist_opt, check_for_nan_in_grad=False)
    model = []
    for i, m in enumerate(chunks):
        d = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, m),
                                    disable_bucketing=(i > 0))
        d.vp_stage = m.vp_stage
        model.append(d)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=dist_opt), model)
    # a saved optimizer has state: create it as Adam's first step would (zeros, step 1)
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = o.optimizer
        o.init_state_fn(inner, o.config)
        for g in inner.param_groups:
            for p in g["params"]:
                inner.state[p]["step"] = torch.tensor(1.0)
    args = SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    request = st.StateRequest(metadata=st.sharded_sd_metadata(dist_opt))
    sd = st.build_state_dict(args, [st.unwrap_model(m) for m in model], opt, None, request, iteration=1)
    out = describe(st.prepare_for_save(sd))
    mpu.destroy_model_parallel()
    return out


def main() -> None:
    from megashard.megatron import cpu_compat

    out_dir, scenarios = sys.argv[1], json.loads(sys.argv[2])
    cpu_compat.apply()
    torch.distributed.init_process_group(backend="gloo")
    rank = torch.distributed.get_rank()
    for i, sc in enumerate(scenarios):
        world = sc["tp"] * sc["pp"] * sc["dp"]
        if world != torch.distributed.get_world_size():
            raise SystemExit(f"scenario {sc} needs {world} ranks")
        res = _build(sc["model"], sc["tp"], sc["pp"], sc["dp"], sc.get("ep", 1), sc.get("vp"),
                     bool(sc.get("distributed_optimizer")))
        with open(os.path.join(out_dir, f"{i}-r{rank}.json"), "w") as f:
            json.dump(res, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

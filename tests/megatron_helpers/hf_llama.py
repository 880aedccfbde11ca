"""A tiny Llama-style megatron-core GPTModel, saved or loaded through megashard, and its logits.

Run under torchrun (gloo, CPU) by tests/test_hf_*.py. ``--mode save`` builds the model at
the given TP/PP layout with rank-specific random weights (norms and biases included),
saves it with :func:`megashard.megatron.save_checkpoint` under Megatron-LM's argument
names, and writes the logits of fixed tokens. ``--mode load`` builds a fresh model,
loads ``--dir`` with ``--finetune`` through :func:`megashard.megatron.load_checkpoint`,
and writes its logits. Logits (``[batch, seq, vocab]``, the real vocabulary only) go to
``--logits`` as raw float32 with a JSON shape file beside it (``.json``).

Megatron's side only: the Hugging Face side runs in its own process, since
``cpu_compat`` changes torch process-wide.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("save", "load"), required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--logits", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None, help="virtual pipeline stages (model chunks) per rank")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ffn", type=int, default=96)
    p.add_argument("--vocab", type=int, default=100)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--interleaved", action="store_true")
    p.add_argument("--rotary-base", type=int, default=10000)
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--experts", type=int, default=0, help="MoE: experts per layer (SequentialMLP, allgather)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    return p.parse_args()


def megatron_args(o: argparse.Namespace, padded: int) -> argparse.Namespace:
    """What Megatron-LM's parser would hold for this model (the names the exporter reads)."""
    return argparse.Namespace(
        num_layers=o.layers, hidden_size=o.hidden, ffn_hidden_size=o.ffn, num_attention_heads=o.heads,
        group_query_attention=o.groups != o.heads, num_query_groups=o.groups, kv_channels=o.hidden // o.heads,
        normalization="RMSNorm", layernorm_epsilon=o.eps, swiglu=True, position_embedding_type="rope",
        rotary_base=o.rotary_base, rotary_percent=1.0, rotary_interleaved=o.interleaved, use_rope_scaling=False,
        untie_embeddings_and_output_weights=not o.tied, add_bias_linear=o.bias, add_qkv_bias=o.bias,
        padded_vocab_size=padded, vocab_size=o.vocab, make_vocab_size_divisible_by=128,
        max_position_embeddings=o.seq, seq_length=o.seq, params_dtype=torch.float32, bf16=False, fp16=False,
        tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp,
        virtual_pipeline_model_parallel_size=o.vp, expert_model_parallel_size=o.ep, **moe_args(o),
        num_layers_per_virtual_pipeline_stage=o.layers // (o.pp * o.vp) if o.vp else None,
        no_save_optim=True, no_save_rng=True, no_load_optim=True, no_load_rng=True,
        save=o.dir, load=o.dir, finetune=True, ckpt_format="tensors", save_format="tensors",
    )


def moe_args(o: argparse.Namespace) -> dict:
    """Megatron-LM's MoE arguments (also TransformerConfig's names, but ``num_experts``)."""
    if not o.experts:
        return {"num_experts": None}
    return {"num_experts": o.experts, "moe_router_topk": o.topk, "moe_ffn_hidden_size": o.ffn,
            "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "none",
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False, "moe_layer_freq": 1,
            "moe_shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": False,
            "moe_router_topk_scaling_factor": None, "moe_expert_capacity_factor": None,
            "moe_grouped_gemm": False, "moe_aux_loss_coeff": 0.0}


def build(o: argparse.Namespace, padded: int) -> list:
    """The model chunks of this rank (one, or ``--vp`` with a virtual pipeline)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, num_query_groups=o.groups,
        ffn_hidden_size=o.ffn, kv_channels=o.hidden // o.heads, normalization="RMSNorm", layernorm_epsilon=o.eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=o.bias,
        add_qkv_bias=o.bias, rotary_interleaved=o.interleaved, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp, pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=o.vp, expert_model_parallel_size=o.ep,
        **({k if k != "num_experts" else "num_moe_experts": v for k, v in moe_args(o).items()
            if k != "moe_layer_freq"}),
        params_dtype=torch.float32, use_cpu_initialization=True, sequence_parallel=False,
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    chunks = []
    for c in range(o.vp or 1):
        vp = c if o.vp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                num_experts=o.experts or None, moe_grouped_gemm=False, normalization="RMSNorm"),
            vocab_size=padded, max_sequence_length=o.seq,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=o.tied, position_embedding_type="rope", rotary_base=o.rotary_base,
            vp_stage=vp,
        ))
    return chunks


def randomize(chunks: list, o: argparse.Namespace) -> None:
    """Every parameter random, different on every TP rank where it is split (norms too)."""
    from megatron.core import parallel_state as mpu

    for c, name, p in sorted((c, n, p) for c, m in enumerate(chunks) for n, p in m.named_parameters()):
        split = bool(getattr(p, "tensor_model_parallel", False))
        expert = getattr(p, "allreduce", True) is False  # an expert's weights: this EP rank's own experts
        seed = zlib.crc32(f"{name}|{mpu.get_pipeline_model_parallel_rank()}|{c}|"
                          f"{mpu.get_expert_model_parallel_rank() if expert else 0}|"
                          f"{mpu.get_tensor_model_parallel_rank() if split else 0}|{o.seed}".encode())
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            if name.endswith("layer_norm_weight") or "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    if o.tied and mpu.get_pipeline_model_parallel_world_size() > 1:
        raise SystemExit("tied embeddings with PP > 1 are not set up by this helper")


def logits(chunks: list, o: argparse.Namespace, padded: int) -> torch.Tensor | None:
    """Forward of fixed tokens through the pipeline (p2p between stages, chunk by chunk around the ring
    with a virtual pipeline); full logits on the last stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    g = torch.Generator().manual_seed(1234)
    b, s = 2, o.seq
    tokens = torch.randint(0, o.vocab, (b, s), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.tril(torch.ones((1, 1, s, s))) < 0.5
    pp, stage = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for c, model in enumerate(chunks):
            model.eval()
            first, last = stage == 0 and c == 0, stage == pp - 1 and c == len(chunks) - 1
            if not first:  # from the previous stage (the last stage's previous chunk for stage 0)
                inp = torch.empty((s, b, o.hidden))
                dist.recv(inp, src=mpu.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(inp)
            out = model(tokens, pos, mask)
            if not last:
                dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
    if stage != pp - 1:
        return None
    # out: [b, s, padded / tp] on each TP rank
    parts = [torch.empty_like(out) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group())
    full = torch.cat(parts, dim=-1)
    assert full.shape[-1] == padded, full.shape
    return full[..., :o.vocab].contiguous() if mpu.get_tensor_model_parallel_rank() == 0 else None


def main() -> int:
    o = parse()
    from megashard.megatron import cpu_compat

    cpu_compat.apply()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    import megashard.megatron as msm

    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp,
                                  virtual_pipeline_model_parallel_size=o.vp, expert_model_parallel_size=o.ep)
    torch.manual_seed(o.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(o.seed)
    mult = 128 * o.tp
    padded = (o.vocab + mult - 1) // mult * mult
    args = megatron_args(o, padded)
    chunks = build(o, padded)
    if o.mode == "save":
        randomize(chunks, o)
        msm.save_checkpoint(1, chunks, None, None, args=args, save_dir=o.dir, async_save=False)
    else:
        it, _ = msm.load_checkpoint(chunks, None, None, args=args)
        assert it == 0, it
    out = logits(chunks, o, padded)
    if out is not None:
        with open(o.logits, "wb") as f:
            f.write(out.float().numpy().tobytes())
        with open(o.logits + ".json", "w") as f:
            json.dump(list(out.shape), f)
    dist.barrier()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

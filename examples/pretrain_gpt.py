#!/usr/bin/env python
"""Train megatron-core's GPTModel with TP / PP (+ virtual pipeline) / DP / EP and megashard checkpoints.

The model takes Megatron-LM's model flags (the names and meanings of its ``pretrain_gpt.py`` with
``--transformer-impl local``): GPT-style by default, Llama-family with ``--normalization RMSNorm --swiglu
--position-embedding-type rope --group-query-attention --num-query-groups N --disable-bias-linear``, and
Mixtral-style with ``--num-experts E --moe-router-topk K`` (``--expert-model-parallel-size``), so a model
imported from Hugging Face (``megashard convert HF_DIR CK``) trains with ``--load CK`` (docs/hf.md).

A small but real Megatron training job: Megatron's DDP, its optimizer (Adam, optionally the
DistributedOptimizer), the OptimizerParamScheduler, and the pipeline schedules from
``get_forward_backward_func`` (interleaved 1F1B when virtual-pipeline chunks are used).
Data is synthetic and deterministic: every sample is derived from its global index, so a
resumed run sees exactly the batches the uninterrupted run saw, whatever the layout.

Runs on CPU with gloo (megashard.megatron.cpu_compat patches megatron-core's CUDA calls)
and unchanged on GPUs with NCCL::

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --train-iters 6 --save /tmp/ckpt --save-interval 3 --save-format tensors
    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --tensor-model-parallel-size 1 \\
        --train-iters 9 --load /tmp/ckpt --save-format tensors

``--async-save`` saves asynchronously and finalizes as Megatron-LM's loop does: a
non-blocking ``finalize_async_save`` every iteration, a blocking one before the next save
and before exit.

Output (rank of the last pipeline stage, TP 0, DP 0): one line per iteration,
``iteration 3 | loss 4.8123456789 | lr ... | grad-norm ...`` with the loss printed
exactly (``repr`` of the float32 value), ``started from checkpoint …`` (saying what the load
restored: ``full state``, or without optimizer and why) / ``started from scratch``, and
``saved checkpoint at iteration N to DIR`` once a save is committed (``--async-save``: ``save started
at iteration N …`` at the snapshot, ``… (committed)`` when finalized).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random
import sys
import time
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megashard.megatron as msm  # noqa: E402
from megashard.megatron import cpu_compat  # noqa: E402


# --------------------------------------------------------------------------------------
# arguments (Megatron-LM's names and meanings)
# --------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="default: hidden size / attention heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="with --group-query-attention")
    g.add_argument("--vocab-size", type=int, default=256,
                   help="The synthetic data's vocabulary; the model's is padded to a multiple of "
                        "--make-vocab-size-divisible-by x TP (256 is the same at TP=1 and TP=2).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--normalization", type=str, default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated linear unit with SiLU)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true")
    g.add_argument("--use-rope-scaling", action="store_true", help="llama3.x rope scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per layer (every layer MoE)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", type=str, nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                   choices=["allgather", "alltoall"])
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=2)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", type=str, default="cosine", choices=["constant", "linear", "cosine"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Exit (after saving, if --save) when iteration %% exit-interval == 0.")
    g = p.add_argument_group("checkpointing (Megatron-LM semantics)")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--pretrained-checkpoint", type=str, default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--data-parallel-random-init", action="store_true")
    msm.add_arguments(p)  # --save-format and megashard's own options
    g = p.add_argument_group("diagnostics (used by the tests)")
    g.add_argument("--dump-loaded-state", type=str, default=None,
                   help="After loading, save the loaded state again (megashard) under this root.")
    args = p.parse_args(argv)

    if args.save_format is None:
        args.save_format = "tensors"
    if args.save_format != "tensors":
        p.error("this example only writes megashard checkpoints: --save-format tensors")
    args.ckpt_format = "tensors"
    # as Megatron-LM's validate_args()
    if args.ffn_hidden_size is None:
        h = args.hidden_size
        args.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    if args.add_bias_linear:
        args.add_qkv_bias = True
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        v = getattr(args, name)
        if isinstance(v, list) and len(v) == 1:
            setattr(args, name, v[0])
    ep = args.expert_model_parallel_size
    if ep > 1 and (not args.num_experts or args.num_experts % ep):
        p.error(f"--expert-model-parallel-size {ep} needs --num-experts, a multiple of {ep}")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % mp:
        p.error(f"world size {args.world_size} is not divisible by TP*PP={mp}")
    args.data_parallel_size = args.world_size // mp
    per_pp = args.num_layers // args.pipeline_model_parallel_size
    if args.num_layers % args.pipeline_model_parallel_size:
        p.error("--num-layers must be divisible by --pipeline-model-parallel-size")
    if args.num_layers_per_virtual_pipeline_stage:
        if args.pipeline_model_parallel_size < 2:
            p.error("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
        if per_pp % args.num_layers_per_virtual_pipeline_stage:
            p.error("layers per pipeline stage must be divisible by --num-layers-per-virtual-pipeline-stage")
        args.virtual_pipeline_model_parallel_size = per_pp // args.num_layers_per_virtual_pipeline_stage
    else:
        args.virtual_pipeline_model_parallel_size = None
    mbs_dp = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % mbs_dp:
        p.error("--global-batch-size must be divisible by micro-batch-size * data-parallel size")
    args.num_microbatches = args.global_batch_size // mbs_dp
    args.consumed_train_samples = 0
    return args


# --------------------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------------------
def initialize(args: argparse.Namespace) -> torch.device:
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    cpu_compat.apply()  # no-op when CUDA is available
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    # every rank identically: replicated parameters must agree (only replica 0 is saved)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    log0(f"layout: TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
         f"VP={args.virtual_pipeline_model_parallel_size or 1} DP={args.data_parallel_size} "
         f"EP={args.expert_model_parallel_size} "
         f"world={args.world_size} device={'cuda' if use_cuda else 'cpu'} "
         f"distributed-optimizer={bool(args.use_distributed_optimizer)}")
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def transformer_config(args: argparse.Namespace) -> Any:
    """The model's TransformerConfig from Megatron-LM's arguments (``core_transformer_config_from_args``)."""
    from megatron.core.transformer import TransformerConfig

    moe: Dict[str, Any] = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_router_topk=args.moe_router_topk,
                   moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                   moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type)
    swiglu = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu) if args.swiglu else {}
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        qk_layernorm=args.qk_layernorm,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        rotary_interleaved=args.rotary_interleaved,
        **swiglu,
        **moe,
        expert_model_parallel_size=args.expert_model_parallel_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,  # init independent of TP: full weights made on CPU, then split
        sequence_parallel=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Megatron-LM's defaults: the interleaved schedule overlaps p2p communication, and
        # with PP=2 it must (a batched send/recv pair between the same two ranks is ambiguous)
        overlap_p2p_comm=args.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
    )


def layer_spec(args: argparse.Namespace, config: Any, vp_stage: Optional[int]) -> Any:
    """The layer spec Megatron-LM's ``gpt_builder`` picks with ``--transformer-impl local``: the decoder
    block spec for MoE, else the local layer spec (its normalization and qk layernorm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=vp_stage)
    return get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)


def build_model(args: argparse.Namespace, device: torch.device) -> Tuple[List[Any], Any]:
    """One GPTModel per virtual-pipeline stage (``vp_stage`` = chunk index), wrapped in Megatron DDP."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(args)
    vp_size = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vp_size):
        kw = dict(vp_stage=vp_stage) if vp_size > 1 else {}
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, **kw)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, **kw)
        m = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(args, config, vp_stage if vp_size > 1 else None),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor,
            vp_stage=vp_stage if vp_size > 1 else None,
        )
        m.vp_stage = vp_stage
        m.to(device)
        chunks.append(m)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0))
        for i, m in enumerate(chunks)
    ]
    for m, inner in zip(model, chunks):
        m.vp_stage = inner.vp_stage
        m.broadcast_params()  # identical DP replicas, as Megatron does at start
    return model, config


def build_optimizer(args: argparse.Namespace, model: List[Any]) -> Tuple[Any, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=min(args.lr_warmup_iters, args.lr_decay_iters - 1) * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# --------------------------------------------------------------------------------------
# synthetic deterministic data
# --------------------------------------------------------------------------------------
def make_sample(args: argparse.Namespace, index: int) -> torch.Tensor:
    """Tokens of global sample ``index``: arithmetic sequences (learnable) with some noise."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
    v = args.vocab_size
    start = int(torch.randint(0, v, (1,), generator=g))
    step = int(torch.randint(1, 8, (1,), generator=g))
    tokens = (start + step * torch.arange(args.seq_length + 1)) % v
    noise = torch.rand(args.seq_length + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(0, v, (int(noise.sum()),), generator=g)
    return tokens


def microbatches(args: argparse.Namespace, iteration: int, device: torch.device) -> Iterator[Dict[str, torch.Tensor]]:
    """The microbatches of ``iteration`` for this DP rank (Megatron's pretraining sampler order)."""
    from megatron.core import parallel_state as mpu

    dp_rank = mpu.get_data_parallel_rank()
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    s = args.seq_length
    mask = torch.tril(torch.ones((1, 1, s, s), device=device)) < 0.5
    pos = torch.arange(s, device=device).unsqueeze(0).expand(mbs, s)
    for mb in range(args.num_microbatches):
        first = iteration * args.global_batch_size + mb * mbs * dp + dp_rank * mbs
        seqs = torch.stack([make_sample(args, first + j) for j in range(mbs)]).to(device)
        yield {
            "tokens": seqs[:, :-1].contiguous(),
            "labels": seqs[:, 1:].contiguous(),
            "loss_mask": torch.ones((mbs, s), dtype=torch.float32, device=device),
            "attention_mask": mask,
            "position_ids": pos,
        }


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict]:
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model: Any) -> Tuple[torch.Tensor, Any]:
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, partial(loss_func, b["loss_mask"])


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------
def train_step(args: argparse.Namespace, iteration: int, model: List[Any], optimizer: Any, scheduler: Any,
               device: torch.device) -> Tuple[Optional[float], float]:
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    iters = [microbatches(args, iteration, device) for _ in model]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if len(model) > 1 else iters[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size
    loss = None
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        val = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        torch.distributed.all_reduce(val, group=mpu.get_data_parallel_group())
        loss = (val[0] / val[1]).item()
    return loss, float(grad_norm) if grad_norm is not None else float("nan")


def flops_per_iteration(args: argparse.Namespace) -> float:
    """Megatron's dense-GPT estimate (forward + backward) for one global batch."""
    b, s, L, h, v = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size, args.vocab_size
    return 24.0 * b * s * L * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * L * h))


def params_digest(model: List[Any]) -> str:
    """SHA-256 over every rank's parameters (gathered), to compare runs of the same layout."""
    h = hashlib.sha256()
    for m in model:
        for name, p in sorted(msm_unwrap(m).named_parameters()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    digests: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


def rng_digest() -> str:
    """Hash of the next draws of every RNG (state restored afterwards), gathered over ranks."""
    from megatron.core import tensor_parallel

    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()})
    draws = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    with tensor_parallel.get_cuda_rng_tracker().fork():
        draws.append(float(torch.rand(1, device="cuda" if torch.cuda.is_available() else "cpu")))
    random.setstate(saved[0]); np.random.set_state(saved[1]); torch.set_rng_state(saved[2])
    tensor_parallel.get_cuda_rng_tracker().set_states(saved[3])
    allv: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(allv, repr(draws))
    return hashlib.sha256("".join(allv).encode()).hexdigest()[:16]


def msm_unwrap(m: Any) -> Any:
    from megashard.megatron.state import unwrap_model

    return unwrap_model(m)


def say(msg: str) -> None:
    """One line in one write: ranks share torchrun's stdout, and ``print`` writes the text and its
    newline separately, so another rank's line could land between them."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def log0(msg: str) -> None:
    if torch.distributed.get_rank() == 0:
        say(msg)


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = initialize(args)
    from megatron.core import parallel_state as mpu

    model, config = build_model(args, device)
    optimizer, scheduler = build_optimizer(args, model)
    # Megatron-LM's setup_model_and_optimizer wires these into the schedule's config
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads

    t0 = time.perf_counter()
    start_iteration, num_flops = 0, 0.0
    restored: Dict[str, Any] = {}  # load_checkpoint says what it restored under "megashard_loaded"
    msm.check_save_writable(args)  # as install() does for Megatron-LM: a read-only --save fails now
    if args.load or args.pretrained_checkpoint:
        start_iteration, num_flops = msm.load_checkpoint(model, optimizer, scheduler, checkpointing_context=restored,
                                                         args=args)
    loaded_dir = msm.find_checkpoint(args.load, args.ckpt_step) if args.load else None
    if loaded_dir is None and args.pretrained_checkpoint:
        loaded_dir = msm.find_checkpoint(args.pretrained_checkpoint)
    if loaded_dir:
        what = ("weights only (--finetune)" if args.finetune else
                "weights only (a release checkpoint)" if os.path.basename(loaded_dir) == "release" else
                "without optimizer (--no-load-optim)" if args.no_load_optim else
                "without optimizer (the checkpoint holds none: saved with --no-save-optim)"
                if not restored.get("megashard_loaded", {}).get("optimizer", True) else "full state")
        log0(f"started from checkpoint {loaded_dir} (iteration {start_iteration}, {what}, "
             f"num-floating-point-operations-so-far {num_flops!r}) in {time.perf_counter() - t0:.2f} s")
    else:
        log0("started from scratch (no checkpoint)")
    log0(f"params-digest {params_digest(model)} | rng-digest {rng_digest()} | "
         f"lr {scheduler.get_lr(optimizer.param_groups[0])!r}")
    if args.dump_loaded_state:
        msm.save_checkpoint(start_iteration, model, optimizer, scheduler, num_flops, args=args,
                            save_dir=args.dump_loaded_state, async_save=False)

    is_reporter = (mpu.is_pipeline_last_stage(ignore_virtual=True)
                   and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0)
    pending: List[int] = []  # an --async-save in flight: its iteration, until committed

    def committed(done: bool) -> None:
        if done and pending:
            it = pending.pop()
            log0(f"saved checkpoint at iteration {it} to {msm.checkpoint_dir(args.save, it)} (committed)")

    def save(it: int, digests: str = "") -> None:
        """Save; log "saved checkpoint" once it is committed ("save started" at an async snapshot)."""
        if args.async_save:  # before the next save: the previous one is committed first
            committed(msm.finalize_async_save(blocking=True))
        msm.save_checkpoint(it, model, optimizer, scheduler, num_flops, args=args)
        if args.async_save:
            pending.append(it)
        log0(f"{'save started' if args.async_save else 'saved checkpoint'} at iteration {it} to "
             f"{msm.checkpoint_dir(args.save, it)}{digests}")

    iteration = start_iteration
    saved_at = None
    while iteration < args.train_iters:
        loss, grad_norm = train_step(args, iteration, model, optimizer, scheduler, device)
        iteration += 1
        num_flops += flops_per_iteration(args)
        if is_reporter:
            say(f"iteration {iteration} | loss {loss!r} | lr {optimizer.param_groups[0]['lr']!r} | "
                f"grad-norm {grad_norm!r}")
        if args.async_save:  # like Megatron-LM's train(): commit a finished async save, never wait
            committed(msm.finalize_async_save(blocking=False))
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save(iteration, f" | params-digest {params_digest(model)} | rng-digest {rng_digest()}")
            saved_at = iteration
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and saved_at != iteration:
                save(iteration)
                saved_at = iteration
            log0(f"exiting at iteration {iteration} (--exit-interval)")
            break
    else:
        # like Megatron-LM's pretrain(): a final save unless the interval just saved
        if args.save and iteration != 0 and saved_at != iteration and iteration != start_iteration:
            save(iteration)
    if args.async_save:  # before exit: wait for and commit the last async save (else it is abandoned)
        committed(msm.finalize_async_save(blocking=True))
    log0(f"done at iteration {iteration}")
    torch.distributed.barrier()
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

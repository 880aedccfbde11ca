"""Fabricated per-rank Megatron state dicts (metadata only) for planning at 1k-16k ranks.

``rank_state_dict(model, layout, rank)`` returns what ``megashard.megatron`` passes to
``megashard.save`` on ``rank`` (after ``prepare_for_save``: factories applied,
non-persistent objects dropped, per-parameter ``step`` removed), with every tensor
``torch.empty(shape, dtype, device="meta")``: no data, no process groups, no
megatron-core objects. ``file_stems(model, layout, rank)`` is what it passes as
``file_stems``. Leaves are :class:`megashard.sharded.ShardedTensor` and the small
:class:`megashard.sharded.ShardedObject`.

What follows megatron-core 0.16.1 (read from its code, and compared with real
megatron-core on CPU by ``tests/test_scale_models.py`` for the ``local`` spec):

* rank order ``tp-cp-ep-dp-pp`` (``parallel_state``): ``tp = r % TP``,
  ``dp = r // TP % DP``, ``pp = r // (TP*DP)``; experts: ``etp = r % ETP`` (ETP = TP),
  ``ep = r // ETP % EP``, ``edp = r // (ETP*EP) % EDP``;
* layer placement (``get_transformer_layer_offset`` / ``get_num_layers_to_build``),
  VP chunks (``vp_stage * L/VP + pp_rank * L/(PP*VP)``); a layer count PP does not
  divide goes to an uneven *last* stage (``num_layers_in_last_pipeline_stage``);
* keys: homogeneous models stack layers (``decoder.layers.X`` with the layer axis
  prepended, offset = global layer index); ``moe_layer_freq`` given as a list (DeepSeek-V3:
  dense first layers) makes the layers non-homogeneous, so keys carry the global layer
  index and there is no layer axis, exactly as ``TransformerBlock.sharded_state_dict``;
* TP splits (column: axis 0, row: axis 1, vocab-parallel embedding/output layer: axis 0),
  SwiGLU ``linear_fc1`` split into its w/v halves (``apply_swiglu_sharded_factory``), replica
  ids ``(0, tp_rank | 0, dp_rank)``, experts with the expert axis (``SequentialMLP`` /
  ``TEGroupedMLP``: identical keys) and replica ``(0, 0|etp_rank, edp_rank)``, router weight
  and ``expert_bias`` buffer (fp32), shared experts;
* DistributedOptimizer ``fully_sharded_model_space``: parameters in reverse registration
  order per buffer (dtype bf16; expert parameters in their own buffer over the expert-DP
  group, in a second chained optimizer: ``optimizer: {0: dense, 1: expert}``), 64-element
  aligned parameter starts, buckets padded to ``lcm(DP, 128)``, one bucket per buffer unless
  ``overlap_grad_reduce`` (then ``bucket_size`` = ``max(4e7, 1e6*DP)``; never on PP stage > 0 or
  VP chunk > 0), each bucket split evenly over DP; per parameter fp32 ``fp32_param``,
  ``exp_avg``, ``exp_avg_sq`` with the model shard's metadata, ``flattened_range`` = the
  parameter's range held by this DP rank and replica ``(r0, r1, 0)``;
* SwiGLU ``linear_fc1`` optimizer state as flattened shards of the weight's two halves (the
  parts of this DP rank's range in each), as ``megashard.megatron.state.
  flatten_swiglu_optimizer_factories`` makes it. ``swiglu_dist_opt_quirk=True`` in
  :func:`rank_state_dict` gives instead what megatron-core (0.16.1 and 0.19.0) builds, which
  megashard passed on before that fix: the SwiGLU factory's build function ignores
  ``flattened_range``, halves the *flat* DP piece (``torch.chunk``) and shards each half as a
  1-D tensor along the weight's row axis, so global shapes depend on the DP piece's length
  (differ between DP ranks: the save is refused);
* ``rng_state`` ShardedObject (``(pp, tp)`` / ``(pp, tp, dp)`` with EP), random values of a real state's sizes.

What follows megatron-core's code for the GPU setup (Transformer Engine spec) and could
not be compared on CPU (no Transformer Engine here): ``spec="te"`` (default for the big
models) adds one ``_extra_state`` ShardedObject per TE module per rank
(``make_sharded_tensors_for_checkpoint``: offsets = the layer/expert offsets,
replica ``(0, tp_rank, dp_rank)``; ``edp_rank`` for grouped experts, one per local expert),
uses the TE module layout for MLA (``linear_q_down_proj`` / ``linear_kv_down_proj``
duplicated over TP, q/kv norms fused into the up projections as ``layer_norm_weight``;
megatron-core 0.16.1's local spec cannot build MLA at all), and
TE's parameter registration order (``layer_norm_weight`` before ``weight``) for the
DistributedOptimizer ranges. ``spec="local"`` is megatron-core's local spec (what runs on
CPU): no ``_extra_state``, local parameter order.

With TP > 1 the duplicated MLA down projections are main replicas on every TP rank
(megatron-core passes no TP group to ``TELinear(parallel_mode='duplicated')``), as there.

Approximations: DeepSeek-V3's multi-token-prediction layer is left out; whether TE's
``RMSNorm`` modules (TENorm: MLA ``input_layernorm``, MoE ``pre_mlp_layernorm``,
``final_layernorm``) carry an ``_extra_state`` depends on the TE version and is not modelled;
uneven pipeline splits (61 layers over PP=16) put the remainder on a smaller last stage
(Megatron needs ``--decoder-last-pipeline-num-layers`` for that); MoE without the
DistributedOptimizer raises; ``args`` is a
small Namespace and ``opt_param_scheduler`` / ``param_groups`` hold representative
values (their exact contents do not affect planning); CP = 1, ETP = TP.
"""
from __future__ import annotations

import argparse
import base64
import functools
import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megashard.sharded import ShardedObject, ShardedTensor

BF16, FP32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------------------------
# public data types
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout. ``world = tp * pp * dp``; EP divides DP (Megatron's rule)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    vp: Optional[int] = None
    distributed_optimizer: bool = False
    #: Megatron's ``--overlap-grad-reduce`` (default off): then buckets of ``bucket_size``
    #: elements (default ``max(4e7, 1e6 * DP)``) instead of one bucket per buffer.
    overlap_grad_reduce: bool = False
    bucket_size: Optional[int] = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp, self.ep) < 1 or (self.vp is not None and self.vp < 1):
            raise ValueError(f"{self}: sizes must be >= 1")
        if (self.tp * self.dp) % (self.tp * self.ep):
            raise ValueError(f"{self}: EP={self.ep} must divide DP={self.dp}")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers that decide shapes (Megatron's argument names)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = True
    # multi-latent attention (DeepSeek); None = GQA
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # mixture of experts
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    shared_expert_intermediate_size: Optional[int] = None
    moe_layer_freq: Tuple[int, ...] = ()   # per layer 1 = MoE, 0 = dense; () = all MoE if experts
    moe_router_enable_expert_bias: bool = False
    spec: str = "te"                       # "te" (GPU) or "local" (megatron-core modules, CPU)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    def is_moe_layer(self, i: int) -> bool:
        if not self.num_experts:
            return False
        return bool(self.moe_layer_freq[i]) if self.moe_layer_freq else True

    @property
    def non_homogeneous(self) -> bool:
        return bool(self.moe_layer_freq) and bool(self.num_experts)

    def padded_vocab(self, tp: int) -> int:
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // m) * m


MODELS: Dict[str, ModelSpec] = {
    "llama3-70b": ModelSpec(
        "llama3-70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
        num_attention_heads=64, num_query_groups=8, kv_channels=128, vocab_size=128256),
    # MLA shapes; 256 routed experts (top-8) + 1 shared, first 3 layers dense, expert bias
    "deepseek-v3": ModelSpec(
        "deepseek-v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
        num_attention_heads=128, num_query_groups=128, kv_channels=128, vocab_size=129280,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        num_experts=256, moe_ffn_hidden_size=2048, shared_expert_intermediate_size=2048,
        moe_layer_freq=(0,) * 3 + (1,) * 58, moe_router_enable_expert_bias=True),
    # small ones, megatron-core's local spec: compared with real megatron-core on CPU
    "tiny-gpt": ModelSpec(
        "tiny-gpt", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, vocab_size=250, spec="local"),
    "tiny-moe": ModelSpec(
        "tiny-moe", num_layers=3, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, vocab_size=250, num_experts=4, moe_ffn_hidden_size=32, shared_expert_intermediate_size=48,
        moe_layer_freq=(0, 1, 1), moe_router_enable_expert_bias=True, spec="local"),
}


# --------------------------------------------------------------------------------------
# rank coordinates
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


def coords(layout: Layout, rank: int) -> Coords:
    """Megatron's default order tp-cp-ep-dp-pp (CP = 1, expert TP = TP)."""
    if not 0 <= rank < layout.world:
        raise ValueError(f"rank {rank} outside world {layout.world} of {layout}")
    tp, dp, pp = rank % layout.tp, rank // layout.tp % layout.dp, rank // (layout.tp * layout.dp)
    etp = layout.tp
    edp_size = layout.dp // layout.ep
    ep = rank // etp % layout.ep
    edp = rank // (etp * layout.ep) % edp_size
    return Coords(tp, dp, pp, ep, rank % etp, edp)


def stage_layers(spec: ModelSpec, layout: Layout, pp_rank: int) -> List[List[int]]:
    """Global layer indices of every VP chunk of ``pp_rank``."""
    L, pp, vp = spec.num_layers, layout.pp, layout.vp or 1
    if pp == 1:
        if vp > 1:
            raise ValueError("virtual pipeline stages need PP > 1")
        return [list(range(L))]
    if L % pp == 0:
        per_pp = L // pp
        if per_pp % vp:
            raise ValueError(f"{L} layers over PP={pp} VP={vp}: uneven chunks")
        per_chunk = per_pp // vp
        return [list(range(v * (L // vp) + pp_rank * per_chunk, v * (L // vp) + (pp_rank + 1) * per_chunk))
                for v in range(vp)]
    if vp > 1:
        raise ValueError(f"{L} layers over PP={pp}: uneven stages are modelled without VP only")
    per = -(-L // pp)
    last = L - per * (pp - 1)
    if last <= 0:
        raise ValueError(f"{L} layers over PP={pp}: no uneven split with a smaller last stage")
    start = pp_rank * per
    return [list(range(start, start + (last if pp_rank == pp - 1 else per)))]


# --------------------------------------------------------------------------------------
# one model chunk's parameters (independent of DP rank)
# --------------------------------------------------------------------------------------
@dataclass
class Shard:
    """One ShardedTensor's metadata; ``tp_repl`` = replicated over TP (replica uses tp rank)."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    prepend: int
    dtype: torch.dtype
    tp_repl: bool
    expert: bool


@dataclass
class Param:
    """One model parameter (or persistent buffer) of a chunk, in registration order."""

    numel: int
    shards: List[Shard]          # 1, or 2 for SwiGLU fc1 (w, v halves)
    path: str = ""               # the key in the chunk's state dict (local layer / expert index)
    is_param: bool = True
    expert: bool = False
    swiglu: Optional[Tuple[int, int]] = None   # (tp_rank, tp_size) of the fc1 split
    layer_offsets: Tuple[Tuple[int, int, int], ...] = ()


@dataclass
class Chunk:
    params: List[Param]
    objects: List[Tuple[str, Tuple[int, ...], Tuple[int, ...], str, str]]   # key, shape, offset, kind, path


def _prod(s: Sequence[int]) -> int:
    n = 1
    for d in s:
        n *= int(d)
    return n


class _Builder:
    """Collects the parameters of one chunk for given (tp, ep, etp) coordinates."""

    def __init__(self, spec: ModelSpec, tp: int, tp_rank: int, ep: int, ep_rank: int):
        self.spec, self.tp, self.tp_rank, self.ep, self.ep_rank = spec, tp, tp_rank, ep, ep_rank
        self.params: List[Param] = []
        self.objects: List[Tuple[str, Tuple[int, ...], Tuple[int, ...], str, str]] = []
        self.kp = self.pathp = ""   # key prefix and the state-dict path prefix it stands for

    def _path(self, key: str) -> str:
        return self.pathp + key[len(self.kp):] if self.kp and key.startswith(self.kp) else key

    def tensor(self, key: str, local: Tuple[int, ...], offsets: Sequence[Tuple[int, int, int]],
               tp_axis: Optional[int], *, tp_size: Optional[int] = None, tp_rank: Optional[int] = None,
               swiglu: bool = False, expert: bool = False, dtype: torch.dtype = BF16,
               is_param: bool = True) -> None:
        """``offsets``: prepended axes (axis, index, count); ``tp_axis`` None = replicated over TP."""
        tps = self.tp if tp_size is None else tp_size
        tpr = self.tp_rank if tp_rank is None else tp_rank
        pre = len(offsets)
        gshape = [o[2] for o in offsets] + list(local)
        goff = [o[1] for o in offsets] + [0] * len(local)
        if tp_axis is not None:
            gshape[pre + tp_axis] *= tps
            goff[pre + tp_axis] = local[tp_axis] * tpr
        numel = _prod(local)
        if swiglu:
            half = list(local)
            half[0] //= 2
            shards = []
            for frag in (tpr, tps + tpr):
                gs, go = list(gshape), list(goff)
                go[pre] = half[0] * frag
                shards.append(Shard(key, tuple(gs), tuple(go), tuple(half), pre, dtype, tp_axis is None, expert))
            self.params.append(Param(numel, shards, self._path(key), is_param, expert, (tpr, tps), tuple(offsets)))
            return
        self.params.append(Param(numel, [Shard(key, tuple(gshape), tuple(goff), tuple(local), pre, dtype,
                                               tp_axis is None, expert)], self._path(key), is_param, expert))

    def extra_state(self, key: str, offsets: Sequence[Tuple[int, int, int]], kind: str = "dense") -> None:
        """A linear layer's ``_extra_state`` (local and TE linears both have one)."""
        if offsets:
            shape, off = tuple(o[2] for o in offsets), tuple(o[1] for o in offsets)
        else:
            shape, off = (1,), (0,)
        self.objects.append((key, shape, off, kind, self._path(key)))

    # -- modules -----------------------------------------------------------------------
    def linear(self, prefix: str, out_f: int, in_f: int, offs: Sequence[Tuple[int, int, int]], mode: str,
               *, ln: Optional[int] = None, swiglu: bool = False, expert: bool = False,
               tp_size: Optional[int] = None, tp_rank: Optional[int] = None) -> None:
        """mode: 'col', 'row' or 'dup' (duplicated). ``ln``: fused norm width (TE order: norm first)."""
        tps = self.tp if tp_size is None else tp_size
        if ln is not None:
            self.tensor(prefix + "layer_norm_weight", (ln,), offs, None)
        if mode == "col":
            self.tensor(prefix + "weight", (out_f // tps, in_f), offs, 0, tp_size=tp_size, tp_rank=tp_rank,
                        swiglu=swiglu, expert=expert)
        elif mode == "row":
            self.tensor(prefix + "weight", (out_f, in_f // tps), offs, 1, tp_size=tp_size, tp_rank=tp_rank,
                        expert=expert)
        else:
            # TELinear(parallel_mode='duplicated') has no TP group: megatron-core gives it
            # replica (0, 0, dp) on every TP rank (get_pg_rank(None) == 0), so each TP rank
            # holds a main replica of the same full tensor
            self.tensor(prefix + "weight", (out_f, in_f), offs, None)
            self.params[-1].shards[0].tp_repl = False
            self.extra_state(prefix + "_extra_state", offs, "dup")
            return
        self.extra_state(prefix + "_extra_state", offs)

    def norm(self, key: str, width: int, offs: Sequence[Tuple[int, int, int]]) -> None:
        self.tensor(key, (width,), offs, None)

    def attention(self, p: str, offs: Sequence[Tuple[int, int, int]]) -> None:
        s = self.spec
        te = s.spec == "te"
        h = s.hidden_size
        if not s.mla:
            qkv = (s.num_attention_heads + 2 * s.num_query_groups) * s.kv_channels
            if not te:  # input_layernorm comes first; its key maps onto linear_qkv.layer_norm_weight
                self.norm(p + "self_attention.linear_qkv.layer_norm_weight", h, offs)
                self.params[-1].path = self._path(p + "input_layernorm.weight")
            # Attention.__init__ builds linear_proj before SelfAttention builds linear_qkv
            self.linear(p + "self_attention.linear_proj.", h, s.num_attention_heads * s.kv_channels, offs, "row")
            self.linear(p + "self_attention.linear_qkv.", qkv, h, offs, "col", ln=h if te else None)
            return
        if not te:
            raise ValueError(f"{s.name}: megatron-core 0.16.1's local spec cannot build MLA "
                             "(DotProductAttention has no k_channels); use spec='te'")
        heads = s.num_attention_heads
        q_head = s.qk_head_dim + s.qk_pos_emb_head_dim
        self.norm(p + "input_layernorm.weight", h, offs)
        self.linear(p + "self_attention.linear_proj.", h, heads * s.v_head_dim, offs, "row")
        if s.q_lora_rank is None:
            self.linear(p + "self_attention.linear_q_proj.", heads * q_head, h, offs, "col")
        else:
            self.linear(p + "self_attention.linear_q_down_proj.", s.q_lora_rank, h, offs, "dup")
            self.linear(p + "self_attention.linear_q_up_proj.", heads * q_head, s.q_lora_rank, offs, "col",
                        ln=s.q_lora_rank)
        self.linear(p + "self_attention.linear_kv_down_proj.", s.kv_lora_rank + s.qk_pos_emb_head_dim, h,
                    offs, "dup")
        self.linear(p + "self_attention.linear_kv_up_proj.", heads * (s.qk_head_dim + s.v_head_dim),
                    s.kv_lora_rank, offs, "col", ln=s.kv_lora_rank)

    def mlp(self, p: str, ffn: int, offs: Sequence[Tuple[int, int, int]], *, fused_ln: bool) -> None:
        s, h = self.spec, self.spec.hidden_size
        ln = h if fused_ln and s.spec == "te" else None
        if fused_ln and s.spec != "te":
            self.norm(p + "mlp.linear_fc1.layer_norm_weight", h, offs)
            self.params[-1].path = self._path(p + "pre_mlp_layernorm.weight")
        self.linear(p + "mlp.linear_fc1.", ffn * (2 if s.swiglu else 1), h, offs, "col", ln=ln, swiglu=s.swiglu)
        self.linear(p + "mlp.linear_fc2.", h, ffn, offs, "row")

    def moe(self, p: str, offs: Sequence[Tuple[int, int, int]]) -> None:
        s, h = self.spec, self.spec.hidden_size
        E = s.num_experts
        if s.spec == "te":  # TENorm
            self.norm(p + "pre_mlp_layernorm.weight", h, offs)
        else:  # the local spec's keys map renames it even in MoE layers
            self.norm(p + "mlp.linear_fc1.layer_norm_weight", h, offs)
            self.params[-1].path = self._path(p + "pre_mlp_layernorm.weight")
        self.tensor(p + "mlp.router.weight", (E, h), offs, None)
        if s.moe_router_enable_expert_bias:
            self.tensor(p + "mlp.router.expert_bias", (E,), offs, None, dtype=FP32, is_param=False)
        n_local = E // self.ep
        ffn = s.moe_ffn_hidden_size
        fc1 = ffn * (2 if s.swiglu else 1)
        base = p + "mlp.experts.experts."
        ax = len(offs)
        if s.spec == "te":  # TEGroupedMLP: weight0..n of fc1, then of fc2
            for name, out_f, in_f, mode in (("linear_fc1.", fc1, h, "col"), ("linear_fc2.", h, ffn, "row")):
                for i in range(n_local):
                    eo = (*offs, (ax, self.ep_rank * n_local + i, E))
                    self._expert_linear(base + name, out_f, in_f, eo, mode, name == "linear_fc1." and s.swiglu)
                    self.params[-1].path = f"{self._path(p)}mlp.experts.{name}weight{i}"
                for i in range(n_local):
                    eo = (*offs, (ax, self.ep_rank * n_local + i, E))
                    self.objects.append((base + name + "_extra_state", tuple(o[2] for o in eo),
                                         tuple(o[1] for o in eo), "expert",
                                         f"{self._path(p)}mlp.experts.{name}_extra_state{i or ''}"))
        else:  # SequentialMLP: local_experts.i.linear_fc1, .linear_fc2
            kp, pathp = self.kp, self.pathp
            for i in range(n_local):
                eo = (*offs, (ax, self.ep_rank * n_local + i, E))
                self.kp, self.pathp = base, self._path(p + "mlp.experts.") + f"local_experts.{i}."
                self._expert_linear(base + "linear_fc1.", fc1, h, eo, "col", s.swiglu)
                self._expert_linear(base + "linear_fc2.", h, ffn, eo, "row", False)
            self.kp, self.pathp = kp, pathp
        if s.shared_expert_intermediate_size:
            sh = s.shared_expert_intermediate_size
            self.linear(p + "mlp.shared_experts.linear_fc1.", sh * (2 if s.swiglu else 1), h, offs, "col",
                        swiglu=s.swiglu)
            self.linear(p + "mlp.shared_experts.linear_fc2.", h, sh, offs, "row")

    def _expert_linear(self, prefix: str, out_f: int, in_f: int, offs: Sequence[Tuple[int, int, int]],
                       mode: str, swiglu: bool) -> None:
        if mode == "col":
            self.tensor(prefix + "weight", (out_f // self.tp, in_f), offs, 0, swiglu=swiglu, expert=True)
        else:
            self.tensor(prefix + "weight", (out_f, in_f // self.tp), offs, 1, expert=True)
        if self.spec.spec != "te":  # SequentialMLP's experts are local linears (TE: grouped, below)
            self.extra_state(prefix + "_extra_state", offs, "expert")


@functools.lru_cache(maxsize=4096)
def _chunk(model: str, layout: Layout, pp_rank: int, vp_stage: int, tp_rank: int, ep_rank: int) -> Chunk:
    """The parameters of one model chunk, in ``named_parameters`` order."""
    s = MODELS[model]
    b = _Builder(s, layout.tp, tp_rank, layout.ep, ep_rank)
    chunks = stage_layers(s, layout, pp_rank)
    vp = len(chunks)
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == layout.pp - 1 and vp_stage == vp - 1
    V = s.padded_vocab(layout.tp)
    if pre:
        b.tensor("embedding.word_embeddings.weight", (V // layout.tp, s.hidden_size), (), 0)
    for local, g in enumerate(chunks[vp_stage]):
        if s.non_homogeneous:
            p, offs = f"decoder.layers.{g}.", ()
        else:
            p, offs = "decoder.layers.", ((0, g, s.num_layers),)
        b.kp, b.pathp = p, f"decoder.layers.{local}."
        b.attention(p, offs)
        if s.is_moe_layer(g):
            b.moe(p, offs)
        else:
            b.mlp(p, s.ffn_hidden_size, offs, fused_ln=True)
    b.kp = b.pathp = ""
    if post:
        b.norm("decoder.final_layernorm.weight", s.hidden_size, ())
        b.tensor("output_layer.weight", (V // layout.tp, s.hidden_size), (), 0)
    return Chunk(b.params, b.objects)


# --------------------------------------------------------------------------------------
# DistributedOptimizer buffers (independent of DP rank)
# --------------------------------------------------------------------------------------
@dataclass
class Buffer:
    """One DDP param buffer: parameter index ranges and bucket bounds."""

    params: List[Tuple[int, int, int]]   # (chunk param index, start, end) in buffer order
    buckets: List[Tuple[int, int]]


def _buffer(chunk: Chunk, expert: bool, dp_size: int, bucket_size: Optional[int]) -> Optional[Buffer]:
    idx = [i for i, p in enumerate(chunk.params) if p.is_param and p.expert == expert]
    if not idx:
        return None
    div = math.lcm(dp_size, 128)
    out: List[Tuple[int, int, int]] = []
    buckets: List[Tuple[int, int]] = []
    start = bucket_start = 0
    end = 0
    open_bucket = False
    for i in reversed(idx):
        start = -(-start // 64) * 64
        end = start + chunk.params[i].numel
        out.append((i, start, end))
        open_bucket = True
        if bucket_size is not None and end - bucket_start >= bucket_size:
            bend = -(-end // div) * div
            buckets.append((bucket_start, bend))
            bucket_start = start = bend
            open_bucket = False
        else:
            start = end
    if open_bucket:
        buckets.append((bucket_start, -(-end // div) * div))
    return Buffer(out, buckets)


@functools.lru_cache(maxsize=4096)
def _buffers(model: str, layout: Layout, pp_rank: int, tp_rank: int, ep_rank: int) -> List[List[Buffer]]:
    """[dense buffers, expert buffers] over this stage's chunks (chunk order)."""
    vp = len(stage_layers(MODELS[model], layout, pp_rank))
    if layout.overlap_grad_reduce:
        size = layout.bucket_size or max(40_000_000, 1_000_000 * layout.dp)
    else:
        size = None
    dense, expert = [], []
    for v in range(vp):
        c = _chunk(model, layout, pp_rank, v, tp_rank, ep_rank)
        bsize = None if (v > 0 or pp_rank > 0) else size
        d = _buffer(c, False, layout.dp, bsize)
        e = _buffer(c, True, layout.dp // layout.ep, bsize)
        dense.append(d)
        expert.append(e)
    return [dense, expert]


def _owned(buf: Buffer, dp_rank: int, dp_size: int) -> List[Tuple[int, int, int]]:
    """(chunk param index, flat start, flat stop) of the pieces this DP rank owns."""
    out = []
    for bstart, bend in buf.buckets:
        share = (bend - bstart) // dp_size
        lo, hi = bstart + dp_rank * share, bstart + (dp_rank + 1) * share
        for i, ps, pe in buf.params:
            s, e = max(ps, lo), min(pe, hi)
            if e > s and bstart <= ps < bend:
                out.append((i, s - ps, e - ps))
    return out


# --------------------------------------------------------------------------------------
# per-rank state dict
# --------------------------------------------------------------------------------------
def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _model_sd(chunk: Chunk, c: Coords) -> Dict[str, Any]:
    sd: Dict[str, Any] = {}
    for p in chunk.params:
        sts = []
        for sh in p.shards:
            rid = (0, c.tp if sh.tp_repl else 0, c.edp if sh.expert else c.dp)
            sts.append(ShardedTensor(sh.key, _meta(sh.local_shape, sh.dtype), sh.global_shape, sh.global_offset,
                                     rid, sh.prepend, sh.local_shape, sh.dtype))
        for st in sts:
            st.allow_shape_mismatch = _vocab_padded(st.key)
        sd[p.path] = sts[0] if len(sts) == 1 else sts
    for key, shape, off, kind, path in chunk.objects:
        sd[path] = ShardedObject(key, None, shape, off,
                                 (0, 0 if kind == "dup" else c.tp, c.edp if kind == "expert" else c.dp))
    return sd


def _opt_state(p: Param, c: Coords, fr: slice, quirk: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    n = fr.stop - fr.start
    for state in ("exp_avg", "exp_avg_sq", "fp32_param"):
        key = f"optimizer.state.{state}.{p.shards[0].key}"
        sts = [(sh, (0, c.tp if sh.tp_repl else 0, 0)) for sh in p.shards]
        if p.swiglu is None:
            sh, rid = sts[0]
            out[state] = ShardedTensor(key, _meta((n,), FP32), sh.global_shape, sh.global_offset, rid,
                                       sh.prepend, sh.local_shape, FP32, slice(fr.start, fr.stop))
        elif quirk:
            # megatron-core 0.16.1 / 0.19.0 unfixed: SwiGLU's build_fn chunks the flat piece and drops flattened_range
            tpr, tps = p.swiglu
            a = -(-n // 2)
            pieces = []
            for length, frag in ((a, tpr), (n - a, tps + tpr)):
                gs = [o[2] for o in p.layer_offsets] + [length * 2 * tps]
                go = [o[1] for o in p.layer_offsets] + [length * frag]
                pieces.append(ShardedTensor(key, _meta((length,), FP32), tuple(gs), tuple(go), sts[0][1],
                                            len(p.layer_offsets), (length,), FP32))
            out[state] = pieces
        else:
            half = p.numel // 2
            pieces = []
            for (sh, rid), lo in zip(sts, (0, half)):
                s, e = max(fr.start, lo) - lo, min(fr.stop, lo + half) - lo
                if e > s:
                    pieces.append(ShardedTensor(key, _meta((e - s,), FP32), sh.global_shape, sh.global_offset,
                                                rid, sh.prepend, sh.local_shape, FP32, slice(s, e)))
            out[state] = pieces
    for v in out.values():
        for st in (v if isinstance(v, list) else [v]):
            st.allow_shape_mismatch = _vocab_padded(st.key)
    return out


def _vocab_padded(key: str) -> bool:
    """Vocab-parallel tensors: their padded vocab size depends on TP, so megatron-core marks
    them ``allow_shape_mismatch`` (VocabParallelEmbedding; the output layer through the
    shared-embedding path) and a TP change still loads them."""
    return key.endswith("word_embeddings.weight") or key.endswith("output_layer.weight")


def _param_groups(expert: bool) -> Dict[str, Any]:
    """DistributedOptimizer.state_dict()['optimizer'] (representative values, no 'params')."""
    groups = []
    for wd in (1, 0):
        groups.append({"lr": 0.0, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1 * wd,
                       "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
                       "differentiable": False, "fused": None, "decoupled_weight_decay": False,
                       "wd_mult": float(wd), "lr_mult": 1.0, "is_expert_parallel": expert,
                       "is_decoupled_lr": False, "default_config": True, "max_lr": 3e-4, "min_lr": 3e-5,
                       "step": 1000})
    return {"param_groups": groups}


def _optimizer_sd(model: str, layout: Layout, c: Coords, chunks: List[Chunk], quirk: bool) -> Any:
    spec = MODELS[model]
    bufs = _buffers(model, layout, c.pp, c.tp, c.ep)
    parts = []
    for expert, dp_rank, dp_size in ((False, c.dp, layout.dp), (True, c.edp, layout.dp // layout.ep)):
        if expert and not spec.num_experts:
            continue
        param_state: Dict[int, Any] = {}
        idx = 0
        for v, buf in enumerate(bufs[int(expert)]):
            if buf is None:
                continue
            for i, s, e in _owned(buf, dp_rank, dp_size):
                param_state[idx] = _opt_state(chunks[v].params[i], c, slice(s, e), quirk)
                idx += 1
        parts.append({"optimizer": _param_groups(expert), "param_state": param_state,
                      "param_state_sharding_type": "fully_sharded_model_space"})
    return parts[0] if len(parts) == 1 else {i: p for i, p in enumerate(parts)}


def _adam_sd(c: Coords, chunks: List[Chunk]) -> Dict[str, Any]:
    """Float16OptimizerWithFloat16Params (no DistributedOptimizer): state per param + fp32 copies.

    Parameters are grouped as megatron-core's ``_get_param_groups`` does: weight-decayed
    (matrices) and not (1-D: norms), groups in order of first appearance.
    """
    groups: Dict[bool, List[Param]] = {}
    for ch in chunks:
        for p in ch.params:
            if p.is_param:
                groups.setdefault(len(p.shards[0].local_shape) == 1, []).append(p)
    state: Dict[int, Any] = {}
    fp32 = []
    n = 0
    for params in groups.values():
        fp32.append([_shard_like(p, c, "optimizer.state.fp32_param.") for p in params])
        for p in params:
            state[n] = {name: _shard_like(p, c, f"optimizer.state.{name}.") for name in ("exp_avg", "exp_avg_sq")}
            n += 1
    pg = _param_groups(False)["param_groups"][:len(groups)]
    return {"optimizer": {"state": state, "param_groups": pg}, "fp32_from_fp16_params": fp32}


def _shard_like(p: Param, c: Coords, prefix: str) -> Any:
    sts = []
    for sh in p.shards:
        rid = (0, c.tp if sh.tp_repl else 0, c.edp if sh.expert else c.dp)
        sts.append(ShardedTensor(prefix + sh.key, _meta(sh.local_shape, FP32), sh.global_shape, sh.global_offset,
                                 rid, sh.prepend, sh.local_shape, FP32))
    return sts[0] if len(sts) == 1 else sts


def _args(model: str, layout: Layout) -> argparse.Namespace:
    s = MODELS[model]
    return argparse.Namespace(
        num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
        padded_vocab_size=s.padded_vocab(layout.tp), tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, virtual_pipeline_model_parallel_size=layout.vp,
        data_parallel_size=layout.dp, expert_model_parallel_size=layout.ep, num_experts=s.num_experts,
        use_distributed_optimizer=layout.distributed_optimizer, bf16=True, iteration=1000,
        consumed_train_samples=1000 * 1024, micro_batch_size=1, global_batch_size=1024, seq_length=4096)


def _rng_state(seed: str) -> Dict[str, Any]:
    """An RNG state as ``megashard.megatron.state.capture_rng_state`` captures it on a GPU, with random
    values of the real sizes (~20 KB of JSON): python's and numpy's Mersenne Twister (624 words each), torch's
    CPU generator (5,056 bytes), the CUDA generator and Megatron's three tracker states (16 bytes each)."""
    r = random.Random(seed)

    def b64(n: int) -> str:
        return base64.b64encode(r.randbytes(n)).decode("ascii")

    return {"format": "megashard-rng-v1",
            "random_rng_state": {"version": 3, "state": [r.getrandbits(32) for _ in range(624)] + [624],
                                 "gauss_next": None},
            "np_rng_state": {"kind": "MT19937", "keys": [r.getrandbits(32) for _ in range(624)], "pos": 624,
                             "has_gauss": 0, "cached_gaussian": 0.0},
            "torch_rng_state": b64(5056), "cuda_rng_state": b64(16),
            "rng_tracker_states": {k: b64(16) for k in ("model-parallel-rng", "expert-parallel-rng",
                                                        "data-parallel-rng")}}


def _rng_object(layout: Layout, c: Coords) -> ShardedObject:
    state = [_rng_state(f"{c.pp}.{c.tp}.{c.dp}")]
    if layout.ep > 1:
        return ShardedObject("rng_state", state, (layout.pp, layout.tp, layout.dp), (c.pp, c.tp, c.dp), 0)
    return ShardedObject("rng_state", state, (layout.pp, layout.tp), (c.pp, c.tp), c.dp)


def model_keys(model: str, layout: Layout) -> List[str]:
    vp = len(stage_layers(MODELS[model], layout, 0))
    return ["model"] if vp == 1 else [f"model{v}" for v in range(vp)]


def rank_state_dict(model: str, layout: Layout, rank: int, *, swiglu_dist_opt_quirk: bool = False,
                    with_model: bool = True) -> Dict[str, Any]:
    """The state dict megashard.megatron passes to ``megashard.save`` on ``rank`` (meta tensors).
    ``with_model=False``: the model chunks' entries (:func:`model_keys`) are None (the simulator
    takes them from another rank of the same :func:`model_class`)."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; known: {sorted(MODELS)}")
    c = coords(layout, rank)
    vp = len(stage_layers(MODELS[model], layout, c.pp))
    chunks = [_chunk(model, layout, c.pp, v, c.tp, c.ep) for v in range(vp)]
    sd: Dict[str, Any] = {
        "args": _args(model, layout),
        "checkpoint_version": 3.0,
        "iteration": 1000,
        "num_floating_point_operations_so_far": 1.0e21,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                             "megashard_swiglu_optim": "flattened-halves",
                             **({"distrib_optim_sharding_type": "fully_sharded_model_space"}
                                if layout.distributed_optimizer else {})},
    }
    for key, ch in zip(model_keys(model, layout), chunks):
        sd[key] = _model_sd(ch, c) if with_model else None
    if layout.distributed_optimizer:
        sd["optimizer"] = _optimizer_sd(model, layout, c, chunks, swiglu_dist_opt_quirk)
    elif MODELS[model].num_experts:
        raise ValueError(f"{model}: MoE without the DistributedOptimizer (chained Float16 optimizers) "
                         "is not modelled")
    else:
        sd["optimizer"] = _adam_sd(c, chunks)
    sd["opt_param_scheduler"] = {"max_lr": 3e-4, "lr_warmup_steps": 2000, "num_steps": 1024000,
                                 "lr_decay_style": "cosine", "lr_decay_steps": 1e9, "min_lr": 3e-5,
                                 "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
                                 "wd_incr_steps": 1e9}
    sd["rng_state"] = _rng_object(layout, c)
    return sd


def model_class(layout: Layout, rank: int) -> Tuple[int, int, int, bool, bool]:
    """Ranks of one class hold model chunks (:func:`_model_sd`) that differ only in their
    replica ids' data-parallel index, which a save reads only as "main replica or not"
    (all zeros): ``(tp, pp, ep, dp == 0, edp == 0)``. Their file stems are the same too."""
    c = coords(layout, rank)
    return c.tp, c.pp, c.ep, c.dp == 0, c.edp == 0


def file_stems(model: str, layout: Layout, rank: int) -> Dict[str, str]:
    """``megashard.megatron.checkpointing.file_stems`` for this rank."""
    c = coords(layout, rank)
    ep = f"_ep{c.ep:03d}" if layout.ep > 1 else ""
    stems = {key: f"model_tp{c.tp:02d}_pp{c.pp:03d}_vp{v}{ep}"
             for v, key in enumerate(model_keys(model, layout))}
    stems["__rest__"] = f"state_tp{c.tp:02d}_pp{c.pp:03d}{ep}"
    return stems

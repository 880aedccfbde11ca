"""Megatron GPTModel <-> Hugging Face Llama / Mixtral: the model description, names and tensor transforms.

Checked against megatron-core 0.16's code and transformers 5.x (logits equal in the tests):

* ``linear_qkv`` is grouped: per query group its query heads, then one key head, then one
  value head (``SelfAttention.get_query_key_value_tensors``), so it is split with
  ``view(groups, heads_per_group + 2, head_dim, ...)``, not as ``[Q|K|V]``.
* ``linear_fc1`` with SwiGLU is ``[gate; up]`` over the full width whatever the TP size
  (``apply_swiglu_sharded_factory`` saves the two halves at offsets ``r`` and ``tp + r``);
  with ``singleton_local_shards`` the halves are separate keys ``..._w`` / ``..._v``.
* the norms are saved as ``linear_qkv.layer_norm_weight`` (input) and
  ``linear_fc1.layer_norm_weight`` (post-attention), also by the local spec (its
  ``sharded_state_dict_keys_map``); ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``
  are accepted too.
* rotary: Megatron's default equals HF's ``rotate_half``; with ``--rotary-interleaved``
  the pairs are ``(2i, 2i+1)``, HF's ``(i, i + d/2)``: q and k rows are permuted per head.
* layers are stacked: a layer's tensor is row ``l`` of a ``[num_layers, ...]`` global tensor.
* the vocabulary is padded in the checkpoint; the real size comes from the user.
* Mixture-of-Experts (every layer an MoE layer, softmax top-k router, no shared experts) is
  Mixtral: ``mlp.router.weight`` ``[experts, hidden]`` is ``block_sparse_moe.gate.weight``;
  the experts are saved (SequentialMLP, TEGroupedMLP and the legacy GroupedMLP alike) as
  ``mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, 2 * ffn, hidden]`` (``[gate; up]``
  = ``[w1; w3]``) and ``...linear_fc2.weight`` ``[layers, experts, hidden, ffn]`` (``w2``).
  Megatron's router (top-k of the logits, softmax over those k) equals Mixtral's (softmax,
  top-k, renormalised). The files use the Hub's per-expert names, which transformers 5.x
  fuses on load (and writes back on save) and vLLM reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError

__all__ = ["HFMappingError", "LlamaSpec", "spec_from_megatron_args", "spec_from_hf_config", "qkv_to_hf",
           "hf_to_qkv", "LAYER", "layer_hf_names", "expert_hf_names"]

LAYER = "decoder.layers."


class HFMappingError(CheckpointError):
    """The model is not one the Hugging Face mapping covers: nothing was written."""


@dataclass
class LlamaSpec:
    """Everything the mapping needs; built from Megatron's saved args or an HF config.json."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int  # the real vocabulary (HF rows)
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    bias: bool
    interleaved: bool = False
    experts: int = 0  # MoE (Mixtral) when > 0; ``ffn`` is then each expert's hidden size
    topk: int = 0
    rope_scaling: Optional[Dict[str, Any]] = None
    dtype: torch.dtype = torch.float32
    extra: Dict[str, Any] = field(default_factory=dict)  # HF config keys carried through (bos/eos ids)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim

    def hf_config(self) -> Dict[str, Any]:
        rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.eps,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "attention_bias": self.bias,
            "mlp_bias": self.bias,
            "attention_dropout": 0.0,
            "rope_parameters": rope,
            # transformers 4.x (and vLLM built on it) read these two
            "rope_theta": self.rope_theta,
            **({"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {}),
            "dtype": _DTYPE_NAMES[self.dtype],
            "torch_dtype": _DTYPE_NAMES[self.dtype],
            "use_cache": True,
        }
        if self.moe:
            for k in ("attention_bias", "mlp_bias"):
                del cfg[k]
            cfg.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                        "num_local_experts": self.experts, "num_experts_per_tok": self.topk,
                        "sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False})
        cfg.update(self.extra)
        return cfg

    def megatron_args(self) -> Dict[str, Any]:
        """Megatron-LM's argument names for this model (recorded in an imported checkpoint)."""
        return {
            "num_layers": self.num_layers, "hidden_size": self.hidden, "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads, "group_query_attention": self.groups != self.heads,
            "num_query_groups": self.groups, "kv_channels": self.head_dim, "normalization": "RMSNorm",
            "layernorm_epsilon": self.eps, "swiglu": True, "position_embedding_type": "rope",
            "rotary_base": self.rope_theta, "rotary_percent": 1.0, "rotary_interleaved": self.interleaved,
            "use_rope_scaling": bool(self.rope_scaling),
            **({"rope_scaling_factor": self.rope_scaling["factor"]} if self.rope_scaling else {}),
            "untie_embeddings_and_output_weights": not self.tied, "add_bias_linear": self.bias,
            "add_qkv_bias": self.bias, "vocab_size": self.vocab, "max_position_embeddings": self.max_positions,
            "bf16": self.dtype == torch.bfloat16, "fp16": self.dtype == torch.float16,
            "num_experts": self.experts or None,
            **({"moe_router_topk": self.topk, "moe_ffn_hidden_size": self.ffn, "moe_layer_freq": 1,
                "moe_router_score_function": "softmax", "moe_router_pre_softmax": False} if self.moe else {}),
        }


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

# Megatron-LM flags the Llama mapping does not cover, with the value that is fine
# (attribute -> (flag, ok value or predicate)); anything else is refused, naming the flag.
_REFUSE: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "multi_latent_attention": ("--multi-latent-attention", lambda v: not v),
    "qk_layernorm": ("--qk-layernorm", lambda v: not v),
    "qk_l2_norm": ("--qk-l2-norm", lambda v: not v),
    "apply_layernorm_1p": ("--apply-layernorm-1p", lambda v: not v),
    "apply_residual_connection_post_layernorm": ("--apply-residual-connection-post-layernorm", lambda v: not v),
    "squared_relu": ("--squared-relu", lambda v: not v),
    "attention_output_gate": ("--attention-output-gate", lambda v: not v),
    "rotary_seq_len_interpolation_factor": ("--rotary-seq-len-interpolation-factor", lambda v: not v),
    "window_size": ("--window-size", lambda v: v is None),
    "mtp_num_layers": ("--mtp-num-layers", lambda v: not v),
    "heterogeneous_layers_config_path": ("--heterogeneous-layers-config-path", lambda v: not v),
    "softmax_scale": ("--softmax-scale", lambda v: v is None),
    "rotary_percent": ("--rotary-percent", lambda v: v is None or float(v) == 1.0),
    "embedding_multiplier_scale": ("--embedding-multiplier-scale", lambda v: v in (None, 1.0)),
}


# MoE flags (with --num-experts) beyond Mixtral's: every layer MoE, softmax top-k renormalised, no shared
# experts, no token dropping, experts without bias
_REFUSE_MOE: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size", lambda v: not v),
    "moe_router_score_function": ("--moe-router-score-function", lambda v: v in (None, "softmax")),
    "moe_router_pre_softmax": ("--moe-router-pre-softmax", lambda v: not v),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias", lambda v: not v),
    "moe_router_topk_scaling_factor": ("--moe-router-topk-scaling-factor", lambda v: v in (None, 1.0)),
    "moe_router_num_groups": ("--moe-router-num-groups", lambda v: not v),
    "moe_router_group_topk": ("--moe-router-group-topk", lambda v: not v),
    "moe_router_topk_limited_devices": ("--moe-router-topk-limited-devices", lambda v: not v),
    "moe_router_force_load_balancing": ("--moe-router-force-load-balancing", lambda v: not v),
    "moe_expert_capacity_factor": ("--moe-expert-capacity-factor", lambda v: v is None),
    "moe_layer_freq": ("--moe-layer-freq", lambda v: v in (None, 1) or (isinstance(v, list) and set(v) == {1})),
    "moe_apply_probs_on_input": ("--moe-apply-probs-on-input", lambda v: not v),
    "moe_latent_size": ("--moe-latent-size", lambda v: v is None),
    "add_bias_linear": ("--add-bias-linear (Megatron's default; Mixtral has no biases: --disable-bias-linear)",
                        lambda v: v is False),
}


def _get(args: Any, name: str, default: Any = None) -> Any:
    v = getattr(args, name, default)
    return default if v is None else v


def _norm_epsilon(args: Any) -> float:
    """``--norm-epsilon``: Megatron-LM stores it as ``layernorm_epsilon`` (TransformerConfig's name);
    imports by earlier megashard versions saved ``norm_epsilon``."""
    v = _get(args, "layernorm_epsilon")
    return float(_get(args, "norm_epsilon", 1e-5) if v is None else v)


def spec_from_megatron_args(args: Any, vocab: int, padded_rows: int, dtype: torch.dtype, where: str) -> LlamaSpec:
    """The Llama description of a saved Megatron model, or :class:`HFMappingError` naming the flag."""
    if args is None:
        raise HFMappingError(f"{where}: the checkpoint holds no Megatron args; the HF export builds config.json "
                             "from them")

    def refuse(flag: str, value: Any, why: str = "") -> HFMappingError:
        return HFMappingError(f"{where}: saved with {flag} {value!r}: the Hugging Face Llama mapping does not "
                              f"cover it{why}; nothing was written")

    norm = _get(args, "normalization", "LayerNorm")
    if norm != "RMSNorm":
        raise refuse("--normalization", norm, " (Llama uses RMSNorm)")
    if not _get(args, "swiglu", False):
        raise refuse("--swiglu", False, " (Llama's MLP is SwiGLU)")
    pos = _get(args, "position_embedding_type", "learned_absolute")
    if pos != "rope":
        raise refuse("--position-embedding-type", pos, " (Llama uses rope)")
    for attr, (flag, ok) in _REFUSE.items():
        v = getattr(args, attr, None)
        if not ok(v):
            raise refuse(flag, v)
    experts = int(_get(args, "num_experts", 0))
    topk = int(_get(args, "moe_router_topk", 2)) if experts else 0
    if experts:
        for attr, (flag, ok) in _REFUSE_MOE.items():
            v = _get(args, attr, True) if attr == "add_bias_linear" else getattr(args, attr, None)
            if not ok(v):
                raise HFMappingError(f"{where}: saved with --num-experts {experts} and {flag} {v!r}: the Hugging "
                                     "Face Mixtral mapping does not cover it (every layer MoE, softmax top-k router "
                                     "renormalised over the k, no shared experts, no token dropping, no biases); "
                                     "nothing was written")
        if not 1 <= topk <= experts:
            raise refuse("--moe-router-topk", topk, f" (with {experts} experts)")
    bias = bool(_get(args, "add_bias_linear", True))
    if bool(_get(args, "add_qkv_bias", False)) and not bias:
        raise refuse("--add-qkv-bias", True, " without --add-bias-linear (Llama's attention_bias also "
                     "biases o_proj)")
    heads = int(_get(args, "num_attention_heads"))
    hidden = int(_get(args, "hidden_size"))
    groups = int(_get(args, "num_query_groups", heads)) if _get(args, "group_query_attention", False) else heads
    head_dim = int(_get(args, "kv_channels", hidden // heads))
    if hidden % heads:
        raise refuse("--hidden-size", hidden, f" (not a multiple of --num-attention-heads {heads}, which "
                     "transformers' Llama requires)")
    if heads % groups:
        raise refuse("--num-query-groups", groups, f" (does not divide --num-attention-heads {heads})")
    if bool(_get(args, "rotary_interleaved", False)) and head_dim % 2:
        raise refuse("--kv-channels", head_dim, " (odd head dimension with --rotary-interleaved)")
    scaling = None
    if _get(args, "use_rope_scaling", False):
        scaling = {"rope_type": "llama3", "factor": float(_get(args, "rope_scaling_factor", 8.0)),
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if dtype not in _DTYPE_NAMES:
        raise HFMappingError(f"{where}: model tensors are {dtype}; the export writes float32, bfloat16 or float16")
    if vocab > padded_rows:
        raise HFMappingError(f"{where}: vocabulary of {vocab} is larger than the checkpoint's {padded_rows} "
                             "embedding rows; check --vocab-size / --tokenizer")
    ffn = int(_get(args, "ffn_hidden_size", 4 * hidden))
    if experts:
        ffn = int(_get(args, "moe_ffn_hidden_size", ffn))
    return LlamaSpec(
        num_layers=int(_get(args, "num_layers")), hidden=hidden, ffn=ffn, experts=experts, topk=topk,
        heads=heads, groups=groups, head_dim=head_dim, vocab=vocab, eps=_norm_epsilon(args),
        rope_theta=float(_get(args, "rotary_base", 10000)),
        max_positions=int(_get(args, "max_position_embeddings", 0) or _get(args, "seq_length", 2048)),
        tied=not bool(_get(args, "untie_embeddings_and_output_weights", False)), bias=bias,
        interleaved=bool(_get(args, "rotary_interleaved", False)), rope_scaling=scaling, dtype=dtype,
        extra=_token_ids(getattr(args, "hf_token_ids", None)))


def _token_ids(v: Any) -> Dict[str, Any]:
    """The special token ids an import recorded (bos/eos/pad), carried back into config.json."""
    if not isinstance(v, dict):
        return {}
    ok = lambda x: isinstance(x, int) or (isinstance(x, list) and all(isinstance(i, int) for i in x))  # noqa: E731
    return {k: v[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in v and (v[k] is None or ok(v[k]))}


def _show(v: Any) -> str:
    """A config value for an error line: its repr, cut short (a hostile value may be megabytes)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def spec_from_hf_config(cfg: Dict[str, Any], where: str) -> LlamaSpec:
    """The description of an HF Llama directory's config.json, or :class:`HFMappingError`.

    config.json is untrusted: every field the import uses is type- and range-checked here
    (numbers finite, positive, at most 2**40; flags true or false; token ids integers), so a
    malformed one is one error line, never a KeyError or TypeError. Sizes are checked against
    the safetensors headers by :func:`megashard.hf.importer.plan_import`.
    """
    if not isinstance(cfg, dict):
        raise HFMappingError(f"{where}: config.json is not a JSON object")
    mt = cfg.get("model_type")
    archs = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
    arch = archs.get(mt) if isinstance(mt, str) else None
    if arch is None or cfg.get("architectures", [arch]) != [arch]:
        raise HFMappingError(f"{where}: config.json model_type {_show(mt)} / architectures "
                             f"{_show(cfg.get('architectures'))}: the import covers Llama-family (LlamaForCausalLM) "
                             "and Mixtral (MixtralForCausalLM) models")
    if cfg.get("sliding_window") not in (None, 0) and mt in ("mistral", "mixtral"):
        raise HFMappingError(f"{where}: config.json sliding_window {_show(cfg['sliding_window'])} is not covered")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFMappingError(f"{where}: config.json hidden_act {_show(act)} is not covered (SwiGLU needs silu)")

    def number(name: str, v: Any, kind: type = int) -> Any:
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise HFMappingError(f"{where}: config.json {name}={_show(v)} is not a number")
        if isinstance(v, float) and not math.isfinite(v):
            raise HFMappingError(f"{where}: config.json {name}={_show(v)} is not a finite number")
        if kind is int and v != int(v):
            raise HFMappingError(f"{where}: config.json {name}={_show(v)} is not an integer")
        if v <= 0 or v > (1 << 40):
            raise HFMappingError(f"{where}: config.json {name}={_show(v)} is out of range (0, 2**40]")
        return kind(v)

    def num(name: str, default: Any = None, kind: type = int) -> Any:
        if name not in cfg and default is None:
            raise HFMappingError(f"{where}: config.json has no {name}")
        return number(name, cfg.get(name, default), kind)

    def flag(name: str) -> bool:
        v = cfg.get(name)
        if v is not None and not isinstance(v, bool):
            raise HFMappingError(f"{where}: config.json {name}={_show(v)} is not true or false")
        return bool(v)

    heads = num("num_attention_heads")
    hidden = num("hidden_size")
    groups = num("num_key_value_heads", heads)
    if cfg.get("head_dim") is not None:
        head_dim = num("head_dim")
    elif heads > hidden:
        raise HFMappingError(f"{where}: config.json num_attention_heads={heads} is larger than hidden_size={hidden} "
                             "and no head_dim is given")
    else:
        head_dim = hidden // heads
    if heads % groups:
        raise HFMappingError(f"{where}: num_key_value_heads {groups} does not divide num_attention_heads {heads}")
    bias, mlp_bias, tied = flag("attention_bias"), flag("mlp_bias"), flag("tie_word_embeddings")
    if bias != mlp_bias:
        raise HFMappingError(f"{where}: attention_bias={bias} with mlp_bias={mlp_bias}: Megatron's --add-bias-linear "
                             "biases both")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise HFMappingError(f"{where}: config.json rope_parameters is not an object")
    if cfg.get("rope_theta") is not None:
        theta = num("rope_theta", kind=float)
    else:
        theta = number("rope_parameters rope_theta", rope.get("rope_theta", 10000.0), float)
    scaling_name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise HFMappingError(f"{where}: config.json {scaling_name} {_show(scaling)} is not covered (Megatron's "
                                 "--use-rope-scaling is llama3 with low/high frequency factors 1/4 and 8192 original "
                                 "positions)")
        else:
            if scaling.get("factor") is None:
                raise HFMappingError(f"{where}: config.json {scaling_name} (llama3) has no factor")
            factor = number(f"{scaling_name} factor", scaling["factor"], float)
            got = tuple(number(f"{scaling_name} {k}", scaling.get(k, d), float)
                        for k, d in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                     ("original_max_position_embeddings", 8192)))
            if got != (1.0, 4.0, 8192.0):
                raise HFMappingError(f"{where}: config.json {scaling_name} {_show(scaling)} is not covered "
                                     "(Megatron's --use-rope-scaling is llama3 with low/high frequency factors 1/4 "
                                     "and 8192 original positions)")
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    experts = topk = 0
    if mt == "mixtral":
        experts, topk = num("num_local_experts"), num("num_experts_per_tok")
        if topk > experts:
            raise HFMappingError(f"{where}: num_experts_per_tok {topk} > num_local_experts {experts}")
        if bias:
            raise HFMappingError(f"{where}: a Mixtral with biases is not covered")
    for name in ("dtype", "torch_dtype"):  # informative only: the safetensors headers give the dtype
        if cfg.get(name) is not None and not isinstance(cfg[name], str):
            raise HFMappingError(f"{where}: config.json {name}={_show(cfg[name])} is not a dtype name")
    dname = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    extra = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    for k, v in extra.items():
        ids = v if isinstance(v, list) and len(v) <= 1024 else [v]
        if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (1 << 40)
                                     for i in ids):
            raise HFMappingError(f"{where}: config.json {k}={_show(v)} is not a token id or a list of them")
    return LlamaSpec(
        num_layers=num("num_hidden_layers"), hidden=hidden, ffn=num("intermediate_size"), heads=heads, groups=groups,
        head_dim=head_dim, vocab=num("vocab_size"), eps=num("rms_norm_eps", 1e-6, float), rope_theta=theta,
        max_positions=num("max_position_embeddings", 2048), tied=tied, bias=bias, rope_scaling=scaling,
        experts=experts, topk=topk, dtype=_DTYPES.get(dname, torch.float32), extra=extra)


# ---------------------------------------------------------------------------
# tensor transforms (row-wise: weights [rows, in] and biases [rows] alike)


def _rope_to_hf(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """Interleaved rotary pairs (2i, 2i+1) -> HF's halves (i, i + d/2), per head."""
    rest = x.shape[1:]
    return x.reshape(n, d // 2, 2, *rest).transpose(1, 2).reshape(n * d, *rest)


def _rope_from_hf(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    rest = x.shape[1:]
    return x.reshape(n, 2, d // 2, *rest).transpose(1, 2).reshape(n * d, *rest)


def qkv_to_hf(w: torch.Tensor, s: LlamaSpec) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's grouped ``linear_qkv`` rows -> (q, k, v) in HF's layout."""
    g, d = s.groups, s.head_dim
    hpg = s.heads // g
    rest = w.shape[1:]
    x = w.reshape(g, hpg + 2, d, *rest)
    q = x[:, :hpg].reshape(s.heads * d, *rest)
    k = x[:, hpg].reshape(g * d, *rest)
    v = x[:, hpg + 1].reshape(g * d, *rest)
    if s.interleaved:
        q, k = _rope_to_hf(q, s.heads, d), _rope_to_hf(k, g, d)
    return q.contiguous(), k.contiguous(), v.contiguous()


def hf_to_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: LlamaSpec,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`qkv_to_hf` (into ``out`` when given)."""
    g, d = s.groups, s.head_dim
    hpg = s.heads // g
    rest = q.shape[1:]
    if s.interleaved:
        q, k = _rope_from_hf(q, s.heads, d), _rope_from_hf(k, g, d)
    if out is None:
        out = torch.empty((s.qkv_rows, *rest), dtype=q.dtype)
    o = out.view(g, hpg + 2, d, *rest)
    o[:, :hpg] = q.reshape(g, hpg, d, *rest)
    o[:, hpg] = k.reshape(g, d, *rest)
    o[:, hpg + 1] = v.reshape(g, d, *rest)
    return out


# ---------------------------------------------------------------------------
# names


def layer_hf_names(i: int, s: LlamaSpec) -> List[Tuple[str, Tuple[int, ...]]]:
    """HF names and shapes of layer ``i``, in the order the export writes them."""
    p = f"model.layers.{i}."
    h, f = s.hidden, s.ffn
    qd, kd = s.heads * s.head_dim, s.groups * s.head_dim
    out: List[Tuple[str, Tuple[int, ...]]] = [(p + "input_layernorm.weight", (h,))]
    for name, rows in (("q_proj", qd), ("k_proj", kd), ("v_proj", kd)):
        out.append((f"{p}self_attn.{name}.weight", (rows, h)))
        if s.bias:
            out.append((f"{p}self_attn.{name}.bias", (rows,)))
    out.append((p + "self_attn.o_proj.weight", (h, qd)))
    if s.bias:
        out.append((p + "self_attn.o_proj.bias", (h,)))
    out.append((p + "post_attention_layernorm.weight", (h,)))
    if s.moe:
        out.append((p + "block_sparse_moe.gate.weight", (s.experts, h)))
        for e in range(s.experts):
            out += expert_hf_names(i, e, s)
        return out
    for name in ("gate_proj", "up_proj"):
        out.append((f"{p}mlp.{name}.weight", (f, h)))
        if s.bias:
            out.append((f"{p}mlp.{name}.bias", (f,)))
    out.append((p + "mlp.down_proj.weight", (h, f)))
    if s.bias:
        out.append((p + "mlp.down_proj.bias", (h,)))
    return out


def expert_hf_names(i: int, e: int, s: LlamaSpec) -> List[Tuple[str, Tuple[int, ...]]]:
    """Mixtral's (the Hub's) names of layer ``i``'s expert ``e``: w1 = gate, w2 = down, w3 = up."""
    p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
    return [(p + "w1.weight", (s.ffn, s.hidden)), (p + "w2.weight", (s.hidden, s.ffn)),
            (p + "w3.weight", (s.ffn, s.hidden))]


# Megatron's stacked layer keys (suffix after "decoder.layers.") -> (accepted aliases)
NORM_IN = ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
NORM_POST = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
QKV_W, QKV_B = "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"
PROJ_W, PROJ_B = "self_attention.linear_proj.weight", "self_attention.linear_proj.bias"
FC1_W, FC1_B = "mlp.linear_fc1.weight", "mlp.linear_fc1.bias"
FC2_W, FC2_B = "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"
ROUTER_W = "mlp.router.weight"
EXP_FC1, EXP_FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
EMBED, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"


def megatron_layer_shapes(s: LlamaSpec) -> Dict[str, Tuple[int, ...]]:
    """Per-layer shapes of Megatron's tensors (without the stacked layer axis)."""
    h, f = s.hidden, s.ffn
    out = {NORM_IN[0]: (h,), QKV_W: (s.qkv_rows, h), PROJ_W: (h, s.heads * s.head_dim), NORM_POST[0]: (h,)}
    if s.moe:  # experts stacked on the axis after the layers' (expert parallelism splits it)
        out.update({ROUTER_W: (s.experts, h), EXP_FC1: (s.experts, 2 * f, h), EXP_FC2: (s.experts, h, f)})
        return out
    out.update({FC1_W: (2 * f, h), FC2_W: (h, f)})
    if s.bias:
        out.update({QKV_B: (s.qkv_rows,), PROJ_B: (h,), FC1_B: (2 * f,), FC2_B: (h,)})
    return out


def dense_model_keys(s: LlamaSpec) -> List[str]:
    """Megatron's global keys for this model (the stacked layer keys with the canonical norm names)."""
    keys = [EMBED] + [LAYER + k for k in megatron_layer_shapes(s)] + [FINAL_NORM]
    if not s.tied:
        keys.append(OUTPUT)
    return keys


def check_shapes(found: Dict[str, Sequence[int]], s: LlamaSpec, padded_rows: int, where: str) -> None:
    """Every Megatron tensor the mapping reads has the shape the args describe."""
    want: Dict[str, Tuple[int, ...]] = {LAYER + k: (s.num_layers, *v) for k, v in megatron_layer_shapes(s).items()}
    want[EMBED] = (padded_rows, s.hidden)
    want[FINAL_NORM] = (s.hidden,)
    if not s.tied:
        want[OUTPUT] = (padded_rows, s.hidden)
    for k, shape in want.items():
        got = found.get(k)
        if got is None:
            raise HFMappingError(f"{where}: no global tensor {k!r}; the saved args describe a Llama model with "
                                 f"{'' if s.bias else 'no '}bias and {'tied' if s.tied else 'untied'} embeddings")
        if tuple(got) != tuple(shape):
            raise HFMappingError(f"{where}: {k!r} has global shape {tuple(got)}, the saved args give {tuple(shape)}")

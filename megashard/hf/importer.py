"""Hugging Face Llama / Mixtral directory -> megashard checkpoint of global tensors (any layout loads it).

:func:`plan_import` validates ``config.json`` and every safetensors header (bounded, byte
ranges inside the file, no symbolic links) and checks each expected tensor's shape and
dtype before anything is written. :func:`import_state` then builds the state megashard
saves: one shard per layer of each stacked Megatron tensor, backed by private mappings
of the source files (norms, ``o_proj``, ``down_proj``, and ``gate`` / ``up`` as the two
halves of ``linear_fc1``), and only ``linear_qkv`` (the grouped interleave of q, k and v)
assembled, into memory the caller provides (a file-backed scratch). Megatron pads the
vocabulary for the layout that loads it; the import saves the real rows, and the padded
embedding and output-layer shards load them (``allow_shape_mismatch``). Mixtral's experts
(the Hub's per-expert ``w1`` / ``w2`` / ``w3``) become shards of the expert-stacked
``linear_fc1`` / ``linear_fc2``, which any expert-parallel layout loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import storage
from ..sharded import ShardedObject, ShardedTensor
from . import mapping as M
from .mapping import HFMappingError, LlamaSpec
from .safetensors import MAX_HEADER, SafetensorsFile

log = logging.getLogger(__name__)

__all__ = ["ImportPlan", "is_hf_dir", "plan_import", "import_state"]

INDEX = "model.safetensors.index.json"
#: Megatron modules whose ``_extra_state`` a GPT layer saves (``None`` for megatron-core's own
#: linears; Transformer Engine's modules accept ``None`` as "nothing saved")
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention",
               "mlp.linear_fc1", "mlp.linear_fc2")
#: ... and an MoE layer (layers, experts)
EXTRA_STATE_EXPERTS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
SINGLE = "model.safetensors"
_LAYER_NAME = re.compile(r"model\.layers\.(\d{1,12})\.")


def is_hf_dir(path: str) -> bool:
    """A directory with config.json and safetensors weights."""
    return storage.foreign_format(path) == "hf"


@dataclass
class ImportPlan:
    src: str
    spec: LlamaSpec
    files: Dict[str, SafetensorsFile]  # open, validated
    where: Dict[str, str]  # HF tensor name -> file

    @property
    def nbytes(self) -> int:
        return sum(e[3] - e[2] for f in self.files.values() for e in f.entries.values())

    def tensor(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].tensor(name)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _read_json(dir_fd: int, name: str, where: str) -> Any:
    path = os.path.join(where, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise HFMappingError(f"{path}: cannot open ({e.strerror}); symbolic links are refused") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise HFMappingError(f"{path}: not a regular file")
        raw = f.read(MAX_HEADER + 1)
    if len(raw) > MAX_HEADER:
        raise HFMappingError(f"{path}: larger than {MAX_HEADER} bytes")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise HFMappingError(f"{path}: not JSON: {e}") from None
    except RecursionError:
        raise HFMappingError(f"{path}: not JSON this import reads (nested too deeply)") from None


def expected(s: LlamaSpec) -> List[Tuple[str, Tuple[int, ...]]]:
    """Every HF tensor name and shape of this model."""
    out = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.num_layers):
        out += M.layer_hf_names(i, s)
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def expected_count(s: LlamaSpec) -> int:
    """``len(expected(s))``, computed without enumerating (config.json's counts are not trusted yet)."""
    one = dataclasses.replace(s, experts=min(s.experts, 1))
    per_layer = len(M.layer_hf_names(0, one)) + max(s.experts - 1, 0) * len(M.expert_hf_names(0, 0, one))
    return 2 + s.num_layers * per_layer + (0 if s.tied else 1)


def _check_counts(s: LlamaSpec, names: Sequence[str], where: str) -> None:
    """config.json's layer (and expert) counts agree with the tensors the files hold: checked before
    any per-layer enumeration, so a claimed 2**40 layers costs nothing."""
    layers = set()
    for n in names:
        m = _LAYER_NAME.match(n)
        if m:
            layers.add(int(m.group(1)))
    if len(layers) != s.num_layers or (layers and (min(layers) != 0 or max(layers) != s.num_layers - 1)):
        held = f"layers 0..{max(layers)} ({len(layers)} distinct)" if layers else "no model.layers.N tensors"
        raise HFMappingError(f"{where}: config.json num_hidden_layers={s.num_layers}, the safetensors files hold "
                             f"{held}")
    want = expected_count(s)
    if want > len(names):
        experts = f", num_local_experts={s.experts}" if s.moe else ""
        raise HFMappingError(f"{where}: config.json (num_hidden_layers={s.num_layers}{experts}) describes {want} "
                             f"tensors, the safetensors files hold {len(names)}")


def plan_import(src: str) -> ImportPlan:
    """Validate an HF Llama / Mixtral directory; the returned plan holds its files open."""
    base = os.path.abspath(src)
    try:
        dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HFMappingError(f"{base}: cannot open the Hugging Face directory ({e.strerror})") from e
    files: Dict[str, SafetensorsFile] = {}
    try:
        spec = M.spec_from_hf_config(_read_json(dir_fd, "config.json", base), base)
        if os.path.lexists(os.path.join(base, INDEX)):
            idx = _read_json(dir_fd, INDEX, base)
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise HFMappingError(f"{os.path.join(base, INDEX)}: no weight_map of names to files")
            where = dict(wm)
        else:
            where = {}
        for name in sorted(set(where.values()) or {SINGLE}):
            files[name] = SafetensorsFile(dir_fd, name, base)
        if not where:
            where = {n: SINGLE for n in files[SINGLE].entries}
        for n, f in where.items():
            if n not in files[f].entries:
                raise HFMappingError(f"{os.path.join(base, f)}: no tensor {n!r} (the index names it)")
        _check_counts(spec, list(where), base)
        want = expected(spec)
        names = {n for n, _ in want}
        extra = [n for n in where if n not in names and not (spec.tied and n == "lm_head.weight")
                 and "rotary_emb.inv_freq" not in n]
        if extra:
            raise HFMappingError(f"{base}: tensors the Llama / Mixtral mapping does not cover: "
                                 f"{', '.join(sorted(extra)[:8])}")
        dtypes = set()
        for n, shape in want:
            if n not in where:
                raise HFMappingError(f"{base}: no tensor {n!r} (config.json describes {spec.num_layers} layers"
                                     f"{', with bias' if spec.bias else ''})")
            dtype, got, _, _ = files[where[n]].entries[n]
            if tuple(got) != tuple(shape):
                raise HFMappingError(f"{os.path.join(base, where[n])}: {n!r} has shape {tuple(got)}, config.json "
                                     f"gives {tuple(shape)}")
            dtypes.add(dtype)
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.bfloat16, torch.float16):
            raise HFMappingError(f"{base}: tensors are {sorted(map(str, dtypes))}; the import takes one of "
                                 "float32, bfloat16, float16")
        spec.dtype = dtypes.pop()
        return ImportPlan(base, spec, files, where)
    except BaseException:
        for f in files.values():
            f.close()
        raise
    finally:
        os.close(dir_fd)


def import_state(plan: ImportPlan, alloc: Callable[[torch.dtype, Sequence[int]], torch.Tensor]) -> Dict[str, Any]:
    """The state dict to save: Megatron's args, iteration 0, and ``model`` of global-tensor shards.

    ``alloc(dtype, shape)`` provides memory for the tensors that must be assembled (qkv).
    """
    s = plan.spec
    L, E = s.num_layers, s.experts
    model: Dict[str, Any] = {}

    def put(key: str, data: torch.Tensor, gshape: Tuple[int, ...], offset: Tuple[int, ...], prepend: int = 0) -> None:
        model[f"{key}@{'.'.join(map(str, offset))}"] = ShardedTensor(key, data, gshape, offset, prepend_axis_num=prepend)

    def layer(key: str, data: torch.Tensor, i: int, rows_at: int = 0, rows: Optional[int] = None) -> None:
        shape = M.megatron_layer_shapes(s)[key]
        put(M.LAYER + key, data, (L, *shape), (i, rows_at) + (0,) * (len(shape) - 1), prepend=1)

    t = plan.tensor
    put(M.EMBED, t("model.embed_tokens.weight"), (s.vocab, s.hidden), (0, 0))
    for i in range(L):
        p = f"model.layers.{i}."
        layer(M.NORM_IN[0], t(p + "input_layernorm.weight"), i)
        layer(M.QKV_W, M.hf_to_qkv(t(p + "self_attn.q_proj.weight"), t(p + "self_attn.k_proj.weight"),
                                   t(p + "self_attn.v_proj.weight"), s, alloc(s.dtype, (s.qkv_rows, s.hidden))), i)
        layer(M.PROJ_W, t(p + "self_attn.o_proj.weight"), i)
        layer(M.NORM_POST[0], t(p + "post_attention_layernorm.weight"), i)
        if s.moe:
            layer(M.ROUTER_W, t(p + "block_sparse_moe.gate.weight"), i)
            fc1, fc2 = (E, 2 * s.ffn, s.hidden), (E, s.hidden, s.ffn)
            for e in range(E):
                x = f"{p}block_sparse_moe.experts.{e}."
                put(M.LAYER + M.EXP_FC1, t(x + "w1.weight"), (L, *fc1), (i, e, 0, 0), prepend=2)
                put(M.LAYER + M.EXP_FC1, t(x + "w3.weight"), (L, *fc1), (i, e, s.ffn, 0), prepend=2)
                put(M.LAYER + M.EXP_FC2, t(x + "w2.weight"), (L, *fc2), (i, e, 0, 0), prepend=2)
                for name in EXTRA_STATE_EXPERTS:
                    o = ShardedObject(f"{M.LAYER}{name}._extra_state", None, (L, E), (i, e))
                    model[o.unique_key] = o  # type: ignore[assignment]
        else:
            layer(M.FC1_W, t(p + "mlp.gate_proj.weight"), i, 0)
            layer(M.FC1_W, t(p + "mlp.up_proj.weight"), i, s.ffn)
            layer(M.FC2_W, t(p + "mlp.down_proj.weight"), i)
        for name in EXTRA_STATE:  # Megatron's strict load asks for them; an HF directory has none
            if s.moe and name.startswith("mlp."):
                continue
            o = ShardedObject(f"{M.LAYER}{name}._extra_state", None, (L,), (i,))
            model[o.unique_key] = o  # type: ignore[assignment]
        if s.bias:
            layer(M.QKV_B, M.hf_to_qkv(t(p + "self_attn.q_proj.bias"), t(p + "self_attn.k_proj.bias"),
                                       t(p + "self_attn.v_proj.bias"), s, alloc(s.dtype, (s.qkv_rows,))), i)
            layer(M.PROJ_B, t(p + "self_attn.o_proj.bias"), i)
            layer(M.FC1_B, t(p + "mlp.gate_proj.bias"), i, 0)
            layer(M.FC1_B, t(p + "mlp.up_proj.bias"), i, s.ffn)
            layer(M.FC2_B, t(p + "mlp.down_proj.bias"), i)
    put(M.FINAL_NORM, t("model.norm.weight"), (s.hidden,), (0,))
    if not s.tied:
        put(M.OUTPUT, t("lm_head.weight"), (s.vocab, s.hidden), (0, 0))
    args = argparse.Namespace(**s.megatron_args(), tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              hf_token_ids=dict(s.extra) or None)
    return {"args": args, "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0,
            "model": model}

"""A toy Megatron-like model sharded over TP, PP (with virtual chunks) and DP.

Global tensors are deterministic functions of their key, so any rank of any
layout can build the shards it should hold and check a load bit-for-bit.
"""
from __future__ import annotations

import argparse
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from megashard.sharded import ShardedTensor

H = 16
L = 8
V = 64


def global_tensor(key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


GLOBALS = {
    "embedding.word_embeddings.weight": ((V, H), torch.bfloat16),
    "decoder.layers.self_attention.linear_qkv.weight": ((L, 3 * H, H), torch.bfloat16),
    "decoder.layers.self_attention.linear_proj.weight": ((L, H, 2 * H), torch.bfloat16),
    "decoder.layers.input_layernorm.weight": ((L, H), torch.float32),
    "decoder.final_layernorm.weight": ((H,), torch.float32),
}


def full(key: str) -> torch.Tensor:
    shape, dtype = GLOBALS[key]
    return global_tensor(key, shape, dtype)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """rank -> (tp_rank, pp_rank, dp_rank); TP fastest, then DP, then PP (Megatron's default order)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, pp_rank, dp_rank


def _split(t: torch.Tensor, dim: int, parts: int, idx: int) -> torch.Tensor:
    n = t.shape[dim] // parts
    return t.narrow(dim, idx * n, n).clone()


def model_state(layout: Layout, rank: int, *, empty: bool = False, distopt: bool = False) -> Dict[str, Any]:
    """The sharded state dict this rank holds (``empty``: zero-filled template)."""
    tp_rank, pp_rank, dp_rank = layout.coords(rank)
    chunks = layout.pp * layout.vp
    per_chunk = L // chunks
    out: Dict[str, Any] = {}

    def st(key: str, data: torch.Tensor, offset: Tuple[int, ...], prepend: int, replica: Tuple[int, int, int]) -> ShardedTensor:
        if empty:
            data = torch.zeros_like(data)
        gshape, _ = GLOBALS[key]
        return ShardedTensor(key, data, gshape, offset, replica, prepend)

    for v in range(layout.vp):
        chunk = {}
        c = v * layout.pp + pp_rank
        first, last = c == 0, c == chunks - 1
        if first:
            k = "embedding.word_embeddings.weight"
            chunk[k] = st(k, _split(full(k), 0, layout.tp, tp_rank), (tp_rank * V // layout.tp, 0), 0, (0, 0, dp_rank))
        for i in range(per_chunk):
            layer = c * per_chunk + i
            k = "decoder.layers.self_attention.linear_qkv.weight"
            d = _split(full(k)[layer], 0, layout.tp, tp_rank)
            chunk[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = st(
                k, d, (layer, tp_rank * d.shape[0], 0), 1, (0, 0, dp_rank))
            k = "decoder.layers.self_attention.linear_proj.weight"
            d = _split(full(k)[layer], 1, layout.tp, tp_rank)
            chunk[f"decoder.layers.{i}.self_attention.linear_proj.weight"] = st(
                k, d, (layer, 0, tp_rank * d.shape[1]), 1, (0, 0, dp_rank))
            k = "decoder.layers.input_layernorm.weight"
            chunk[f"decoder.layers.{i}.input_layernorm.weight"] = st(
                k, full(k)[layer].clone(), (layer, 0), 1, (0, tp_rank, dp_rank))
        if last:
            k = "decoder.final_layernorm.weight"
            chunk[k] = st(k, full(k).clone(), (0,), 0, (0, tp_rank, dp_rank))
        out["model" if layout.vp == 1 else f"model{v}"] = chunk
    if distopt:
        out["optimizer"] = {"state": {}}
        idx = 0
        for name, chunk in out.items():
            if not name.startswith("model"):
                continue
            for path, sh in chunk.items():
                n = sh.data.numel()
                a, b = n * dp_rank // layout.dp, n * (dp_rank + 1) // layout.dp
                data = sh.data.reshape(-1)[a:b].float() * 0.5
                out["optimizer"]["state"][idx] = {
                    "exp_avg": ShardedTensor(f"optimizer.state.exp_avg.{sh.key}", data.clone(), sh.global_shape,
                                             sh.global_offset, (0, sh.replica_id[1], 0), sh.prepend_axis_num,
                                             local_shape=sh.local_shape, dtype=torch.float32,
                                             flattened_range=slice(a, b))
                }
                idx += 1
    return out


def expected_shard(sh: ShardedTensor) -> torch.Tensor:
    """What a shard must contain: the slice of the global tensor (plus DistOpt scaling)."""
    key = sh.key
    scale = None
    if key.startswith("optimizer.state.exp_avg."):
        key = key[len("optimizer.state.exp_avg."):]
        scale = 0.5
    g = full(key)
    idx = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.chunk_shape))
    region = g[idx].reshape(sh.local_shape)
    if scale is not None:
        region = region.float() * scale
    if sh.flattened_range is not None:
        region = region.reshape(-1)[sh.flattened_range]
    return region


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0.0 vs 0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check_state(state: Dict[str, Any]) -> List[str]:
    """Bit-exact comparison of every ShardedTensor in a loaded template; returns mismatches."""
    bad = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, ShardedTensor):
            exp = expected_shard(node)
            if not bit_equal(node.data, exp):
                bad.append(f"{path} ({node.key} @ {node.global_offset})")
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))

    walk(state, "")
    return bad


def extras(rank: int) -> Dict[str, Any]:
    """Non-tensor and rank-local state saved alongside the model."""
    return {
        "iteration": 1234,
        "args": argparse.Namespace(lr=3e-4, name="toy", layers=[1, 2, 3], dtype=torch.bfloat16),
        "rng": torch.manual_seed(100 + rank).get_state(),
        "blob": bytes(range(256)) * 2,
        "note": {"rank": rank, 7: "int key", "t": (1, 2.5, None)},
    }


EXP_AVG = "optimizer.state.exp_avg."


def union_state(layout: Layout, distopt: bool) -> Dict[str, Any]:
    """Every rank's shards of ``layout`` held by one process (save deduplicates the replicas)."""
    sd: Dict[str, Any] = {}
    for r in range(layout.world):
        for name, part in model_state(layout, r, distopt=distopt).items():
            sd[f"{name}_r{r}"] = part
    return sd


def expected_global(key: str) -> torch.Tensor:
    """The full global value of ``key`` in a :func:`union_state` checkpoint (Adam moments included)."""
    if key.startswith(EXP_AVG):
        return full(key[len(EXP_AVG):]).float() * 0.5
    return full(key)

"""Compare the global tensors of megashard checkpoints, bit for bit, in the calling process
(``megashard.load`` needs no process group there).

Every global tensor of each checkpoint is read in full through ``megashard.load`` (so
the checkpoint's own shards are reassembled, whatever layout saved them) and the two
sets are compared with ``torch.equal``: the keys compared, those only in one checkpoint, and
those that differ (with the max abs difference).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


def global_tensors(ckpt: str, prefixes: Optional[List[str]] = None) -> Dict[str, torch.Tensor]:
    """Every global tensor of ``ckpt`` (whose key starts with one of ``prefixes``), in full."""
    from megashard import api
    from megashard.sharded import ShardedTensor

    manifest = api.read_manifest(ckpt)
    template = {}
    for key, rec in manifest.tensors.items():
        if prefixes and not any(key.startswith(p) for p in prefixes):
            continue
        t = torch.empty(tuple(rec.global_shape), dtype=rec.dtype)
        template[key] = ShardedTensor(key, t, tuple(rec.global_shape), (0,) * len(rec.global_shape))
    api.load(template, ckpt)
    return {k: v.data for k, v in template.items()}


def compare(a: str, b: str, prefixes: Optional[List[str]] = None) -> Dict[str, object]:
    ta, tb = global_tensors(a, prefixes), global_tensors(b, prefixes)
    common = sorted(set(ta) & set(tb))
    differ = {}
    for k in common:
        x, y = ta[k], tb[k]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else None
            differ[k] = diff
    return {
        "compared": common,
        "only_a": sorted(set(ta) - set(tb)),
        "only_b": sorted(set(tb) - set(ta)),
        "differ": differ,
        "numel": int(sum(ta[k].numel() for k in common)),
    }

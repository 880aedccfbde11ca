"""Compare the global tensors of megashard checkpoints, bit for bit.

Run as a script (one process, its own gloo group, so the pytest process stays clean)::

    python -m megatron_helpers.ckpt_compare CKPT_A CKPT_B [--prefix model --prefix optimizer]

Every global tensor of each checkpoint is read in full through ``megashard.load`` (so
the checkpoint's own shards are reassembled, whatever layout saved them) and the two
sets are compared with ``torch.equal``. Prints one JSON object: the keys compared,
those only in one checkpoint, and those that differ (with the max abs difference).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--prefix", action="append", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(json.dumps(compare(args.a, args.b, args.prefix)))
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

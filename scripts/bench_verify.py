"""What `megashard verify DIR` costs per GB (median of interleaved runs, warm page cache).

    python scripts/bench_verify.py [--gb 1.0] [--rounds 5]

Saves a checkpoint of ``--gb`` GB (bf16/fp32 tensors, 2 simulated ranks' worth of files in one
process), then times ``verify_checkpoint`` and, beside it, the raw floor of reading the same
bytes with ``preadv`` and hashing them with SHA-256 + CRC32 (what tensorizer's hashes need).
Run it with another megashard on PYTHONPATH to compare versions in the same session.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time

import torch
from isal import isal_zlib

import megashard
from megashard.checkpoint_tools import verify_checkpoint
from megashard.sharded import ShardedTensor


def _floor(path: str) -> None:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for f in sorted(os.listdir(path)):
        fd = os.open(os.path.join(path, f), os.O_RDONLY)
        try:
            sha, crc, pos = hashlib.sha256(), 0, 0
            while True:
                n = os.preadv(fd, [view], pos)
                if n <= 0:
                    break
                sha.update(view[:n])
                crc = isal_zlib.crc32(view[:n], crc)
                pos += n
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="megashard-bench-verify-")
    path = os.path.join(root, "ckpt")
    if not os.path.isdir(path):
        n = int(a.gb * 1e9 / 4 / 64)
        rows = n // 4096
        state = {f"t{i}": ShardedTensor(f"layer{i}.w", torch.randn(rows, 4096), (rows, 4096), (0, 0)) for i in range(64)}
        megashard.save(state, path, fsync=False)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    times = {"verify": [], "floor": []}
    for _ in range(a.rounds):
        t = time.perf_counter()
        problems = verify_checkpoint(path)
        times["verify"].append(time.perf_counter() - t)
        assert not problems, problems
        t = time.perf_counter()
        _floor(path)
        times["floor"].append(time.perf_counter() - t)
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:7s} {size / 1e9:.2f} GB  median {med:.3f} s  = {med / (size / 1e9):.3f} s/GB  "
              f"({size / 1e9 / med:.2f} GB/s)  runs {[round(x, 3) for x in v]}")
    print(f"dir {path} (megashard from {os.path.dirname(megashard.__file__)})")


if __name__ == "__main__":
    main()

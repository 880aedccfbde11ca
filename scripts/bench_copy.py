"""``megashard copy`` directory -> directory against the floors of the same bytes.

Saves one checkpoint of ``--gib`` GiB (four float32 tensors, one file) under ``--dir`` and, in
``--reps`` interleaved repeats, copies it with ``cp -r`` (+ ``sync``; an in-kernel copy that checks
nothing), a plain Python loop of 1 MiB ``preadv``/``pwrite`` (+ fsync), ``megashard copy`` and
``megashard copy --sha256``. Prints medians (seconds, GB/s). Removes what it wrote.

    python scripts/bench_copy.py [--gib 1] [--reps 3] [--dir /tmp/megashard-bench-copy]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import megashard  # noqa: E402
from megashard.copy import copy  # noqa: E402


def _loop(src: str, dst: str) -> None:
    os.makedirs(dst)
    buf = memoryview(bytearray(1 << 20))
    for n in os.listdir(src):
        fi = os.open(os.path.join(src, n), os.O_RDONLY)
        fo = os.open(os.path.join(dst, n), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        off = 0
        while (k := os.preadv(fi, [buf], off)) > 0:
            os.pwrite(fo, buf[:k], off)
            off += k
        os.fsync(fo)
        os.close(fo)
        os.close(fi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/megashard-bench-copy")
    a = ap.parse_args()
    root = a.dir
    os.makedirs(root)
    try:
        n = int(a.gib * (1 << 30)) // 16
        g = torch.Generator().manual_seed(0)
        megashard.save({f"t{i}": torch.randn(n, generator=g) for i in range(4)}, f"{root}/src")
        size = sum(os.path.getsize(f"{root}/src/{f}") for f in os.listdir(f"{root}/src"))
        ways = {
            "cp -r + sync": lambda d: (subprocess.run(["cp", "-r", f"{root}/src", d], check=True),
                                       subprocess.run(["sync", "-f", d], check=True)),
            "read+write loop, 1 MiB": lambda d: _loop(f"{root}/src", d),
            "megashard copy": lambda d: copy(f"{root}/src", d),
            "megashard copy --sha256": lambda d: copy(f"{root}/src", d, sha256=True),
        }
        times: dict = {k: [] for k in ways}
        for _ in range(a.reps):
            for k, run in ways.items():
                d = f"{root}/dst"
                shutil.rmtree(d, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                t = time.perf_counter()
                run(d)
                times[k].append(time.perf_counter() - t)
        for k, v in times.items():
            m = statistics.median(v)
            print(f"{k:26s} median {m:6.2f} s  {size / m / 1e9:5.2f} GB/s  runs {[round(x, 2) for x in v]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

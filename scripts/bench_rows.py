#!/usr/bin/env python
"""Row jobs: what an own load of strided destinations costs next to the raw preadv floor.

Two column halves of a (12250, 8192) fp32 matrix are saved, then loaded whole (world 1, own):
each half's rows are back to back in the file and strided in the destination, 24.5k rows of
16 KiB in all (one row run per half). Rounds interleave the load with the floor (one preadv per
IOV_MAX rows, in parallel, into the same views); 7 rounds, medians and same-round ratios.
Prints one JSON object.

    python scripts/bench_rows.py [CHECKPOINT_DIR]   # created (~400 MB) when missing
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megashard  # noqa: E402
from megashard import readers  # noqa: E402
from megashard.format.fastio import IOV_MAX, default_read_threads, preadv_all, run_parallel  # noqa: E402
from megashard.sharded import ShardedTensor  # noqa: E402

ROWS, COLS, ROUNDS = 12250, 8192, 7


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "megashard-bench-rows")
    if not os.path.exists(path):
        full = torch.randn(ROWS, COLS)
        half = COLS // 2
        megashard.save({k: ShardedTensor.from_rank_offsets("w", full[:, r * half:(r + 1) * half].contiguous(),
                                                           (1, r, 2)) for r, k in enumerate("ab")}, path)
        del full
    dst = torch.zeros(ROWS, COLS)
    jobs: list = []
    t_read: list = []
    real = readers.read_own

    def timed_read_own(*a):  # the read alone (planning excluded); records the row jobs
        jobs[:] = a[4]
        t = time.perf_counter()
        try:
            return real(*a)
        finally:
            t_read.append(time.perf_counter() - t)

    readers.read_own = timed_read_own

    def load() -> None:
        megashard.load({"w": ShardedTensor.from_rank_offsets("w", dst)}, path, mode="own")

    load()
    assert len(jobs) == 2 and all(len(j[3]) == ROWS and j[2] == COLS * 2 for j in jobs), "not two row jobs"
    fds = {f: os.open(os.path.join(path, f), os.O_RDONLY) for f, *_ in jobs}
    threads = default_read_threads()
    floor_tasks = [partial(preadv_all, fds[f], views[i:i + IOV_MAX], off + i * run, f)
                   for f, off, run, views in jobs for i in range(0, len(views), IOV_MAX)]
    t_load, t_floor = [], []
    t_read.clear()
    for _ in range(ROUNDS):
        t = time.perf_counter()
        load()
        t_load.append(time.perf_counter() - t)
        t = time.perf_counter()
        run_parallel(floor_tasks, threads)
        t_floor.append(time.perf_counter() - t)
    med = statistics.median
    print(json.dumps({
        "load_s": round(med(t_load), 4), "read_own_s": round(med(t_read), 4), "floor_s": round(med(t_floor), 4),
        "load_over_floor": round(med(a / b for a, b in zip(t_load, t_floor)), 3),
        "read_own_over_floor": round(med(a / b for a, b in zip(t_read, t_floor)), 3),
        "rounds": {"load": [round(x, 4) for x in t_load], "read_own": [round(x, 4) for x in t_read],
                   "floor": [round(x, 4) for x in t_floor]}}))


if __name__ == "__main__":
    main()

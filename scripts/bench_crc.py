"""What the default CRC32 check costs an ``own`` load (issue 28 item 5): the same load with
``check_crc=True`` and ``check_crc=False``, interleaved, each in a fresh process, warm page
cache, medians.

    python scripts/bench_crc.py [--gb 1.0] [--tensors 200] [--rounds 7] [--cold] [--json out.json]

Saves one checkpoint of ``--gb`` GB (fp32, ``--tensors`` tensors of equal size, in one
process), then alternates the two loads in fresh processes (the order flips every round).
Each process fills pre-touched destinations (as a resume fills a live model), so the time is
the read (and the check), not page faults. Prints the medians and ``ratio`` = throughput
with the check / without (≥ 0.95 is the target).

``--cold``: before every load the checkpoint's own files leave the page cache
(``posix_fadvise(DONTNEED)`` after an ``fsync``; nothing else is dropped), so each load reads from
the disk as a resume after a restart does; the check then runs while the reads wait on the device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _child(path: str, check: bool, gb: float, tensors: int) -> None:
    import torch

    import megashard
    from megashard.sharded import ShardedTensor

    n = int(gb * 1e9 / 4 / tensors)
    t = {f"t{i}": ShardedTensor(f"t{i}", torch.zeros(n), (n,), (0,)) for i in range(tensors)}
    t0 = time.perf_counter()
    _, stats = megashard.load(t, path, mode="own", check_crc=check, return_stats=True)
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "bytes": stats.bytes_read, "crc_checked": stats.crc_checked}))


def _drop_cache(path: str) -> None:
    """Evict only this checkpoint's pages (the benchmark's own files), as a fresh node would read them."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint's pages before every load")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a.child[0], a.child[1] == "1", a.gb, a.tensors)
    import torch

    import megashard
    from megashard.sharded import ShardedTensor

    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench-crc-") as d:
        path = os.path.join(d, "ckpt")
        n = int(a.gb * 1e9 / 4 / a.tensors)
        g = torch.Generator().manual_seed(0)
        megashard.save({f"t{i}": ShardedTensor(f"t{i}", torch.randn(n, generator=g), (n,), (0,))
                        for i in range(a.tensors)}, path)

        def run(check: bool) -> dict:
            if a.cold:
                _drop_cache(path)
            out = subprocess.run([sys.executable, __file__, "--gb", str(a.gb), "--tensors", str(a.tensors),
                                  "--child", path, "1" if check else "0"], check=True, capture_output=True, text=True)
            return json.loads(out.stdout.strip().splitlines()[-1])

        run(False)  # warm the page cache
        times = {True: [], False: []}
        checked = 0
        for r in range(a.rounds):
            for check in ((True, False) if r % 2 == 0 else (False, True)):
                res = run(check)
                times[check].append(res["seconds"])
                if check:
                    checked = res["crc_checked"]
        on, off = statistics.median(times[True]), statistics.median(times[False])
        gb = n * 4 * a.tensors / 1e9
        result = {"gb": gb, "tensors": a.tensors, "rounds": a.rounds, "cpus": os.cpu_count(),
                  "page_cache": "cold" if a.cold else "warm",
                  "with_crc_s": on, "without_crc_s": off, "with_crc_gbps": gb / on, "without_crc_gbps": gb / off,
                  "ratio": off / on, "crc_checked_bytes": checked, "all_with_crc": times[True],
                  "all_without_crc": times[False]}
        print(json.dumps(result, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

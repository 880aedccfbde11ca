"""Peak host memory beyond the tensors themselves, per rank and per node, for every save and load path.

    python scripts/bench_memory.py [--mib 256 1024] [--tensors 16] [--json docs/bench-memory.json]

2 fake nodes × 2 gloo ranks on this machine (``MEGASHARD_NODE_ID`` per rank); the model (``--mib`` of
bf16 matrices, ``--tensors`` of them) is split by rows over a node's two ranks (TP=2) and replicated
over the nodes (DP=2). For each checkpoint size, in one process per rank and in this order: a save,
an async save (its first: the staging buffer is allocated then and reused by later saves), loads in
``own``, ``scatter`` and ``readonce`` mode into the same layout, then the same three resharding to
columns (saved by rows). Before each step the rank's ``VmHWM`` is reset to its RSS (sources and
destinations exist and are touched); the figure is the peak above that. Per node: the sum of its two
ranks (a ``scatter`` ring's shared pages count in each rank that maps them). Every load checked bit
for bit. Memory, not time, is the point: one run suffices.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from typing import Any, Dict, List

MODES = ("own", "scatter", "readonce")
COLS = 4096
PER_NODE, NODES = 2, 2


def _state(local: int, n: int, rows: int, split: str, empty: bool, first: int = 0) -> Dict[str, Any]:
    """Tensors ``w<first>..`` split by rows or columns over a node's two ranks (``local``), replicated
    over the nodes; ``empty``: zeros of the same shapes (a load's destinations)."""
    import torch

    from megashard import ShardedTensor

    out = {}
    for i in range(first, first + n):
        g = torch.Generator().manual_seed(i)
        full = None if empty else torch.randn(rows, COLS, generator=g).to(torch.bfloat16)
        if split == "rows":
            sl, off, shape = (slice(local * rows // 2, (local + 1) * rows // 2), slice(None)), (local * rows // 2, 0), \
                (rows // 2, COLS)
        else:
            sl, off, shape = (slice(None), slice(local * COLS // 2, (local + 1) * COLS // 2)), (0, local * COLS // 2), \
                (rows, COLS // 2)
        data = torch.zeros(shape, dtype=torch.bfloat16) if empty else full[sl].contiguous()
        out[f"w{i - first}" if first else f"w{i}"] = ShardedTensor(f"w{i}", data, (rows, COLS), off, (0, 0, 0))
    return out


def _reset_hwm() -> int:
    """VmHWM := VmRSS; returns that RSS in bytes."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _rank(rank: int, world: int, a: argparse.Namespace, store: str, q: Any) -> None:
    try:
        q.put((rank, _steps(rank, world, a, store)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it instead of waiting
        import traceback

        q.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _steps(rank: int, world: int, a: argparse.Namespace, store: str) -> List[Dict[str, Any]]:
    import ctypes
    import datetime

    import torch
    import torch.distributed as dist

    import megashard

    os.environ["MEGASHARD_NODE_ID"] = f"node{rank // PER_NODE}"
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: freed blocks leave the RSS
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    local = rank % PER_NODE
    rows_out: List[Dict[str, Any]] = []
    for mib in a.mib:
        rows = max(2, int(mib * 2**20 / a.tensors / COLS / 2) // 2 * 2)
        base = os.path.join(a.dir, f"m{mib}")
        src = _state(local, a.tensors, rows, "rows", False)
        shard_bytes = sum(t.data.numel() * 2 for t in src.values())

        def measure(step: str, fn: Any, check: Any = lambda: True) -> None:
            dist.barrier()
            before = _reset_hwm()
            fn()
            extra = _status("VmHWM") - before  # before the check, which builds the expected tensors
            rows_out.append({"mib": mib, "step": step, "extra": extra, "ok": bool(check()),
                             "rank_bytes": shard_bytes,
                             "largest": rows * COLS * 2})

        measure("save", lambda: megashard.save(src, base + "-sync"))
        measure("async save", lambda: megashard.save(src, base + "-async", async_save=True).result())
        src = None  # the loads' figures are beyond their destinations only

        for split, label in (("rows", "load"), ("cols", "reshard")):
            for mode in MODES:
                template = _state(local, a.tensors, rows, split, True)

                def check() -> bool:
                    return all(torch.equal(template[k].data, _state(local, 1, rows, split, False, first=i)["w0"].data)
                               for i, k in enumerate(sorted(template, key=lambda k: int(k[1:]))))

                measure(f"{label} {mode}", lambda: megashard.load(template, base + "-sync", mode=mode), check)
                template = None
    dist.destroy_process_group()
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[256, 1024])
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import multiprocessing as mp

    world = NODES * PER_NODE
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        a.dir = tmp
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, a, os.path.join(tmp, "store"), q)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        sys.exit("\n".join(f"rank {r}: {v}" for r, v in sorted(failed.items())))
    out: Dict[str, Any] = {"nodes": NODES, "per_node": PER_NODE, "tensors": a.tensors, "rows": []}
    print(f"{'checkpoint':>10s} {'step':18s} {'max/rank MiB':>12s} {'max/node MiB':>12s} "
          f"{'rank shard MiB':>14s} {'largest MiB':>11s} bit-exact")
    for i, row in enumerate(got[0]):
        per = [got[r][i] for r in range(world)]
        assert all(p["step"] == row["step"] and p["mib"] == row["mib"] for p in per)
        node = [sum(per[n * PER_NODE + k]["extra"] for k in range(PER_NODE)) for n in range(NODES)]
        r = {"checkpoint_mib": row["mib"], "step": row["step"], "max_rank_extra_mib": max(p["extra"] for p in per) / 2**20,
             "max_node_extra_mib": max(node) / 2**20, "rank_shard_mib": row["rank_bytes"] / 2**20,
             "largest_tensor_mib": row["largest"] / 2**20, "bit_exact": all(p["ok"] for p in per)}
        out["rows"].append(r)
        print(f"{r['checkpoint_mib']:>10.0f} {r['step']:18s} {r['max_rank_extra_mib']:>12.1f} "
              f"{r['max_node_extra_mib']:>12.1f} {r['rank_shard_mib']:>14.1f} {r['largest_tensor_mib']:>11.1f} "
              f"{r['bit_exact']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

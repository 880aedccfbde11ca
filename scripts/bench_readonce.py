"""Load modes side by side on fake nodes: ``own`` vs ``scatter`` vs ``readonce`` (issue 29, item 3).

    python scripts/bench_readonce.py [--mib 256] [--nodes 2] [--per-node 2] [--rounds 5] [--cold] [--json out.json]

``nodes × per-node`` gloo ranks on this machine, ``MEGASHARD_NODE_ID`` per rank (ranks
``n*per_node ..`` on node ``n``); the model (``--mib`` of bf16 matrices) is TP=``per-node``
within a node and replicated over the nodes (DP=``nodes``), as Megatron lays a TP group on a
node. Saved once, then the three modes load it in turn, interleaved, ``--rounds`` times, every
load checked bit for bit. Per mode: the job's bytes read from storage (the sum of every rank's
``LoadStats.bytes_read``), its time (the slowest rank's; median over rounds) and each rank's
peak host memory beyond its destinations (``VmHWM`` reset before the load; the largest). One
host: the "network" is loopback and the storage the page cache, or the disk with ``--cold``
(the checkpoint's pages dropped before every load), so the bytes are the point, not the times.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

MODES = ("own", "scatter", "readonce")
COLS = 4096


def _state(rank: int, tp: int, dp: int, n: int, rows: int, empty: bool) -> Dict[str, Any]:
    import torch

    from megashard import ShardedTensor

    t_rank, d_rank = rank % tp, rank // tp
    out = {}
    for i in range(n):
        part = rows // tp
        if empty:
            data = torch.zeros(part, COLS, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(i)
            full = torch.randn(rows, COLS, generator=g).to(torch.bfloat16)
            data = full[t_rank * part:(t_rank + 1) * part].clone()
        out[f"w{i}"] = ShardedTensor(f"w{i}", data, (rows, COLS), (t_rank * part, 0), (0, 0, d_rank))
    return out


def _drop_cache(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rss() -> Dict[str, int]:
    s = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def _rank(rank: int, world: int, a: argparse.Namespace, store: str, q: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import megashard

    os.environ["MEGASHARD_NODE_ID"] = f"node{rank // a.per_node}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    tp, dp = a.per_node, a.nodes
    rows = max(tp, int(a.mib * 2**20 / a.tensors / COLS / 2) // tp * tp)
    path = os.path.join(a.dir, "ckpt")
    megashard.save(_state(rank, tp, dp, a.tensors, rows, False), path)
    want = _state(rank, tp, dp, a.tensors, rows, False)
    rows_out: List[Dict[str, Any]] = []
    for r in range(a.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            template = _state(rank, tp, dp, a.tensors, rows, True)  # destinations exist before the load
            dist.barrier()
            if a.cold and rank == 0:
                _drop_cache(path)
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _rss()["VmRSS"]
            t0 = time.perf_counter()
            _, st = megashard.load(template, path, mode=mode, return_stats=True)
            dt = time.perf_counter() - t0
            extra = _rss()["VmHWM"] - before
            ok = all(torch.equal(template[k].data, want[k].data) for k in want)
            rows_out.append({"round": r, "mode": mode, "seconds": dt, "read": st.bytes_read,
                             "received": st.bytes_received, "extra": extra, "ok": ok, "chosen": st.mode})
    dist.destroy_process_group()
    q.put((rank, rows_out, a.tensors * rows * COLS * 2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import multiprocessing as mp

    world = a.nodes * a.per_node
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        a.dir = tmp
        store = os.path.join(tmp, "store")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, a, store, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = [q.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
    by_rank = {r: rows for r, rows, _ in got}
    model = got[0][2]
    out: Dict[str, Any] = {"model_bytes": model, "nodes": a.nodes, "per_node": a.per_node, "cold": a.cold,
                           "modes": {}}
    for mode in MODES:
        per_round = []
        for k in range(a.rounds):
            rows = [next(x for x in by_rank[r] if x["mode"] == mode and x["round"] == k) for r in range(world)]
            per_round.append({"seconds": max(x["seconds"] for x in rows), "read": sum(x["read"] for x in rows),
                              "extra": max(x["extra"] for x in rows), "ok": all(x["ok"] for x in rows)})
        res = {"seconds_median": statistics.median(x["seconds"] for x in per_round),
               "job_bytes_read": per_round[-1]["read"], "read_vs_model": per_round[-1]["read"] / model,
               "peak_extra_mib": max(x["extra"] for x in per_round) / 2**20,
               "bit_exact": all(x["ok"] for x in per_round)}
        out["modes"][mode] = res
        print(f"{mode:9s} {res['seconds_median']:.3f} s  read {res['job_bytes_read'] / 2**20:.1f} MiB "
              f"({res['read_vs_model']:.2f}x the model)  peak extra {res['peak_extra_mib']:.1f} MiB/rank  "
              f"bit-exact {res['bit_exact']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

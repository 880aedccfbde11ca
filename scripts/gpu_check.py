#!/usr/bin/env python
"""Loads into GPU memory, checked and timed: the CUDA paths that CPU machines cannot run.

Usage::

    python scripts/gpu_check.py [--size-gib 1] [--reps 5] [--json FILE]

Needs one CUDA GPU. Two ranks (gloo, one node, both on ``cuda:0``) save a GPT-like
model at TP=2 and load it into GPU tensors that already exist, every op checked
bit-for-bit against the saved shards:

  own_gpu            ``mode="own"``: each rank preadvs its bytes into pinned buffers, H2D copies
  scatter_shm_gpu    ``mode="scatter"``: own bytes through passed descriptors + pinned buffers,
                     shared bytes from the page-locked shared-memory ring straight to the GPU
  scatter_group_gpu  ``mode="scatter", scatter_transport="group"``: gloo sends, staged
  host_then_gpu      load into host tensors, then ``.copy_`` to the GPU (what staging every GPU
                     tensor in a full host copy costs: the path before pinned buffers)
  own_cpu / scatter_shm_cpu   the same loads into host tensors (the CPU ratio on this machine)

Ops run interleaved (rotated order per repetition), median of ``--reps``; per repetition
the slower rank counts; peak RSS per rank per op over the RSS before it (VmHWM reset before each). Floors
measured in the same run: ``preadv`` of one rank's file into pinned memory, one H2D copy
of 1 GiB from pinned and from pageable memory. Then a one-rank NCCL process group runs
own and scatter loads into the GPU (collectives on the device) and an async save of GPU
tensors (pinned staging, sources changed right after the call), and shared memory is
page-locked and copied from in one process. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

H, V = 2048, 32000
GPU = os.environ.get("MEGASHARD_GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this script's own logic
OPS = ["own_gpu", "scatter_shm_gpu", "scatter_group_gpu", "host_then_gpu", "own_cpu", "scatter_shm_cpu"]


def model(rank: int, tp: int, layers: int) -> Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...], torch.Tensor, Any]]:
    """key -> (global shape, global offset, this rank's data, replica id); deterministic per key."""
    g = torch.Generator()
    out = {}

    def add(key: str, shape: Tuple[int, ...], dim: int, dtype: torch.dtype) -> None:
        g.manual_seed(zlib.crc32(key.encode()))
        if dim < 0:  # replicated over TP
            data = torch.randn(shape, generator=g).to(dtype)
            out[key] = (shape, (0,) * len(shape), data, rank)
            return
        local = list(shape)
        local[dim] //= tp
        full = torch.randn(shape, generator=g).to(dtype)
        off = [0] * len(shape)
        off[dim] = rank * local[dim]
        out[key] = (shape, tuple(off), full.narrow(dim, off[dim], local[dim]).clone(), 0)

    add("embedding.weight", (V, H), 0, torch.bfloat16)
    for i in range(layers):
        add(f"layers.{i}.qkv.weight", (3 * H, H), 0, torch.bfloat16)
        add(f"layers.{i}.proj.weight", (H, H), 1, torch.bfloat16)
        add(f"layers.{i}.fc1.weight", (4 * H, H), 0, torch.bfloat16)
        add(f"layers.{i}.fc2.weight", (H, 4 * H), 1, torch.bfloat16)
        add(f"layers.{i}.norm1.weight", (H,), -1, torch.float32)
        add(f"layers.{i}.norm2.weight", (H,), -1, torch.float32)
    add("final_norm.weight", (H,), -1, torch.float32)
    return out


def state(m: Dict[str, Any], device: str, empty: bool, fresh: bool = False) -> Dict[str, Any]:
    """Sharded state around the saved data, or (``empty``) zero-filled; ``fresh``: uninitialised."""
    from megashard.sharded import ShardedTensor

    out = {}
    for k, (shape, off, data, rep) in m.items():
        alloc = torch.empty if fresh else torch.zeros
        d = alloc(data.shape, dtype=data.dtype, device=device) if empty else data
        out[k] = ShardedTensor(k, d, shape, off, rep if isinstance(rep, int) else 0)
    return out


def sync() -> None:
    if GPU == "cuda":
        torch.cuda.synchronize()


def reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def status_mib(field: str) -> float:
    """``VmHWM`` (peak resident memory since the last reset) or ``VmRSS``, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(rank: int, world: int, store: str, tmp: str, layers: int, reps: int, q: Any) -> None:
    os.environ["MEGASHARD_NODE_ID"] = "gpu-check-node"
    import torch.distributed as dist

    import megashard
    from megashard import devicecopy

    registered: List[bool] = []
    real_register = devicecopy.DeviceCopier.register

    def register(self: Any, t: torch.Tensor) -> bool:
        ok = real_register(self, t)
        registered.append(ok)
        return ok

    devicecopy.DeviceCopier.register = register  # type: ignore[method-assign]
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        if GPU == "cuda":
            torch.cuda.set_device(0)
        m = model(rank, world, layers)
        path = os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        megashard.save(state(m, "cpu", empty=False), path)
        save_s = time.perf_counter() - t0
        want_gpu = {k: v[2].to(GPU) for k, v in m.items()}
        templates = {GPU: state(m, GPU, empty=True), "cpu": state(m, "cpu", empty=True)}
        times: Dict[str, List[float]] = {op: [] for op in OPS}
        rss: Dict[str, float] = {}
        stats_of: Dict[str, Any] = {}
        bad: Dict[str, List[str]] = {}

        def run(op: str) -> None:
            dev = GPU if op.endswith("gpu") else "cpu"
            tpl = templates[dev]
            for sh in tpl.values():
                sh.data.zero_()
            sync()
            reset_hwm()
            base_rss = status_mib("VmRSS")
            dist.barrier()
            t = time.perf_counter()
            if op == "host_then_gpu":  # a full host copy, allocated per load, as the staged path did
                host_tmp = state(m, "cpu", empty=True, fresh=True)
                _, st = megashard.load(host_tmp, path, mode="own", return_stats=True)
                for k, sh in tpl.items():
                    sh.data.copy_(host_tmp[k].data)
                del host_tmp
            else:
                kw: Dict[str, Any] = {"mode": "own" if op.startswith("own") else "scatter"}
                if op.startswith("scatter_group"):
                    kw["scatter_transport"] = "group"
                _, st = megashard.load(tpl, path, return_stats=True, **kw)
            sync()
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[op].append(float(dt))
            rss[op] = max(rss.get(op, 0.0), status_mib("VmHWM") - base_rss)  # peak over what was resident
            stats_of[op] = {"mode": st.mode, "transport": st.transport, "read": st.bytes_read,
                            "received": st.bytes_received}
            want = want_gpu if dev == GPU else {k: v[2] for k, v in m.items()}
            wrong = [k for k, sh in tpl.items() if not torch.equal(sh.data.view(torch.uint8), want[k].view(torch.uint8))]
            if wrong:
                bad.setdefault(op, []).extend(wrong[:3])

        for op in OPS:  # warm-up (page cache, pinned allocator, CUDA context)
            run(op)
        for op in OPS:
            times[op].clear()
        for r in range(reps):
            order = OPS[r % len(OPS):] + OPS[:r % len(OPS)]
            for op in (order if r % 2 == 0 else order[::-1]):
                run(op)
        floors = {}
        if rank == 0 and GPU == "cuda":
            floors = measure_floors(path)
        need = sum(v[2].numel() * v[2].element_size() for v in m.values())
        q.put((rank, True, {"save_s": save_s, "times": times, "rss_mib": rss, "stats": stats_of, "bad": bad,
                            "needed_bytes": need, "registered": registered, "floors": floors}))
    except BaseException as e:  # noqa: BLE001
        import traceback

        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def measure_floors(path: str) -> Dict[str, float]:
    """preadv of rank 0's data file into pinned memory; 1 GiB H2D from pinned and pageable memory."""
    from megashard.format.fastio import default_read_threads, read_requests, tensor_memoryview

    files = sorted(f for f in os.listdir(path) if f.endswith(".tensors"))
    f = os.path.join(path, files[0])
    size = os.path.getsize(f)
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    fd = os.open(f, os.O_RDONLY)
    try:
        best = []
        for _ in range(3):
            t = time.perf_counter()
            read_requests(fd, [(0, tensor_memoryview(buf))], f, default_read_threads())
            best.append(time.perf_counter() - t)
    finally:
        os.close(fd)
    n = 1 << 30
    out = {"file_bytes": size, "preadv_pinned_s": statistics.median(best)}
    for name, pinned in (("h2d_pinned_1gib_s", True), ("h2d_pageable_1gib_s", False)):
        src = torch.ones(n, dtype=torch.uint8, pin_memory=pinned)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts)
        del src, dst
    return out


def nccl_worker(store: str, tmp: str, q: Any) -> None:
    """World size 1 over NCCL: collectives on the device; own and scatter loads into the GPU."""
    import torch.distributed as dist

    import megashard

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))
        m = model(0, 1, 2)
        path = os.path.join(tmp, "nccl_ckpt")
        megashard.save(state(m, "cuda", empty=False), path)  # GPU sources too
        res = {}
        for mode in ("own", "scatter"):
            tpl = state(m, "cuda", empty=True)
            _, st = megashard.load(tpl, path, mode=mode, return_stats=True)
            ok = all(torch.equal(tpl[k].data.cpu().view(torch.uint8), m[k][2].view(torch.uint8)) for k in m)
            res[mode] = {"bit_exact": ok, "mode": st.mode, "read": st.bytes_read}
        # async save of GPU tensors: snapshot into pinned staging on a side stream, then the
        # sources change at once; the checkpoint must hold the values at the call
        src = state(m, "cuda", empty=False)
        src = {k: type(sh)(sh.key, sh.data.clone(), sh.global_shape, sh.global_offset, sh.replica_id)
               for k, sh in src.items()}
        apath = os.path.join(tmp, "async_ckpt")
        t = time.perf_counter()
        h = megashard.save(src, apath, async_save=True)
        blocking = time.perf_counter() - t
        for sh in src.values():
            sh.data.add_(1)
        h.result()
        tpl = state(m, "cuda", empty=True)
        megashard.load(tpl, apath, mode="own")
        ok = all(torch.equal(tpl[k].data.cpu().view(torch.uint8), m[k][2].view(torch.uint8)) for k in m)
        res["async_save_gpu"] = {"bit_exact": ok, "blocking_s": blocking, "timings": h.timings,
                                 "bytes": sum(v[2].numel() * v[2].element_size() for v in m.values())}
        q.put((0, True, res))
    except BaseException as e:  # noqa: BLE001
        import traceback

        q.put((0, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def ring_check() -> Dict[str, Any]:
    """Page-lock a ring segment, copy from it to the GPU, unlock."""
    from megashard import shm
    from megashard.devicecopy import DeviceCopier

    ring = shm.Ring.create(1, 4, 64 << 20)
    try:
        dst = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        with DeviceCopier([dst.device]) as cp:
            t = time.perf_counter()
            ok = cp.register(ring.data)
            reg_s = time.perf_counter() - t
            ring.data.copy_(torch.arange(256 << 20, dtype=torch.int64).to(torch.uint8))
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                cp.copy(dst, ring.data)
                cp.sync()
                ts.append(time.perf_counter() - t)
            exact = torch.equal(dst.cpu(), ring.data)
            cp.unregister_all()
        return {"registered": ok, "register_s": reg_s, "copy_256mib_s": statistics.median(ts), "bit_exact": exact}
    finally:
        ring.close()


def spawn(target: Any, args: Tuple[Any, ...], n: int, timeout: float) -> List[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*(a(r) if callable(a) else a for a in args), q)) for r in range(n)]
    for p in procs:
        p.start()
    res: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(res) < n and time.monotonic() < deadline:
        try:
            r, ok, v = q.get(timeout=1)
            res[r] = v if ok else {"error": v}
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return [res.get(r, {"error": "no result"}) for r in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if GPU == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (MEGASHARD_GPU_CHECK_DEVICE=cpu runs the script's logic on CPU)", file=sys.stderr)
        return 2
    layers = max(1, round((a.size_gib * 2 ** 30 - V * H * 2) / (12 * H * H * 2)))
    out: Dict[str, Any] = {"torch": torch.__version__, "layers": layers,
                           "gpu": torch.cuda.get_device_name(0) if GPU == "cuda" else "none (dry run)",
                           "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="megashard-gpu-") as tmp:
        store = os.path.join(tmp, "store")
        ranks = spawn(worker, (lambda r: r, 2, store, tmp, layers, a.reps), 2, 900)
        out["ranks"] = ranks
        if all("times" in r for r in ranks):
            med = {op: statistics.median(ranks[0]["times"][op]) for op in OPS}
            out["median_s"] = med
            gb = sum(r["needed_bytes"] for r in ranks) / 1e9
            out["node_gb"] = gb
            out["ratios"] = {"scatter_shm_gpu / own_gpu": med["own_gpu"] / med["scatter_shm_gpu"],
                             "own_gpu vs host_then_gpu": med["host_then_gpu"] / med["own_gpu"],
                             "scatter_shm_cpu / own_cpu": med["own_cpu"] / med["scatter_shm_cpu"]}
        if GPU == "cuda":
            out["nccl_one_rank"] = spawn(nccl_worker, (os.path.join(tmp, "store2"), tmp), 1, 300)[0]
            out["ring"] = ring_check()
        left = [n for n in os.listdir("/dev/shm") if n.startswith("megashard-")]
        out["dev_shm_left"] = left
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

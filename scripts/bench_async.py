#!/usr/bin/env python
"""Async save benchmark: how long training stalls, and how much slower it runs meanwhile.

Two gloo ranks on CPU, a GPT-like state at TP=2 (``scripts/_bench_worker.py``'s
model, ``--size-gib`` in all). In one run, rounds interleave (order rotating):

* ``sync``      megashard.save — blocking = total;
* ``async``     megashard.save(async_save=True): blocking = until it returns; then
                training steps run (polling ``async_save.all_done()`` each step, as
                Megatron's loop does) until every rank's write ended; total = commit;
* ``td_async``  megatron-core torch_dist: ``dist_checkpointing.save(...,
                async_sharded_save=True)`` + ``AsyncCallsQueue`` (forked writer),
                ``maybe_finalize_async_calls(blocking=False)`` each step;
* ``thread`` / ``process``: the GIL question — the same bytes (the rank's shards)
                written by ``write_file(fsync=True)`` from a thread of the trainer or
                from a forked child, while the trainer runs steps; ``thread_nice``: the
                thread at megashard's writer niceness (``MEGASHARD_ASYNC_NICE``).

A training step is a small MLP's forward/backward/update on one thread (Python- and
dispatch-heavy, as a CPU stand-in for a step's host side). Step slowdown = median step
during the write / median of the 8 normal steps run just before each repetition. The first async save
(which allocates staging) is reported separately. Peak RSS per op is VmHWM after a
reset at its start; the machine is shared, so medians and spreads are printed.

    python scripts/bench_async.py --size-gib 1 --rounds 5
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORLD = 2


def _worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist

    from _bench_worker import (local_shards, release_free_memory, reset_peak_rss, sharded_state_dict,
                               spec_for_size, torch_dist_cpu_shim, _status_kib)

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=900))
    torch_dist_cpu_shim()
    import megashard
    from megashard import async_save
    from megashard.format import write_file
    from megashard.format.fastio import take_io_role
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    spec = spec_for_size(a.size_gib * (1 << 30))
    shards = local_shards(spec, WORLD, rank, 0, "pattern")
    local_bytes = sum(s.data.numel() * s.data.element_size() for s in shards)

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(32, 256)

    def step() -> float:
        t = time.perf_counter()
        for _ in range(4):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        return time.perf_counter() - t

    queue = AsyncCallsQueue()
    out: Dict[str, List[Dict[str, Any]]] = {}

    def rec(name: str, **kw: Any) -> None:
        kw["peak_rss_mib"] = _status_kib("VmHWM") / 1024
        out.setdefault(name, []).append(kw)

    def fresh(path: str, create: bool = False) -> None:
        shutil.rmtree(path, ignore_errors=True)
        for n in os.listdir(a.workdir):  # abandoned temp dirs of earlier rounds
            if n.startswith("." + os.path.basename(path) + "."):
                shutil.rmtree(os.path.join(a.workdir, n), ignore_errors=True)
        if create:
            os.makedirs(path, exist_ok=True)

    def before(path: str, create: bool = False) -> float:
        if rank == 0:
            fresh(path, create)
        release_free_memory()
        dist.barrier()
        reset_peak_rss()
        return time.perf_counter()

    def op_sync(tag: str) -> None:
        p = os.path.join(a.workdir, "sync")
        t0 = before(p)
        megashard.save(sharded_state_dict(shards), p)
        t = time.perf_counter() - t0
        rec(tag, blocking_s=t, total_s=t, steps=[])

    def op_async(tag: str) -> None:
        p = os.path.join(a.workdir, "async")
        rss0 = _status_kib("VmRSS") / 1024
        t0 = before(p)
        h = megashard.save(sharded_state_dict(shards), p, async_save=True)
        tb = time.perf_counter() - t0
        steps = []
        while not async_save.all_done():
            steps.append(step())
        h.result()
        rec(tag, blocking_s=tb, total_s=time.perf_counter() - t0, steps=steps, rss_before_mib=rss0,
            allocations=async_save.staging().allocations, staging_bytes=async_save.staging().nbytes(),
            **h.timings)

    def op_td(tag: str) -> None:
        p = os.path.join(a.workdir, "td")
        t0 = before(p, create=True)
        req = dist_checkpointing.save(sharded_state_dict(shards), p, async_sharded_save=True)
        queue.schedule_async_request(req)
        tb = time.perf_counter() - t0
        steps = []
        while not queue.maybe_finalize_async_calls(blocking=False):
            steps.append(step())
        rec(tag, blocking_s=tb, total_s=time.perf_counter() - t0, steps=steps)

    def op_writer(tag: str, how: str) -> None:
        # the rank's shards (the bytes the staging holds; the staging itself is left out of forks)
        tensors = {f"t{i}": s.data for i, s in enumerate(shards)}
        p = os.path.join(a.workdir, f"raw-{how}-r{rank}")
        os.makedirs(p, exist_ok=True)
        target = os.path.join(p, "shards.tensors")
        t0 = before(os.path.join(a.workdir, "none"))
        steps = []
        if how.startswith("thread"):
            def write() -> None:
                if how == "thread_nice":
                    take_io_role("async", async_save.writer_nice())  # as megashard's writer thread does
                write_file(tensors, target, fsync=True)

            th = threading.Thread(target=write)
            th.start()
            while th.is_alive():
                steps.append(step())
            th.join()
        else:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    write_file(tensors, target, fsync=True)
                    code = 0
                finally:
                    os._exit(code)
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                steps.append(step())
        rec(tag, blocking_s=0.0, total_s=time.perf_counter() - t0, steps=steps)
        dist.barrier()

    ops: Dict[str, Callable[[str], None]] = {
        "sync": op_sync, "async": op_async, "td_async": op_td,
        "thread": lambda t: op_writer(t, "thread"), "thread_nice": lambda t: op_writer(t, "thread_nice"),
        "process": lambda t: op_writer(t, "process")}
    dist.barrier()
    base = [step() for _ in range(10)]  # warm-up
    op_sync("warmup_sync")
    op_async("async_first")  # allocates staging
    op_td("warmup_td")
    names = list(ops)
    baseline: List[float] = []
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            pre = [step() for _ in range(8)]  # normal steps right before the op: its own baseline
            baseline += pre
            ops[name](name)
            out[name][-1]["pre_steps"] = pre
            dist.barrier()
    out["baseline_steps"] = [{"steps": base[5:] + baseline}]
    out["meta"] = [{"local_bytes": local_bytes, "rank": rank}]
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summarize(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    base = _med([s for r in ranks for s in r["baseline_steps"][0]["steps"]])
    res: Dict[str, Any] = {"normal_step_s": base, "local_bytes": [r["meta"][0]["local_bytes"] for r in ranks]}
    for op in ("sync", "async_first", "async", "td_async", "thread", "thread_nice", "process"):
        reps = list(zip(*[r[op] for r in ranks]))  # per repetition, every rank's record
        blocking = [max(x["blocking_s"] for x in rep) for rep in reps]
        total = [max(x["total_s"] for x in rep) for rep in reps]
        steps = [s for rep in reps for x in rep for s in x["steps"]]
        res[op] = {
            "reps": len(reps),
            "blocking_s": _med(blocking), "blocking_range": [min(blocking), max(blocking)],
            "total_s": _med(total), "total_range": [min(total), max(total)],
            "peak_rss_mib": _med([max(x["peak_rss_mib"] for x in rep) for rep in reps]),
            "steps_during": len(steps),
            "step_slowdown_vs_all_normal": (_med(steps) / base) if steps else None,
        }
        pre = [s for rep in reps for x in rep for s in x.get("pre_steps", [])]
        # against the normal steps just before each repetition: robust to load drifting during the run
        res[op]["step_slowdown"] = (_med(steps) / _med(pre)) if steps and pre else res[op]["step_slowdown_vs_all_normal"]
        if op.startswith("async"):
            for k in ("plan_s", "copy_s", "agree_s"):
                res[op][k] = _med([max(x[k] for x in rep) for rep in reps])
            res[op]["rss_before_mib"] = max(x["rss_before_mib"] for x in reps[0])
            res[op]["allocations"] = [x.get("allocations") for x in reps[-1]]
            res[op]["staging_bytes"] = [x.get("staging_bytes") for x in reps[-1]]
    res["async_blocking_vs_sync"] = res["async"]["blocking_s"] / res["sync"]["blocking_s"]
    return res


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    work = a.workdir or tempfile.mkdtemp(prefix="megashard-bench-async-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    outd = tempfile.mkdtemp(prefix="megashard-bench-async-out-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--size-gib", str(a.size_gib),
                                       "--rounds", str(a.rounds), "--workdir", work, "--out", outd], env=env))
    rcs = [p.wait() for p in procs]
    shutil.rmtree(work, ignore_errors=True)
    if any(rcs):
        print(f"worker exit codes {rcs}", file=sys.stderr)
        return 1
    ranks = [json.load(open(os.path.join(outd, f"rank{r}.json"))) for r in range(WORLD)]
    summary = _summarize(ranks)
    print(json.dumps(summary, indent=1))
    print(f"\n{'op':<12} {'blocking s':>11} {'total s':>9} {'peak RSS MiB':>13} {'step x':>7}")
    for op in ("sync", "async_first", "async", "td_async", "thread", "thread_nice", "process"):
        r = summary[op]
        sd = "" if r["step_slowdown"] is None else f"{r['step_slowdown']:.2f}"
        print(f"{op:<12} {r['blocking_s']:>11.3f} {r['total_s']:>9.3f} {r['peak_rss_mib']:>13.0f} {sd:>7}")
    print(f"async steady blocking / sync: {summary['async_blocking_vs_sync']:.3f}; "
          f"normal step {summary['normal_step_s'] * 1000:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":  # required: megatron-core's AsyncCallsQueue forks, torch_dist may spawn
    sys.exit(main())

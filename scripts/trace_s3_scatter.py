#!/usr/bin/env python
"""Timeline of a 2-rank ``scatter`` load against ``own`` from S3 (SeaweedFS on free ports), one node.

Starts SeaweedFS (tests/seaweedfs.py), saves bench_s3's state (four tensors, ``--mib`` MiB), then 2 gloo
ranks load their row halves into resident tensors, ``own`` and ``scatter`` alternating for ``--reps``
rounds (after a warm-up). Every ranged GET, ring wait, copy out of the ring, CRC check and agreement is
timed (wrappers installed in the rank processes, times on the shared monotonic clock), and per round the
script prints what each rank did when, relative to the round's barrier. Prints a JSON summary on stdout.

    python scripts/trace_s3_scatter.py [--mib 256] [--reps 4] [--events]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import megashard  # noqa: E402
from bench_s3 import half_digests, make_state, set_aws_env, sharded, byte_view, GiB  # noqa: E402
from distributed import all_ok, run_ranks  # noqa: E402
from seaweedfs import seaweedfs  # noqa: E402

EVENTS: List[Tuple[str, float, float, str, Any]] = []
_LOCK = threading.Lock()


def _ev(name: str, t0: float, t1: float, extra: Any = None) -> None:
    with _LOCK:
        EVENTS.append((name, t0, t1, threading.current_thread().name, extra))


def _wrap(owner: Any, attr: str, name: str, extra=None) -> None:
    fn = getattr(owner, attr)
    if isinstance(fn, classmethod):
        raise TypeError(attr)

    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _ev(name, t0, time.perf_counter(), extra(*a, **k) if extra else None)
    setattr(owner, attr, wrapped)


def install() -> None:
    from megashard import loading, readers, scatter, shm
    from megashard.storage.s3 import client, checkpoint
    from megashard.transport import Comm

    _wrap(client.ObjectStore, "_get_range", "GET", lambda self, key, url, a, b, *r, **k: b - a)
    _wrap(client.ObjectStore, "head", "HEAD")
    _wrap(client.ObjectStore, "get_bytes", "GETB")
    _wrap(checkpoint.ObjectCheckpointFiles, "read_files", "read_files", lambda self, jobs, **k: len(jobs))
    _wrap(shm.Ring, "wait_produced", "wait_produced")
    _wrap(shm.Ring, "wait_slot_free", "wait_slot_free", lambda self, k, pids, blocking=True: blocking)
    _wrap(scatter, "_place", "place", lambda ops, lock, src, pieces, copier: sum(p[2] for p in pieces))
    _wrap(scatter._DirectReads, "run", "direct")
    _wrap(scatter._Reader, "transfer_shm", "transfer_shm")
    _wrap(scatter._Consumer, "transfer_shm", "transfer_shm")
    _wrap(Comm, "agree", "agree", lambda self, err, what: what)
    _wrap(loading, "check_crcs", "check_crcs")
    _wrap(readers, "read_own", "read_own")
    _wrap(readers, "scatter", "scatter")
    _wrap(loading, "_open_shared_index", "index")
    cr, at = shm.Ring.create.__func__, shm.Ring.attach.__func__

    def create(cls, *a, **k):
        t0 = time.perf_counter()
        try:
            return cr(cls, *a, **k)
        finally:
            _ev("ring_create", t0, time.perf_counter())

    def attach(cls, *a, **k):
        t0 = time.perf_counter()
        try:
            return at(cls, *a, **k)
        finally:
            _ev("ring_attach", t0, time.perf_counter())
    shm.Ring.create = classmethod(create)
    shm.Ring.attach = classmethod(attach)


def _rank(rank: int, world: int, url: str, shapes: Dict[str, Any], reps: int, digests: Dict[str, List[str]],
          modes: List[str]) -> Dict[str, Any]:
    import torch.distributed as dist

    from megashard.sharded import ShardedTensor
    from megashard.storage.s3.client import clear_store_cache

    install()
    clear_store_cache()
    out: Dict[str, List[Any]] = {m: [] for m in modes}
    for rnd in range(reps + 1):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            tmpl = {}
            for k, (shape, dt) in shapes.items():
                rows = shape[0] // world
                t = torch.zeros(rows, *shape[1:], dtype=getattr(torch, dt))
                tmpl[k] = ShardedTensor.from_rank_offsets(k, t, (0, rank, world))
            from megashard import shm
            shm.RING_SLOTS = int(mode.split("+s")[1]) // 4 if "+s" in mode else 4  # experiment: ring slots
            from megashard.storage.s3 import checkpoint as s3ck
            if not hasattr(s3ck.ObjectCheckpointFiles, "_file_range"):
                s3ck.ObjectCheckpointFiles._file_range = s3ck.ObjectCheckpointFiles.__dict__.get("file_range")
            # "+map": the ring's slots written through the mapping (before file ranges existed)
            s3ck.ObjectCheckpointFiles.file_range = None if "+map" in mode else s3ck.ObjectCheckpointFiles.__dict__["_file_range"]
            gc.collect()
            dist.barrier()
            EVENTS.clear()
            s0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            megashard.load(tmpl, url, mode=mode.split("+")[0])
            t1 = time.perf_counter()
            s1 = resource.getrusage(resource.RUSAGE_SELF)
            ok = all(__import__("hashlib").sha1(byte_view(tmpl[k].data)).hexdigest() == digests[k][rank]
                     for k in tmpl)
            if rnd > 0:
                out[mode].append({"t0": t0, "t1": t1, "cpu": (s1.ru_utime + s1.ru_stime) - (s0.ru_utime + s0.ru_stime),
                                  "ok": ok, "events": [(n, a - t0, b - t0, th, x) for n, a, b, th, x in EVENTS]})
            del tmpl
            dist.barrier()
    return out


def summarize(ev: List[Any]) -> Dict[str, Any]:
    s: Dict[str, Any] = {}
    gets = [e for e in ev if e[0] == "GET"]
    if gets:
        s["gets"] = len(gets)
        s["get_first_start"] = round(min(e[1] for e in gets) * 1e3, 1)
        s["get_last_end"] = round(max(e[2] for e in gets) * 1e3, 1)
        s["get_MiB"] = round(sum(e[4] for e in gets) / 2**20, 1)
        s["get_threads"] = len({e[3] for e in gets})
    for n in ("wait_produced", "wait_slot_free", "place", "check_crcs", "ring_create", "ring_attach", "index",
              "direct", "transfer_shm", "read_own", "scatter", "HEAD", "GETB"):
        es = [e for e in ev if e[0] == n]
        if es:
            s[n] = (len(es), round(sum(e[2] - e[1] for e in es) * 1e3, 1), round(min(e[1] for e in es) * 1e3, 1),
                    round(max(e[2] for e in es) * 1e3, 1))
    s["agree"] = [(e[4].replace("scatter load ", "").replace("load of ", "")[:20], round(e[1] * 1e3, 1),
                   round(e[2] * 1e3, 1)) for e in ev if e[0] == "agree"]
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--events", action="store_true", help="print every event of the last round")
    ap.add_argument("--modes", default="own,scatter")
    args = ap.parse_args()
    modes = args.modes.split(",")
    state = make_state(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory(prefix="trace-s3-") as root, seaweedfs(Path(root)) as sw:
        set_aws_env(sw)
        from megashard.storage.s3.client import ObjectStore
        bucket = f"trace-{uuid.uuid4().hex[:12]}"
        store, _ = ObjectStore.for_url(f"s3://{bucket}/x")
        store.boto3_client().create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/ck/iter_0000001"
        megashard.save(sharded(state), url)
        shapes = {k: (tuple(v.shape), str(v.dtype)[6:]) for k, v in state.items()}
        digests = half_digests(state, 2)
        res = all_ok(run_ranks(_rank, 2, url, shapes, args.reps, digests, modes, timeout=900,
                               env={"MEGASHARD_NODE_ID": "trace-node0"}))
    out: Dict[str, Any] = {"mib": args.mib, "reps": args.reps, "loadavg": os.getloadavg()}
    for mode in modes:
        rounds = list(zip(*(r[mode] for r in res)))
        secs = [max(s["t1"] for s in rs) - min(s["t0"] for s in rs) for rs in rounds]
        cpus = [sum(s["cpu"] for s in rs) for rs in rounds]
        out[mode] = {"seconds": [round(x, 3) for x in secs], "median_s": round(statistics.median(secs), 3),
                     "cpu_s_per_GiB": round(statistics.median(cpus) / (nbytes / GiB), 3),
                     "cpu_by_rank": [round(statistics.median(s["cpu"] for s in r[mode]), 3) for r in res],
                     "ok": all(s["ok"] for rs in rounds for s in rs)}
        for i, rs in enumerate(rounds):
            base = min(s["t0"] for s in rs)
            for rank, s in enumerate(rs):
                shift = s["t0"] - base
                ev = [(n, a + shift, b + shift, th, x) for n, a, b, th, x in s["events"]]
                print(f"[{mode} round {i + 1} rank {rank}] {round((s['t1'] - base) * 1e3, 1)} ms cpu "
                      f"{s['cpu']:.3f}: {json.dumps(summarize(ev))}", file=sys.stderr)
        if args.events:
            for rank, s in enumerate(rounds[-1]):
                for n, a, b, th, x in sorted(s["events"], key=lambda e: e[1]):
                    print(f"  {mode} r{rank} {a * 1e3:8.1f} {b * 1e3:8.1f} {(b - a) * 1e3:7.1f} {n:<14} {th:<22} {x}",
                          file=sys.stderr)
    if "own" in out and "scatter" in out:
        out["scatter_vs_own"] = round(out["scatter"]["median_s"] / out["own"]["median_s"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

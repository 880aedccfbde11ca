#!/usr/bin/env python
"""Timeline of one S3 load against the floor's, on the same SeaweedFS server (a diagnostic, not a benchmark).

Starts SeaweedFS (tests/seaweedfs.py), saves the state ``scripts/bench_s3.py`` builds (``--mib``), uploads the same
bytes as one object for the floor, then, interleaved for ``--reps`` rounds: ``megashard.load(mode="own")`` into
resident tensors, and the floor (``--floor-streams`` ranged GETs of equal parts, ``readinto`` one resident buffer).
Every request is recorded (thread, kind, bytes, send time, response headers time, end) by wrapping the client's
methods and ``http.client``; the load's steps (head, digest/index, HEAD, plan, CRC32) too. Prints per round the
time to the first data GET, the data span (first GET sent to last byte), the tail after it, how many GETs were in
flight over the span (time-weighted mean, and the span's share with fewer than the connections busy) and, with
``--detail``, every request. Progress on stderr, one JSON object (all rounds' events) on stdout with ``--json``.

    python scripts/s3_timeline.py [--mib 256] [--reps 3] [--floor-streams 8,16] [--detail]
"""
from __future__ import annotations

import argparse
import gc
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import megashard  # noqa: E402
import bench_s3 as B  # noqa: E402  (its state, floor and environment)
from seaweedfs import seaweedfs  # noqa: E402
from megashard.storage.s3 import client as oc  # noqa: E402
from megashard.storage.s3.client import ObjectStore  # noqa: E402
from megashard import loading  # noqa: E402
from megashard.storage.s3 import checkpoint as s3ck  # noqa: E402

EVENTS: List[Dict[str, Any]] = []
_LOCK = threading.Lock()
_T = threading.local()
T0 = [0.0]


def now() -> float:
    return time.perf_counter() - T0[0]


def record(kind: str, t0: float, t1: float, **kw: Any) -> None:
    with _LOCK:
        EVENTS.append({"kind": kind, "thread": threading.current_thread().name, "t0": t0, "t1": t1, **kw})


def wrap(owner: Any, name: str, kind: str, nbytes: Callable[..., int] = lambda *a, **k: 0,
         what: Callable[..., Any] = lambda *a, **k: None) -> None:
    orig = getattr(owner, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        t0, c0 = now(), time.thread_time()
        _T.headers = None
        try:
            return orig(*a, **k)
        finally:
            record(kind, t0, now(), bytes=nbytes(*a, **k), headers=getattr(_T, "headers", None), what=what(*a, **k),
                   cpu=time.thread_time() - c0)

    setattr(owner, name, wrapped)


def instrument() -> None:
    # response headers in: per thread, the time of the last getresponse (a request's "first byte")
    orig_getresponse = http.client.HTTPConnection.getresponse

    def getresponse(self: Any) -> Any:
        r = orig_getresponse(self)
        _T.headers = now()
        return r

    http.client.HTTPConnection.getresponse = getresponse
    wrap(ObjectStore, "_get_range", "GET_RANGE", lambda self, key, url, first, end, *a, **k: end - first,
         lambda self, key, url, first, end, *a, **k: f"{key.rsplit('/', 1)[-1]} @{first}")
    wrap(ObjectStore, "get_bytes", "GET", what=lambda self, key, *a, **k: key.rsplit("/", 1)[-1])
    wrap(ObjectStore, "head", "HEAD", what=lambda self, key, *a, **k: key.rsplit("/", 1)[-1])
    wrap(ObjectStore, "_presign", "presign")
    wrap(loading._Crc, "compute", "crc32", lambda self, *a, **k: self.nbytes)
    wrap(s3ck.ObjectCheckpointFiles, "read_manifest_bytes", "head+digest+index")
    wrap(loading, "_open_shared_index", "open_index")
    wrap(loading.readers, "read_own", "read_own")
    wrap(loading, "check_crcs", "check_crcs")


def floor_get(store: ObjectStore, key: str, dest: memoryview, streams: int) -> None:
    """bench_s3.floor_get with each GET recorded."""
    def on_get(a: int, b: int, t0: float, th: float, t1: float) -> None:
        record("GET_RANGE", t0 - T0[0], t1 - T0[0], bytes=b - a, headers=th - T0[0])

    B.floor_get(store, key, dest, streams, on_get=on_get)


def summary(events: List[Dict[str, Any]], total: float, conns: int) -> Dict[str, Any]:
    gets = sorted((e for e in events if e["kind"] == "GET_RANGE"), key=lambda e: e["t0"])
    first, last = gets[0]["t0"], max(e["t1"] for e in gets)
    # in flight over [first, last]: time-weighted mean and the time with fewer than `conns` busy
    pts = sorted([(e["t0"], 1) for e in gets] + [(e["t1"], -1) for e in gets])
    busy, t_prev, area, under = 0, first, 0.0, 0.0
    for t, d in pts:
        area += busy * (t - t_prev)
        if busy < min(conns, len(gets)):
            under += t - t_prev
        busy += d
        t_prev = t
    span = last - first
    ttfb = [e["headers"] - e["t0"] for e in gets if e.get("headers")]
    rate = [e["bytes"] / (e["t1"] - e["headers"]) / 1e9 for e in gets if e.get("headers") and e["t1"] > e["headers"]]
    return {"total": round(total, 4), "to_first_get": round(first, 4), "span": round(span, 4),
            "tail": round(total - last, 4), "gets": len(gets), "mean_in_flight": round(area / span, 2) if span else 0,
            "under_full_s": round(under, 4), "ttfb_median_ms": round(1e3 * statistics.median(ttfb), 1) if ttfb else None,
            "ttfb_max_ms": round(1e3 * max(ttfb), 1) if ttfb else None,
            "get_GBps_median": round(statistics.median(rate), 3) if rate else None,
            "starts_ms": [round(1e3 * e["t0"], 1) for e in gets], "ends_ms": [round(1e3 * e["t1"], 1) for e in gets]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--floor-streams", default="8,16")
    ap.add_argument("--detail", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    streams = [int(s) for s in args.floor_streams.split(",") if s]
    instrument()
    out: Dict[str, Any] = {"rounds": []}
    with tempfile.TemporaryDirectory(prefix="s3tl-") as root, seaweedfs(Path(root)) as sw:
        B.set_aws_env(sw)
        store, _ = ObjectStore.for_url("s3://tlbucket/x")
        store.boto3_client().create_bucket(Bucket="tlbucket")
        state = B.make_state(args.mib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        flat_t = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
        url = "s3://tlbucket/ms/iter_0000001"
        megashard.save(B.sharded(state), url)
        B.floor_put(store, "floor-src", B.byte_view(flat_t), 8)
        for rnd in range(args.reps + 1):
            cases: List[Tuple[str, Callable[[], None]]] = []
            tmpl = B.template_like(state)
            cases.append(("megashard", lambda tmpl=tmpl: megashard.load(tmpl, url, mode="own")))
            for n in streams:
                buf = torch.zeros(nbytes, dtype=torch.uint8)
                cases.append((f"floor_{n}", lambda buf=buf, n=n: floor_get(store, "floor-src", B.byte_view(buf), n)))
            if rnd % 2:
                cases.reverse()
            for name, run in cases:
                gc.collect()
                EVENTS.clear()
                T0[0] = time.perf_counter()
                cpu0 = time.process_time()
                run()
                total = now()
                cpu = time.process_time() - cpu0
                s = summary(EVENTS, total, oc.connections() if name == "megashard" else int(name.split("_")[1]))
                s["cpu_ms"] = round(1e3 * cpu, 1)
                if rnd:
                    out["rounds"].append({"case": name, "round": rnd, **s, "events": list(EVENTS)})
                print(f"round {rnd} {name:<10} total {1e3 * s['total']:6.1f} ms  first GET {1e3 * s['to_first_get']:5.1f}"
                      f"  span {1e3 * s['span']:6.1f}  tail {1e3 * s['tail']:5.1f}  GETs {s['gets']:2d}  in flight "
                      f"{s['mean_in_flight']:5.2f}  under-full {1e3 * s['under_full_s']:5.1f} ms  ttfb med/max "
                      f"{s['ttfb_median_ms']}/{s['ttfb_max_ms']} ms  per-GET GB/s {s['get_GBps_median']}  cpu {s['cpu_ms']} ms",
                      file=sys.stderr, flush=True)
                if args.detail and rnd:
                    for e in sorted(EVENTS, key=lambda e: e["t0"]):
                        h = f" hdr {1e3 * (e['headers'] - e['t0']):6.1f}" if e.get("headers") else ""
                        h += f" cpu {1e3 * e['cpu']:5.1f}" if "cpu" in e else ""
                        print(f"    {e['thread']:<22} {e['kind']:<18} {1e3 * e['t0']:7.1f} -> {1e3 * e['t1']:7.1f}"
                              f" ({1e3 * (e['t1'] - e['t0']):6.1f} ms){h} {e.get('bytes') or ''} {e.get('what') or ''}", file=sys.stderr)
        agg: Dict[str, Any] = {}
        for name in {r["case"] for r in out["rounds"]}:
            rs = [r for r in out["rounds"] if r["case"] == name]
            agg[name] = {k: statistics.median(r[k] for r in rs) for k in
                         ("total", "to_first_get", "span", "tail", "mean_in_flight", "under_full_s", "cpu_ms")}
        print(json.dumps(agg, indent=1), file=sys.stderr)
        if args.json:
            print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Benchmark megashard's s3:// save/load against tensorizer's own S3 path and the endpoint's raw floor (issue 22).

Starts its own S3 endpoint (moto behind tests/scripts/s3_server.py, on a free port on 127.0.0.1, killed by its
pid at the end), creates a bucket, builds a state of four large tensors (2 fp32, 2 bf16) totalling ``--mib`` MiB
and measures, in ONE run, with the cases of each group interleaved round by round (order rotated each round; one
untimed warm-up round, then ``--reps`` timed rounds; medians reported):

  write: megashard.save to s3:// (world 1, in-process) | tensorizer TensorSerializer on
         stream_io.open_stream("s3://...", "wb") (serializes to a temp file, then boto3 upload_file) |
         raw floor: our client's ``upload`` of the same bytes as one object | one plain http.client PUT
         (presigned URL, one connection)
  read:  megashard.load mode="own" (world 1) | tensorizer TensorDeserializer from s3 (curl stream,
         lazy_load=False, verify_hash=False) | raw floor: our client's ``read_into`` of one whole object |
         one plain http.client GET (presigned URL, one connection, readinto)
  ranks: megashard.load with 2 gloo ranks on one node (MEGASHARD_NODE_ID equal), each rank loading its
         row half of every tensor, mode "own" and mode "scatter" (spawned processes; rounds inside them)

For each case: seconds (median), GB/s (payload bytes / s), client CPU-seconds per GiB (getrusage RUSAGE_SELF
utime+stime, plus RUSAGE_CHILDREN for tensorizer's curl processes; in the rank case each rank's own CPU around
its load), the endpoint process's own CPU seconds (/proc/<pid>/stat), and request counts by kind: ``stats`` from megashard's ObjectStore (megashard and raw-client cases,
per rank in the rank case) and ``endpoint`` as the endpoint's own request log classifies them (every case).
moto is a correctness endpoint (single Python process, ~100-300 MB/s per stream): read the figures against the
raw floor, not as absolute S3 throughput. Prints ONE JSON object on stdout; progress goes to stderr.

    python scripts/bench_s3.py [--mib 256] [--reps 3]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import hashlib
import http.client
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import megashard  # noqa: E402
sys.path.insert(0, str(ROOT / "tests"))
from distributed import all_ok, run_ranks  # noqa: E402  (the tests' gloo launcher)
from s3_endpoint import S3Server  # noqa: E402  (the tests' endpoint process: tests/scripts/s3_server.py)
from megashard.objstore.client import ObjectStore, clear_store_cache  # noqa: E402
from megashard.sharded import ShardedTensor  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SERVER = ROOT / "tests" / "scripts" / "s3_server.py"
KEY = "testing"


def log(msg: str) -> None:
    print(f"[bench_s3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- endpoint


class Endpoint(S3Server):
    """The tests' moto endpoint process (our child; only its pid is ever signalled), with the
    counters this benchmark reads."""

    def __init__(self) -> None:
        self._log_dir = tempfile.mkdtemp(prefix="bench-s3-")
        super().__init__(Path(self._log_dir) / "requests.jsonl")
        self.url = self.endpoint

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def reset_log(self) -> None:
        self.request("POST", "/__reset_log__", b"")

    def counts(self) -> Dict[str, int]:
        """Requests since the last reset, by kind (the same names as ObjectStore.stats)."""
        out: collections.Counter = collections.Counter()
        for line in self.request("GET", "/__log__").decode().splitlines():
            if line.strip():
                out[_kind(json.loads(line))] += 1
        return dict(sorted(out.items()))

    def cpu_s(self) -> float:
        """The endpoint process's CPU seconds so far (/proc/<pid>/stat utime + stime)."""
        with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def _kind(e: Dict[str, Any]) -> str:
    m, q = e["method"], set(e.get("query") or ())
    if m == "GET":
        if not e.get("key") or "list-type" in q or "prefix" in q:
            return "LIST" if "uploads" not in q else "MPU_LIST"
        return "GET_RANGE" if e.get("range") else "GET"
    if m == "PUT":
        return "MPU_PART" if "partNumber" in q else ("PUT_BUCKET" if not e.get("key") else "PUT")
    if m == "POST":
        if "uploads" in q:
            return "MPU_CREATE"
        if "uploadId" in q:
            return "MPU_COMPLETE"
        return "DELETE" if "delete" in q else "POST"
    if m == "DELETE":
        return "MPU_ABORT" if "uploadId" in q else "DELETE"
    return m


def set_aws_env(endpoint: str) -> None:
    """Fake credentials and the endpoint, the way tests/s3_endpoint.py sets them (never the user's ~/.aws)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE", "AWS_REGION",
                 "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        os.environ.pop(name, None)
    os.environ.update({"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                       "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": KEY, "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"})
    clear_store_cache()


# ---------------------------------------------------------------------------------------------- state


def make_state(mib: int) -> Dict[str, torch.Tensor]:
    """Four tensors of mib/4 MiB each (2 fp32, 2 bf16), 1024 columns, row counts even (two rank halves)."""
    quarter = mib * MiB // 4
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in (("layers.0.weight", torch.float32), ("layers.1.weight", torch.bfloat16),
                        ("embedding.weight", torch.float32), ("output.weight", torch.bfloat16)):
        rows = quarter // (1024 * (4 if dtype == torch.float32 else 2))
        rows -= rows % 2
        out[name] = torch.randn(rows, 1024, generator=g).to(dtype)
    return out


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def sharded(state: Dict[str, torch.Tensor], rank: int = 0, world: int = 1) -> Dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, v, (0, rank, world)) for k, v in state.items()}


def template_like(state: Dict[str, torch.Tensor], rank: int = 0, world: int = 1) -> Dict[str, ShardedTensor]:
    out = {}
    for k, v in state.items():
        rows = v.shape[0] // world
        out[k] = ShardedTensor.from_rank_offsets(k, torch.empty(rows, *v.shape[1:], dtype=v.dtype), (0, rank, world))
    return out


def half_digests(state: Dict[str, torch.Tensor], world: int) -> Dict[str, List[str]]:
    out = {}
    for k, v in state.items():
        rows = v.shape[0] // world
        out[k] = [hashlib.sha1(byte_view(v[r * rows:(r + 1) * rows].contiguous())).hexdigest() for r in range(world)]
    return out


# ---------------------------------------------------------------------------------------------- measuring


def cpu_now() -> Tuple[float, float]:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


class Case:
    """One timed case: ``run(round)`` does the work; ``after(round)`` (untimed) checks and cleans up."""

    def __init__(self, name: str, run: Callable[[int], Any], after: Optional[Callable[[int, Any], None]] = None,
                 store: Optional[ObjectStore] = None) -> None:
        self.name, self.run, self.after, self.store = name, run, after, store
        self.samples: List[Dict[str, Any]] = []


def measure(case: Case, rnd: int, ep: Endpoint, nbytes: int, timed: bool) -> None:
    gc.collect()
    ep.reset_log()
    if case.store is not None:
        case.store.stats.clear()
    e0 = ep.cpu_s()
    s0, c0 = cpu_now()
    t0 = time.perf_counter()
    result = case.run(rnd)
    dt = time.perf_counter() - t0
    s1, c1 = cpu_now()
    e1 = ep.cpu_s()
    sample = {"seconds": dt, "cpu_self_s": s1 - s0, "cpu_children_s": c1 - c0, "endpoint_cpu_s": e1 - e0,
              "stats": dict(sorted(case.store.stats.items())) if case.store is not None else None,
              "endpoint": ep.counts()}
    if case.after is not None:
        case.after(rnd, result)
    del result
    if timed:
        case.samples.append(sample)
    log(f"  {case.name:<22} {'' if timed else '(warm-up) '}{dt:7.2f} s  {nbytes / dt / 1e9:6.3f} GB/s  "
        f"cpu {s1 - s0 + c1 - c0:6.2f} s  endpoint cpu {e1 - e0:6.2f} s {sample['endpoint']}")


def summarize(case: Case, nbytes: int) -> Dict[str, Any]:
    sec = statistics.median(s["seconds"] for s in case.samples)
    cpu = statistics.median(s["cpu_self_s"] + s["cpu_children_s"] for s in case.samples)
    last = case.samples[-1]
    return {"seconds": round(sec, 3), "GBps": round(nbytes / sec / 1e9, 4),
            "cpu_s_per_GiB": round(cpu / (nbytes / GiB), 3),
            "cpu_self_s": round(statistics.median(s["cpu_self_s"] for s in case.samples), 3),
            "cpu_children_s": round(statistics.median(s["cpu_children_s"] for s in case.samples), 3),
            "endpoint_cpu_s": round(statistics.median(s["endpoint_cpu_s"] for s in case.samples), 3),
            "seconds_all": [round(s["seconds"], 3) for s in case.samples],
            "stats": last["stats"], "endpoint": last["endpoint"]}


def interleave(cases: List[Case], reps: int, ep: Endpoint, nbytes: int) -> None:
    for rnd in range(reps + 1):  # round 0: warm-up, not reported
        order = cases[rnd % len(cases):] + cases[:rnd % len(cases)]
        if rnd % 2:
            order = order[::-1]
        log(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: {[c.name for c in order]}")
        for c in order:
            measure(c, rnd, ep, nbytes, timed=rnd > 0)


def delete_prefix(store: ObjectStore, prefix: str) -> None:
    objects, _ = store.list(prefix)
    store.delete([o.key for o in objects])


# ---------------------------------------------------------------------------------------------- tensorizer


def tz_creds(ep: Endpoint) -> Dict[str, Any]:
    return {"s3_access_key_id": KEY, "s3_secret_access_key": KEY, "s3_endpoint": ep.url, "force_http": True}


def tz_save(url: str, state: Dict[str, torch.Tensor], ep: Endpoint) -> None:
    from tensorizer import TensorSerializer, stream_io

    ser = TensorSerializer(stream_io.open_stream(url, "wb", **tz_creds(ep)))
    ser.write_state_dict(state)
    ser.close()  # closes the temp file, which uploads it (boto3 upload_file) and deletes it


def tz_load(url: str, ep: Endpoint) -> Dict[str, torch.Tensor]:
    from tensorizer import TensorDeserializer, stream_io

    stream = stream_io.open_stream(url, "rb", **tz_creds(ep))
    with TensorDeserializer(stream, device="cpu", lazy_load=False, verify_hash=False) as d:
        out = {k: d[k] for k in d.keys()}
    stream.close()
    return out


# ---------------------------------------------------------------------------------------------- raw floor


def raw_put_1stream(store: ObjectStore, key: str, views: List[memoryview], size: int) -> None:
    url = store.boto3_client().generate_presigned_url("put_object", Params={"Bucket": store.bucket, "Key": key},
                                                      ExpiresIn=3600)
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        conn.putrequest("PUT", f"{u.path}?{u.query}", skip_accept_encoding=True)
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        for v in views:
            conn.send(v)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"raw PUT {key}: HTTP {resp.status} {body[:300]!r}")
    finally:
        conn.close()


def raw_get_1stream(store: ObjectStore, key: str, dest: memoryview) -> None:
    url = store.boto3_client().generate_presigned_url("get_object", Params={"Bucket": store.bucket, "Key": key},
                                                      ExpiresIn=3600)
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        conn.request("GET", f"{u.path}?{u.query}")
        resp = conn.getresponse()
        if resp.status != 200 or int(resp.getheader("Content-Length", "-1")) != len(dest):
            raise RuntimeError(f"raw GET {key}: HTTP {resp.status} length {resp.getheader('Content-Length')}")
        got = 0
        while got < len(dest):
            n = resp.readinto(dest[got:])
            if not n:
                raise RuntimeError(f"raw GET {key}: body ended at {got} of {len(dest)} bytes")
            got += n
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------- ranks


def _rank_loads(rank: int, world: int, url: str, shapes: Dict[str, Tuple[Tuple[int, ...], str]], reps: int,
                digests: Dict[str, List[str]]) -> Dict[str, Any]:
    """Every round: barrier, load this rank's row half of every tensor in one mode, time it; modes alternate."""
    import torch.distributed as dist

    clear_store_cache()
    store, _ = ObjectStore.for_url(url)
    out: Dict[str, List[Dict[str, Any]]] = {"own": [], "scatter": []}
    for rnd in range(reps + 1):
        for mode in (("own", "scatter") if rnd % 2 == 0 else ("scatter", "own")):
            tmpl = {}
            for k, (shape, dt) in shapes.items():
                rows = shape[0] // world
                t = torch.empty(rows, *shape[1:], dtype=getattr(torch, dt))
                tmpl[k] = ShardedTensor.from_rank_offsets(k, t, (0, rank, world))
            gc.collect()
            dist.barrier()
            store.stats.clear()
            s0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            megashard.load(tmpl, url, mode=mode)
            dt = time.perf_counter() - t0
            s1 = resource.getrusage(resource.RUSAGE_SELF)
            ok = None
            if rnd == 1:  # check bit-exactness once per mode, outside the timing
                ok = all(hashlib.sha1(byte_view(tmpl[k].data)).hexdigest() == digests[k][rank] for k in tmpl)
            if rnd > 0:
                out[mode].append({"seconds": dt, "cpu_s": (s1.ru_utime + s1.ru_stime) - (s0.ru_utime + s0.ru_stime),
                                  "stats": dict(sorted(store.stats.items())), "ok": ok})
            del tmpl
            dist.barrier()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["process_cpu_s"] = ru.ru_utime + ru.ru_stime  # whole process: imports, init, all rounds
    return out


# ---------------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per group (default 3; plus one warm-up)")
    ap.add_argument("--skip-ranks", action="store_true", help="skip the 2-rank own/scatter group")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.mib < 4:
        ap.error("--reps >= 1 and --mib >= 4")
    t_start = time.perf_counter()
    ep = Endpoint()
    log(f"endpoint {ep.url} (pid {ep.proc.pid})")
    try:
        return _run(args, ep, t_start)
    finally:
        ep.stop()
        log("endpoint stopped")


def _run(args: argparse.Namespace, ep: Endpoint, t_start: float) -> Dict[str, Any]:
    set_aws_env(ep.url)
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    ep.request("PUT", f"/{bucket}")
    base = f"s3://{bucket}"
    store, _ = ObjectStore.for_url(f"{base}/x")

    state = make_state(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    views = [byte_view(t) for t in state.values()]
    segments, off = [], 0
    for v in views:
        segments.append((off, v))
        off += len(v)
    log(f"state: {len(state)} tensors, {nbytes / MiB:.1f} MiB: "
        + ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype)[6:]}" for k, v in state.items()))

    # ---- write group
    def ms_save(rnd: int) -> None:
        megashard.save(sharded(state), f"{base}/ms-save-{rnd}/iter_0000001")

    def tz_save_case(rnd: int) -> None:
        tz_save(f"{base}/tz-save-{rnd}.tensors", state, ep)

    def raw_put(rnd: int) -> None:
        store.upload(f"raw-put-{rnd}", nbytes, segments, if_none_match=False)

    def raw_put1(rnd: int) -> None:
        raw_put_1stream(store, f"raw-put1-{rnd}", views, nbytes)

    def drop(prefix: Callable[[int], str], keep_round0: bool = True) -> Callable[[int, Any], None]:
        def after(rnd: int, _: Any) -> None:
            if not (keep_round0 and rnd == 0):  # the warm-up's objects are the read group's sources
                delete_prefix(store, prefix(rnd))
        return after

    writes = [Case("megashard_save", ms_save, drop(lambda r: f"ms-save-{r}/"), store),
              Case("tensorizer_save", tz_save_case, drop(lambda r: f"tz-save-{r}.tensors")),
              Case("raw_put_client", raw_put, drop(lambda r: f"raw-put-{r}"), store),
              Case("raw_put_1stream", raw_put1, drop(lambda r: f"raw-put1-{r}", keep_round0=False), store)]
    log(f"write group ({args.reps} rounds + warm-up)")
    interleave(writes, args.reps, ep, nbytes)

    # ---- read group (sources: the warm-up round's objects)
    ms_url = f"{base}/ms-save-0/iter_0000001"
    tz_url = f"{base}/tz-save-0.tensors"
    raw_info = store.head("raw-put-0")
    assert raw_info is not None and raw_info.size == nbytes
    holder: Dict[str, Any] = {}

    def ms_load(rnd: int) -> Any:
        tmpl = holder.pop("tmpl")
        megashard.load(tmpl, ms_url, mode="own")
        return tmpl

    def ms_check(rnd: int, tmpl: Any) -> None:
        if rnd == 1:
            bad = [k for k in state if not torch.equal(tmpl[k].data.view(torch.uint8), state[k].view(torch.uint8))]
            assert not bad, f"megashard load: {bad} differ"
        holder["tmpl"] = template_like(state)  # the next round's destination, allocated outside the timing

    def tz_check(rnd: int, got: Any) -> None:
        if rnd == 1:
            bad = [k for k in state if not torch.equal(got[k].view(torch.uint8), state[k].view(torch.uint8))]
            assert not bad and len(got) == len(state), f"tensorizer load: {bad} differ"

    def raw_get(rnd: int) -> Any:
        buf = holder.pop("buf")
        store.read_into("raw-put-0", [(0, byte_view(buf))], size=nbytes, etag=raw_info.etag)
        return buf

    def raw_get1(rnd: int) -> Any:
        buf = holder.pop("buf1")
        raw_get_1stream(store, "raw-put-0", byte_view(buf))
        return buf

    def raw_check(name: str) -> Callable[[int, Any], None]:
        def after(rnd: int, buf: Any) -> None:
            if rnd == 1:
                bad = [k for k, (o, v) in zip(state, segments)
                       if not torch.equal(buf[o:o + len(v)], state[k].reshape(-1).view(torch.uint8))]
                assert not bad, f"{name}: bytes of {bad} differ"
            holder[name] = torch.empty(nbytes, dtype=torch.uint8)
        return after

    holder["tmpl"] = template_like(state)
    holder["buf"] = torch.empty(nbytes, dtype=torch.uint8)
    holder["buf1"] = torch.empty(nbytes, dtype=torch.uint8)
    reads = [Case("megashard_load_own", ms_load, ms_check, store),
             Case("tensorizer_load", lambda rnd: tz_load(tz_url, ep), tz_check),
             Case("raw_get_client", raw_get, raw_check("buf"), store),
             Case("raw_get_1stream", raw_get1, raw_check("buf1"), store)]
    log(f"read group ({args.reps} rounds + warm-up)")
    interleave(reads, args.reps, ep, nbytes)
    holder.clear()
    gc.collect()

    results = {c.name: summarize(c, nbytes) for c in writes + reads}

    # ---- 2 ranks on one node, own vs scatter
    if not args.skip_ranks:
        log("ranks group: 2 gloo ranks, one node, own vs scatter (spawning)")
        shapes = {k: (tuple(v.shape), str(v.dtype)[6:]) for k, v in state.items()}
        digests = half_digests(state, 2)
        ep.reset_log()
        e0 = ep.cpu_s()
        c0 = cpu_now()[1]
        t0 = time.perf_counter()
        per_rank = all_ok(run_ranks(_rank_loads, 2, ms_url, shapes, args.reps, digests, timeout=600,
                                    env={"MEGASHARD_NODE_ID": "bench-node0"}))
        wall = time.perf_counter() - t0
        children_cpu = cpu_now()[1] - c0
        endpoint_cpu = ep.cpu_s() - e0
        for mode in ("own", "scatter"):
            rounds = list(zip(*(r[mode] for r in per_rank)))  # per round: (rank0 sample, rank1 sample)
            secs = [max(s["seconds"] for s in rs) for rs in rounds]
            cpus = [sum(s["cpu_s"] for s in rs) for rs in rounds]
            ok = all(s["ok"] for s in rounds[0])
            sec = statistics.median(secs)
            results[f"megashard_load_2ranks_{mode}"] = {
                "seconds": round(sec, 3), "GBps": round(nbytes / sec / 1e9, 4),
                "cpu_s_per_GiB": round(statistics.median(cpus) / (nbytes / GiB), 3),
                "cpu_s_by_rank": [round(statistics.median(s["cpu_s"] for s in r[mode]), 3) for r in per_rank],
                "seconds_all": [round(s, 3) for s in secs], "bit_exact": ok,
                "stats_by_rank": [r[mode][-1]["stats"] for r in per_rank]}
            log(f"  2 ranks {mode:<8} {sec:7.2f} s  {nbytes / sec / 1e9:6.3f} GB/s  "
                f"stats {[r[mode][-1]['stats'] for r in per_rank]}  bit-exact {ok}")
        results["ranks_group_processes"] = {
            "wall_s": round(wall, 2), "children_cpu_s": round(children_cpu, 2),
            "rank_process_cpu_s": [round(r["process_cpu_s"], 2) for r in per_rank],
            "endpoint_all_rounds": ep.counts(), "endpoint_cpu_s_all_rounds": round(endpoint_cpu, 2),
            "note": "children_cpu_s (RUSAGE_CHILDREN) covers the whole spawned processes incl. torch import; "
                    "the per-mode cpu figures are each rank's RUSAGE_SELF around its load call"}

    from megashard.objstore import client as oc
    import tensorizer

    return {
        "bench": "s3", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv_or_default(args))),
        "mib": args.mib, "payload_bytes": nbytes, "reps": args.reps, "warmup_rounds": 1,
        "tensors": {k: [list(v.shape), str(v.dtype)[6:]] for k, v in state.items()},
        "config": {"MEGASHARD_S3_CONNECTIONS": oc.connections(), "MEGASHARD_S3_PART_BYTES": oc.part_bytes(nbytes),
                   "MEGASHARD_S3_GET_BYTES": oc.get_bytes_limit()},
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "tensorizer": tensorizer.__version__, "cpus": os.cpu_count(),
                 "loadavg_end": os.getloadavg()},
        "endpoint": "moto (tests/scripts/s3_server.py) on 127.0.0.1, one process",
        "results": results, "total_wall_s": round(time.perf_counter() - t_start, 1),
    }


def argv_or_default(args: argparse.Namespace) -> List[str]:
    return [f"--mib {args.mib}", f"--reps {args.reps}"] + (["--skip-ranks"] if args.skip_ranks else [])


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))

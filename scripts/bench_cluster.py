"""Load modes on the namespace cluster, bytes counted where they leave storage (issue 29, "Measured").

    sudo python scripts/bench_cluster.py [--mib 64] [--storage-mbit 40] [--node-mbit 160] [--rounds 1] \
        [--modes own,scatter,readonce,auto] [--storages fuse,s3] [--saves 1] [--save-floor 1,4,16] \
        [--code TREE] [--json out.json]
    sudo python scripts/bench_cluster.py --probe-fuse    # what weed mount fetches for partial reads

Builds ``tests/cluster.py``'s cluster (2 nodes x 2 ranks, SeaweedFS on a storage host whose link is
rate-limited with ``tc``, node links ``--node-mbit``), starts one torchrun job on it (this file with
``--worker``) and, for each storage (the shared FUSE mount ``weed mount``, then S3 through
SeaweedFS's gateway): saves a ``--mib`` checkpoint (bf16 matrices, TP=2 within a node, DP=2 over the
nodes, so every node needs the whole model) and loads it with every mode in ``--modes``, interleaved
(the order reversed every other round), every load checked bit for bit.

Before every load the caches that would serve it are dropped, only ours: each node's FUSE mount is
unmounted and mounted again with an empty chunk cache (its page cache goes with it), and the storage
host's volume files (under the run directory) get ``POSIX_FADV_DONTNEED``. The bytes that leave
storage are the ``tx`` counter of the storage host's ``eth0`` (in its network namespace: everything
that crossed the rate-limited link towards the nodes, protocol headers included as the kernel counts
them) between the start and the end of the load. The job's time is from a barrier before the load to
a barrier after it. Printed and written as JSON: per storage and mode, bytes from storage ÷ the
unique bytes the job needs (the model) and the time ÷ (unique bytes ÷ storage link rate).

Saves (``--saves`` per storage, the first one the process's first: it pays imports and clients; each
state is built before the timing): the time from a barrier before ``megashard.save`` to one after it,
the bytes that reached storage (``rx``), and, for S3, what each rank did when (the target's check,
write and commit, every PUT: start, last byte handed to the socket, answer) and the storage link's
counters every ~0.2 s. After the S3 saves, the **save floor**: every rank sends the same bytes as its
save's data objects as plain presigned PUTs (``--save-floor``: 1 stream per rank = one PUT per object,
N = a multipart upload of N equal parts on N connections), timed the same way; the JSON's table gives
the save ÷ the link rate and the best floor ÷ the save. ``--code`` runs the job on another megashard
tree (a ``git archive`` of main, for a before/after with the same instrumentation).

The job and this process meet through files in a results directory: rank 0 writes ``want-<step>``,
this process drops caches, reads the counter and writes ``go-<step>``; after the load rank 0 writes
``done-<step>`` and this process reads the counter again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent
# the job imports the megashard tree that --code names (passed on in BENCH_CLUSTER_CODE), else this one
sys.path[:0] = [str(REPO / "tests"), os.environ.get("BENCH_CLUSTER_CODE") or str(REPO)]

MODES = ("own", "scatter", "readonce", "auto")
STORAGES = ("fuse", "s3")
COLS = 4096
TENSORS = 16


# --------------------------------------------------------------------------- the job (one rank)


def _state(rank: int, tp: int, rows: int, empty: bool) -> Dict[str, Any]:
    import torch

    from megashard import ShardedTensor

    t_rank, d_rank = rank % tp, rank // tp
    part = rows // tp
    out = {}
    for i in range(TENSORS):
        if empty:
            data = torch.zeros(part, COLS, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(i)
            data = torch.randn(rows, COLS, generator=g).to(torch.bfloat16)[t_rank * part:(t_rank + 1) * part].clone()
        out[f"w{i}"] = ShardedTensor(f"w{i}", data, (rows, COLS), (t_rank * part, 0), (0, 0, d_rank))
    return out


def _rows(mib: float, tp: int) -> int:
    return max(tp, int(mib * 2**20 / TENSORS / COLS / 2) // tp * tp)


def _wait_file(path: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:.0f} s (the benchmark's host process is gone?)")
        time.sleep(0.05)


def _instrument(events: List[Dict[str, Any]]) -> None:
    """Record, in this rank, when each phase of an S3 save runs (wall clock: every node shares the
    host's clock): the target's ``check``/``write_file``/``commit``, every PUT (start, last byte
    handed to the socket, response) and every control request. Patches the classes in this process only."""
    import http.client

    from megashard.storage.s3 import checkpoint as ck
    from megashard.storage.s3 import client as cl

    sent = threading.local()
    get_response = http.client.HTTPConnection.getresponse

    def getresponse(self: Any, *args: Any, **kw: Any) -> Any:
        sent.at = time.time()
        return get_response(self, *args, **kw)

    http.client.HTTPConnection.getresponse = getresponse  # type: ignore[method-assign]
    put_views = cl.ObjectStore._put_views

    def timed_put(self: Any, kind: str, key: str, url: str, views: Any, length: int, headers: Any, **kw: Any) -> Any:
        t = time.time()
        sent.at = None
        try:
            return put_views(self, kind, key, url, views, length, headers, **kw)
        finally:
            events.append({"what": kind, "key": key.rsplit("/", 1)[-1], "bytes": length, "t0": t,
                           "sent": sent.at, "t1": time.time(), "thread": threading.get_ident()})

    cl.ObjectStore._put_views = timed_put  # type: ignore[method-assign]
    call = cl.ObjectStore._call

    def timed_call(self: Any, kind: str, key: str, *args: Any, **kw: Any) -> Any:
        t = time.time()
        try:
            return call(self, kind, key, *args, **kw)
        finally:
            events.append({"what": kind, "key": key.rsplit("/", 1)[-1], "t0": t, "t1": time.time()})

    cl.ObjectStore._call = timed_call  # type: ignore[method-assign]

    def phase(name: str, fn: Any, static: bool) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            t = time.time()
            try:
                return fn(*args, **kw)
            finally:
                events.append({"what": name, "t0": t, "t1": time.time()})
        return staticmethod(run) if static else run

    for name in ("check", "commit", "after_commit"):
        setattr(ck.ObjectSave, name, phase(name, getattr(ck.ObjectSave, name), False))
    ck.ObjectSave.write_file = phase("write_file", ck.ObjectSave.write_file, True)


def _worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import megashard

    print(f"rank {os.environ.get('RANK')}: megashard from {megashard.__file__}", flush=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    tp = int(os.environ["LOCAL_WORLD_SIZE"])
    rows = _rows(a.mib, tp)
    want = _state(rank, tp, rows, False)
    step = 0

    def meet(kind: str, info: Dict[str, Any]) -> None:
        """Rank 0 tells the host what comes next and waits for its go; every rank waits for rank 0."""
        if rank == 0:
            with open(os.path.join(a.results, f".want-{step}"), "w") as f:
                json.dump(dict(info, kind=kind), f)
            os.rename(os.path.join(a.results, f".want-{step}"), os.path.join(a.results, f"want-{step}"))
            _wait_file(os.path.join(a.results, f"go-{step}"))
        dist.barrier()

    def done(rec: Dict[str, Any]) -> None:
        with open(os.path.join(a.results, f"rank{rank}-{step}.json"), "w") as f:
            json.dump(dict(rec, rank=rank, host=os.uname().nodename), f)
        dist.barrier()
        if rank == 0:
            open(os.path.join(a.results, f"done-{step}"), "w").close()

    for storage in a.storages:
        path = os.path.join(a.shared, "bench-ckpt") if storage == "fuse" else a.s3
        if storage == "s3" and rank == 0:
            import boto3
            from urllib.parse import urlparse

            boto3.client("s3").create_bucket(Bucket=urlparse(a.s3).netloc)
        events: List[Dict[str, Any]] = []
        if storage == "s3":
            _instrument(events)
        for n in range(a.saves):  # the first save of the process, then warm ones (each replaces the last)
            state = _state(rank, tp, rows, False)  # built before the timing: not the save's work
            del events[:]
            meet("save", {"storage": storage, "save": n})
            t0, wall0 = time.perf_counter(), time.time()
            megashard.save(state, path)
            saved = time.time()
            dist.barrier()
            done({"seconds": time.perf_counter() - t0, "start": wall0, "saved": saved, "events": list(events)})
            step += 1
            del state
        if storage == "s3" and a.save_floor:
            # the same bytes as plain PUTs from the same ranks through the same link: each rank sends what its
            # save's data PUTs sent (the sizes of its objects), from one buffer of its tensors' bytes
            from urllib.parse import urlparse

            from bench_s3 import floor_put  # the plain-PUT floor bench_s3 measures, from this node
            from megashard.storage.s3.client import ObjectStore

            events = json.loads(Path(a.results, f"rank{rank}-{step - 1}.json").read_text())["events"]
            sizes = [e["bytes"] for e in events if e["what"] == "PUT" and e["key"].endswith(".tensors")]
            parts: Dict[str, int] = {}
            for e in events:
                if e["what"] == "MPU_CREATE":
                    parts[e["key"]] = 0
            sizes += [sum(e["bytes"] for e in events if e["what"] == "MPU_PART" and e["key"] == k) for k in parts]
            blob = b"".join(t.data.contiguous().view(torch.uint8).numpy().tobytes() for t in want.values())
            store = ObjectStore.for_url(a.s3)[0]
            bucket = urlparse(a.s3).netloc
            assert store.bucket == bucket
            bufs = [memoryview((blob * (-(-n // len(blob))))[:n]) for n in sizes]
            store.boto3_client()
            for streams in a.save_floor:
                meet("save_floor", {"storage": storage, "streams": streams})
                t0 = time.perf_counter()
                for j, buf in enumerate(bufs):
                    floor_put(store, f"floor/{streams}/r{rank}-{j}", buf, streams)
                dist.barrier()
                done({"seconds": time.perf_counter() - t0, "bytes": sizes})
                step += 1
        for r in range(a.rounds):
            for mode in (a.modes if r % 2 == 0 else a.modes[::-1]):
                template = _state(rank, tp, rows, True)
                meet("load", {"storage": storage, "mode": mode, "round": r})
                t0 = time.perf_counter()
                _, st = megashard.load(template, path, mode=mode, return_stats=True)
                mine = time.perf_counter() - t0
                dist.barrier()
                job = time.perf_counter() - t0
                ok = all(torch.equal(template[k].data, want[k].data) for k in want)
                done({"seconds": job, "rank_seconds": mine, "bytes_read": st.bytes_read,
                      "bytes_received": st.bytes_received, "chosen": st.mode, "bit_exact": ok,
                      "buffer_peak": st.buffer_peak})
                step += 1
    if rank == 0:
        open(os.path.join(a.results, "finished"), "w").close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the host


def _drop_storage_cache(root: Path) -> None:
    """``POSIX_FADV_DONTNEED`` on the storage host's files (SeaweedFS's volumes, all under the run directory)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _host(a: argparse.Namespace) -> int:
    import cluster

    why = cluster.missing_prerequisites()
    if why:
        print(f"bench_cluster: {why}", file=sys.stderr)
        return 2
    nodes, nproc = 2, 2
    rows = _rows(a.mib, nproc)
    unique = TENSORS * rows * COLS * 2  # every node needs the whole model: the union is the model
    floor_s = unique * 8 / (a.storage_mbit * 1e6)
    steps: List[Dict[str, Any]] = []
    t_build = time.perf_counter()
    with cluster.Cluster(nodes=nodes, storage_mbit=a.storage_mbit, node_mbit=a.node_mbit, shm_mb=256,
                         local_mb=16) as c, tempfile.TemporaryDirectory(prefix="bench-cluster-") as out:
        print(f"cluster up in {time.perf_counter() - t_build:.1f} s: storage {a.storage_mbit} Mbit/s, nodes "
              f"{a.node_mbit} Mbit/s; model {unique / 2**20:.1f} MiB, floor {floor_s:.1f} s", flush=True)
        code = str(Path(a.code).resolve()) if a.code else str(REPO)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")])),
               "MEGASHARD_HUGEPAGES": "0", "BENCH_CLUSTER_CODE": code, **c.s3_env()}
        args = ["--worker", "--mib", str(a.mib), "--rounds", str(a.rounds), "--modes", ",".join(a.modes),
                "--storages", ",".join(a.storages), "--saves", str(a.saves), "--save-floor", ",".join(map(str, a.save_floor)),
                "--shared", str(c.shared), "--s3", "s3://megashard-bench/ckpt", "--results", out]
        codes: List[Any] = []
        job = threading.Thread(target=lambda: codes.append(
            c.torchrun(str(Path(__file__).resolve()), args, nproc=nproc, env=env, name="bench", timeout=3000)))
        job.start()
        step = 0
        while True:
            want = os.path.join(out, f"want-{step}")
            while not os.path.exists(want) and job.is_alive():
                time.sleep(0.05)
            if not os.path.exists(want):
                break
            info = json.loads(Path(want).read_text())
            if info["kind"] == "load" and info["storage"] == "fuse":
                for i in range(nodes):
                    c.remount_shared(i)
            _drop_storage_cache(c.root / "storage")
            before = c.storage_link_bytes()
            series = [(time.time(), before["rx"], before["tx"])]  # the link's counters every ~0.2 s
            Path(out, f"go-{step}").touch()
            while not os.path.exists(os.path.join(out, f"done-{step}")) and job.is_alive():
                time.sleep(0.05)
                if time.time() - series[-1][0] >= 0.2:
                    now = c.storage_link_bytes()
                    series.append((time.time(), now["rx"], now["tx"]))
            if not os.path.exists(os.path.join(out, f"done-{step}")):
                break
            after = c.storage_link_bytes()
            ranks = [json.loads(Path(out, f"rank{r}-{step}.json").read_text()) for r in range(nodes * nproc)]
            rec = dict(info, tx=after["tx"] - before["tx"], rx=after["rx"] - before["rx"],
                       tx_packets=after["tx_packets"] - before["tx_packets"],
                       seconds=max(r["seconds"] for r in ranks), ranks=ranks,
                       link_series=[(round(t, 3), rx - before["rx"], tx - before["tx"]) for t, rx, tx in series])
            steps.append(rec)
            if info["kind"] == "save_floor":
                print(f"{info['storage']:4s} save floor {info['streams']:2d} stream(s) per rank {rec['seconds']:6.1f} s  "
                      f"into storage {rec['rx'] / 2**20:7.1f} MiB ({rec['rx'] * 8 / (a.storage_mbit * 1e6):.1f} s "
                      f"at the link rate)", flush=True)
            elif info["kind"] == "save":
                print(f"{info['storage']:4s} save      {rec['seconds']:6.1f} s  into storage "
                      f"{rec['rx'] / 2**20:7.1f} MiB ({rec['rx'] / unique:.3f}x; {rec['rx'] * 8 / (a.storage_mbit * 1e6):.1f} s "
                      f"at the link rate)", flush=True)
            else:
                print(f"{info['storage']:4s} {info['mode']:9s} {rec['seconds']:6.1f} s ({rec['seconds'] / floor_s:.2f}x "
                      f"floor)  from storage {rec['tx'] / 2**20:7.1f} MiB ({rec['tx'] / unique:.3f}x)  ranks read "
                      f"{sum(r['bytes_read'] for r in ranks) / 2**20:.1f} MiB  chose "
                      f"{sorted({r['chosen'] for r in ranks})}  bit-exact {all(r['bit_exact'] for r in ranks)}",
                      flush=True)
            step += 1
        job.join()
        if codes != [[0] * nodes]:
            print(f"bench_cluster: the job failed ({codes})\n{c.job_logs('bench')}", file=sys.stderr)
            return 1
    table: Dict[str, Dict[str, Any]] = {}
    link_bps = a.storage_mbit * 1e6 / 8
    for storage in a.storages:
        saves = [s for s in steps if s["kind"] == "save" and s["storage"] == storage]
        table[storage] = {"save_seconds": saves[0]["seconds"], "save_bytes_into_storage": saves[0]["rx"],
                          "save_link_seconds": saves[0]["rx"] / link_bps,
                          "save_vs_link": saves[0]["rx"] / link_bps / saves[0]["seconds"],
                          "saves_seconds": [s["seconds"] for s in saves],
                          "saves_vs_link": [s["rx"] / link_bps / s["seconds"] for s in saves]}
        if len(saves) > 1:  # the first save of a process pays its one-off costs (imports, clients)
            warm = saves[1:]
            table[storage]["warm_save_seconds_median"] = statistics.median(s["seconds"] for s in warm)
        floors = [s for s in steps if s["kind"] == "save_floor" and s["storage"] == storage]
        if floors:
            table[storage]["save_floor"] = {
                str(s["streams"]): {"seconds": s["seconds"], "bytes_into_storage": s["rx"],
                                    "vs_link": s["rx"] / link_bps / s["seconds"]} for s in floors}
            best = min(floors, key=lambda s: s["seconds"])
            table[storage]["save_floor_best"] = {"streams_per_rank": best["streams"], "seconds": best["seconds"]}
            table[storage]["save_vs_floor"] = best["seconds"] / saves[0]["seconds"]
            if len(saves) > 1:
                table[storage]["warm_save_vs_floor"] = best["seconds"] / table[storage]["warm_save_seconds_median"]
        for mode in a.modes:
            runs = [s for s in steps if s["kind"] == "load" and s["storage"] == storage and s["mode"] == mode]
            tx = statistics.median(s["tx"] for s in runs)
            secs = statistics.median(s["seconds"] for s in runs)
            table[storage][mode] = {
                "seconds_median": secs, "time_vs_floor": secs / floor_s, "bytes_from_storage_median": tx,
                "storage_bytes_vs_unique": tx / unique,
                "ranks_bytes_read": statistics.median(sum(r["bytes_read"] for r in s["ranks"]) for s in runs),
                "chosen": sorted({r["chosen"] for s in runs for r in s["ranks"]}),
                "bit_exact": all(r["bit_exact"] for s in runs for r in s["ranks"]), "rounds": len(runs)}
    result = {"unique_bytes": unique, "storage_mbit": a.storage_mbit, "node_mbit": a.node_mbit,
              "floor_seconds": floor_s, "nodes": nodes, "ranks_per_node": nproc, "layout": "TP=2 x DP=2",
              "code": code, "table": table, "steps": steps}
    print(f"\nunique bytes {unique / 2**20:.1f} MiB; floor = unique bytes / storage link = {floor_s:.1f} s")
    for storage, rows_ in table.items():
        line = (f"{storage} save {rows_['save_seconds']:.2f} s = {rows_['save_vs_link']:.2f}x the link rate "
                f"({rows_['save_link_seconds']:.2f} s for its bytes)")
        if "warm_save_seconds_median" in rows_:
            line += f"; later saves {' '.join(f'{x:.2f}' for x in rows_['saves_seconds'][1:])} s"
        if "save_floor" in rows_:
            line += (f"; plain PUTs (floor, best of {','.join(rows_['save_floor'])} streams/rank): "
                     f"{rows_['save_floor_best']['seconds']:.2f} s; save = {rows_['save_vs_floor']:.2f}x the floor")
            if "warm_save_vs_floor" in rows_:
                line += f" (later saves, median: {rows_['warm_save_vs_floor']:.2f}x)"
        print(line)
    print(f"{'storage':7s} {'mode':9s} {'from storage / unique':>22s} {'time':>8s} {'time / floor':>13s}  chose")
    for storage, rows_ in table.items():
        for mode in a.modes:
            r = rows_[mode]
            print(f"{storage:7s} {mode:9s} {r['storage_bytes_vs_unique']:22.3f} {r['seconds_median']:7.1f}s "
                  f"{r['time_vs_floor']:13.2f}  {','.join(r['chosen'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


def _probe_fuse(a: argparse.Namespace) -> int:
    """``--probe-fuse``: bytes that leave storage when nodes read parts of one 32 MiB file through
    ``weed mount`` (written there from /dev/urandom; both mounts remounted before each case), to
    tell the FUSE client's fetching apart from what megashard reads."""
    import cluster

    mib = 2**20
    cases = [("whole file, one node", [(0, 0, 32)]), ("first 8 MiB, one node", [(0, 0, 8)]),
             ("8 MiB extents alternating over 2 nodes", [(0, 0, 8), (1, 8, 8), (0, 16, 8), (1, 24, 8)]),
             ("halves: node0 0-16 MiB, node1 16-32 MiB", [(0, 0, 16), (1, 16, 16)])]
    out = []
    with cluster.Cluster(nodes=2, storage_mbit=a.storage_mbit, node_mbit=a.node_mbit, local_mb=16) as c:
        path = f"{c.shared}/probe.bin"
        c.run_in_node(0, ["sh", "-c", f"head -c {32 * mib} /dev/urandom > {path} && sync"], timeout=300)
        for name, reads in cases:
            for i in range(2):
                c.remount_shared(i)
            before = c.storage_link_bytes()["tx"]
            for node, off, n in reads:
                c.run_in_node(node, ["dd", f"if={path}", "of=/dev/null", "bs=1M", f"skip={off}", f"count={n}",
                                     "status=none"], timeout=300)
            time.sleep(1)  # fetches the client started after the read returned
            tx = c.storage_link_bytes()["tx"] - before
            read = sum(n for _, _, n in reads) * mib
            out.append({"case": name, "read": read, "from_storage": tx})
            print(f"{name:42s} read {read / mib:5.1f} MiB, storage sent {tx / mib:6.1f} MiB ({tx / read:.3f}x)",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"storage_mbit": a.storage_mbit, "cases": out}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--storage-mbit", type=int, default=40)
    ap.add_argument("--node-mbit", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--saves", type=int, default=1, help="saves per storage in the one job (the first is cold)")
    ap.add_argument("--storages", default=",".join(STORAGES), help="which storages, of fuse,s3")
    ap.add_argument("--save-floor", default="1,4,16",
                    help="after the S3 save: the same bytes as plain PUTs from every rank at these streams per rank "
                         "('' for none)")
    ap.add_argument("--code", default=None, help="the megashard tree the job imports (default: this one)")
    ap.add_argument("--probe-fuse", action="store_true", help="instead: what weed mount fetches from storage for partial reads of one file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shared", help=argparse.SUPPRESS)
    ap.add_argument("--s3", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.modes = [m for m in a.modes.split(",") if m]
    a.storages = [m for m in a.storages.split(",") if m]
    a.save_floor = [int(n) for n in a.save_floor.split(",") if n]
    if [m for m in a.storages if m not in STORAGES]:
        ap.error(f"unknown storage(s) in {a.storages}; choose from {','.join(STORAGES)}")
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    if a.worker:
        return _worker(a)
    return _probe_fuse(a) if a.probe_fuse else _host(a)


if __name__ == "__main__":
    sys.exit(main())

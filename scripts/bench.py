#!/usr/bin/env python
"""megashard vs megatron-core ``torch_dist``: save / load / reshard / scatter throughput.

Usage::

    python scripts/bench.py [--size-gib 2] [--reps 3] [--tiny-reps 5] [--workdir DIR] [--profile FILE]

Prints ONE JSON object on stdout (progress goes to stderr). Two gloo ranks on
CPU, launched like torchrun (RANK/WORLD_SIZE, MASTER_ADDR=127.0.0.1,
OMP_NUM_THREADS=1) by ``scripts/_bench_worker.py``. The operations compared with
each other run in one fresh pair of processes ("group") with their repetitions
interleaved (A B, B A, ...), so that other load on a shared machine hits both
sides of a ratio alike; each op gets a warm-up, then ``--reps`` timed
repetitions (median reported; per repetition the slower rank counts). Peak RSS
is per op (VmHWM reset before each). Loaded bytes are checked bit-for-bit.
Loads read a warm page cache (the checkpoint was just written; dropping caches
needs root; ``disk_read_bytes`` shows what came from the device). Saves include
fsync on both systems.

Groups and ops (the model is TP=2 unless noted):
  save     ms_save          megashard.save
           td_save          dist_checkpointing.save (torch_dist)
  load     td_load          dist_checkpointing.load, same layout
           ms_load_own      megashard.load mode="own", same layout
           ms_load_scatter  megashard.load mode="scatter", MEGASHARD_NODE_ID equal on both
                            ranks: rank 0 reads everything; rank 1 copies its part out of
                            the shared-memory ring (scatter_transport="auto" → "shm")
           ms_load_scatter_group  the same with scatter_transport="group" (gloo sends)
  reshard  ms_load_reshard  megashard.load into TP1·DP2 (each rank loads every full tensor)
           td_load_reshard  dist_checkpointing.load into TP1·DP2
  tiny     ms_tiny_save / td_tiny_save   a ~0.65 MB model: fixed overhead
Checkpoints are deleted at the end. ``--profile FILE`` samples every thread's
stack during the last repetition of each op (py-spy cannot attach in this VM).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _bench_worker import GROUPS, model_bytes, spec_for_size, tiny_spec  # noqa: E402

GIB = 1 << 30
GB = 1e9
WORLD = 2
TARGETS = {  # ratio name -> minimum
    "save_vs_torch_dist": 5.0,
    "own_load_vs_torch_dist_load": 2.0,
    "reshard_load_vs_torch_dist_reshard": 1.5,
    "scatter_vs_own": 0.9,
    "scatter_group_vs_own": 0.0,  # reported, no target (the fallback path)
}
TINY_SAVE_TARGET_S = 0.25


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(group: str, work: str, out_dir: str, size_bytes: float, reps: int, timeout: float,
              fsync: bool, profile: bool) -> Dict[str, List[Dict[str, Any]]]:
    """Launch the two ranks of one group, wait (kill on timeout); per op, the ranks' results."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                   PYTHONWARNINGS="ignore")
        for var in ("GROUP_RANK", "MEGASHARD_NODE_ID"):  # the worker sets the node id per op
            env.pop(var, None)
        cmd = [sys.executable, os.path.join(HERE, "_bench_worker.py"), "--group", group, "--workdir", work,
               "--out", out_dir, "--size-bytes", str(size_bytes), "--reps", str(reps)]
        if not fsync:
            cmd.append("--no-fsync")
        if profile:
            cmd.append("--profile")
        procs.append(subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = []
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"{group}-rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({"group": group, "rank": rank, "ok": False,
                            "error": "hung (killed)" if rank in hung else f"exit code {procs[rank].returncode}"})
    bad = [r for r in results if not r.get("ok")]
    if bad:
        raise RuntimeError(f"group {group} failed:\n" + "\n".join(
            f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in bad))
    per_op = {op: [r["ops"][op] for r in results] for op in GROUPS[group].ops}
    for op, res in per_op.items():
        mism = [m for r in res for m in r["mismatches"]]
        if mism:
            raise RuntimeError(f"{op}: loaded data differs from what was saved: {mism[:10]}")
    return per_op


def summarize(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per repetition the slowest rank's wall time counts; median over repetitions."""
    reps = len(results[0]["times_s"])
    per_rep = [max(r["times_s"][i] for r in results) for i in range(reps)]
    out: Dict[str, Any] = {
        "median_s": statistics.median(per_rep),
        "min_s": min(per_rep),
        "times_s": [round(t, 4) for t in per_rep],
        # CPU seconds (user+sys, all threads) per rank, median over reps: insensitive to other load
        "cpu_s": [round(statistics.median(r["cpu_s"]), 3) for r in results],
        "warmup_s": round(max(r["warmup_s"] for r in results), 4),
        "delivered_bytes": sum(r["local_bytes"] for r in results),
        # per rank: max over repetitions of the op's own peak RSS, and of that peak minus
        # the RSS just before the op (the model/template itself is in the baseline)
        "peak_rss_mib": [round(max(r["rss_peak_mib"]), 1) for r in results],
        "baseline_rss_mib": [round(min(r["rss_baseline_mib"]), 1) for r in results],
        "rss_over_baseline_mib": [round(max(p - b for p, b in zip(r["rss_peak_mib"], r["rss_baseline_mib"])), 1)
                                  for r in results],
        "read_syscall_bytes": [int(statistics.median(r["rchar_bytes"])) for r in results],
        "disk_read_bytes": [max(r["disk_read_bytes"]) for r in results],
    }
    if results[0].get("load_stats"):
        out["bytes_read_from_storage"] = [int(statistics.median(s["bytes_read"] for s in r["load_stats"]))
                                          for r in results]
        out["bytes_received"] = [int(statistics.median(s["bytes_received"] for s in r["load_stats"]))
                                 for r in results]
        out["mode"] = results[0]["load_stats"][-1]["mode"]
        out["transport"] = results[0]["load_stats"][-1].get("transport", "")
    ck = results[0].get("checkpoint_bytes")
    if ck is not None:
        out["checkpoint_bytes"] = ck
    return out


def rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / GB, 3)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="model size (GiB, ≥); default 2")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per op after a warm-up")
    ap.add_argument("--tiny-reps", type=int, default=5, help="repetitions for the tiny-model saves")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated subset of " + ",".join(GROUPS))
    ap.add_argument("--no-fsync", action="store_true", help="megashard saves without fsync (diagnostic)")
    ap.add_argument("--group-timeout", type=float, default=900.0)
    ap.add_argument("--scatter-chunk-mib", type=float, default=None,
                    help="scatter_chunk_bytes for the scatter loads (default: megashard's)")
    ap.add_argument("--markdown", default=None, metavar="FILE", help="also write the results as markdown tables")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="sample every thread's stack during the last repetition; write the breakdown to FILE")
    a = ap.parse_args(argv)
    groups = [g for g in a.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        ap.error(f"unknown groups {sorted(unknown)}")
    if {"load", "reshard"} & set(groups) and "save" not in groups:
        groups.insert(0, "save")  # the loads read the checkpoints the save group leaves behind

    if a.scatter_chunk_mib:
        os.environ["MEGASHARD_BENCH_SCATTER_CHUNK"] = str(int(a.scatter_chunk_mib * (1 << 20)))
    size_bytes = a.size_gib * GIB
    spec = spec_for_size(size_bytes)
    work = tempfile.mkdtemp(prefix="megashard-bench-", dir=a.workdir)
    out_dir = os.path.join(work, "results")
    os.makedirs(out_dir)
    log(f"model: H={spec.hidden} V={spec.vocab} L={spec.layers}, {model_bytes(spec) / GIB:.3f} GiB; work dir {work}")
    summary: Dict[str, Dict[str, Any]] = {}
    profiles: Dict[str, Any] = {}
    t_start = time.monotonic()
    try:
        for group in groups:
            log(f"group {group} ({', '.join(GROUPS[group].ops)}) ...")
            t0 = time.monotonic()
            load_before = os.getloadavg()[0]
            per_op = run_group(group, work, out_dir, size_bytes, a.tiny_reps if GROUPS[group].tiny else a.reps,
                               a.group_timeout, not a.no_fsync, bool(a.profile))
            # other processes on this machine compete for the 2 CPUs: record how busy it was
            load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            for op, res in per_op.items():
                summary[op] = summarize(res)
                summary[op]["loadavg_1min"] = load
                if a.profile:
                    profiles[op] = [r.get("profile") for r in res]
            log(f"group {group}: " + ", ".join(f"{op} {summary[op]['median_s']:.3f} s" for op in per_op)
                + f" (group wall {time.monotonic() - t0:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if a.profile:
        with open(a.profile, "w") as f:
            json.dump(profiles, f, indent=1)
        log(f"profiles written to {a.profile}")
    report = build_report(a, spec, summary, time.monotonic() - t_start)
    print(json.dumps(report, indent=2))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(report))
    return 0


ROWS = [  # (op, what, GB/s of)
    ("ms_save", "megashard save (TP2, fsync)", "checkpoint bytes"),
    ("td_save", "torch_dist save (TP2, fsync)", "checkpoint bytes"),
    ("ms_load_own", "megashard own load (TP2→TP2)", "bytes delivered"),
    ("td_load", "torch_dist load (TP2→TP2)", "bytes delivered"),
    ("ms_load_reshard", "megashard reshard load (TP2→TP1·DP2)", "bytes delivered"),
    ("td_load_reshard", "torch_dist reshard load (TP2→TP1·DP2)", "bytes delivered"),
    ("ms_load_scatter", "megashard scatter load (TP2, 1 reader, shm)", "bytes delivered"),
    ("ms_load_scatter_group", "megashard scatter load (TP2, 1 reader, gloo)", "bytes delivered"),
    ("ms_tiny_save", "megashard save, tiny model", "checkpoint bytes"),
    ("td_tiny_save", "torch_dist save, tiny model", "checkpoint bytes"),
]


def markdown(report: Dict[str, Any]) -> str:
    """The report's main numbers as markdown tables."""
    ops = report["ops"]
    lines = ["| operation | median s | GB/s | of | bytes read per rank (storage) | peak RSS MiB per rank "
             "(over pre-op RSS) | CPU s per rank |", "|---|---|---|---|---|---|---|"]
    for op, what, of in ROWS:
        if op not in ops:
            continue
        o = ops[op]
        nbytes = o["checkpoint_bytes"] if of == "checkpoint bytes" else o["delivered_bytes"]
        read = o.get("bytes_read_from_storage", o["read_syscall_bytes"] if "load" in op else None)
        read_s = "—" if read is None else " / ".join(f"{b / GB:.2f} GB" for b in read)
        if "load" in op and "bytes_read_from_storage" not in o:
            read_s += " (rchar)"
        rss = " / ".join(f"{p:.0f} (+{d:.0f})" for p, d in zip(o["peak_rss_mib"], o["rss_over_baseline_mib"]))
        cpu = " / ".join(f"{c:.2f}" for c in o["cpu_s"])
        lines.append(f"| {what} | {o['median_s']:.3f} | {nbytes / o['median_s'] / GB:.2f} | {of} ({nbytes / GB:.3f} GB)"
                     f" | {read_s} | {rss} | {cpu} |")
    lines += ["", "| ratio | value | target | met |", "|---|---|---|---|"]
    for name, r in report["ratios"].items():
        lines.append(f"| {name} | {r['value']} | {r['target']} | {'yes' if r['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def build_report(a: argparse.Namespace, spec: Any, s: Dict[str, Dict[str, Any]], wall: float) -> Dict[str, Any]:
    mb = model_bytes(spec)
    res: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
                    "platform": platform.platform(), "python": platform.python_version()},
        "setup": {"ranks": WORLD, "backend": "gloo (CPU)", "model_bytes": mb,
                  "model": {"hidden": spec.hidden, "vocab": spec.vocab, "layers": spec.layers,
                            "dtypes": "bf16 matrices, fp32 biases/layernorms"},
                  "tiny_model_bytes": model_bytes(tiny_spec()), "reps": a.reps, "interleaved": True, "tiny_reps": a.tiny_reps,
                  "page_cache": "warm (loads read a checkpoint just written)",
                  "fsync": not a.no_fsync, "bench_wall_s": round(wall, 1)},
        "ops": s,
    }
    try:
        import megatron.core
        import torch
        res["setup"]["versions"] = {"torch": torch.__version__, "megatron_core": megatron.core.__version__}
    except Exception:  # noqa: BLE001
        pass
    m: Dict[str, Any] = {}

    def have(*names: str) -> bool:
        return all(n in s for n in names)

    if have("ms_save"):
        m["megashard_save_GBps"] = rate(s["ms_save"]["checkpoint_bytes"], s["ms_save"]["median_s"])
        m["megashard_save_s"] = round(s["ms_save"]["median_s"], 3)
    if have("td_save"):
        m["torch_dist_save_GBps"] = rate(s["td_save"]["checkpoint_bytes"], s["td_save"]["median_s"])
        m["torch_dist_save_s"] = round(s["td_save"]["median_s"], 3)
    for ph, name in (("ms_load_own", "megashard_own_load"), ("ms_load_reshard", "megashard_reshard_load"),
                     ("ms_load_scatter", "megashard_scatter_load"),
                     ("ms_load_scatter_group", "megashard_scatter_group_load"), ("td_load", "torch_dist_load"),
                     ("td_load_reshard", "torch_dist_reshard_load")):
        if have(ph):
            m[name + "_GBps"] = rate(s[ph]["delivered_bytes"], s[ph]["median_s"])
            m[name + "_s"] = round(s[ph]["median_s"], 3)
    if have("ms_tiny_save"):
        m["megashard_tiny_save_s"] = round(s["ms_tiny_save"]["median_s"], 4)
    if have("td_tiny_save"):
        m["torch_dist_tiny_save_s"] = round(s["td_tiny_save"]["median_s"], 4)
    res["metrics"] = m

    ratios: Dict[str, Any] = {}

    def ratio(name: str, num: str, den: str) -> None:
        if num in m and den in m:
            r = m[num] / m[den]
            ratios[name] = {"value": round(r, 2), "target": TARGETS[name], "met": r >= TARGETS[name]}

    ratio("save_vs_torch_dist", "megashard_save_GBps", "torch_dist_save_GBps")
    ratio("own_load_vs_torch_dist_load", "megashard_own_load_GBps", "torch_dist_load_GBps")
    ratio("reshard_load_vs_torch_dist_reshard", "megashard_reshard_load_GBps", "torch_dist_reshard_load_GBps")
    ratio("scatter_vs_own", "megashard_scatter_load_GBps", "megashard_own_load_GBps")
    ratio("scatter_group_vs_own", "megashard_scatter_group_load_GBps", "megashard_own_load_GBps")
    if "megashard_tiny_save_s" in m:
        ratios["tiny_save_seconds"] = {"value": m["megashard_tiny_save_s"], "target": f"<= {TINY_SAVE_TARGET_S}",
                                       "met": m["megashard_tiny_save_s"] <= TINY_SAVE_TARGET_S,
                                       "torch_dist_s": m.get("torch_dist_tiny_save_s")}
    res["ratios"] = ratios
    return res


if __name__ == "__main__":
    sys.exit(main())

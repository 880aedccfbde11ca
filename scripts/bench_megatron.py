#!/usr/bin/env python
"""What a Megatron-LM user sees: ``save-checkpoint`` / ``load-checkpoint`` in Megatron's own timers.

Usage::

    python scripts/bench_megatron.py [--layers 8 --hidden 1024 --heads 16 --vocab 32000]
        [--tp 2 --pp 1 --vp 1 --dp 1] [--distributed-optimizer] [--swiglu]
        [--repeats 2] [--saves 2] [--formats tensors torch_dist] [--json] [--profile DIR]
    python scripts/bench_megatron.py --report RESULT.json ...   # one table from saved --json results

Runs Megatron-LM's own ``pretrain_gpt.py`` (the vendored core_v0.16.1 training tree,
through ``tests/megatron_helpers/mlm_pretrain_gpt.py``: ``megashard.megatron.install()``,
mock data, ``--transformer-impl local``, CPU, gloo) once per format and repetition:

* a *save* run: ``--train-iters S --save-interval 1 --save-format F`` (S saves, each
  timed by Megatron's ``save-checkpoint`` timer);
* a *resume* run: ``--load`` of that save (``--override-opt_param-scheduler``), timed by
  Megatron's ``load-checkpoint`` timer.

Formats are interleaved (tensors, torch_dist, torch_dist, tensors, ...) so that other
load on a shared machine hits both alike; medians over every save / resume are
reported with min–max, and separately for each run's first save (torch_dist sets up
its machinery then) and the later ones. Megatron's timers report (min, max) over ranks;
the max is used.
For ``tensors`` runs every rank also records where megashard's part went (state dict
building incl. the model's and optimizer's ``sharded_state_dict``, factories,
``megashard.save``/``load``, model / optimizer / RNG state in, tracker and barriers):
the breakdown below the table, medians of the slowest rank. ``--profile DIR`` writes a
cProfile of each rank's megashard save/load calls there. Checkpoints are deleted at the
end unless ``--keep``.

The *raw floor* beside megashard's resume: after each ``tensors`` resume, one process per
rank, started together, reads the very byte ranges that rank's load read (recorded in
``megashard.readers.read_own``) from the same files with plain ``os.preadv`` on as many
threads as megashard uses: into already-touched memory for the bytes that went into
existing tensors, into freshly allocated memory for the optimizer state megashard
allocated (``state.preallocate_optimizer_state``), as a resume must. Max over ranks, like
Megatron's timer; the allocation is inside the timing, the touched memory is not.
And beside every save run (either format, so that the disk's history stays alike), one
process per rank writes that format's checkpoint bytes per rank with plain ``os.pwrite``
and ``fsync``, as many times back to back as the run saved: the disk's floor for a first
and for a later save.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
SCRIPT = os.path.join(TESTS, "megatron_helpers", "mlm_pretrain_gpt.py")
WORKER_FLAG = "--_worker"

DIRECT = "tensors-direct"
#: Megatron-LM flags of each format's save run; ``tensors-direct``: megashard with ``--megashard-direct-io``
SAVE_FLAGS = {"tensors": ["--save-format", "tensors"], "torch_dist": ["--save-format", "torch_dist"],
              DIRECT: ["--save-format", "tensors", "--megashard-direct-io"]}

#: megashard's part of a save / load, by the function that does it (module, attribute, phase)
PHASES = [
    ("megashard.megatron.checkpointing", "save_checkpoint", "total"),
    ("megashard.megatron.checkpointing", "load_checkpoint", "total"),
    ("megashard.megatron.checkpointing", "resolve_load", "tracker + common"),
    ("megashard.megatron.checkpointing", "load_common", "tracker + common"),
    ("megashard.megatron.checkpointing", "commit_tracker", "tracker + barriers"),
    ("megashard.megatron.state", "preallocate_optimizer_state", "optimizer state allocation"),
    ("megashard.megatron.state", "build_state_dict", "state dict (sharded_state_dict)"),
    ("megashard.megatron.state", "prepare_for_save", "factories"),
    ("megashard.megatron.state", "prepare_for_load", "factories"),
    ("megashard.megatron.state", "finish_load", "factories"),
    ("megashard.api", "save", "megashard.save"),
    ("megashard.api", "load", "megashard.load"),
    ("megashard.megatron.state", "load_model_state", "model state in"),
    ("megashard.megatron.state", "load_optimizer_state", "optimizer state in"),
    ("megashard.megatron.state", "restore_rng_state", "rng"),
]


# --------------------------------------------------------------------------------------
# worker: one rank of Megatron-LM's pretrain_gpt.py, with megashard's phases timed
# --------------------------------------------------------------------------------------
def _instrument(out_dir: str, profile_dir: Optional[str]) -> None:
    import importlib

    rank = int(os.environ.get("RANK", "0"))
    events: List[Dict[str, Any]] = []  # one per top-level save/load: {"op":, phase: seconds}
    current: Dict[str, Any] = {}

    def wrap(mod: Any, attr: str, phase: str) -> None:
        fn = getattr(mod, attr, None)
        if fn is None:  # an older megashard (A/B runs against a previous commit)
            return

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            top = phase == "total"
            if top:
                current.clear()
                current["op"] = attr.split("_")[0]
                prof = None
                if profile_dir:
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                current[phase] = current.get(phase, 0.0) + dt
                if top:
                    if prof is not None:
                        prof.disable()
                        prof.dump_stats(os.path.join(profile_dir, f"{attr}-{len(events)}-rank{rank}.prof"))
                    events.append(dict(current))
                    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                        json.dump(events, f)

        setattr(mod, attr, timed)

    for modname, attr, phase in PHASES:
        wrap(importlib.import_module(modname), attr, phase)
    _record_reads(out_dir, rank)


def _record_reads(out_dir: str, rank: int) -> None:
    """Keep what each own-mode load read (file, offset, bytes) and how many bytes of fresh
    optimizer state it filled, for the raw floor (recorded before the reads, outside the
    phase timings' hot path: one list per load)."""
    from megashard import readers
    from megashard.megatron import state

    loads: List[Dict[str, Any]] = []
    fresh = [0]
    read_own, prealloc = readers.read_own, state.preallocate_optimizer_state

    @functools.wraps(prealloc)
    def preallocate(*a: Any, **k: Any) -> Any:
        got = prealloc(*a, **k)
        fresh[0] += sum(t.numel() * t.element_size() for t in got.tensors)
        return got

    @functools.wraps(read_own)
    def recorded(base: str, files: Any, ops: Any, view_ops: Any, row_jobs: Any, threads: Any) -> int:
        ranges = [(op.file, op.offset, op.nbytes) for op in ops] + [(f, o, len(mv)) for f, o, mv in view_ops]
        ranges += [(f, o, run * len(views)) for f, o, run, views in row_jobs]
        loads.append({"base": base, "ranges": ranges, "fresh_bytes": fresh[0]})
        fresh[0] = 0
        return read_own(base, files, ops, view_ops, row_jobs, threads)

    def dump() -> None:  # at exit: outside Megatron's timers
        if loads:
            with open(os.path.join(out_dir, f"reads-rank{rank}.json"), "w") as f:
                json.dump(loads, f)

    atexit.register(dump)
    state.preallocate_optimizer_state = preallocate
    readers.read_own = recorded


def _torch_adam_distopt_resumable() -> None:
    """Megatron's own torch_dist resume with DistributedOptimizer and torch's Adam (no Apex /
    TE, as on CPU) fails on a fresh optimizer (``assert len(steps) == 1``: no ``step`` yet).
    megashard.megatron handles it (``state.ensure_distributed_optimizer_state``); the same
    call is made here before megatron-core builds a load template, for both formats, so that
    torch_dist can be timed too. It costs what Megatron's ``init_state_fn`` costs on GPU.
    Both are no-ops for megashard's own path, which does the same itself."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megashard.megatron import state

    original = DistributedOptimizer.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self: Any, model_sd: Any, is_loading: bool = False, *a: Any, **k: Any) -> Any:
        if is_loading:
            state.ensure_distributed_optimizer_state(self)
        return original(self, model_sd, is_loading, *a, **k)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    # fp32 model: the main params are views of the model's; megashard copies under no_grad,
    # Megatron's torch_dist path does not ("a view of a leaf Variable ... in-place")
    DistributedOptimizer.load_state_dict = torch.no_grad()(DistributedOptimizer.load_state_dict)


def _worker(argv: List[str]) -> None:
    out_dir, profile_dir = argv[0], argv[1] or None
    sys.argv = [SCRIPT, *argv[2:]]
    # the helper's module level: stubs for optional imports, CPU patches, sys.path (its __main__ does not run)
    import megatron_helpers.mlm_pretrain_gpt  # noqa: F401
    _instrument(out_dir, profile_dir)
    _torch_adam_distopt_resumable()
    import runpy

    runpy.run_path(SCRIPT, run_name="__main__")


# --------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------
def _tree(workdir: str) -> str:
    """Megatron-LM's training tree: $MEGATRON_LM_DIR, else the vendored archive, extracted."""
    if os.environ.get("MEGATRON_LM_DIR"):
        return os.environ["MEGATRON_LM_DIR"]
    sys.path.insert(0, TESTS)
    from pathlib import Path

    from test_megatron_lm_install import ARCHIVE, _extract  # the tests' extraction (checked layout)

    path, _ = _extract(ARCHIVE, Path(workdir) / "megatron-lm")
    return path


TIMER = re.compile(r"^\s*(save-checkpoint|load-checkpoint) \.*: \(([\d.]+), ([\d.]+)\)", re.M)


def _megatron_args(a: argparse.Namespace) -> List[str]:
    sys.path.insert(0, TESTS)
    from test_megatron_lm_install import ARGS  # the tests' CPU/gloo/mock-data flags

    args = list(ARGS) + [
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
        "--vocab-size", str(a.vocab), "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
        "--micro-batch-size", "1", "--global-batch-size", str(a.dp * max(1, a.pp * 2 if a.pp > 1 else 1)),
        "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
        "--log-interval", "1000",
        # the timings do not depend on the values; a larger model at lr 1e-3 may diverge in
        # 2 steps and Megatron's NaN check would stop the run
        "--lr", "1e-5", "--no-check-for-nan-in-loss-and-grad",
    ]
    if a.vp > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(a.layers // (a.pp * a.vp))]
    if a.distributed_optimizer:
        args += ["--use-distributed-optimizer"]
    if a.swiglu:
        args += ["--swiglu"]
    return args


def _run(a: argparse.Namespace, tree: str, args: List[str], timeout: int) -> Dict[str, Any]:
    from megatron_helpers.runner import torchrun

    out_dir = tempfile.mkdtemp(prefix="phases-", dir=a.workdir)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    env = {"MEGATRON_LM_DIR": tree, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    run = torchrun(os.path.abspath(__file__), [WORKER_FLAG, out_dir, a.profile or "", *args],
                   nproc=a.tp * a.pp * a.dp, timeout=timeout, env=env)
    if run.returncode != 0:
        raise SystemExit(f"run failed ({run.returncode}): {' '.join(args)}\n{run.output[-6000:]}")
    timers = [(m.group(1), float(m.group(3)) / 1e3) for m in TIMER.finditer(run.output)]
    phases, reads = {}, {}
    for f in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, f)) as fh:
            if f.startswith("reads-rank"):
                reads[int(f[len("reads-rank"):-5])] = json.load(fh)
            else:
                phases[f[:-5]] = json.load(fh)
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"timers": timers, "phases": phases, "reads": reads, "output": run.output}


# --------------------------------------------------------------------------------------
# raw floor: the same bytes per rank, plain preadv, all ranks at once
# --------------------------------------------------------------------------------------
def _in_threads(fn: Any, args: List[Tuple[Any, ...]]) -> None:
    """``fn(*a)`` for every ``a``, the first in this thread and the others in their own."""
    import threading

    ts = [threading.Thread(target=fn, args=a) for a in args[1:]]
    for t in ts:
        t.start()
    fn(*args[0])
    for t in ts:
        t.join()


def _at_once(target: Any, per_rank: List[Tuple[Any, ...]], timeout: float) -> List[Any]:
    """One spawned process per rank, ``target(*args, barrier, out)``; what each put on ``out``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(per_rank)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for args in per_rank]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join()


def _floor_rank(load: Dict[str, Any], threads: int, barrier: Any, out: Any) -> None:
    import torch

    ranges = load["ranges"]
    total = sum(n for _, _, n in ranges)
    fresh_bytes = min(int(load["fresh_bytes"]), total)
    touched = torch.ones(total - fresh_bytes, dtype=torch.uint8)  # the model's tensors exist already
    fds = {f: os.open(os.path.join(load["base"], f), os.O_RDONLY) for f in {f for f, _, _ in ranges}}
    barrier.wait()
    t0 = time.perf_counter()
    fresh = torch.empty(fresh_bytes, dtype=torch.uint8)  # a resume's new optimizer state
    views = [memoryview(touched.numpy()), memoryview(fresh.numpy())]
    jobs: List[List[Any]] = [[] for _ in range(threads)]
    buf, pos, share, done = 0, 0, -(-total // threads), 0
    for f, off, n in ranges:  # consecutive destinations; each thread takes ~1/threads of the bytes
        while n:
            if pos == len(views[buf]):
                buf, pos = buf + 1, 0
            take = min(n, len(views[buf]) - pos)
            jobs[min(done // share, threads - 1)].append((fds[f], off, views[buf][pos:pos + take]))
            pos, off, n, done = pos + take, off + take, n - take, done + take

    def run(js: List[Any]) -> None:
        for fd, off, mv in js:
            while len(mv):
                got = os.preadv(fd, [mv], off)
                mv, off = mv[got:], off + got

    _in_threads(run, [(j,) for j in jobs])
    out.put(time.perf_counter() - t0)
    for fd in fds.values():
        os.close(fd)


def _write_floor_rank(path: str, nbytes: int, saves: int, threads: int, direct: bool, barrier: Any, out: Any) -> None:
    import mmap

    import numpy
    import torch

    if direct:  # O_DIRECT: page-aligned memory, whole 4 KiB blocks (the last one padded)
        nbytes = -(-nbytes // 4096) * 4096
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        numpy.frombuffer(m, dtype=numpy.uint8)[:] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
        data = memoryview(m)
    else:
        data = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())  # incompressible
    share = -(-nbytes // threads // 4096) * 4096
    times = []
    for i in range(saves):
        barrier.wait()  # every save starts together, as Megatron's timer (with barrier) does
        t0 = time.perf_counter()
        fd = os.open(f"{path}.{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                     | (os.O_DIRECT if direct else 0), 0o600)

        def run(lo: int, hi: int) -> None:
            while lo < hi:
                lo += os.pwrite(fd, data[lo:min(hi, lo + (64 << 20))], lo)

        _in_threads(run, [(k * share, min(nbytes, (k + 1) * share)) for k in range(threads)])
        os.fsync(fd)
        os.close(fd)
        times.append(time.perf_counter() - t0)
    for i in range(saves):
        os.unlink(f"{path}.{i}")
    out.put(times)


def raw_write_floor(workdir: str, world: int, nbytes: int, saves: int, direct: bool = False) -> List[float]:
    """Seconds per back-to-back save for ``world`` processes each writing ``nbytes`` (max over ranks)."""
    from megashard.format.fastio import default_threads

    d = tempfile.mkdtemp(prefix="floor-", dir=workdir)
    try:
        per_rank = _at_once(_write_floor_rank, [(os.path.join(d, f"rank{r}"), nbytes, saves, default_threads(), direct)
                                                for r in range(world)], 900)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return [max(ts[i] for ts in per_rank) for i in range(saves)]


def raw_floor(reads: Dict[int, List[Dict[str, Any]]]) -> Optional[float]:
    """Seconds for every rank's processes to re-read its last load's bytes (max over ranks)."""
    from megashard.format.fastio import default_read_threads

    loads = [evs[-1] for _, evs in sorted(reads.items()) if evs]
    if not loads:
        return None
    return max(_at_once(_floor_rank, [(ld, default_read_threads()) for ld in loads], 600))


def _slowest(phases: Dict[str, List[Dict[str, Any]]], op: str) -> List[Dict[str, float]]:
    """Per save/load event: each phase's time on the rank whose total was largest."""
    per_rank = {r: [e for e in evs if e.get("op") == op] for r, evs in phases.items()}
    n = min((len(v) for v in per_rank.values()), default=0)
    out = []
    for i in range(n):
        ev = max((v[i] for v in per_rank.values()), key=lambda e: e.get("total", 0.0))
        out.append({k: v for k, v in ev.items() if k != "op"})
    return out


def _stat(xs: List[float]) -> Dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def bench(a: argparse.Namespace) -> Dict[str, Any]:
    os.makedirs(a.workdir, exist_ok=True)
    tree = _tree(a.workdir)
    base = _megatron_args(a)
    saves: Dict[str, List[float]] = {f: [] for f in a.formats}
    loads: Dict[str, List[float]] = {f: [] for f in a.formats}
    first: Dict[str, List[float]] = {f: [] for f in a.formats}  # each run's first save (one-time set-up)
    save_phases: List[Dict[str, float]] = []
    load_phases: List[Dict[str, float]] = []
    sizes: Dict[str, int] = {}
    floors: List[float] = []  # raw preadv of each tensors resume's bytes (see raw_floor)
    write_floor: Dict[str, List[float]] = {"first": [], "later": []}  # raw pwrite + fsync after each save run
    read_bytes: List[int] = []
    fresh_bytes: List[int] = []
    for rep in range(a.repeats):
        order = a.formats if rep % 2 == 0 else list(reversed(a.formats))
        for fmt in order:
            root = tempfile.mkdtemp(prefix=f"ckpt-{fmt}-", dir=a.workdir)
            t0 = time.time()
            r = _run(a, tree, base + ["--train-iters", str(a.saves), "--save-interval", "1", "--save", root,
                                      *SAVE_FLAGS[fmt]], a.timeout)
            got = [t for name, t in r["timers"] if name == "save-checkpoint"]
            if len(got) != a.saves:
                raise SystemExit(f"expected {a.saves} save-checkpoint timers, got {got}\n{r['output'][-4000:]}")
            saves[fmt] += got
            first[fmt].append(got[0])
            if fmt == "tensors":
                save_phases += _slowest(r["phases"], "save")
            last = os.path.join(root, f"iter_{a.saves:07d}")
            sizes[fmt] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(last) for f in fs)
            wf = raw_write_floor(a.workdir, a.tp * a.pp * a.dp, sizes[fmt] // (a.tp * a.pp * a.dp), a.saves,
                                 direct=a.write_floor == "direct")
            write_floor["first"].append(wf[0])
            write_floor["later"] += wf[1:]
            # keep only the checkpoint that is resumed (disk)
            for it in range(1, a.saves):
                shutil.rmtree(os.path.join(root, f"iter_{it:07d}"), ignore_errors=True)
            r = _run(a, tree, base + ["--train-iters", str(a.saves), "--load", root,
                                      "--override-opt_param-scheduler"], a.timeout)
            got = [t for name, t in r["timers"] if name == "load-checkpoint"]
            if len(got) != 1:
                raise SystemExit(f"expected one load-checkpoint timer, got {got}\n{r['output'][-4000:]}")
            if fmt != "torch_dist" and "holds a megashard checkpoint: loading with megashard" not in r["output"]:
                raise SystemExit("the resume did not go through megashard")
            loads[fmt] += got
            if fmt == "tensors":
                load_phases += _slowest(r["phases"], "load")
                fl = raw_floor(r["reads"])
                if fl is not None:
                    floors.append(fl)
                    read_bytes.append(max(sum(n for _, _, n in evs[-1]["ranges"]) for evs in r["reads"].values()))
                    fresh_bytes.append(max(evs[-1]["fresh_bytes"] for evs in r["reads"].values()))
            print(f"[rep {rep}] {fmt}: save {saves[fmt][-a.saves:]} load {got[0]:.2f} s "
                  f"({time.time() - t0:.0f} s wall)", file=sys.stderr, flush=True)
            if not a.keep:
                shutil.rmtree(root, ignore_errors=True)

    def phase_stats(evs: List[Dict[str, float]]) -> Dict[str, Any]:
        keys = sorted({k for e in evs for k in e})
        return {k: _stat([e.get(k, 0.0) for e in evs]) for k in keys}

    res: Dict[str, Any] = {
        "config": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "tp", "pp", "vp", "dp",
                                              "distributed_optimizer", "swiglu", "repeats", "saves")},
        "checkpoint_bytes": sizes,
        "save_checkpoint_s": {f: _stat(v) for f, v in saves.items()},
        "save_checkpoint_first_s": {f: _stat(v) for f, v in first.items()},
        "save_checkpoint_later_s": {f: _stat([t for i, t in enumerate(v) if i % a.saves]) for f, v in saves.items()},
        "load_checkpoint_s": {f: _stat(v) for f, v in loads.items()},
        "megashard_save_phases_s": phase_stats(save_phases),
        "megashard_load_phases_s": phase_stats(load_phases),
        "load_raw_floor_s": _stat(floors),
        "save_raw_floor_s": {k: _stat(v) for k, v in write_floor.items()},
        "save_raw_floor_kind": a.write_floor,
        "load_bytes_per_rank": {"read": max(read_bytes, default=0), "fresh_optimizer_state": max(fresh_bytes, default=0)},
        "loadavg": os.getloadavg(),
    }
    for fmt in ("tensors", DIRECT):
        if fmt in a.formats and "torch_dist" in a.formats:
            res["ratio_torch_dist_over_" + fmt.replace("-", "_")] = {
                t: res[k]["torch_dist"]["median"] / res[k][fmt]["median"]
                for t, k in (("save", "save_checkpoint_s"), ("load", "load_checkpoint_s"))}
    return res


def _fmt(s: Dict[str, Any]) -> str:
    return f"{s['median']:.2f} s ({s['min']:.2f}–{s['max']:.2f}, n={s['n']})" if s else "-"


def table(res: Dict[str, Any]) -> str:
    c = res["config"]
    opt = "DistributedOptimizer" if c["distributed_optimizer"] else "Adam"
    lines = [f"GPT {c['layers']} layers, hidden {c['hidden']}, vocab {c['vocab']}, TP={c['tp']} PP={c['pp']} "
             f"VP={c['vp']} DP={c['dp']}, {opt}{', SwiGLU' if c['swiglu'] else ''}; checkpoint "
             + ", ".join(f"{f} {b / 1e9:.2f} GB" for f, b in res["checkpoint_bytes"].items()),
             "", "| Megatron timer | `--save-format tensors` | `torch_dist` | ratio |", "|---|---|---|---|"]
    for fmt in ("tensors", DIRECT):
        if fmt not in res["save_checkpoint_s"]:
            continue
        ratio = res.get("ratio_torch_dist_over_" + fmt.replace("-", "_"), {})
        for name, key, r in (("save-checkpoint", "save_checkpoint_s", "save"),
                             ("load-checkpoint", "load_checkpoint_s", "load")):
            lines.append(f"| {name}{' (' + fmt + ')' if fmt != 'tensors' else ''} | {_fmt(res[key].get(fmt, {}))} | "
                         f"{_fmt(res[key].get('torch_dist', {}))} | {ratio.get(r, float('nan')):.2f}× |")
    fl = res.get("load_raw_floor_s")
    if fl:
        b = res["load_bytes_per_rank"]
        lines += ["", f"raw floor of the resume (plain preadv of the same {b['read'] / 1e6:.0f} MB per rank, "
                      f"{b['fresh_optimizer_state'] / 1e6:.0f} MB of it into fresh memory, all ranks at once): "
                      f"{_fmt(fl)}; megashard's load-checkpoint / floor: "
                      f"{res['load_checkpoint_s']['tensors']['median'] / fl['median']:.2f}×"]
    wf = res.get("save_raw_floor_s")
    if wf and wf.get("first"):
        lines += [f"raw floor of a save (plain pwrite{' with O_DIRECT' if res.get('save_raw_floor_kind') == 'direct' else ''}"
                  f" + fsync of the same bytes per rank, all ranks at once, "
                  f"back to back after each save run): first {_fmt(wf['first'])}, later {_fmt(wf.get('later', {}))}"]
    for op in ("save", "load"):
        ph = res[f"megashard_{op}_phases_s"]
        if ph:
            lines += ["", f"megashard's part of a {op} (slowest rank, medians):"]
            for k, s in sorted(ph.items(), key=lambda kv: -kv[1]["median"]):
                lines.append(f"    {k:34s} {s['median']:7.3f} s")
    lines.append(f"\nload average during the run: {', '.join(f'{x:.1f}' for x in res['loadavg'])}")
    return "\n".join(lines)


def _label(c: Dict[str, Any]) -> str:
    lay = f"TP={c['tp']}" + (f" PP={c['pp']}" if c["pp"] > 1 else "") + (f"·VP={c['vp']}" if c["vp"] > 1 else "") \
        + (f" DP={c['dp']}" if c["dp"] > 1 else "")
    opt = "DistOpt" if c["distributed_optimizer"] else "Adam"
    return f"{c['layers']}L h{c['hidden']}, {lay}, {opt}{' SwiGLU' if c['swiglu'] else ''}"


def _later_ratio(r: Dict[str, Any]) -> str:
    later = r.get("save_checkpoint_later_s", {})
    if not later.get("tensors") or not later.get("torch_dist"):
        return "–"
    return f"{later['torch_dist']['median'] / later['tensors']['median']:.2f}×"


def report(paths: List[str]) -> str:
    """One markdown row per saved ``--json`` result: both timers, both formats, ratios."""
    rows = ["| config | GB | save-checkpoint tensors | torch_dist | ratio | ratio, later saves | "
            "load-checkpoint tensors | torch_dist | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        if "ratio_torch_dist_over_tensors" not in r:
            continue
        sv, ld, ratio = r["save_checkpoint_s"], r["load_checkpoint_s"], r["ratio_torch_dist_over_tensors"]
        rows.append(f"| {_label(r['config'])} | {r['checkpoint_bytes']['tensors'] / 1e9:.2f} | "
                    f"{sv['tensors']['median']:.2f} s | {sv['torch_dist']['median']:.2f} s | **{ratio['save']:.2f}×** | "
                    f"{_later_ratio(r)} | "
                    f"{ld['tensors']['median']:.2f} s | {ld['torch_dist']['median']:.2f} s | **{ratio['load']:.2f}×** |")
    floors = ["", "| config | first save: tensors | torch_dist | raw write floor | later saves: tensors | torch_dist | "
              "raw write floor | resume: tensors | raw read floor |", "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        wf, lf = r.get("save_raw_floor_s", {}), r.get("load_raw_floor_s", {})
        if "tensors" not in r["save_checkpoint_s"] or (not wf.get("first") and not lf):
            continue
        if r.get("save_raw_floor_kind", "buffered") != "buffered":
            wf = {}
        fs, ls = r["save_checkpoint_first_s"], r["save_checkpoint_later_s"]

        def med(x: Dict[str, Any]) -> str:
            return f"{x['median']:.2f} s" if x else "–"

        floors.append(f"| {_label(r['config'])} | {med(fs.get('tensors', {}))} | {med(fs.get('torch_dist', {}))} | "
                      f"{med(wf.get('first', {}))} | {med(ls.get('tensors', {}))} | {med(ls.get('torch_dist', {}))} | "
                      f"{med(wf.get('later', {}))} | {med(r['load_checkpoint_s'].get('tensors', {}))} | {med(lf)} |")
    direct = ["", f"| config | save-checkpoint {DIRECT} | torch_dist | ratio | first saves | later saves | "
              "O_DIRECT write floor, first / later | "
              f"load-checkpoint {DIRECT} (page cache cold) | torch_dist | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        sv, ld = r["save_checkpoint_s"], r["load_checkpoint_s"]
        if not sv.get(DIRECT) or not sv.get("torch_dist"):
            continue
        fs, ls = r["save_checkpoint_first_s"], r["save_checkpoint_later_s"]

        def rat(x: Dict[str, Any]) -> str:
            return f"{x['torch_dist']['median'] / x[DIRECT]['median']:.2f}×" if x.get(DIRECT) and x.get("torch_dist") else "–"

        wf = r.get("save_raw_floor_s", {}) if r.get("save_raw_floor_kind") == "direct" else {}
        wfs = (f"{wf['first']['median']:.2f} s / {wf['later']['median']:.2f} s" if wf.get("first") and wf.get("later")
               else "–")
        direct.append(f"| {_label(r['config'])} | {sv[DIRECT]['median']:.2f} s | {sv['torch_dist']['median']:.2f} s | "
                      f"**{rat(sv)}** | {rat(fs)} | {rat(ls)} | {wfs} | {ld[DIRECT]['median']:.2f} s | "
                      f"{ld['torch_dist']['median']:.2f} s | {rat(ld)} |")
    return "\n".join((rows if len(rows) > 2 else []) + (floors if len(floors) > 3 else [])
                     + (direct if len(direct) > 3 else []))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER_FLAG:
        _worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--formats", nargs="+", default=["tensors", "torch_dist"], choices=sorted(SAVE_FLAGS),
                   help=f"{DIRECT}: megashard saving with --megashard-direct-io (its resume then reads "
                        "from disk: O_DIRECT leaves nothing in the page cache)")
    p.add_argument("--write-floor", choices=["buffered", "direct"], default="buffered",
                   help="the raw write floor beside each save run: through the page cache, or with O_DIRECT")
    p.add_argument("--repeats", type=int, default=2, help="save+resume runs per format (interleaved)")
    p.add_argument("--saves", type=int, default=2, help="saves per save run (each one timed)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_megatron"))
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--profile", default=None, help="directory for cProfile dumps of megashard's save/load")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--json", action="store_true")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print one table from saved --json results; run nothing")
    a = p.parse_args(argv)
    if a.report:
        print(report(a.report))
        return 0
    if a.vp > 1 and a.layers % (a.pp * a.vp):
        p.error("--layers must be a multiple of PP*VP")
    res = bench(a)
    print(json.dumps(res, indent=1) if a.json else table(res))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        sys.path.insert(0, TESTS)
        sys.path.insert(0, REPO)
    sys.exit(main())

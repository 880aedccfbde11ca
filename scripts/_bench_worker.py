"""One rank of one benchmark phase (launched by ``scripts/bench.py``; not for direct use).

Every phase runs in a fresh pair of processes so that peak RSS and caches of one
phase do not leak into another. The rank reads its identity from the usual
torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs a warm-up
plus ``--reps`` timed repetitions of one operation, checks the loaded data
bit-for-bit after the timed part, and writes one JSON file with its numbers.

The model is GPT-like and built directly as megatron-core ``ShardedTensor``s
(``ShardedTensor.from_rank_offsets``): column-parallel weights split on their
first local dim, row-parallel weights on their second, TP-replicated layernorms
and row-parallel biases with ``replica_id=(0, tp_rank, dp_rank)``, a vocab-parallel
embedding and output layer, layers stacked on a prepended axis as in Megatron.
Content is deterministic: element ``[l, i, j]`` of tensor ``k`` is
``(row_k[i] + layer_k[l]) + col_k[j]`` computed in the tensor's dtype, so any
rank of any layout regenerates any slice bit-exactly in one memory pass.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

MiB = 1 << 20


# ---------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    vocab: int
    layers: int

    @property
    def ffn(self) -> int:
        return 4 * self.hidden


@dataclass(frozen=True)
class TensorDef:
    """One global tensor. ``shape`` excludes the prepended layer axis (``per_layer``)."""

    key: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    split: str  # "col": local dim 0 split over TP; "row": local dim 1; "rep": TP-replicated
    per_layer: bool


def tensor_defs(spec: ModelSpec) -> List[TensorDef]:
    h, f, v = spec.hidden, spec.ffn, spec.vocab
    bf16, fp32 = torch.bfloat16, torch.float32
    p = "decoder.layers."
    return [
        TensorDef("embedding.word_embeddings.weight", (v, h), bf16, "col", False),
        TensorDef(p + "input_layernorm.weight", (h,), fp32, "rep", True),
        TensorDef(p + "self_attention.linear_qkv.weight", (3 * h, h), bf16, "col", True),
        TensorDef(p + "self_attention.linear_qkv.bias", (3 * h,), fp32, "col", True),
        TensorDef(p + "self_attention.linear_proj.weight", (h, h), bf16, "row", True),
        TensorDef(p + "self_attention.linear_proj.bias", (h,), fp32, "rep", True),
        TensorDef(p + "pre_mlp_layernorm.weight", (h,), fp32, "rep", True),
        TensorDef(p + "mlp.linear_fc1.weight", (f, h), bf16, "col", True),
        TensorDef(p + "mlp.linear_fc1.bias", (f,), fp32, "col", True),
        TensorDef(p + "mlp.linear_fc2.weight", (h, f), bf16, "row", True),
        TensorDef(p + "mlp.linear_fc2.bias", (h,), fp32, "rep", True),
        TensorDef("decoder.final_layernorm.weight", (h,), fp32, "rep", False),
        TensorDef("output_layer.weight", (v, h), bf16, "col", False),
    ]


def model_bytes(spec: ModelSpec) -> int:
    total = 0
    for d in tensor_defs(spec):
        n = math.prod(d.shape) * (spec.layers if d.per_layer else 1)
        total += n * torch.empty((), dtype=d.dtype).element_size()
    return total


def spec_for_size(size_bytes: float) -> ModelSpec:
    """Smallest GPT-like model of at least ``size_bytes`` (H=2048, V=32768 when that fits)."""
    for hidden, vocab in ((2048, 32768), (1024, 16384), (512, 8192), (256, 4096), (64, 1024)):
        base = model_bytes(ModelSpec(hidden, vocab, 0))
        per_layer = model_bytes(ModelSpec(hidden, vocab, 1)) - base
        if base + per_layer <= size_bytes or hidden == 64:
            layers = max(1, math.ceil((size_bytes - base) / per_layer))
            return ModelSpec(hidden, vocab, layers)
    raise AssertionError("unreachable")


def tiny_spec() -> ModelSpec:
    """A ~0.65 MB model (the 'fixed overhead' case)."""
    return ModelSpec(hidden=64, vocab=1024, layers=4)


_VEC_CACHE: Dict[Tuple[str, str, int], torch.Tensor] = {}


def _vec(key: str, which: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    ck = (key, which, n)
    if ck not in _VEC_CACHE:
        g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{which}".encode()))
        _VEC_CACHE[ck] = torch.randn(n, generator=g).to(dtype)
    return _VEC_CACHE[ck]


def pattern(d: TensorDef, layer: int, n_layers: int, rows: slice, cols: Optional[slice]) -> torch.Tensor:
    """The region ``[layer][rows, cols]`` of global tensor ``d`` (bit-identical for any slicing)."""
    lv = _vec(d.key, "layer", max(1, n_layers), d.dtype)[layer]
    r = _vec(d.key, "row", d.shape[0], d.dtype)[rows] + lv
    if len(d.shape) == 1:
        return r
    c = _vec(d.key, "col", d.shape[1], d.dtype)[cols]
    return torch.add(r.unsqueeze(1), c.unsqueeze(0))


@dataclass
class Shard:
    """One local shard: enough to (re)build a megatron-core ShardedTensor around ``data``."""

    path: str
    tdef: TensorDef
    layer: int
    rows: slice
    cols: Optional[slice]
    data: torch.Tensor
    rank_offsets: Tuple[Tuple[int, int, int], ...]
    replica_id: Tuple[int, int, int]
    prepend: int


def local_shards(spec: ModelSpec, tp: int, tp_rank: int, dp_rank: int, fill: str) -> List[Shard]:
    """The shards this rank holds at TP=``tp`` (``fill``: "pattern" or "zeros")."""
    out: List[Shard] = []
    for d in tensor_defs(spec):
        layers = range(spec.layers) if d.per_layer else [0]
        for layer in layers:
            pre = 1 if d.per_layer else 0
            rows, cols = slice(0, d.shape[0]), (slice(0, d.shape[1]) if len(d.shape) == 2 else None)
            offsets: List[Tuple[int, int, int]] = [(0, layer, spec.layers)] if d.per_layer else []
            replica = (0, 0, dp_rank)
            if d.split == "col" and tp > 1:
                n = d.shape[0] // tp
                rows = slice(tp_rank * n, (tp_rank + 1) * n)
                offsets.append((pre, tp_rank, tp))
            elif d.split == "row" and tp > 1:
                n = d.shape[1] // tp
                cols = slice(tp_rank * n, (tp_rank + 1) * n)
                offsets.append((pre + 1, tp_rank, tp))
            elif d.split == "rep":
                replica = (0, tp_rank, dp_rank)
            if fill == "pattern":
                data = pattern(d, layer, spec.layers, rows, cols).contiguous()
            else:
                shape = (rows.stop - rows.start,) + ((cols.stop - cols.start,) if cols is not None else ())
                data = torch.zeros(shape, dtype=d.dtype)
            name = d.key.replace("decoder.layers.", f"decoder.layers.{layer}.") if d.per_layer else d.key
            out.append(Shard(name, d, layer, rows, cols, data, tuple(offsets), replica, pre))
    return out


def sharded_state_dict(shards: List[Shard]) -> Dict[str, Any]:
    """Fresh megatron-core ShardedTensors around the (persistent) shard data."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model = {s.path: ShardedTensor.from_rank_offsets(s.tdef.key, s.data, *s.rank_offsets,
                                                     replica_id=s.replica_id, prepend_axis_num=s.prepend)
             for s in shards}
    return {"model": model}


def mismatches(shards: List[Shard], spec: ModelSpec, loaded: Optional[Dict[str, torch.Tensor]] = None) -> List[str]:
    """Bit-exact check of every shard against the pattern (``loaded``: path -> tensor overrides)."""
    bad = []
    for s in shards:
        got = loaded[s.path] if loaded is not None else s.data
        exp = pattern(s.tdef, s.layer, spec.layers, s.rows, s.cols)
        if got.dtype != exp.dtype or got.shape != exp.shape or not torch.equal(
                got.contiguous().view(torch.uint8), exp.contiguous().view(torch.uint8)):
            bad.append(s.path)
    return bad


# ---------------------------------------------------------------------------
# measurement helpers


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_io(field: str) -> int:
    """A /proc/self/io counter: ``rchar`` = bytes passed through read()/pread()/readv()
    (page cache, pipes and sockets alike); ``read_bytes`` = bytes fetched from the block
    device (0 when the page cache is warm); -1 if unavailable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (robust to other load on the machine)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def io_counters() -> Tuple[int, int]:
    return proc_io("rchar"), proc_io("read_bytes")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    """Wall time of a collective operation, bounded by barriers on both sides."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def fresh_dir(path: str, create: bool) -> None:
    """Rank 0 removes (and optionally recreates) ``path``; everybody waits."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        if create:
            os.makedirs(path)
    dist.barrier()


def torch_dist_cpu_shim() -> None:
    """TORCH_DIST CPU SHIM: megatron-core's torch_dist save stages tensors with
    ``torch.cuda.synchronize()`` (filesystem_async.preload_tensors) and allocates its
    failure flag on ``torch.cuda.current_device()`` (state_dict_saver.py:252), both of
    which raise on CPU-only torch. These two patches are all sync save/load needs on
    CPU (shared/docs/megatron-checkpointing.md §3.4); the broader
    megashard.megatron.cpu_compat is deliberately not used, because it wraps torch
    factories and Tensor methods and would slow the baseline down."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


class StackSampler:
    """In-process wall-clock sampling profiler over all threads (py-spy cannot attach
    in this VM). Every ``interval`` s it records each thread's Python stack; a thread
    blocked in C (preadv, fsync, gloo recv, hashing) shows as the Python line that
    called into C, which is what the time breakdown needs."""

    def __init__(self, interval: float = 0.005, depth: int = 40) -> None:
        import threading

        self.interval, self.depth = interval, depth
        self.samples: Dict[str, Dict[Tuple[str, ...], int]] = {}
        self.n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.n += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                f: Any = frame
                while f is not None and len(stack) < self.depth:
                    co = f.f_code
                    stack.append(f"{os.path.basename(co.co_filename)}:{co.co_name}:{f.f_lineno}")
                    f = f.f_back
                name = names.get(ident, "?")
                name = "main" if name == "MainThread" else name.rsplit("_", 1)[0]
                per = self.samples.setdefault(name, {})
                key = tuple(reversed(stack))
                per[key] = per.get(key, 0) + 1

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 25) -> Dict[str, Any]:
        """Per thread group: leaf lines and inclusive functions, as % of wall samples."""
        out: Dict[str, Any] = {"samples": self.n, "interval_s": self.interval, "threads": {}}
        for name, per in self.samples.items():
            total = sum(per.values())
            leaf: Dict[str, int] = {}
            incl: Dict[str, int] = {}
            for stack, c in per.items():
                leaf[stack[-1]] = leaf.get(stack[-1], 0) + c
                for fn in {":".join(x.split(":")[:2]) for x in stack}:
                    incl[fn] = incl.get(fn, 0) + c
            pct = lambda d: [(k, round(100.0 * v / max(1, self.n), 1))  # noqa: E731
                             for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
            out["threads"][name] = {"thread_samples": total, "leaf_pct_of_wall": pct(leaf),
                                    "inclusive_pct_of_wall": pct(incl)}
        return out


# ---------------------------------------------------------------------------
# phases


@dataclass
class Ctx:
    phase: str
    rank: int
    world: int
    spec: ModelSpec
    ckpt: str
    reps: int
    fsync: bool
    profile: bool = False


def _layout(phase: str, rank: int, world: int) -> Tuple[int, int, int]:
    """(tp, tp_rank, dp_rank) of this phase's template: TP=world, or TP1·DP=world for reshard."""
    if phase.endswith("reshard"):
        return 1, 0, rank
    return world, rank, 0


def run_phase(ctx: Ctx) -> Dict[str, Any]:
    import megashard
    from megashard.api import LAST_LOAD_STATS

    tp, tp_rank, dp_rank = _layout(ctx.phase, ctx.rank, ctx.world)
    is_save = "save" in ctx.phase
    system = "torch_dist" if ctx.phase.startswith("td_") else "megashard"
    if system == "torch_dist":
        torch_dist_cpu_shim()
        from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: F401 - import cost before timing
    t_build = time.perf_counter()
    shards = local_shards(ctx.spec, tp, tp_rank, dp_rank, "pattern" if is_save else "zeros")
    build_s = time.perf_counter() - t_build
    local_bytes = sum(s.data.numel() * s.data.element_size() for s in shards)
    gc.collect()

    def one() -> Any:
        sd = sharded_state_dict(shards)
        if system == "megashard" and is_save:
            return megashard.save(sd, ctx.ckpt, fsync=ctx.fsync)
        if system == "megashard":
            mode = "scatter" if ctx.phase.endswith("scatter") else "own"
            megashard.load(sd, ctx.ckpt, mode=mode)
            return dict(LAST_LOAD_STATS.__dict__)
        if is_save:
            return dist_checkpointing.save(sd, ctx.ckpt)
        return dist_checkpointing.load(sd, ctx.ckpt)

    def prepare() -> None:
        if is_save:  # untimed: remove the previous repetition's checkpoint
            fresh_dir(ctx.ckpt, create=(system == "torch_dist"))

    rss_base_kib = _status_kib("VmRSS")
    peak_reset = reset_peak_rss()
    prepare()
    io0 = io_counters()
    warmup_s, _ = timed(one)
    warmup_disk = io_counters()[1] - io0[1]
    times: List[float] = []
    stats: List[Any] = []
    rchars: List[int] = []
    disk: List[int] = []
    cpu: List[float] = []
    last: Any = None
    profile: Optional[Dict[str, Any]] = None
    for i in range(ctx.reps):
        prepare()
        io0 = io_counters()
        c0 = cpu_seconds()
        if ctx.profile and i == ctx.reps - 1:  # profile only the last repetition
            with StackSampler() as sampler:
                t, last = timed(one)
            profile = sampler.report()
        else:
            t, last = timed(one)
        cpu.append(cpu_seconds() - c0)
        io1 = io_counters()
        rchars.append(io1[0] - io0[0])
        disk.append(io1[1] - io0[1])
        times.append(t)
        if system == "megashard" and not is_save:
            stats.append(last)
    rss_peak_kib = _status_kib("VmHWM")

    # correctness, after the timed part
    if is_save:
        bad: List[str] = []
    elif system == "megashard":
        bad = mismatches(shards, ctx.spec)
    else:
        loaded = last["model"]
        bad = mismatches(shards, ctx.spec, loaded)
    ckpt_bytes = dir_bytes(ctx.ckpt) if ctx.rank == 0 and os.path.isdir(ctx.ckpt) else None
    return {
        "phase": ctx.phase, "rank": ctx.rank, "world": ctx.world, "system": system,
        "tp": tp, "dp": ctx.world // tp, "build_s": build_s,
        "local_bytes": local_bytes, "n_shards": len(shards),
        "warmup_s": warmup_s, "times_s": times, "cpu_s": cpu, "median_s": statistics.median(times),
        "load_stats": stats, "rchar_bytes": rchars,
        "disk_read_bytes": disk, "warmup_disk_read_bytes": warmup_disk,
        "rss_baseline_mib": rss_base_kib / 1024, "rss_peak_mib": rss_peak_kib / 1024,
        "peak_is_phase_only": peak_reset,
        "checkpoint_bytes": ckpt_bytes, "mismatches": bad,
        "node_id": os.environ.get("MEGASHARD_NODE_ID"), "profile": profile,
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--phase", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True, help="directory for the per-rank JSON result")
    ap.add_argument("--size-bytes", type=float, default=0, help="model size; 0 = the tiny model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-fsync", action="store_true")
    ap.add_argument("--profile", action="store_true", help="sample stacks during the last repetition")
    a = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    spec = spec_for_size(a.size_bytes) if a.size_bytes > 0 else tiny_spec()
    ctx = Ctx(a.phase, rank, world, spec, a.ckpt, a.reps, not a.no_fsync, a.profile)
    try:
        res = run_phase(ctx)
        res["spec"] = {"hidden": spec.hidden, "vocab": spec.vocab, "layers": spec.layers,
                       "model_bytes": model_bytes(spec)}
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator
        import traceback

        res = {"phase": a.phase, "rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}
    with open(os.path.join(a.out, f"{a.phase}-rank{rank}.json"), "w") as f:
        json.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0 if res.get("ok") else 1


if __name__ == "__main__":  # required: torch_dist's save starts a spawn-context Manager
    sys.exit(main())

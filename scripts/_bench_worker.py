"""One rank of one benchmark group (launched by ``scripts/bench.py``; not for direct use).

A group is a set of operations that are compared with each other (megashard save
vs torch_dist save, ...). Each group runs in a fresh pair of processes; inside it
the operations' repetitions are interleaved (A B, B A, A B, ...) so that load
from other processes on a shared machine hits every side of a comparison alike.
The rank reads its identity from the usual torchrun variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), warms every op up once, runs ``--reps`` rounds, checks
loaded data bit-for-bit after the last round (untimed) and writes one JSON file.
Peak RSS is per operation: VmHWM is reset (``/proc/self/clear_refs``) before each.

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
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


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


def release_free_memory() -> None:
    """glibc ``malloc_trim(0)``: hand freed heap memory back to the OS, so that the next
    op's RSS baseline is its live memory and its temporaries show in its own peak
    (as in a fresh process) instead of reusing pages an earlier op left behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
# operations and groups


@dataclass(frozen=True)
class Op:
    """One measured operation."""

    name: str
    system: str  # "megashard" | "torch_dist"
    save: bool
    ckpt: str  # checkpoint directory name under the work dir
    mode: str = ""  # megashard load mode
    transport: str = ""  # megashard scatter transport ("" = the default, auto)


OPS: Dict[str, Op] = {o.name: o for o in [
    Op("ms_save", "megashard", True, "ms_ckpt"),
    Op("td_save", "torch_dist", True, "td_ckpt"),
    Op("td_load", "torch_dist", False, "td_ckpt"),
    Op("ms_load_own", "megashard", False, "ms_ckpt", "own"),
    Op("ms_load_scatter", "megashard", False, "ms_ckpt", "scatter"),
    Op("ms_load_scatter_group", "megashard", False, "ms_ckpt", "scatter", "group"),
    Op("ms_load_reshard", "megashard", False, "ms_ckpt", "own"),
    Op("td_load_reshard", "torch_dist", False, "td_ckpt"),
    Op("ms_tiny_save", "megashard", True, "ms_tiny"),
    Op("td_tiny_save", "torch_dist", True, "td_tiny"),
]}


@dataclass(frozen=True)
class Group:
    """Operations compared in one pair of processes, repetitions interleaved."""

    ops: Tuple[str, ...]
    reshard: bool = False  # template TP1·DP=world instead of TP=world
    tiny: bool = False


GROUPS: Dict[str, Group] = {
    "save": Group(("ms_save", "td_save")),
    "load": Group(("td_load", "ms_load_own", "ms_load_scatter", "ms_load_scatter_group")),
    "reshard": Group(("ms_load_reshard", "td_load_reshard"), reshard=True),
    "tiny": Group(("ms_tiny_save", "td_tiny_save"), tiny=True),
}
SCATTER_NODE_ID = "bench-node"  # both ranks on one "node": rank 0 reads for both


@dataclass
class Ctx:
    group: str
    rank: int
    world: int
    spec: ModelSpec
    workdir: str
    reps: int
    fsync: bool
    profile: bool = False


@dataclass
class OpRecord:
    """What one rank measured for one operation over its repetitions."""

    times_s: List[float] = field(default_factory=list)
    cpu_s: List[float] = field(default_factory=list)
    rchar_bytes: List[int] = field(default_factory=list)
    disk_read_bytes: List[int] = field(default_factory=list)
    rss_baseline_mib: List[float] = field(default_factory=list)
    rss_peak_mib: List[float] = field(default_factory=list)
    load_stats: List[Dict[str, Any]] = field(default_factory=list)
    warmup_s: float = 0.0
    mismatches: List[str] = field(default_factory=list)
    profile: Optional[Dict[str, Any]] = None


def run_group(ctx: Ctx) -> Dict[str, Any]:
    """Warm up every op once, then ``reps`` rounds (order alternating) of every op.

    Between ops (untimed): save targets are removed, load templates re-zeroed, the
    peak-RSS counter reset; so each op's peak RSS is its own although the ops share
    a process. Loads are checked bit-for-bit after their last repetition.
    """
    import megashard

    torch_dist_cpu_shim()  # only affects torch.cuda.*, which megashard does not call on gloo
    from megatron.core import dist_checkpointing

    group = GROUPS[ctx.group]
    tp, tp_rank, dp_rank = (1, 0, ctx.rank) if group.reshard else (ctx.world, ctx.rank, 0)
    ops = [OPS[n] for n in group.ops]
    saving = ops[0].save
    t_build = time.perf_counter()
    shards = local_shards(ctx.spec, tp, tp_rank, dp_rank, "pattern" if saving else "zeros")
    build_s = time.perf_counter() - t_build
    local_bytes = sum(s.data.numel() * s.data.element_size() for s in shards)
    gc.collect()
    peak_reset_works = reset_peak_rss()
    records = {o.name: OpRecord() for o in ops}

    def prepare(op: Op) -> None:
        path = os.path.join(ctx.workdir, op.ckpt)
        if op.save:
            fresh_dir(path, create=(op.system == "torch_dist"))  # torch_dist wants an existing dir
        else:
            for s in shards:
                s.data.zero_()
        if op.mode == "scatter":
            os.environ["MEGASHARD_NODE_ID"] = SCATTER_NODE_ID
        else:
            os.environ.pop("MEGASHARD_NODE_ID", None)
        gc.collect()
        release_free_memory()
        dist.barrier()

    def execute(op: Op) -> Any:
        sd = sharded_state_dict(shards)
        path = os.path.join(ctx.workdir, op.ckpt)
        if op.system == "megashard" and op.save:
            return megashard.save(sd, path, fsync=ctx.fsync)
        if op.system == "megashard":
            kw: Dict[str, Any] = {"scatter_transport": op.transport} if op.transport else {}
            if os.environ.get("MEGASHARD_BENCH_SCATTER_CHUNK"):  # scripts/bench.py --scatter-chunk-mib
                kw["scatter_chunk_bytes"] = int(os.environ["MEGASHARD_BENCH_SCATTER_CHUNK"])
            _, stats = megashard.load(sd, path, mode=op.mode, return_stats=True, **kw)
            return dict(stats.__dict__)
        if op.save:
            return dist_checkpointing.save(sd, path)
        return dist_checkpointing.load(sd, path)

    for op in ops:  # warm-up
        prepare(op)
        records[op.name].warmup_s, _ = timed(lambda: execute(op))
    for i in range(ctx.reps):
        for op in (ops if i % 2 == 0 else ops[::-1]):
            rec = records[op.name]
            prepare(op)
            rec.rss_baseline_mib.append(_status_kib("VmRSS") / 1024)
            reset_peak_rss()
            io0, c0 = io_counters(), cpu_seconds()
            if ctx.profile and i == ctx.reps - 1:  # sample the last repetition only
                with StackSampler() as sampler:
                    t, out = timed(lambda: execute(op))
                rec.profile = sampler.report()
            else:
                t, out = timed(lambda: execute(op))
            rec.cpu_s.append(cpu_seconds() - c0)
            io1 = io_counters()
            rec.rss_peak_mib.append(_status_kib("VmHWM") / 1024)
            rec.times_s.append(t)
            rec.rchar_bytes.append(io1[0] - io0[0])
            rec.disk_read_bytes.append(io1[1] - io0[1])
            if op.system == "megashard" and not op.save:
                rec.load_stats.append(out)
            if i == ctx.reps - 1 and not op.save:  # correctness, untimed
                rec.mismatches = mismatches(shards, ctx.spec, out["model"] if op.system == "torch_dist" else None)
            del out
    os.environ.pop("MEGASHARD_NODE_ID", None)

    result: Dict[str, Any] = {}
    for op in ops:
        rec = records[op.name]
        path = os.path.join(ctx.workdir, op.ckpt)
        result[op.name] = dict(
            rec.__dict__, op=op.name, system=op.system, rank=ctx.rank, world=ctx.world, tp=tp,
            dp=ctx.world // tp, build_s=build_s, local_bytes=local_bytes, n_shards=len(shards),
            peak_is_op_only=peak_reset_works,
            checkpoint_bytes=dir_bytes(path) if ctx.rank == 0 and os.path.isdir(path) else None)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--group", required=True, choices=sorted(GROUPS))
    ap.add_argument("--workdir", required=True, help="checkpoints go here")
    ap.add_argument("--out", required=True, help="directory for the per-rank JSON result")
    ap.add_argument("--size-bytes", type=float, required=True, help="model size (ignored for the tiny group)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-fsync", action="store_true", help="megashard saves without fsync (diagnostic)")
    ap.add_argument("--profile", action="store_true", help="sample stacks during the last repetition")
    a = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    spec = tiny_spec() if GROUPS[a.group].tiny else spec_for_size(a.size_bytes)
    ctx = Ctx(a.group, rank, world, spec, a.workdir, a.reps, not a.no_fsync, a.profile)
    try:
        res: Dict[str, Any] = {"group": a.group, "rank": rank, "ok": True, "ops": run_group(ctx),
                               "spec": {"hidden": spec.hidden, "vocab": spec.vocab, "layers": spec.layers,
                                        "model_bytes": model_bytes(spec)}}
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator
        import traceback

        res = {"group": a.group, "rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}
    with open(os.path.join(a.out, f"{a.group}-rank{rank}.json"), "w") as f:
        json.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0 if res.get("ok") else 1


if __name__ == "__main__":  # required: torch_dist's save starts a spawn-context Manager
    sys.exit(main())

"""``save`` and ``load``: orchestration of planning, file I/O, transport and commit.

Save (collective, a fixed number of collectives, none per tensor):
  1. every rank flattens its state dict and announces its shards (one all-gather);
  2. every rank computes the same writer plan (replicas deduplicated and balanced);
  3. every rank writes its files into a shared temporary directory and fsyncs them;
  4. results are gathered; rank 0 writes ``manifest.json`` and commits by rename;
  5. the outcome is agreed, so a failure anywhere raises on every rank.

Load (collective): ``own`` mode reads exactly the byte ranges each rank needs;
``scatter`` mode has one reader per node read every needed byte once and stream it
to the node's ranks in bounded chunks. ``auto`` picks ``own`` when every rank can
see the checkpoint, ``scatter`` otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import time
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import async_save as async_save_mod, jsonstate, plan, storage
from .errors import CheckpointError, StateDictError
from .format import empty_buffer, write_file
from .format.fastio import IOV_MAX, default_read_threads, preadv_all, read_requests, run_parallel, tensor_memoryview
from .manifest import Manifest, ShardRecord, TensorRecord, dtype_from_name, dtype_name, itemsize
from .plan import Box, ShardId
from .sharded import ShardedTensor, is_main_replica, looks_like_sharded_object, looks_like_sharded_tensor
from .scatter import TRANSPORTS as SCATTER_TRANSPORTS, scatter
from .transport import Comm, node_readers

log = logging.getLogger(__name__)

MODEL_CHUNK_PREFIX = "model"
REST_STEM = "__rest__"
BYTES_IN_FILE_THRESHOLD = 64 * 1024  # larger bytes values go into .tensors files, not JSON
DEFAULT_SCATTER_CHUNK = 8 << 20  # bytes per ring slot / staging buffer of a scatter load (4 slots fit a 64 MB /dev/shm)


def _rank_prefix(comm: Comm) -> str:
    return f"[rank {comm.rank}] "


# ---------------------------------------------------------------------------
# save


@dataclass
class _LocalTensor:
    name: str
    tensor: torch.Tensor
    stem: str
    ref: Dict[str, Any]  # JSON ref dict patched with file/offsets after writing


@dataclass
class _SaveState:
    rank: int
    shards: List[Tuple[str, ShardedTensor, str]] = field(default_factory=list)  # (path, shard, stem)
    objects: List[Tuple[str, Any, str]] = field(default_factory=list)  # (path, sharded object, stem)
    local: List[_LocalTensor] = field(default_factory=list)
    obj_local: Dict[str, List[_LocalTensor]] = field(default_factory=dict)


def _stem_for(path: str, file_stems: Optional[Mapping[str, str]]) -> str:
    top = path.split(".", 1)[0].split("[", 1)[0]
    if file_stems and top in file_stems:
        return file_stems[top]
    if top.startswith(MODEL_CHUNK_PREFIX) and (top == MODEL_CHUNK_PREFIX or top[len(MODEL_CHUNK_PREFIX):].isdigit()):
        return top
    return (file_stems or {}).get(REST_STEM, "state")


def _shard_name(sh: ShardedTensor) -> str:
    if sh.chunk_shape == sh.global_shape and sh.flattened_range is None:
        return sh.key
    name = f"{sh.key}/shard_{'.'.join(map(str, sh.global_offset))}_{'.'.join(map(str, sh.chunk_shape))}"
    if sh.flat_range is not None:
        name += f"_flat{sh.flat_range[0]}-{sh.flat_range[1]}"
    return name


def _object_unique_key(obj: Any) -> str:
    uk = getattr(obj, "unique_key", None)
    if isinstance(uk, str):
        return uk
    return f"{obj.key}/shard_{'.'.join(map(str, obj.global_offset))}_{'.'.join(map(str, obj.global_shape))}"


def _tensor_ref(t: torch.Tensor) -> Dict[str, Any]:
    return {"kind": "tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def _reject_unapplied(path: str, value: Any) -> None:
    name = type(value).__name__
    if name in ("ShardedTensorFactory", "LocalNonpersistentObject"):
        raise StateDictError(
            f"cannot save {path!r}: {name} must be resolved before megashard.save "
            "(apply megatron-core's apply_factories / drop non-persistent objects; megashard.megatron does this)"
        )


def _make_save_hook(st: _SaveState, file_stems: Optional[Mapping[str, str]]) -> Callable[[str, Any], Any]:
    def hook(path: str, value: Any) -> Any:
        _reject_unapplied(path, value)
        if looks_like_sharded_tensor(value):
            sh = ShardedTensor.from_any(value)
            if sh.data is None:
                raise StateDictError(f"cannot save {path!r}: ShardedTensor {sh.key!r} has no data")
            st.shards.append((path, sh, _stem_for(path, file_stems)))
            return {"kind": "sharded", "key": sh.key}
        if looks_like_sharded_object(value):
            st.objects.append((path, value, _stem_for(path, file_stems)))
            return {"kind": "object", "key": _object_unique_key(value)}
        if isinstance(value, torch.Tensor):
            ref = _tensor_ref(value)
            st.local.append(_LocalTensor(f"__rank{st.rank}__/{path}", value, _stem_for(path, file_stems), ref))
            return ref
        if isinstance(value, (bytes, bytearray)) and len(value) > BYTES_IN_FILE_THRESHOLD:
            t = torch.frombuffer(bytearray(value), dtype=torch.uint8)
            ref = _tensor_ref(t)
            ref["kind"] = "bytes"
            st.local.append(_LocalTensor(f"__rank{st.rank}__/{path}", t, _stem_for(path, file_stems), ref))
            return ref
        return jsonstate.UNHANDLED

    return hook


def _encode_object_value(st: _SaveState, ukey: str, value: Any, stem: str) -> Any:
    items: List[_LocalTensor] = st.obj_local.setdefault(ukey, [])

    def hook(path: str, v: Any) -> Any:
        _reject_unapplied(path, v)
        if isinstance(v, torch.Tensor) or (isinstance(v, (bytes, bytearray)) and len(v) > BYTES_IN_FILE_THRESHOLD):
            t = v if isinstance(v, torch.Tensor) else torch.frombuffer(bytearray(v), dtype=torch.uint8)
            ref = _tensor_ref(t)
            if not isinstance(v, torch.Tensor):
                ref["kind"] = "bytes"
            items.append(_LocalTensor(f"__object__/{ukey}/{len(items)}", t, stem, ref))
            return ref
        return jsonstate.UNHANDLED

    return jsonstate.encode(value, path=ukey, hook=hook)


def _shard_meta(sh: ShardedTensor) -> List[Any]:
    flat = list(sh.flat_range) if sh.flat_range is not None else None
    n = sh.data.numel() if sh.data is not None else 0
    return [sh.key, dtype_name(sh.dtype), list(sh.global_shape), list(sh.global_offset), list(sh.chunk_shape),
            flat, bool(is_main_replica(sh.replica_id)), n * itemsize(sh.dtype)]


def _validate_and_assign(all_meta: List[Dict[str, Any]]) -> Tuple[Dict[ShardId, int], Dict[str, int], Dict[str, Tuple[str, List[int]]]]:
    """Pure: consistency checks + writer plan, identical on every rank."""
    problems: List[str] = []
    info: Dict[str, Tuple[str, List[int]]] = {}
    holders: Dict[ShardId, List[int]] = {}
    nbytes: Dict[ShardId, int] = {}
    preferred: Dict[ShardId, int] = {}
    for rank, meta in enumerate(all_meta):
        for key, dt, gshape, off, cshape, flat, main, nb in meta["shards"]:
            if key in info and info[key] != (dt, gshape):
                problems.append(
                    f"tensor {key!r}: rank {rank} has dtype {dt} global shape {tuple(gshape)}, another rank has "
                    f"{info[key][0]} {tuple(info[key][1])}"
                )
                continue
            info[key] = (dt, gshape)
            sid = ShardId(key, tuple(off), tuple(cshape), tuple(flat) if flat else None)
            holders.setdefault(sid, []).append(rank)
            nbytes[sid] = nb
            if main:
                preferred.setdefault(sid, rank)
    by_key: Dict[str, List[Tuple[Box, Optional[Tuple[int, int]]]]] = {}
    for sid in holders:
        by_key.setdefault(sid.key, []).append((Box(sid.offset, sid.shape), sid.flat))
    for key, pieces in by_key.items():
        problems += plan.coverage_problems(key, tuple(info[key][1]), pieces)
    obj_writer: Dict[str, int] = {}
    for rank, meta in enumerate(all_meta):
        for ukey, main in meta["objects"]:
            if main and ukey in obj_writer and obj_writer[ukey] >= 0:
                problems.append(f"object {ukey!r}: main replica on ranks {obj_writer[ukey]} and {rank}")
            elif main:
                obj_writer[ukey] = rank
            else:
                obj_writer.setdefault(ukey, -1 - rank)
    obj_writer = {k: (v if v >= 0 else -1 - v) for k, v in obj_writer.items()}
    if problems:
        head = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise StateDictError(f"sharded state dict is inconsistent across ranks:\n  {head}{more}")
    return plan.assign_writers(holders, nbytes, preferred), obj_writer, info


@dataclass
class _WriteJob:
    """What this rank writes, selected on the calling thread; tensors may be replaced by snapshots."""

    groups: Dict[str, Dict[str, torch.Tensor]]  # stem -> {name in file: tensor}
    shard_records: List[Tuple[str, str, Dict[str, Any]]]  # (stem, name, record without file offsets)
    zero_records: List[Dict[str, Any]]
    objects: Dict[str, Any]
    local_refs: List[Tuple[str, str, Dict[str, Any]]]  # (stem, name, JSON ref to patch)
    tree: Any

    def tensors(self) -> List[Tuple[str, str]]:
        return [(stem, name) for stem, ts in sorted(self.groups.items()) for name in ts]


def _select(st: _SaveState, writers: Mapping[ShardId, int], obj_writer: Mapping[str, int], rank: int) -> _WriteJob:
    """Everything this rank writes (its assigned shards, objects and local tensors)."""
    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    shard_records: List[Tuple[str, str, Dict[str, Any]]] = []
    zero_records: List[Dict[str, Any]] = []
    for _path, sh, stem in st.shards:
        sid = ShardId(sh.key, tuple(sh.global_offset), tuple(sh.chunk_shape), sh.flat_range)
        if writers.get(sid) != rank:
            continue
        name = _shard_name(sh)
        if sh.data.numel() == 0:
            zero_records.append(_shard_record_json(sh, None, name, 0, 0, 0))
            continue
        if groups.setdefault(stem, {}).setdefault(name, sh.data) is not sh.data:
            continue  # the same shard listed twice on this rank (tied weights)
        shard_records.append((stem, name, _shard_record_json(sh, None, name, 0, 0, 0)))
    objects: Dict[str, Any] = {}
    for _path, obj, stem in st.objects:
        ukey = _object_unique_key(obj)
        if obj_writer.get(ukey) != rank or ukey in objects:
            continue
        objects[ukey] = {"key": obj.key, "offset": list(obj.global_offset), "shape": list(obj.global_shape),
                         "value": _encode_object_value(st, ukey, obj.data, stem)}
    local_refs: List[Tuple[str, str, Dict[str, Any]]] = []
    for lt in st.local + [lt for items in st.obj_local.values() for lt in items]:
        if lt.tensor.numel() == 0:
            lt.ref.update(file=None, name=lt.name, data_offset=0, nbytes=0, crc32=0)
        else:
            groups.setdefault(lt.stem, {})[lt.name] = lt.tensor
            local_refs.append((lt.stem, lt.name, lt.ref))
    return _WriteJob(groups, shard_records, zero_records, objects, local_refs, st.tree)  # type: ignore[attr-defined]


def _write_job(job: _WriteJob, temp_dir: str, rank: int, align: int, fsync: bool,
               threads: Optional[int]) -> Dict[str, Any]:
    """Write this rank's files into ``temp_dir``; the records the manifest needs."""
    os.makedirs(temp_dir, exist_ok=True)
    files: Dict[str, Dict[str, Any]] = {}
    placed: Dict[Tuple[str, str], Any] = {}
    for stem, tensors in sorted(job.groups.items()):
        fname = f"{stem}-r{rank:05d}.tensors"
        infos = write_file(tensors, os.path.join(temp_dir, fname), align=align, fsync=fsync, threads=threads)
        size = os.path.getsize(os.path.join(temp_dir, fname))
        files[fname] = {"rank": rank, "bytes": size, "tensors": len(infos)}
        for inf in infos:
            placed[(stem, inf.name)] = (fname, inf)
    records = list(job.zero_records)
    for stem, name, rec in job.shard_records:
        fname, inf = placed[(stem, name)]
        records.append(dict(rec, file=fname, header_offset=inf.header_offset, data_offset=inf.data_offset,
                            crc32=inf.crc32))
    for stem, name, ref in job.local_refs:
        fname, inf = placed[(stem, name)]
        ref.update(file=fname, name=name, data_offset=inf.data_offset, nbytes=inf.nbytes, crc32=inf.crc32)
    return {"files": files, "shards": records, "objects": job.objects, "tree": job.tree}


def _finish_save(comm: Comm, err: Optional[str], result: Any, *, all_meta: List[Dict[str, Any]], temp_dir: str,
                 final_dir: str, layout: Optional[Mapping[str, Any]], t0: float, fsync: bool,
                 is_async: bool = False) -> None:
    """Agree on every rank's write, commit on rank 0 (manifest, rename), agree on the commit."""
    results = comm.agree(err, "save", result)  # gathers every rank's records

    def commit() -> None:
        if comm.rank != 0:
            return
        manifest = _build_manifest(results, all_meta, comm.world_size, layout)
        text = manifest.to_json()
        storage.write_file_atomic(os.path.join(temp_dir, storage.MANIFEST_DIGEST_NAME), storage.manifest_digest(text))
        storage.write_file_atomic(os.path.join(temp_dir, storage.MANIFEST_NAME), text)
        storage.commit_dir(temp_dir, final_dir)
        try:  # leftovers of saves that crashed long ago (never a save in progress: age check)
            storage.cleanup_stale_temps(os.path.dirname(final_dir), os.path.basename(final_dir))
        except OSError as e:
            log.warning("%scould not remove stale temporary directories: %s", _rank_prefix(comm), e)

    _, err = comm.run("save/commit", commit)
    comm.agree(err, "save")  # everybody learns the outcome
    total = sum(f["bytes"] for r in results for f in r["files"].values())
    _log_summary(comm, "saved", final_dir, total, time.perf_counter() - t0,
                 f"{'async, ' if is_async else ''}{len(all_meta)} rank(s), fsync={fsync}")


def save(
    state_dict: Mapping[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: Any = None,
    file_stems: Optional[Mapping[str, str]] = None,
    layout: Optional[Mapping[str, Any]] = None,
    align: int = 4096,
    fsync: bool = True,
    threads: Optional[int] = None,
    timeout: Optional[float] = None,
    async_save: bool = False,
) -> Optional["async_save_mod.AsyncSaveHandle"]:
    """Save a (sharded) state dict to ``checkpoint_dir``; collective over ``process_group``.

    Leaves: ``ShardedTensor`` (megashard's or megatron-core's), ``ShardedObject``,
    plain tensors (rank-local), JSON-representable values and bytes. The directory
    appears atomically once every rank's files are durable. ``timeout`` (s) bounds
    every collective; default: the process group's.

    ``async_save=True`` returns an :class:`~megashard.async_save.AsyncSaveHandle` as
    soon as every rank holds a snapshot of its tensors (the caller may change them at
    once); files are written in the background and the checkpoint is committed by the
    collective ``handle.result()``. A save started while another is in flight first
    finalizes that one, raising its error if it failed (see :mod:`megashard.async_save`).
    """
    previous = async_save_mod.in_flight()
    if previous is not None:
        previous.result()  # at most one save in flight (collective, like this save)
    comm = Comm(process_group, timeout)
    final_dir = os.path.abspath(os.fspath(checkpoint_dir))
    t0 = time.perf_counter()
    st = _SaveState(comm.rank)

    def prepare() -> Dict[str, Any]:
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        tree = jsonstate.encode(dict(state_dict), hook=_make_save_hook(st, file_stems))
        st.tree = tree  # type: ignore[attr-defined]
        return {
            "shards": [_shard_meta(sh) for _, sh, _ in st.shards],
            "objects": [[_object_unique_key(o), bool(is_main_replica(o.replica_id))] for _, o, _ in st.objects],
            "token": secrets.token_hex(6) if comm.rank == 0 else None,
        }

    meta, err = comm.run("save/prepare", prepare)
    all_meta = comm.agree(err, "save", meta)  # collective 1
    writers, obj_writer, _ = _validate_and_assign(all_meta)
    token = all_meta[0]["token"]
    temp_dir = storage.temp_dir_name(final_dir, token)
    finish = partial(_finish_save, all_meta=all_meta, temp_dir=temp_dir, final_dir=final_dir, layout=layout,
                     t0=t0, fsync=fsync, is_async=async_save)
    if not async_save:
        result, err = comm.run("save/write", lambda: _write_job(_select(st, writers, obj_writer, comm.rank),
                                                                temp_dir, comm.rank, align, fsync, threads))
        finish(comm, err, result)
        return None

    def snapshot() -> _WriteJob:
        job = _select(st, writers, obj_writer, comm.rank)
        async_save_mod.wait_idle()
        keys = job.tensors()
        copies = async_save_mod.staging().snapshot([job.groups[s][n] for s, n in keys], threads)
        for (s, n), c in zip(keys, copies):
            job.groups[s][n] = c
        return job

    t_plan = time.perf_counter()
    job, err = comm.run("save/snapshot", snapshot)
    t_copy = time.perf_counter()
    st = _SaveState(comm.rank)  # drop every reference to the caller's tensors
    comm.agree(err, "save")  # every rank holds its snapshot
    t_snap = time.perf_counter()
    log.debug("%sasync save %s: snapshot in %.3f s", _rank_prefix(comm), final_dir, t_snap - t0)
    handle = async_save_mod.start(
        async_save_mod._Commit(comm, final_dir, temp_dir, finish),
        lambda: _write_job(job, temp_dir, comm.rank, align, fsync, threads))
    handle.timings = {"plan_s": t_plan - t0, "copy_s": t_copy - t_plan, "agree_s": t_snap - t_copy}
    return handle


def _shard_record_json(sh: ShardedTensor, file: Optional[str], name: str, header_offset: int, data_offset: int,
                       crc32: int) -> Dict[str, Any]:
    n = sh.data.numel() * itemsize(sh.dtype)
    return {"key": sh.key, "offset": list(sh.global_offset), "shape": list(sh.chunk_shape),
            "flat": list(sh.flat_range) if sh.flat_range is not None else None, "file": file, "name": name,
            "header_offset": header_offset, "data_offset": data_offset, "nbytes": n, "crc32": crc32}


def _build_manifest(results: List[Dict[str, Any]], all_meta: List[Dict[str, Any]], world: int,
                    layout: Optional[Mapping[str, Any]]) -> Manifest:
    info: Dict[str, Tuple[str, List[int]]] = {}
    for meta in all_meta:
        for key, dt, gshape, *_ in meta["shards"]:
            info.setdefault(key, (dt, gshape))
    tensors: Dict[str, TensorRecord] = {}
    for key in sorted(info):
        dt, gshape = info[key]
        tensors[key] = TensorRecord(key, dtype_from_name(dt), tuple(gshape))
    files: Dict[str, Dict[str, Any]] = {}
    objects: Dict[str, Any] = {}
    trees: Dict[str, Any] = {}
    rank_trees: List[str] = []
    for r in results:
        files.update(r["files"])
        objects.update(r["objects"])
        for s in r["shards"]:
            tensors[s["key"]].shards.append(ShardRecord(
                tuple(s["offset"]), tuple(s["shape"]), tuple(s["flat"]) if s["flat"] else None, s["file"], s["name"],
                s["header_offset"], s["data_offset"], s["nbytes"], s["crc32"]))
        text = json.dumps(r["tree"], sort_keys=True, separators=(",", ":"))
        tid = hashlib.sha256(text.encode()).hexdigest()[:16]
        trees.setdefault(tid, r["tree"])
        rank_trees.append(tid)
    for t in tensors.values():
        t.shards.sort(key=lambda s: (s.offset, s.flat or (0, 0)))
    return Manifest(world_size=world, layout=dict(layout or {}), files=files, tensors=tensors, objects=objects,
                    trees=trees, rank_trees=rank_trees, created=time.time())


# ---------------------------------------------------------------------------
# load


@dataclass
class _Op:
    """One byte range to bring into ``dest`` (a contiguous uint8 tensor), or, in scatter
    loads, into a temporary that exists only while its bytes arrive (``lazy``)."""

    file: str
    offset: int
    nbytes: int
    dest: Optional[torch.Tensor]
    lazy: Optional[Tuple["_Temps", int, int]] = None  # temporaries, buffer index, offset in buffer

    def target(self) -> torch.Tensor:
        """Where the bytes go (allocates a lazy temporary on first use)."""
        if self.lazy is None:
            return self.dest
        temps, i, off = self.lazy
        return temps.buffer(i)[off:off + self.nbytes]

    def arrived(self, nbytes: int) -> None:
        """``nbytes`` of this op were delivered (a complete temporary is placed and freed)."""
        if self.lazy is not None:
            self.lazy[0].arrived(self.lazy[1], nbytes)


class _Temps:
    """The temporaries of one resharded shard (saved pieces before placement).

    Scatter loads allocate each buffer when its first bytes arrive and place and free it
    as soon as all its bytes have, so a rank never holds every temporary at once; the
    final ``place`` (in ``work.finish``) only handles what is left."""

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype, wp: Any, chunk: torch.Tensor) -> None:
        self.sizes, self.dtype, self.wp, self.chunk = list(sizes), dtype, wp, chunk
        self.bufs: Dict[int, torch.Tensor] = {}
        self.pending = [0] * len(self.sizes)
        self.placed: set = set()

    def buffer(self, i: int) -> torch.Tensor:
        if i not in self.bufs:
            self.bufs[i] = _bytes_view(_empty(self.sizes[i], self.dtype))
        return self.bufs[i]

    def arrived(self, i: int, nbytes: int) -> None:
        self.pending[i] -= nbytes
        if self.pending[i] <= 0:
            self.place(i)

    def place(self, i: int) -> None:
        if i in self.placed:
            return
        buf = self.buffer(i).view(self.dtype)
        for p in self.wp.placements:
            if p.buffer == i:
                idx = tuple(slice(o, o + s) for o, s in zip(p.dst.offset, p.dst.shape))
                self.chunk[idx].copy_(buf.as_strided(p.shape, p.strides, buf.storage_offset() + p.storage_offset))
        self.placed.add(i)
        self.bufs.pop(i, None)  # freed as soon as it is placed


@dataclass
class _LoadWork:
    rows_ok: bool = False  # own mode: strided overlaps are read run by run into the destination
    view_ops: List[Tuple[str, int, memoryview]] = field(default_factory=list)
    row_jobs: List[Tuple[str, int, int, List[memoryview]]] = field(default_factory=list)  # file, offset, run, views
    ops: List[_Op] = field(default_factory=list)
    finish: List[Callable[[], None]] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    touched: Dict[str, set] = field(default_factory=dict)  # file -> names (for verify)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, outside autograd (parameters are filled in place)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A temporary; large ones are huge-page backed so first-touch page faults stay cheap."""
    nbytes = numel * itemsize(dtype)
    if nbytes >= (8 << 20):
        return empty_buffer(nbytes).view(dtype)[:numel]
    return torch.empty(numel, dtype=dtype)


def _plan_rows(rr: plan.RowReads, mv: memoryview, work: _LoadWork) -> None:
    """Runs whose source bytes are back to back become one preadv per IOV_MAX runs."""
    import numpy as np

    n = rr.run_bytes
    src = np.zeros(1, dtype=np.int64) + rr.file_offset
    dst = np.zeros(1, dtype=np.int64) + rr.dst_offset
    for size, ss, ds in zip(rr.lead_shape, rr.src_strides, rr.dst_strides):
        steps = np.arange(size, dtype=np.int64)
        src = (src[:, None] + steps[None, :] * ss).reshape(-1)
        dst = (dst[:, None] + steps[None, :] * ds).reshape(-1)
    views = [mv[d:d + n] for d in dst.tolist()]
    if len(src) < 2 or bool(np.all(np.diff(src) == n)):
        work.row_jobs.append((rr.file, int(src[0]), n, views))
    else:
        work.view_ops.extend((rr.file, o, v) for o, v in zip(src.tolist(), views))


def _plan_sharded(sh: ShardedTensor, rec: Optional[TensorRecord], work: _LoadWork, path: str) -> Optional[torch.Tensor]:
    """Plan reads for one requested shard; returns the tensor that will hold it."""
    if rec is None:
        work.problems.append(f"missing: tensor {sh.key!r} (at {path}) is not in the checkpoint")
        return sh.data
    if rec.dtype != sh.dtype:
        work.problems.append(f"dtype mismatch: {sh.key!r} saved as {dtype_name(rec.dtype)}, requested {dtype_name(sh.dtype)}")
        return sh.data
    if tuple(rec.global_shape) != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
        work.problems.append(
            f"shape mismatch: {sh.key!r} saved with global shape {tuple(rec.global_shape)}, requested {tuple(sh.global_shape)}")
        return sh.data
    dest = sh.data
    n_el = (sh.flat_range[1] - sh.flat_range[0]) if sh.flat_range is not None else plan.numel(sh.local_shape)
    if dest is None:
        dest = torch.empty(sh.local_shape if sh.flattened_range is None else (n_el,), dtype=sh.dtype)
    if dest.numel() != n_el:
        work.problems.append(f"shape mismatch: {sh.key!r} destination has {dest.numel()} elements, shard needs {n_el}")
        return dest
    want = Box(tuple(sh.global_offset), tuple(sh.chunk_shape))
    pieces = [s.piece() for s in rec.shards]
    isz = itemsize(sh.dtype)
    wp = plan.plan_want(want, sh.flat_range, pieces, isz, rows_ok=work.rows_ok)
    for s in rec.shards:
        if s.file:
            work.touched.setdefault(s.file, set()).add(s.name)
    if wp.covered < want.numel and not (sh.allow_shape_mismatch and wp.covered > 0):
        work.problems.append(f"missing data: {sh.key!r} at offset {tuple(sh.global_offset)}: checkpoint covers "
                             f"{wp.covered} of {want.numel} elements")
        return dest
    if wp.direct:
        direct_ok = dest.is_contiguous() and dest.device.type == "cpu"
        target = dest if direct_ok else torch.empty(dest.shape, dtype=dest.dtype)
        for r in wp.reads:
            work.ops.append(_Op(r.file, r.file_offset, r.nbytes, _bytes_view(target)[r.buffer_offset:r.buffer_offset + r.nbytes]))
        if not direct_ok:
            work.finish.append(lambda d=dest, t=target: d.copy_(t.view(d.shape)))
        return dest
    chunk_is_dest = sh.flat_range is None and dest.is_contiguous() and dest.device.type == "cpu"
    chunk = dest.view(want.shape) if chunk_is_dest else torch.empty(want.shape, dtype=dest.dtype)
    temps = _Temps(wp.buffers, sh.dtype, wp, chunk)
    if wp.rows:
        mv = tensor_memoryview(chunk.detach())
        for rr in wp.rows:
            _plan_rows(rr, mv, work)
    for r in wp.reads:
        if r.buffer == -1:
            work.ops.append(_Op(r.file, r.file_offset, r.nbytes, _bytes_view(chunk)[r.buffer_offset:r.buffer_offset + r.nbytes]))
        elif work.rows_ok:  # own mode: every temporary up front (its reads run all at once anyway)
            work.ops.append(_Op(r.file, r.file_offset, r.nbytes, temps.buffer(r.buffer)[r.buffer_offset:r.buffer_offset + r.nbytes]))
        else:  # scatter: allocated when its bytes arrive, placed and freed when complete
            temps.pending[r.buffer] += r.nbytes
            work.ops.append(_Op(r.file, r.file_offset, r.nbytes, None, (temps, r.buffer, r.buffer_offset)))

    def place(dest=dest, temps=temps, chunk=chunk, flat=sh.flat_range) -> None:
        for i in range(len(temps.sizes)):
            temps.place(i)
        if flat is not None:
            dest.copy_(chunk.reshape(-1)[flat[0]:flat[1]])
        elif not chunk_is_dest:
            dest.copy_(chunk.view(dest.shape))

    work.finish.append(place)
    return dest


class _Sharded:
    """Marker for saved-tree entries that the template supplies."""


_SHARDED = _Sharded()


@dataclass
class _LazyRef:
    """A rank-local tensor or large bytes value in a file, validated but not yet planned:
    read straight into the template's tensor when it asks for one (see ``_materialize``)."""

    ref: Dict[str, Any]
    path: str


def _decode_saved_tree(tree: Any, manifest: Manifest, work: _LoadWork, path_prefix: str = "",
                       lazy: bool = False) -> Any:
    """Decode a state tree; file-backed values are planned for reading (or left as
    :class:`_LazyRef` with ``lazy``). Never imports, never allocates before validating."""
    def resolver(ref: Any, path: str) -> Any:
        kind = ref.get("kind") if isinstance(ref, dict) else None
        if kind in ("sharded", "object"):
            return _SHARDED
        if kind in ("tensor", "bytes"):
            _checked_ref(ref, manifest, path)
            return _LazyRef(ref, path) if lazy else _materialize(ref, path, manifest, work)
        raise CheckpointError(f"state {path or '<root>'}: unknown reference {str(ref)[:100]} in the manifest")

    return jsonstate.decode(tree, path=path_prefix, resolver=resolver)


def _materialize(ref: Dict[str, Any], path: str, manifest: Manifest, work: _LoadWork,
                 into: Optional[torch.Tensor] = None) -> Any:
    """Plan the read of a file-backed value, into ``into`` when it is a matching CPU tensor."""
    dtype, shape, file, offset, nbytes = _checked_ref(ref, manifest, path)
    direct = (into is not None and into.dtype == dtype and tuple(into.shape) == shape
              and into.is_contiguous() and into.device.type == "cpu")
    t = into if direct else torch.empty(shape, dtype=dtype)  # size validated against the file above
    if nbytes:
        work.ops.append(_Op(file, offset, nbytes, _bytes_view(t)))
        work.touched.setdefault(file, set()).add(ref.get("name", ""))
    if into is not None and not direct:
        work.finish.append(lambda d=into, s=t: d.copy_(s.view(d.shape)))
        return into
    return _LazyBytes(t) if ref.get("kind") == "bytes" else t


def _checked_ref(ref: Dict[str, Any], manifest: Manifest, path: str) -> Tuple[torch.dtype, Tuple[int, ...], Any, int, int]:
    """A rank-local tensor/bytes reference, checked before anything is allocated for it:
    shape, byte count and byte range must agree with the dtype and lie inside a listed file."""
    where = f"state {path or '<root>'}"
    dtype = dtype_from_name(ref.get("dtype"), f"{where}: ")
    shape = ref.get("shape", [])
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 64:
        raise CheckpointError(f"{where}: bad tensor shape {str(shape)[:80]}")
    nbytes, offset, file = ref.get("nbytes", 0), ref.get("data_offset", 0), ref.get("file")
    if type(nbytes) is not int or type(offset) is not int or nbytes < 0 or offset < 0:
        raise CheckpointError(f"{where}: bad byte range {offset!r}+{nbytes!r}")
    if nbytes != plan.numel(shape) * itemsize(dtype):
        raise CheckpointError(f"{where}: {nbytes} bytes do not match shape {shape} of {dtype_name(dtype)}")
    if nbytes:
        if not isinstance(file, str) or file not in manifest.files:
            raise CheckpointError(f"{where}: tensor refers to unknown file {file!r}")
        if offset + nbytes > int(manifest.files[file].get("bytes", 0)):
            raise CheckpointError(f"{where}: byte range {offset}+{nbytes} lies past the end of {file}")
    return dtype, tuple(shape), file, offset, nbytes


class _LazyBytes:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _finalize_tree(value: Any) -> Any:
    """Drop template-supplied markers, turn lazily read bytes into bytes."""
    if isinstance(value, _LazyBytes):
        return bytes(value.t.numpy().tobytes())
    if isinstance(value, _LazyRef):
        return _SHARDED  # never planned for reading (e.g. under load_common): left out
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            fv = _finalize_tree(v)
            if fv is _SHARDED or (isinstance(fv, dict) and not fv and isinstance(v, dict) and v):
                continue
            out[k] = fv
        return out
    if isinstance(value, list):
        return [_finalize_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_finalize_tree(v) for v in value)
    return value


def _lookup(tree: Any, keys: Sequence[Any]) -> Tuple[bool, Any]:
    cur = tree
    for k in keys:
        if isinstance(cur, dict) and k in cur:
            cur = cur[k]
        elif isinstance(cur, (list, tuple)) and isinstance(k, int) and 0 <= k < len(cur):
            cur = cur[k]
        else:
            return False, None
    return True, cur


def _merge_template(template: Any, saved: Any, keys: Tuple[Any, ...], work: _LoadWork, manifest: Manifest,
                    objects: "_Objects", strict: bool) -> Any:
    """Result = template structure with leaves loaded; this rank's saved-only entries are kept too."""
    path = ".".join(map(str, keys))
    _reject_unapplied(path, template)
    if looks_like_sharded_tensor(template):
        sh = ShardedTensor.from_any(template)
        return _plan_sharded(sh, manifest.tensors.get(sh.key), work, path)
    if looks_like_sharded_object(template):
        ukey = _object_unique_key(template)
        if ukey not in objects:
            work.problems.append(f"missing: object {ukey!r} (at {path}) is not in the checkpoint")
            return template.data
        if strict:
            _refuse_unregistered(objects[ukey], path)
        return objects[ukey]
    found, sv = _lookup(saved, keys)
    if isinstance(template, torch.Tensor):
        if not found or not isinstance(sv, _LazyRef) or sv.ref.get("kind") != "tensor":
            work.problems.append(f"missing: tensor at {path} was not saved by this rank")
            return template
        dtype, shape, *_ = _checked_ref(sv.ref, manifest, sv.path)
        if shape == tuple(template.shape) and dtype == template.dtype:
            return _materialize(sv.ref, sv.path, manifest, work, into=template)  # straight into the caller's tensor
        work.problems.append(f"shape mismatch: tensor at {path} saved as {shape} {dtype}, "
                             f"requested {tuple(template.shape)} {template.dtype}")
        return template
    if isinstance(template, dict):
        out = dict(sv) if found and isinstance(sv, dict) else {}
        for k in out:
            if k not in template:  # saved by this rank, not in the template: returned as saved
                out[k] = _materialize_all(out[k], manifest, work)
        if strict and not template:  # an empty template dict asks for everything saved there
            _refuse_unregistered(out, path)
        for k, v in template.items():
            out[k] = _merge_template(v, saved, keys + (k,), work, manifest, objects, strict)
        return out
    if isinstance(template, (list, tuple)):
        vals = [_merge_template(v, saved, keys + (i,), work, manifest, objects, strict)
                for i, v in enumerate(template)]
        return type(template)(vals) if isinstance(template, tuple) and not hasattr(template, "_fields") else (
            type(template)(*vals) if isinstance(template, tuple) else vals)
    if not found:
        return template
    if isinstance(sv, _LazyRef):
        return _materialize(sv.ref, sv.path, manifest, work)
    if strict:
        _refuse_unregistered(sv, path)
    return sv


def _materialize_all(value: Any, manifest: Manifest, work: _LoadWork) -> Any:
    """Plan reads for every file-backed value inside ``value`` (validated refs only)."""
    if isinstance(value, _LazyRef):
        return _materialize(value.ref, value.path, manifest, work)
    if isinstance(value, dict):
        return {k: _materialize_all(v, manifest, work) for k, v in value.items()}
    if isinstance(value, list):
        return [_materialize_all(v, manifest, work) for v in value]
    if type(value) is tuple:
        return tuple(_materialize_all(v, manifest, work) for v in value)
    return value


def _refuse_unregistered(value: Any, path: str) -> None:
    """strict loads fail on enums nobody registered (non-strict ones load as placeholders)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, jsonstate.UnregisteredEnum):
            raise CheckpointError(f"cannot load {path or '<root>'}: enum {v.type_name} is not registered; call "
                                  "megashard.jsonstate.register_enum(cls) before loading, or pass strict=False")
        if isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(k for k in v if isinstance(k, jsonstate.Unrepresentable))
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, argparse.Namespace):
            stack.extend(vars(v).values())


class _Objects:
    """ShardedObject values by unique key, decoded only when the template asks for them."""

    def __init__(self, manifest: Manifest, work: _LoadWork) -> None:
        self.manifest, self.work, self.done = manifest, work, {}

    def __contains__(self, ukey: str) -> bool:
        return ukey in self.manifest.objects

    def __getitem__(self, ukey: str) -> Any:
        if ukey not in self.done:
            entry = self.manifest.objects[ukey]
            value = entry.get("value") if isinstance(entry, dict) else None
            self.done[ukey] = _decode_saved_tree(value, self.manifest, self.work, ukey)
        return self.done[ukey]


def checkpoint_location(checkpoint_dir: str | os.PathLike) -> str:
    """The directory that holds the complete checkpoint ``checkpoint_dir`` (read-only: an
    interrupted re-save's ``.old-*`` copy is read in place, never renamed)."""
    path = os.path.abspath(os.fspath(checkpoint_dir))
    found = storage.locate(path)
    if found is None:
        raise CheckpointError(
            f"{path} is not a megashard checkpoint ({storage.why_not_checkpoint(path)}); check the path, or "
            "whether the save that should have produced it finished")
    return found


def _read_manifest_bytes(base: str) -> bytes:
    with storage.CheckpointFiles(base) as files:
        return files.read_manifest_bytes()


def read_manifest(checkpoint_dir: str | os.PathLike) -> Manifest:
    """Parse and validate ``manifest.json`` of a committed checkpoint; changes nothing on disk."""
    base = checkpoint_location(checkpoint_dir)
    return Manifest.from_json(_read_manifest_bytes(base), os.path.join(base, storage.MANIFEST_NAME))


def is_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    return storage.is_checkpoint(os.fspath(checkpoint_dir))


def _file_size(manifest: Manifest, f: str) -> int:
    if f not in manifest.files:
        raise CheckpointError(f"{f!r} is not listed in the manifest's files")
    return int(manifest.files[f].get("bytes", 0))


def _execute_own(base: str, manifest: Manifest, work: _LoadWork, threads: Optional[int]) -> int:
    """Read every planned byte range straight into its destination (parallel preadv per file)."""
    by_file: Dict[str, List[Tuple[int, memoryview]]] = {}
    for op in work.ops:
        by_file.setdefault(op.file, []).append((op.offset, tensor_memoryview(op.dest)))
    for f, off, mv in work.view_ops:
        by_file.setdefault(f, []).append((off, mv))
    files = sorted(set(by_file) | {j[0] for j in work.row_jobs})
    nthreads = threads or default_read_threads()
    total = 0
    with storage.CheckpointFiles(base) as cf:
        fds = {f: cf.open(f, _file_size(manifest, f)) for f in files}
        for f, reqs in by_file.items():
            path = os.path.join(base, f)
            size = int(manifest.files[f].get("bytes", 0))
            for off, mv in reqs:
                if off < 0 or off + len(mv) > size:
                    raise CheckpointError(f"{path}: byte range {off}+{len(mv)} past end of file ({size} bytes)")
            read_requests(fds[f], reqs, path, nthreads)
            total += sum(len(mv) for _, mv in reqs)
        tasks = []
        for f, off, run, views in work.row_jobs:
            path = os.path.join(base, f)
            size = int(manifest.files[f].get("bytes", 0))
            if off < 0 or off + run * len(views) > size:
                raise CheckpointError(f"{path}: byte range {off}+{run * len(views)} past end of file ({size} bytes)")
            for i in range(0, len(views), IOV_MAX):
                tasks.append(partial(preadv_all, fds[f], views[i:i + IOV_MAX], off + i * run, path))
            total += run * len(views)
        run_parallel(tasks, nthreads)
    return total


def _verify(base: str, touched: Mapping[str, Any], manifest: Optional[Manifest] = None) -> None:
    """Check every byte a load delivered: each touched file's structure (header, index, zero
    fill, terminator) and the hashes of every touched tensor; with ``manifest``, also that
    the manifest's byte ranges are the ones the file's own index names."""
    from .format import TensorFileReader
    from .format.verify import structure_problems

    where = _manifest_ranges(manifest) if manifest is not None else {}
    with storage.CheckpointFiles(base) as cf:
        for f, names in sorted(touched.items()):
            size = _file_size(manifest, f) if manifest is not None else None
            cf.open(f, size)  # name, type and size checks before parsing
            with TensorFileReader(f, dir_fd=cf.dir_fd, nofollow=True) as r:
                problems = structure_problems(r)
                if problems:
                    raise CheckpointError("; ".join(problems[:5]))
                for n in sorted(names):
                    if n not in r:
                        raise CheckpointError(f"{cf.path(f)}: tensor {n!r} named by the manifest is not in the file")
                    e = r._entry(n)
                    want = where.get((f, n))
                    if want is not None and want != (e.data_offset, e.data_length):
                        raise CheckpointError(f"{cf.path(f)}: tensor {n!r}: manifest says bytes {want[0]}+{want[1]}, "
                                              f"the file's index {e.data_offset}+{e.data_length}")
                    r.verify(n)


def _manifest_ranges(manifest: Manifest) -> Dict[Tuple[str, str], Tuple[int, int]]:
    """(file, tensor name) -> (data offset, bytes) for every shard the manifest lists."""
    out: Dict[Tuple[str, str], Tuple[int, int]] = {}
    for t in manifest.tensors.values():
        for sh in t.shards:
            if sh.file:
                out[(sh.file, sh.name)] = (sh.data_offset, sh.nbytes)
    return out


@dataclass
class LoadStats:
    mode: str = ""
    bytes_read: int = 0  # from storage, by this rank
    bytes_received: int = 0
    transport: str = ""  # scatter: "shm" or "group" on this rank's node
    seconds: float = 0.0


LAST_LOAD_STATS = LoadStats()


def load(
    state_dict: Mapping[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    mode: str = "auto",
    process_group: Any = None,
    strict: bool = True,
    verify: bool = False,
    scatter_chunk_bytes: int = DEFAULT_SCATTER_CHUNK,
    scatter_transport: str = "auto",
    threads: Optional[int] = None,
    timeout: Optional[float] = None,
) -> Dict[str, Any]:
    """Load a checkpoint into the template ``state_dict``; collective over ``process_group``.

    Template ShardedTensors are filled in place (any TP/PP/VP/DP layout); the result
    mirrors the template with ShardedTensor -> tensor, ShardedObject -> its value,
    and keeps what this rank saved that the template lacks. ``verify`` checks every
    delivered byte (structure + hashes). ``timeout`` (s) bounds every collective;
    default: the process group's.
    Read-only: never renames or deletes anything in the checkpoint's parent.
    """
    if mode not in ("auto", "own", "scatter"):
        raise ValueError(f"mode must be 'auto', 'own' or 'scatter', got {mode!r}")
    if scatter_transport not in SCATTER_TRANSPORTS:
        raise ValueError(f"scatter_transport must be one of {SCATTER_TRANSPORTS}, got {scatter_transport!r}")
    comm = Comm(process_group, timeout)
    base = os.path.abspath(os.fspath(checkpoint_dir))
    t0 = time.perf_counter()
    stats = LoadStats()

    def probe() -> Dict[str, Any]:
        node = os.environ.get("MEGASHARD_NODE_ID") or os.environ.get("GROUP_RANK") or os.uname().nodename
        found = storage.locate(base)
        why = None if found else storage.why_not_checkpoint(base)
        return {"sees": found, "node": str(node), "why": why}

    info, err = comm.run("load/probe", probe)
    infos = comm.agree(err, "load", info)  # collective 1
    if not any(i["sees"] for i in infos):
        comm.agree(f"CheckpointError: {base} is not a readable megashard checkpoint: {infos[0]['why']}"
                   if comm.rank == 0 else None, "load")
    base = infos[comm.rank]["sees"] or base  # an interrupted re-save's copy is read where it is
    nodes = [i["node"] for i in infos]
    readers = node_readers(nodes)
    all_see = all(i["sees"] for i in infos)
    chosen = mode if mode != "auto" else ("own" if all_see else "scatter")
    if chosen == "own" and not all_see:
        blind = [r for r, i in enumerate(infos) if not i["sees"]]
        comm.agree(f"mode='own' but ranks {blind} cannot see {base}; use mode='scatter' or 'auto'"
                   if comm.rank == blind[0] else None, "load")
    if chosen == "scatter":
        blind_readers = sorted({readers[r] for r in range(comm.world_size) if not infos[readers[r]]["sees"]})
        if blind_readers:
            comm.agree(f"scatter load: node reader rank(s) {blind_readers} cannot see {base}"
                       if comm.rank == 0 else None, "load")
    stats.mode = chosen

    # the manifest: read locally (own) or by rank 0 and broadcast (scatter)
    mpath = os.path.join(base, storage.MANIFEST_NAME)
    if chosen == "own":
        manifest, err = comm.run("load/manifest", lambda: Manifest.from_json(_read_manifest_bytes(base), mpath))
        comm.agree(err, "load")
    else:
        def read0() -> Any:  # rank 0 reads and validates once; the others parse what it sends
            data = _read_manifest_bytes(base)
            return Manifest.from_json(data, mpath), data.decode()

        read, err = comm.run("load/manifest", read0 if comm.rank == 0 else lambda: (None, None))
        comm.agree(err, "load")
        text = comm.broadcast_json(read[1], 0)
        manifest, err = comm.run("load/manifest", lambda: read[0] if read[0] is not None else Manifest.from_json(text, mpath))
        comm.agree(err, "load")

    work = _LoadWork(rows_ok=chosen == "own")

    def plan_local() -> Any:
        saved = _decode_saved_tree(manifest.tree_for_rank(comm.rank), manifest, work, lazy=True)
        res = _merge_template(dict(state_dict), saved, (), work, manifest, _Objects(manifest, work), strict)
        if work.problems and strict:
            raise StateDictError(_format_problems(work.problems, base))
        for p in work.problems:
            log.warning("%s%s", _rank_prefix(comm), p)
        return res

    result, err = comm.run("load/plan", torch.no_grad()(plan_local))
    comm.agree(err, "load")

    if chosen == "own":
        nread, err = comm.run("load/read", lambda: _execute_own(base, manifest, work, threads))
        stats.bytes_read = nread or 0
    else:
        try:
            (nread, nrecv), err = _scatter(comm, base, manifest, work, readers, scatter_chunk_bytes, threads,
                                           scatter_transport, stats)
        except Exception as e:  # noqa: BLE001 - must reach the final agreement, never skip it
            (nread, nrecv), err = (0, 0), f"{type(e).__name__}: scatter transfer failed: {e}"
        stats.bytes_read, stats.bytes_received = nread, nrecv
    if err is None:
        @torch.no_grad()
        def fin() -> None:
            for f in work.finish:
                f()
            if verify and (chosen == "own" or readers[comm.rank] == comm.rank):
                _verify(base, work.touched, manifest)
        _, err = comm.run("load/finish", fin)
    totals = comm.agree(err, "load", [stats.bytes_read, stats.bytes_received])  # final: all succeeded or all raise
    stats.seconds = time.perf_counter() - t0
    LAST_LOAD_STATS.__dict__.update(stats.__dict__)
    _log_summary(comm, "loaded", base, sum(t[0] for t in totals), stats.seconds,
                 f"{chosen} mode{', verified' if verify else ''}")
    return _finalize_tree(result)


def _log_summary(comm: Comm, verb: str, path: str, nbytes: int, seconds: float, what: str) -> None:
    """One INFO line per save/load, on rank 0, with figures aggregated over ranks."""
    msg = (f"{verb} checkpoint {path}: {nbytes / 1e9:.3f} GB over {comm.world_size} rank(s) in {seconds:.2f} s "
           f"({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s, {what})")
    if comm.rank == 0:
        log.info("%s%s", _rank_prefix(comm), msg)
    else:
        log.debug("%s%s", _rank_prefix(comm), msg)


def load_common(
    checkpoint_dir: str | os.PathLike,
    keys: Optional[Sequence[str]] = None,
    *,
    process_group: Any = None,
    strict: bool = False,
    timeout: Optional[float] = None,
) -> Dict[str, Any]:
    """Top-level non-tensor values saved by rank 0 (e.g. ``args``, ``iteration``), without a template.

    Collective when a process group is initialised: rank 0 reads and broadcasts, so it
    works when only rank 0 can see the checkpoint. Tensor-valued entries are skipped;
    only the requested ``keys`` are decoded. ``strict``: an unregistered enum raises
    CheckpointError instead of loading as a placeholder.
    """
    comm = Comm(process_group, timeout)
    base = os.path.abspath(os.fspath(checkpoint_dir))

    def read() -> Any:
        if comm.rank != 0 and comm.world_size > 1:
            return None
        m = read_manifest(base)
        tree = m.tree_for_rank(0)
        if isinstance(tree, dict) and jsonstate.TAG not in tree and keys is not None:
            tree = {k: v for k, v in tree.items() if k in keys}  # decode only what was asked for
        value = _decode_saved_tree(tree, m, _LoadWork(), lazy=True)
        if not isinstance(value, dict):
            raise CheckpointError(f"{base}: saved state is not a dict")
        out = {}
        for k, v in value.items():
            if keys is not None and k not in keys:
                continue
            fv = _finalize_tree(_strip_tensors(v))
            if fv is not _SHARDED and not (isinstance(fv, dict) and not fv and isinstance(v, dict) and v):
                v = fv
                if strict:
                    _refuse_unregistered(v, k)
                out[k] = v
        return jsonstate.encode(out)

    encoded, err = comm.run("load_common", read)
    comm.agree(err, "load_common")
    encoded = comm.broadcast_json(encoded, 0)
    return jsonstate.decode(encoded)


def _strip_tensors(v: Any) -> Any:
    if isinstance(v, (torch.Tensor, _LazyBytes, _LazyRef)):
        return _SHARDED
    if isinstance(v, dict):
        return {k: _strip_tensors(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_strip_tensors(x) for x in v]
    return v


def _format_problems(problems: List[str], base: str) -> str:
    head = "\n  ".join(problems[:50])
    more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
    return (f"state dict does not match checkpoint {base} ({len(problems)} problem(s)):\n  {head}{more}\n"
            "Pass strict=False to load what matches.")


def _scatter(comm: Comm, base: str, manifest: Manifest, work: _LoadWork, readers: Mapping[int, int], chunk: int,
             threads: Optional[int], transport: str, stats: "LoadStats") -> Tuple[Tuple[int, int], Optional[str]]:
    """One reader per node reads each needed byte once; its ranks take their bytes from
    shared memory or the process group (:mod:`megashard.scatter`). On a reader,
    ``work.touched`` grows by what its node's other ranks touched, so ``verify`` there
    covers every byte the node loaded."""
    (nread, nrecv, stats.transport), err = scatter(comm, base, manifest, work.ops, work.touched, readers, chunk,
                                                   threads, transport, partial(storage.CheckpointFiles, base))
    return (nread, nrecv), err

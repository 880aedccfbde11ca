"""``load``: fill a template state dict from a checkpoint saved in any layout.

Collectives per load, whatever the world size: *probe* (every rank sends rank 0 whether
it sees the checkpoint and its node; each receives its mode and node reader), *plan*
agreement, the transfer (scatter and readonce modes) and the final agreement. Each rank opens
the index itself and reads only the sections its own shards overlap
(:class:`~megashard.manifest.LazyIndex`); a rank that cannot see the checkpoint gets the
index from its node's reader. ``own`` mode reads exactly the byte ranges each rank
needs; ``scatter`` has one reader per node read every needed byte once and hand it to
the node's ranks; ``readonce`` has every byte the job needs read once, by ranks on every
node, and sent to the ranks that need it (:mod:`megashard.readers`).
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from isal import isal_zlib

from . import jsonstate, plan, readers, storage
from .devicecopy import on_host
from .errors import CheckpointError, ChecksumError, FormatError, StateDictError
from .format import empty_buffer
from .format.fastio import default_read_threads, tensor_memoryview
from .format.dtypes import encode_dtype
from .format.layout import TENSOR_TYPE_STATE_DICT, MetaEntry, parse_header, zeroed_header_crcs
from .format.reader import MAX_HEADER
from .index import Index, index_from_bytes
from .storage import check_file_size, open_index, read_index_bytes
from .logs import log_summary, rank_prefix
from .manifest import dtype_from_name, dtype_name, itemsize
from .plan import Box
from .sharded import (ShardedTensor, check_data, looks_like_sharded_object, looks_like_sharded_tensor,
                      object_unique_key, reject_unapplied)
from .transport import Comm, node_id, node_readers

log = logging.getLogger(__name__)

DEFAULT_SCATTER_CHUNK = 8 << 20  # bytes per ring slot / staging buffer of a scatter load (4 slots: 32 MiB of shared memory per node)


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


@dataclass
class _Crc:
    """A saved tensor this load reads whole, so its CRC32 can be checked against the index's.
    Tensorizer's CRC32 covers the tensor's header (hash values zeroed) and then its data; the
    header is rebuilt from what the index says (name, dtype, shape, header size), as the writer
    built it, so no byte beyond the data is read."""

    file: str
    name: str
    what: str  # what the tensor holds, for the message
    data_offset: int
    nbytes: int
    crc32: int  # as the index records it
    header_bytes: int  # data_offset - header_offset
    dtype: torch.dtype
    shapes: List[Tuple[int, ...]]  # the saved tensor's shape (candidates: leading 1s of a chunk may be prepended axes)
    data: Any = None  # the delivered bytes in file order: a uint8 tensor or memoryviews (None: a temporary's)
    data_crc: Optional[int] = None

    def compute(self, data: Any = None) -> None:
        data = self.data if data is None else data
        if isinstance(data, list):
            c = 0
            for mv in data:
                c = isal_zlib.crc32(mv, c)
        elif on_host(data):
            c = isal_zlib.crc32(tensor_memoryview(data))
        else:  # a GPU destination: its bytes come back through host memory in slices
            c, step = 0, 64 << 20
            for i in range(0, data.numel(), step):
                c = isal_zlib.crc32(tensor_memoryview(data[i:i + step].to("cpu", copy=True)), c)
        self.data_crc = c

    def problem(self, base: str) -> Optional[str]:
        if self.data_crc is None:
            return None
        heads = zeroed_header_crcs(self.name, self.dtype, self.shapes, self.nbytes, self.header_bytes)
        got = [isal_zlib.crc32_combine(h, self.data_crc, self.nbytes) for h in heads]
        if self.crc32 in got:
            return None
        if not got:
            what = "its header is not one megashard writes"
        elif len(set(got)) == 1:
            what = f"CRC32 {got[0]:08x}, recorded {self.crc32:08x}"
        else:  # either header variant (with or without SHA-256) fits its size: neither matches
            what = f"CRC32 {' or '.join(f'{g:08x}' for g in dict.fromkeys(got))}, recorded {self.crc32:08x}"
        return (f"{base}/{self.file}: tensor {self.name!r} ({self.what}) is damaged ({what}): bytes "
                f"{self.data_offset}+{self.nbytes} are not what was saved. Load an earlier checkpoint or restore "
                f"the file from a copy (`megashard verify {base}` lists every damaged tensor); check_crc=False "
                "(Megatron: --megashard-no-crc-on-load) loads it unchecked")


def check_crcs(crcs: Sequence[_Crc], base: str, threads: Optional[int] = None) -> int:
    """Check every tensor a load read whole against the CRC32 its index records (ChecksumError
    naming each damaged one); returns the bytes checked."""
    todo = [c for c in crcs if c.data_crc is None and c.data is not None]
    nthreads = min(len(todo), threads or default_read_threads())
    if nthreads > 1:  # isal releases the GIL: large tensors are checked in parallel
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(nthreads) as ex:
            list(ex.map(_Crc.compute, sorted(todo, key=lambda c: -c.nbytes)))
    else:
        for c in todo:
            c.compute()
    bad = [m for m in (c.problem(base) for c in crcs) if m]
    if bad:
        more = f"\n  ... and {len(bad) - 10} more damaged tensor(s)" if len(bad) > 10 else ""
        raise ChecksumError("\n  ".join(bad[:10]) + more)
    return sum(c.nbytes for c in crcs if c.data_crc is not None)


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
        self.crcs: Dict[int, List[Tuple[_Crc, int, int]]] = {}  # buffer -> saved tensors read whole into it

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
        for c, off, n in self.crcs.get(i, ()):  # before the temporary is freed
            c.compute(self.buffer(i)[off:off + n])
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
    touched: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # file -> {name: [data offset, bytes]} (verify)
    owners: Dict[Tuple[str, str], Any] = field(default_factory=dict)  # (file, name) -> what the index says it holds
    check_crc: bool = False  # load() turns it on: CRC32 of every saved tensor read whole
    crcs: Dict[Tuple[str, str], _Crc] = field(default_factory=dict)
    by_read: Dict[int, _Crc] = field(default_factory=dict)  # id(op or row job) -> the tensor its bytes are, whole
    base: str = "<checkpoint>"  # where the checkpoint is, for messages

    def whole(self, c: Optional[_Crc], data: Any, read: Any) -> None:
        """``read`` (an op or row job) brings exactly the bytes of ``c``'s tensor into ``data``."""
        if c is not None:
            c.data = data
            self.by_read[id(read)] = c

    def arrived(self, read: Any, crc: Optional[int] = None) -> None:
        """All bytes of an op or row job are in (a reading thread): check its tensor's CRC32 now,
        while later bytes still download, instead of after the load (:func:`check_crcs`). ``crc``:
        the CRC32 of exactly those bytes, already computed by the reads as they landed (an object
        store's GETs, :meth:`~megashard.storage.s3.client.ObjectStore.read_many`): nothing left to do."""
        c = self.by_read.get(id(read))
        if c is not None:
            if crc is not None:
                c.data_crc = crc
            else:
                c.compute()

    def crc(self, file: Optional[str], name: str, what: str, header_offset: Any, data_offset: int, nbytes: int,
            crc32: Any, dtype: torch.dtype, shapes: List[Tuple[int, ...]]) -> Optional[_Crc]:
        """Plan the CRC32 check of a saved tensor read whole (once per tensor). None when off
        or when the index lacks the header's place (rank-local values of checkpoints saved
        before it was recorded)."""
        if not self.check_crc or not file or not nbytes or (file, name) in self.crcs:
            return None
        if type(header_offset) is not int or type(crc32) is not int:
            return None
        hl = data_offset - header_offset
        if not 0 < hl <= MAX_HEADER or header_offset <= 0:
            return None
        c = self.crcs[(file, name)] = _Crc(file, name, what, data_offset, nbytes, crc32, hl, dtype, shapes)
        return c

    def touch(self, file: str, name: str, offset: int, nbytes: int, owner: Any) -> None:
        """Record a tensor of a file this load reads; one tensor of a file holds one thing, so
        an index naming it for two (forged: both would load the same bytes) is refused."""
        prev = self.owners.setdefault((file, name), owner)
        if prev != owner:
            raise CheckpointError(f"{file}: tensor {name!r} is named twice by the index, for {_owner_text(prev)} "
                                  f"and for {_owner_text(owner)}; the checkpoint is damaged or forged")
        self.touched.setdefault(file, {})[name] = [offset, nbytes]


def _owner_text(owner: Any) -> str:
    if owner[0] == "shard":
        _, key, off, shp, flat = owner
        return f"tensor {key!r} chunk {list(off)}+{list(shp)}" + (f" flat {list(flat)}" if flat else "")
    return f"state {owner[1] or '<root>'}"


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, outside autograd (parameters are filled in place)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A temporary; large ones are huge-page backed so first-touch page faults stay cheap."""
    nbytes = numel * itemsize(dtype)
    if nbytes >= (8 << 20):
        return empty_buffer(nbytes).view(dtype)[:numel]
    return torch.empty(numel, dtype=dtype)


def _plan_rows(rr: plan.RowReads, mv: memoryview, work: _LoadWork) -> Optional[Tuple[str, int, int, List[memoryview]]]:
    """Runs whose source bytes are back to back become one preadv per IOV_MAX runs (that
    row job is returned: it may read a saved tensor whole)."""
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
        return work.row_jobs[-1]
    work.view_ops.extend((rr.file, o, v) for o, v in zip(src.tolist(), views))
    return None


@dataclass
class BoxPlan:
    """The reads of one box of a requested shard (see :func:`plan_shard`)."""

    key: str
    box: Box  # global coordinates
    flat: Optional[Tuple[int, int]]  # the request's flat range when it was saved exactly so
    pos: int  # element position of the box in the request
    wp: plan.WantPlan
    records: List[Any]  # the saved shards the index returned for the box


def plan_shard(sh: ShardedTensor, index: Index, rows_ok: bool, path: str = "") -> Tuple[List[BoxPlan], List[str]]:
    """Pure: which saved bytes fill the requested shard ``sh`` (no buffers; the scale
    simulator runs exactly this). Returns the box plans and any problems.

    A flattened request (DistributedOptimizer state) is cut into the boxes its flat range
    covers, so a resharding load reads only the bytes it needs."""
    rec = index.tensor(sh.key)
    if rec is None:
        at = f" (at {path})" if path else ""
        return [], [f"missing: tensor {sh.key!r}{at} is not in the checkpoint"]
    if rec.dtype != sh.dtype:
        return [], [f"dtype mismatch: {sh.key!r} saved as {dtype_name(rec.dtype)}, requested {dtype_name(sh.dtype)}"]
    if tuple(rec.global_shape) != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
        return [], [f"shape mismatch: {sh.key!r} saved with global shape {tuple(rec.global_shape)}, "
                    f"requested {tuple(sh.global_shape)}"]
    want = Box(tuple(sh.global_offset), tuple(sh.chunk_shape))
    isz = itemsize(sh.dtype)
    boxes: List[Tuple[Box, int]] = [(want, 0)]
    exact_flat = None  # a flattened request saved exactly so: one direct read
    if sh.flat_range is not None:
        a, b = sh.flat_range
        if any(s.offset == want.offset and s.shape == want.shape and s.flat == (a, b)
               for s in index.pieces(sh.key, want)):
            exact_flat = (a, b)
        else:
            boxes = [(Box(tuple(g + o for g, o in zip(want.offset, box.offset)), box.shape), pos)
                     for box, pos in plan.flat_boxes(want.shape, a, b)]
    out = []
    covered = 0
    for box, pos in boxes:
        records = index.pieces(sh.key, box)
        wp = plan.plan_want(box, exact_flat, [r.piece() for r in records], isz, rows_ok=rows_ok)
        covered += (exact_flat[1] - exact_flat[0]) if wp.direct and exact_flat else wp.covered
        out.append(BoxPlan(sh.key, box, exact_flat, pos, wp, records))
    total = (sh.flat_range[1] - sh.flat_range[0]) if sh.flat_range is not None else want.numel
    # allow_shape_mismatch (Megatron's padded vocabulary): a box wholly past the saved rows is padding
    outside = sh.allow_shape_mismatch and any(o >= g for o, g in zip(want.offset, rec.global_shape))
    if covered < total and not (sh.allow_shape_mismatch and (covered > 0 or outside)):
        return out, [f"missing data: {sh.key!r} at offset {tuple(sh.global_offset)}: checkpoint covers "
                     f"{covered} of {total} elements"]
    return out, []


def _plan_sharded(sh: ShardedTensor, index: Index, work: _LoadWork, path: str) -> Optional[torch.Tensor]:
    """Plan reads for one requested shard; returns the tensor that will hold it: the
    template's, or one allocated here only once the plan is complete and the files it reads
    have their recorded sizes (never returned unfilled: ``None`` when the shard cannot load,
    whether the template brought a tensor or not)."""
    n_el = (sh.flat_range[1] - sh.flat_range[0]) if sh.flat_range is not None else plan.numel(sh.local_shape)
    dest = sh.data
    check_data(sh, path or sh.key, "load")
    if dest is not None and dest.numel() != n_el:
        work.problems.append(f"shape mismatch: {sh.key!r} destination has {dest.numel()} elements, shard needs {n_el}")
        return None
    # strided row reads need host memory; GPU destinations take whole pieces (read through
    # pinned buffers, :mod:`megashard.devicecopy`) and place resharded ones from host temporaries
    boxes, problems = plan_shard(sh, index, work.rows_ok and (dest is None or on_host(dest)), path)
    if problems:  # strict=False: a shard it cannot fill comes back as None, not as the unfilled template
        work.problems += problems
        return None
    # before anything is allocated for the bytes a file claims to hold; a shard read straight into the
    # template's own tensor allocates nothing from the claims: where every read checks its file itself
    # (an object store's GETs), the reads are the check
    reads_only = dest is not None and all(bp.wp.direct or not bp.wp.buffers for bp in boxes)
    for f in sorted({r.file for bp in boxes for r in bp.records if r.file}):
        index.confirm_file(f, reads_only)
    if dest is None:  # unsaved parts (allow_shape_mismatch) read as zeros, never as stale memory
        alloc = torch.zeros if sh.allow_shape_mismatch else torch.empty
        dest = alloc(sh.local_shape if sh.flattened_range is None else (n_el,), dtype=sh.dtype)
    staged = not dest.is_contiguous()
    buf = torch.empty(dest.shape, dtype=dest.dtype) if staged else dest
    flat_buf = buf.detach().reshape(-1)
    for bp in boxes:
        n = (bp.flat[1] - bp.flat[0]) if bp.flat is not None else bp.box.numel
        view = flat_buf[bp.pos:bp.pos + n]
        _emit(bp, view if bp.flat is not None else view.view(bp.box.shape), sh.dtype, work)
    if staged:
        work.finish.append(lambda d=dest, t=buf: d.copy_(t.view(d.shape)))
    return dest


def _emit(bp: BoxPlan, view: torch.Tensor, dtype: torch.dtype, work: _LoadWork) -> None:
    """Turn one box plan into reads into ``view`` (contiguous CPU) and placements."""
    wp = bp.wp
    files = {r.file for r in wp.reads} | {r.file for r in wp.rows}
    whole: Dict[Tuple[str, int, int], Any] = {}  # a read of exactly a saved tensor's bytes can be CRC-checked
    for s in bp.records:
        if s.file in files:
            work.touch(s.file, s.name, s.data_offset, s.nbytes, ("shard", bp.key, s.offset, s.shape, s.flat))
            whole[(s.file, s.data_offset, s.nbytes)] = s

    def crc(file: str, offset: int, nbytes: int) -> Optional[_Crc]:
        s = whole.get((file, offset, nbytes))
        if s is None:
            return None
        shapes = [(s.flat[1] - s.flat[0],)] if s.flat else [  # the chunk without 0..all of its leading 1s
            tuple(s.shape[k:]) for k in range(len(s.shape) + 1) if all(d == 1 for d in s.shape[:k])]
        return work.crc(s.file, s.name, f"{bp.key!r} chunk {list(s.offset)}+{list(s.shape)}"
                        + (f" flat {list(s.flat)}" if s.flat else ""), s.header_offset, s.data_offset, s.nbytes,
                        s.crc32, dtype, shapes)

    def read(file: str, offset: int, nbytes: int, dest: torch.Tensor) -> None:
        work.ops.append(_Op(file, offset, nbytes, dest))
        work.whole(crc(file, offset, nbytes), dest, work.ops[-1])

    if wp.direct:
        for r in wp.reads:
            read(r.file, r.file_offset, r.nbytes, _bytes_view(view)[r.buffer_offset:r.buffer_offset + r.nbytes])
        return
    chunk = view
    temps = _Temps(wp.buffers, dtype, wp, chunk)
    if wp.rows:
        mv = tensor_memoryview(chunk.detach())
        for rr in wp.rows:
            job = _plan_rows(rr, mv, work)
            if job is not None:
                work.whole(crc(job[0], job[1], job[2] * len(job[3])), job[3], job)
    for r in wp.reads:
        if r.buffer == -1:
            read(r.file, r.file_offset, r.nbytes, _bytes_view(chunk)[r.buffer_offset:r.buffer_offset + r.nbytes])
            continue
        if work.rows_ok:  # own mode: every temporary up front (its reads run all at once anyway)
            work.ops.append(_Op(r.file, r.file_offset, r.nbytes, temps.buffer(r.buffer)[r.buffer_offset:r.buffer_offset + r.nbytes]))
        else:  # scatter: allocated when its bytes arrive, placed and freed when complete
            temps.pending[r.buffer] += r.nbytes
            work.ops.append(_Op(r.file, r.file_offset, r.nbytes, None, (temps, r.buffer, r.buffer_offset)))
        c = crc(r.file, r.file_offset, r.nbytes)
        if c is not None:  # checked when the temporary is placed, before it is freed
            temps.crcs.setdefault(r.buffer, []).append((c, r.buffer_offset, r.nbytes))
    if wp.buffers:
        def place(temps=temps) -> None:
            for i in range(len(temps.sizes)):
                temps.place(i)

        work.finish.append(place)


class _Sharded:
    """Marker for saved-tree entries that the template supplies."""


_SHARDED = _Sharded()


@dataclass
class _LazyRef:
    """A rank-local tensor or large bytes value in a file, validated but not yet planned:
    read straight into the template's tensor when it asks for one (see ``_materialize``)."""

    ref: Dict[str, Any]
    path: str


def _decode_saved_tree(tree: Any, index: Index, work: _LoadWork, path_prefix: str = "",
                       lazy: bool = False) -> Any:
    """Decode a state tree; file-backed values are planned for reading (or left as
    :class:`_LazyRef` with ``lazy``). Never imports, never allocates before validating."""
    def resolver(ref: Any, path: str) -> Any:
        kind = ref.get("kind") if isinstance(ref, dict) else None
        if kind in ("sharded", "object"):
            return _SHARDED
        if kind in ("tensor", "bytes", "json"):
            _checked_ref(ref, index, path)
            if lazy:
                return _LazyRef(ref, path)
            return _stored_json(ref, path, index, work) if kind == "json" else _materialize(ref, path, index, work)
        raise CheckpointError(f"state {path or '<root>'}: unknown reference {str(ref)[:100]} in the index")

    return jsonstate.decode(tree, path=path_prefix, resolver=resolver)


def _materialize(ref: Dict[str, Any], path: str, index: Index, work: _LoadWork,
                 into: Optional[torch.Tensor] = None) -> Any:
    """Plan the read of a file-backed value, into ``into`` when it is a matching CPU tensor."""
    dtype, shape, file, offset, nbytes = _checked_ref(ref, index, path)
    direct = (into is not None and into.dtype == dtype and tuple(into.shape) == shape
              and into.is_contiguous() and into.device.type == "cpu")
    t = into if direct else torch.empty(shape, dtype=dtype)  # size validated against the file above
    if nbytes:
        work.ops.append(_Op(file, offset, nbytes, _bytes_view(t)))
        work.touch(file, str(ref.get("name", "")), offset, nbytes, ("state", path))
        work.whole(work.crc(file, str(ref.get("name", "")), f"state {path or '<root>'}", ref.get("header_offset"),
                            offset, nbytes, ref.get("crc32"), dtype, [shape]), work.ops[-1].dest, work.ops[-1])
    if into is not None and not direct:
        work.finish.append(lambda d=into, s=t: d.copy_(s.view(d.shape)))
        return into
    return _LazyBytes(t) if ref.get("kind") == "bytes" else t


def _checked_ref(ref: Dict[str, Any], index: Index, path: str) -> Tuple[torch.dtype, Tuple[int, ...], Any, int, int]:
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
        if not isinstance(file, str) or file not in index.files:
            raise CheckpointError(f"{where}: tensor refers to unknown file {file!r}")
        if offset + nbytes > int(index.files[file].get("bytes", 0)):
            raise CheckpointError(f"{where}: byte range {offset}+{nbytes} lies past the end of {file}")
        index.confirm_file(file)  # the file really is that large: only then may nbytes size an allocation
    return dtype, tuple(shape), file, offset, nbytes


class _LazyBytes:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _stored_json(ref: Dict[str, Any], path: str, index: Index, work: _LoadWork) -> "_LazyJson":
    """Plan the read of a ShardedObject's value stored as JSON in a file (``saving._object_in_file``):
    its tensor header and data, checked (before anything is allocated) to lie in a listed file; decoded
    in the load's finish step."""
    dtype, shape, file, offset, nbytes = _checked_ref(ref, index, path)
    if dtype != torch.uint8 or len(shape) != 1:
        raise CheckpointError(f"state {path or '<root>'}: a stored JSON value must be a 1-D uint8 tensor, "
                              f"the index says {dtype_name(dtype)} {list(shape)}")
    name, hoff = str(ref.get("name", "")), ref.get("header_offset")
    hl = offset - hoff if type(hoff) is int else 0
    if not nbytes or not 0 < hl <= MAX_HEADER:
        raise CheckpointError(f"{file}: object {path!r} (tensor {name!r}): its reference lacks a valid size or "
                              "header offset; the checkpoint is damaged or forged")
    buf = torch.empty(hl + nbytes, dtype=torch.uint8)  # the range lies in the file (checked above)
    work.ops.append(_Op(file, hoff, hl + nbytes, _bytes_view(buf)))
    work.touch(file, name, offset, nbytes, ("state", path))
    held = _LazyJson(path, f"{work.base}/{file}", name, hl)
    work.finish.append(partial(held.decode, buf))
    return held


class _LazyJson:
    """A ShardedObject's value stored as JSON text in a rank's file: checked against its tensor
    header's own CRC32 (the index's reference holds none) and decoded once its bytes are read, in the
    load's finish step, so a bad value fails every rank's load."""

    def __init__(self, path: str, where: str, name: str, header_bytes: int) -> None:
        self.path, self.where, self.name, self.header_bytes = path, where, name, header_bytes
        self.strict = False  # refuse unregistered enums (a strict load's template asked for it)
        self.value: Any = None
        self.done = False

    def decode(self, buf: torch.Tensor) -> None:
        raw = buf.numpy().tobytes()
        head, data = raw[:self.header_bytes], raw[self.header_bytes:]
        what = f"{self.where}: tensor {self.name!r} (object {self.path!r})"
        entry = MetaEntry(self.name, self.name.encode(), TENSOR_TYPE_STATE_DICT, encode_dtype(torch.uint8),
                          (len(data),), 0, self.header_bytes, len(data), False)
        try:
            header = parse_header(head, entry, self.where)
        except FormatError as e:
            raise ChecksumError(f"{what}: its header is damaged ({e}); restore the file from a copy or load an "
                                "earlier checkpoint") from None
        if header.crc32 is None or isal_zlib.crc32(data, isal_zlib.crc32(header.zeroed)) != header.crc32:
            raise ChecksumError(f"{what} is damaged (its CRC32 does not match its header's); restore the file "
                                "from a copy or load an earlier checkpoint")
        # no resolver: a value stored this way holds no references (saving._object_in_file)
        self.value = jsonstate.decode(jsonstate.parse_json(data, what), path=self.path)
        if self.strict:
            _refuse_unregistered(self.value, self.path)
        self.done = True


def _finalize_tree(value: Any) -> Any:
    """Drop template-supplied markers, turn lazily read bytes into bytes."""
    if isinstance(value, _LazyBytes):
        return bytes(value.t.numpy().tobytes())
    if isinstance(value, _LazyJson):
        if not value.done:
            raise CheckpointError(f"{value.where}: object {value.path!r} was never read (a load that skipped its "
                                  "finish step); this is a megashard bug, please report it")
        return value.value
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


def _merge_template(template: Any, saved: Any, keys: Tuple[Any, ...], work: _LoadWork, index: Index,
                    objects: "_Objects", strict: bool) -> Any:
    """Result = template structure with leaves loaded; this rank's saved-only entries are kept too."""
    path = ".".join(map(str, keys))
    reject_unapplied(path, template)
    if looks_like_sharded_tensor(template):
        sh = ShardedTensor.from_any(template)
        return _plan_sharded(sh, index, work, path)
    if looks_like_sharded_object(template):
        ukey = object_unique_key(template)
        if ukey not in objects:
            work.problems.append(f"missing: object {ukey!r} (at {path}) is not in the checkpoint")
            return template.data
        value = objects[ukey]
        if strict and isinstance(value, _LazyJson):
            value.strict = True  # checked when it is decoded
        elif strict:
            _refuse_unregistered(value, path)
        return value
    found, sv = _lookup(saved, keys)
    if isinstance(template, torch.Tensor):
        if not found or not isinstance(sv, _LazyRef) or sv.ref.get("kind") != "tensor":
            work.problems.append(f"missing: tensor at {path} was not saved by this rank")
            return template
        dtype, shape, *_ = _checked_ref(sv.ref, index, sv.path)
        if shape == tuple(template.shape) and dtype == template.dtype:
            return _materialize(sv.ref, sv.path, index, work, into=template)  # straight into the caller's tensor
        work.problems.append(f"shape mismatch: tensor at {path} saved as {shape} {dtype}, "
                             f"requested {tuple(template.shape)} {template.dtype}")
        return template
    if isinstance(template, dict):
        out = dict(sv) if found and isinstance(sv, dict) else {}
        for k in out:
            if k not in template:  # saved by this rank, not in the template: returned as saved
                out[k] = _materialize_all(out[k], index, work)
        if strict and not template:  # an empty template dict asks for everything saved there
            _refuse_unregistered(out, path)
        for k, v in template.items():
            out[k] = _merge_template(v, saved, keys + (k,), work, index, objects, strict)
        return out
    if isinstance(template, (list, tuple)):
        vals = [_merge_template(v, saved, keys + (i,), work, index, objects, strict)
                for i, v in enumerate(template)]
        return type(template)(vals) if isinstance(template, tuple) and not hasattr(template, "_fields") else (
            type(template)(*vals) if isinstance(template, tuple) else vals)
    if not found:
        return template
    if isinstance(sv, _LazyRef):
        return _materialize(sv.ref, sv.path, index, work)
    if strict:
        _refuse_unregistered(sv, path)
    return sv


def _materialize_all(value: Any, index: Index, work: _LoadWork) -> Any:
    """Plan reads for every file-backed value inside ``value`` (validated refs only)."""
    if isinstance(value, _LazyRef):
        return _materialize(value.ref, value.path, index, work)
    if isinstance(value, dict):
        return {k: _materialize_all(v, index, work) for k, v in value.items()}
    if isinstance(value, list):
        return [_materialize_all(v, index, work) for v in value]
    if type(value) is tuple:
        return tuple(_materialize_all(v, index, work) for v in value)
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

    def __init__(self, index: Index, work: _LoadWork) -> None:
        self.index, self.work, self.done = index, work, {}

    def __contains__(self, ukey: str) -> bool:
        return self.index.has_object(ukey)

    def __getitem__(self, ukey: str) -> Any:
        if ukey not in self.done:
            entry = self.index.object(ukey)
            value = entry.get("value") if isinstance(entry, dict) else None
            self.done[ukey] = _decode_saved_tree(value, self.index, self.work, ukey)
        return self.done[ukey]


@dataclass
class LoadStats:
    mode: str = ""
    bytes_read: int = 0  # from storage, by this rank
    bytes_received: int = 0
    index_bytes_read: int = 0  # of the checkpoint's index, by this rank
    transport: str = ""  # scatter: "shm" or "group" on this rank's node; "none": only its reader needed bytes
    buffer_peak: int = 0  # readonce: most bytes of staging buffers this rank held at once
    seconds: float = 0.0
    crc_checked: int = 0  # bytes of saved tensors this rank read whole and checked against their CRC32


def _probe(base: str) -> Dict[str, Any]:
    node = node_id()
    if storage.is_url(base):  # no request here: in scatter mode the node readers fetch the index for their node
        return {"sees": base, "node": str(node), "why": None}
    found = storage.locate(base)
    return {"sees": found, "node": str(node), "why": None if found else storage.why_not_checkpoint(base)}


# rank 0 gathers and plans every rank's byte ranges for a readonce load (1,024 ranks x 200 ranges: ~4 s);
# auto chooses it up to this world size until that gather is two-level
READONCE_AUTO_MAX_RANKS = 1024


def plan_probe(infos: List[Dict[str, Any]], base: str, mode: str) -> List[Dict[str, Any]]:
    """Rank 0: the load mode, each rank's node reader and who shares the index with whom."""
    if not any(i["sees"] for i in infos):
        raise CheckpointError(f"{base} is not a readable megashard checkpoint: {infos[0]['why']}")
    readers_of = node_readers([i["node"] for i in infos])
    all_see = all(i["sees"] for i in infos)
    nodes = len(set(readers_of.values()))
    # several nodes that all see the checkpoint: read each byte once per job, not once per node or replica;
    # rank 0 plans every rank's ranges, so above READONCE_AUTO_MAX_RANKS auto keeps own's per-rank plans
    many = nodes > 1 and len(infos) <= READONCE_AUTO_MAX_RANKS
    chosen = mode if mode != "auto" else ("scatter" if not all_see else "readonce" if many else "own")
    if chosen in ("own", "readonce") and not all_see:
        blind = [r for r, i in enumerate(infos) if not i["sees"]]
        raise StateDictError(f"mode={chosen!r} but ranks {blind[:20]} cannot see {base}; use mode='scatter' or 'auto'")
    members: Dict[int, List[int]] = {}
    for r, rd in readers_of.items():
        members.setdefault(rd, []).append(r)
    if chosen == "scatter":
        blind_readers = sorted(rd for rd in members if not infos[rd]["sees"])
        if blind_readers:
            raise CheckpointError(f"scatter load: node reader rank(s) {blind_readers[:20]} cannot see {base}")
    # on an object store a scatter load has each node's reader fetch the index once for its node
    one_fetch = storage.is_url(base) and chosen == "scatter"
    fetches = [bool(i["sees"]) and (not one_fetch or readers_of[r] == r) for r, i in enumerate(infos)]
    out = []
    for r, i in enumerate(infos):
        rd = readers_of[r]
        out.append({"mode": chosen, "base": i["sees"], "reader": rd,
                    "node": {str(m): rd for m in members[rd]} if chosen == "scatter" else {},
                    "index_from": rd if not fetches[r] else None,
                    "index_to": [m for m in members[r] if not fetches[m]] if rd == r else []})
    return out


def _open_shared_index(comm: Comm, base: str, probe: Dict[str, Any]) -> Index:
    """This rank's index: opened from the checkpoint, or sent whole by its node's reader
    (for ranks that cannot see the directory), then read lazily like any other."""
    where = os.path.join(base, storage.MANIFEST_NAME)
    if probe["index_to"]:
        try:
            head, sections = read_index_bytes(base)
            own = index_from_bytes(head, sections, where)
            own.check_file = partial(check_file_size, base, index=own)
            own.reads_check_files = storage.is_url(base)
            # the ranks it goes to allocate from it and cannot check a file themselves. On an object
            # store they receive their bytes only through this reader, whose every GET checks the
            # object's size and ETag before any byte is delivered (and scatter allocates a
            # temporary only when its bytes arrive): a HEAD per object of the checkpoint per node
            # (40 million at 16,384 ranks) would buy nothing.
            if not storage.is_url(base):
                for name in own.files:
                    own.confirm_file(name)
        except BaseException:
            for m in probe["index_to"]:  # never leave a waiting rank behind
                comm.send(torch.tensor([-1, -1], dtype=torch.int64), m)
            raise
        for m in probe["index_to"]:
            comm.send(torch.tensor([len(head), len(sections)], dtype=torch.int64), m)
            comm.send(torch.frombuffer(bytearray(head + sections), dtype=torch.uint8), m)
        return own
    if probe["index_from"] is not None:
        sizes = torch.zeros(2, dtype=torch.int64)
        comm.recv(sizes, probe["index_from"])
        nh, ns = (int(x) for x in sizes.tolist())
        if nh < 0:
            raise CheckpointError(f"{base}: this node's reader (rank {probe['index_from']}) could not read the index")
        buf = torch.empty(nh + ns, dtype=torch.uint8)
        comm.recv(buf, probe["index_from"])
        data = bytes(buf.numpy())
        return index_from_bytes(data[:nh], data[nh:], where)
    return open_index(base)


def load(
    state_dict: Mapping[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    mode: str = "auto",
    process_group: Any = None,
    strict: bool = True,
    verify: bool = False,
    check_crc: bool = True,
    scatter_chunk_bytes: int = DEFAULT_SCATTER_CHUNK,
    scatter_transport: str = "auto",
    threads: Optional[int] = None,
    timeout: Optional[float] = None,
    return_stats: bool = False,
) -> Any:
    """Load a checkpoint into the template ``state_dict``; collective: every rank of
    ``process_group`` calls it with the template of what it holds.

    ``state_dict``: the template, shaped like what was saved: ``ShardedTensor`` leaves describe
    which part of each global tensor this rank wants, in any TP/PP/VP/EP/DP layout, and are
    filled in place (:func:`megashard.sharded_state_dict` builds them from a model; without
    data, a tensor is allocated); plain tensors are filled in place when shape and dtype match;
    other leaves are replaced by the saved values.
    ``checkpoint_dir``: a checkpoint directory or ``s3://`` URL.
    ``mode``: ``"own"`` (every rank reads its own byte ranges), ``"scatter"`` (one reader per
    node reads and hands the node's ranks their bytes), ``"readonce"`` (every byte the job needs
    is read once, by ranks spread over all nodes, and sent over the process group to the ranks
    that need it) or ``"auto"`` (when every rank sees the checkpoint: ``own`` on one node,
    ``readonce`` on several, up to 1,024 ranks; else ``scatter``); see ``docs/loading.md``.
    ``process_group``: the ranks that load together (default: the world).
    ``strict``: missing keys, dtype and global-shape mismatches raise one ``StateDictError``
    listing them all; ``False`` loads what matches, logs the rest and returns ``None`` for a
    shard it cannot fill (never uninitialised memory).
    ``verify``: after the load, re-read every file region it read and check its structure,
    CRC32 and SHA-256 (also covers bytes a resharding load read only in part).
    ``check_crc``: check every saved tensor the load reads whole against the CRC32 its index
    records, in memory, as it arrives (default on; a mismatch raises ``ChecksumError`` naming the
    file and tensor). A saved tensor that a resharding load reads only in part is not checked
    (its CRC32 covers all of it): ``verify=True`` checks those too.
    ``scatter_chunk_bytes``, ``scatter_transport``: the ring slot size and transport
    (``"auto"``, ``"shm"``, ``"group"``) of a scatter load; ``scatter_chunk_bytes`` is also the
    largest extent (staging buffer, message) of a readonce load.
    ``threads``: reader threads per rank (default: from the CPU count).
    ``timeout``: seconds that bound every collective and the wait for an earlier async save's
    write; default: the process group's.
    ``return_stats``: return ``(result, LoadStats)`` instead.

    Returns the loaded state: the template's structure with each ShardedTensor replaced by
    its filled tensor, each ShardedObject by its value, plus what this rank saved that the
    template lacks. Raises on every rank if any rank fails. Read-only: never renames or
    deletes anything in the checkpoint's parent.
    """
    if mode not in ("auto", "own", "scatter", "readonce"):
        raise ValueError(f"mode must be 'auto', 'own', 'scatter' or 'readonce', got {mode!r}")
    if scatter_transport not in readers.SCATTER_TRANSPORTS:
        raise ValueError(f"scatter_transport must be one of {readers.SCATTER_TRANSPORTS}, got {scatter_transport!r}")
    comm = Comm(process_group, timeout)
    base = storage.location(checkpoint_dir)
    t0 = time.perf_counter()
    stats = LoadStats()

    info, err = comm.run("load/probe", lambda: _probe(base))
    probe = comm.coordinate(f"load of {base}", err, info, lambda infos: plan_probe(infos, base, mode))  # collective 1
    base = probe["base"] or base  # an interrupted re-save's copy is read where it is
    chosen = stats.mode = probe["mode"]
    node = {int(r): rd for r, rd in probe["node"].items()}

    index, err = comm.run("load/index", lambda: _open_shared_index(comm, base, probe))
    work = _LoadWork(rows_ok=chosen == "own", check_crc=check_crc and not verify,  # verify re-reads every byte
                     base=base)

    def plan_local() -> Any:
        saved = _decode_saved_tree(index.tree_for_rank(comm.rank), index, work, lazy=True)
        res = _merge_template(dict(state_dict), saved, (), work, index, _Objects(index, work), strict)
        if work.problems and strict:
            raise StateDictError(_format_problems(work.problems, base))
        for p in work.problems:
            log.warning("%s%s", rank_prefix(comm), p)
        return res

    try:
        if err is None:
            result, err = comm.run("load/plan", torch.no_grad()(plan_local))
        comm.agree(err, f"load of {base}")
        if chosen == "own":
            nread, err = comm.run("load/read", lambda: readers.read_own(base, index, work.ops, work.view_ops,
                                                                          work.row_jobs, threads, work.arrived))
            stats.bytes_read = nread or 0
        elif chosen == "readonce":
            try:
                (nread, nrecv, stats.buffer_peak), err = readers.read_once(comm, base, index, work.ops,
                                                                           scatter_chunk_bytes, threads,
                                                                           probe["reader"])
            except Exception as e:  # noqa: BLE001 - must reach the final agreement, never skip it
                (nread, nrecv), err = (0, 0), f"{type(e).__name__}: read-once transfer failed: {e}"
            stats.bytes_read, stats.bytes_received = nread, nrecv
        else:
            try:
                (nread, nrecv, stats.transport), err = readers.scatter(
                    comm, base, index, work.ops, work.touched, node, scatter_chunk_bytes, threads, scatter_transport)
            except Exception as e:  # noqa: BLE001 - must reach the final agreement, never skip it
                (nread, nrecv), err = (0, 0), f"{type(e).__name__}: scatter transfer failed: {e}"
            stats.bytes_read, stats.bytes_received = nread, nrecv
        if err is None:
            @torch.no_grad()
            def fin() -> None:
                for f in work.finish:
                    f()
                stats.crc_checked = check_crcs(list(work.crcs.values()), base, threads)
                if verify and (chosen == "own" or node.get(comm.rank, comm.rank) == comm.rank):
                    readers.verify_delivered(base, work.touched, index)
            _, err = comm.run("load/finish", fin)
        comm.agree(err, f"load of {base}")  # final: all succeeded or all raise
    finally:
        if index is not None:
            stats.index_bytes_read = index.bytes_read
            index.close()
    total = comm.all_reduce([stats.bytes_read])[0]
    stats.seconds = time.perf_counter() - t0
    log_summary(log, comm, "loaded", base, total, stats.seconds,
                f"{chosen} mode{', verified' if verify else ', CRC32 checked' if check_crc else ', unchecked'}")
    out = _finalize_tree(result)
    return (out, stats) if return_stats else out


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
    only the requested ``keys`` are decoded (and, in a version-2 index, read). ``strict``:
    an unregistered enum raises CheckpointError instead of loading as a placeholder.
    """
    comm = Comm(process_group, timeout)
    base = storage.location(checkpoint_dir)

    def read() -> Any:
        if comm.rank != 0 and comm.world_size > 1:
            return None
        index = open_index(storage.checkpoint_location(base))
        try:
            tree = index.tree_for_rank(0, keys)
            if isinstance(tree, dict) and jsonstate.TAG not in tree and keys is not None:
                tree = {k: v for k, v in tree.items() if k in keys}  # decode only what was asked for
            value = _decode_saved_tree(tree, index, _LoadWork(), lazy=True)
        finally:
            index.close()
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
    comm.agree(err, f"load_common of {base}")
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

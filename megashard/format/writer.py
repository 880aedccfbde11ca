"""Write `.tensors` files: tensorizer's bytes, faster.

Why it is faster than tensorizer's writer on the same CPUs:

* CRC32 with ISA-L (``isal.isal_zlib.crc32``, ~10 GiB/s vs zlib's ~2-3), so
  SHA-256 (OpenSSL, GIL released) is the only expensive hash; ``sha256=False``
  leaves it out (CRC32-only headers, tensorizer's ``include_sha256=False`` variant).
* Each large tensor is processed in cache-sized chunks: SHA-256, CRC32 and
  ``os.pwrite`` of a chunk run back-to-back while it is in L2, so tensor memory
  is read from DRAM once; tensors are spread over threads largest first.
* A tensor larger than its share of the work is split: one task hashes it with
  SHA-256 (inherently sequential) while other tasks CRC and write its chunks
  (CRCs joined with ``crc32_combine``).
* Runs of small tensors are assembled (headers + data) in one buffer, hashed and
  written with a single ``pwrite``.

The file header and metadata index are written last, so a crashed write never
leaves a file that looks complete.

``direct=True`` writes the block-aligned body of every large tensor with ``O_DIRECT``
through reused page-aligned bounce buffers (the copy into them is the pass that hashes),
so those bytes never enter the page cache: no page-cache pages are allocated and dirtied
for them, and the final fsync has only headers and small tensors left to flush. Where
the page cache is the slow part (on the 2-vCPU VM: allocating fresh pages costs more
than the disk), that halves a save; the price is that the file is not cached for a
reader on the same node afterwards. Filesystems without ``O_DIRECT`` fall back to the
page cache. The bytes written are the same either way.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import threading
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Mapping, Tuple

import numpy
import torch
from isal import isal_zlib

from ..errors import FormatError, UnsupportedFormatError
from . import layout as L
from .dtypes import DtypeCodec, encode_dtype
from .fastio import default_threads, io_pool, io_role, pwrite_all, take_io_role, tensor_memoryview

log = logging.getLogger(__name__)

__all__ = ["save_file", "write_file", "file_segments"]

HASH_CHUNK = 256 << 10  # fits L2 next to the hash state: hash, crc and write it while hot
SMALL_TENSOR = 1 << 20  # below this, tensors are packed with their neighbours
GROUP_BYTES = 8 << 20
SPLIT_MIN = 64 << 20
COPY_TASK_BYTES = 64 << 20
MAX_ALIGN = 1 << 24
INLINE_BYTES = 4 << 20  # smaller files are written by the calling thread alone
EARLY_WRITEBACK_MIN = 64 << 20  # below this the final fsync is short anyway
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory aligned (covers 512 B and 4 KiB sectors)
DIRECT_BUF = 4 << 20  # one bounce buffer (two per writing thread): large O_DIRECT writes, little memory
DIRECT_WRITERS = 8  # threads issuing O_DIRECT writes: one in flight per writing thread (at most 8)


@dataclass
class _Item:
    name: str
    name_b: bytes
    src: torch.Tensor | None  # contiguous CPU tensor; None for meta
    codec: DtypeCodec
    shape: tuple[int, ...]
    nbytes: int
    long_shape: bool
    header_offset: int = 0
    data_offset: int = 0
    plan: L.HeaderPlan | None = None
    crc32: int = 0
    sha256: bytes = b""

    @property
    def is_meta(self) -> bool:
        return self.src is None

    @property
    def end(self) -> int:
        return self.data_offset + self.nbytes


_DOC_ZERO = (
    "tensorizer 2.12.1's reader fails on a zero-element or meta tensor whose dtype numpy "
    "lacks (TypeError: data type '<V2...' not understood); keep such tensors out of the "
    "file (e.g. record their shape elsewhere) or store them as a numpy-representable dtype"
)


def _prepare(tensors: Mapping[str, torch.Tensor]) -> list[_Item]:
    """Validate keys/values and refuse anything tensorizer's reader would choke on."""
    if not isinstance(tensors, Mapping):
        raise FormatError(f"expected a mapping of str to tensors, got {type(tensors).__name__}")
    if len(tensors) == 0:
        raise FormatError(
            "refusing to write an empty state dict: tensorizer cannot open a .tensors file "
            "with no tensors ('Tensor index in the file is empty'); skip writing the file")
    if sys.byteorder != "little":
        raise UnsupportedFormatError("writing .tensors files needs a little-endian host")
    items: list[_Item] = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise FormatError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if not name:
            raise FormatError("empty tensor name: tensorizer cannot read an empty name")
        if name.startswith("\x1e"):
            raise FormatError(
                f"tensor name {name!r} starts with \\x1e, which tensorizer reads as a nested path")
        try:
            name_b = name.encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError(f"tensor name {name!r} is not encodable as UTF-8") from None
        if len(name_b) > 0xFFFF:
            raise FormatError(f"tensor name {name[:60]!r}... is {len(name_b)} bytes; the limit is 65535")
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise FormatError(f"{name!r}: {t.layout} tensors cannot be stored; convert to dense first")
        if t.is_quantized:
            raise FormatError(f"{name!r}: quantized tensors are not supported")
        codec = encode_dtype(t.dtype)
        shape = tuple(int(d) for d in t.shape)
        if len(shape) > 255:
            raise FormatError(f"{name!r}: {len(shape)} dimensions; the format allows 255")
        numel = t.numel()
        if t.is_meta or numel == 0:
            if codec.opaque:
                what = "meta" if t.is_meta else "zero-element"
                raise FormatError(f"{name!r}: refusing to write a {what} {t.dtype} tensor: {_DOC_ZERO}")
        if t.is_meta:
            src = None
            nbytes = 0
        else:
            src = t.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            src = src.resolve_conj().resolve_neg().contiguous()
            nbytes = numel * codec.itemsize
        long_shape = any(d >= L.LONG_DIM for d in shape)
        items.append(_Item(name, name_b, src, codec, shape, nbytes, long_shape))
    return items


def _plan(items: list[_Item], align: int, sha256: bool = True) -> tuple[int, int, int, int]:
    """Assign offsets; returns (version, flags, metadata_len, file_size). ``sha256=False``:
    CRC32-only headers."""
    version = L.VERSION_NON_OPAQUE
    if any(i.codec.opaque for i in items):
        version = L.VERSION_OPAQUE
    if any(i.is_meta for i in items):
        version = L.VERSION_META
    versioned = any(i.long_shape for i in items)
    flags = 0
    if versioned:
        version = L.VERSION_LONG
        flags = L.FLAG_VERSIONED_HEADERS
    needed = sum(L.metadata_entry_size(len(i.name_b), len(i.codec.encoded), len(i.shape),
                                       i.long_shape, versioned) for i in items)
    if align == 1:
        metadata_len = max(L.TENSORIZER_METADATA_SIZE, needed)  # identical to tensorizer
    else:
        page = min(align, 4096)
        metadata_len = needed + (-(L.PROLOGUE_SIZE + needed)) % page
    pos = L.PROLOGUE_SIZE + metadata_len
    for it in items:
        base = L.header_size(len(it.name_b), len(it.codec.encoded), len(it.shape), it.long_shape, sha256=sha256)
        pad = (-(pos + base)) % align if it.nbytes else 0
        it.header_offset = pos
        it.plan = L.build_header(0, L.TENSOR_TYPE_STATE_DICT, it.name_b, it.codec.encoded,
                                 it.shape, it.long_shape, it.nbytes, pad, sha256)
        it.data_offset = pos + len(it.plan.buf)
        pos = it.end
    return version, flags, metadata_len, pos + len(L.TERMINATOR)


def _check_align(align: int) -> None:
    if not isinstance(align, int) or align < 1 or align > MAX_ALIGN or align & (align - 1):
        raise FormatError(f"align must be a power of two between 1 and {MAX_ALIGN}, got {align!r}")


def _metadata(items: list[_Item], flags: int, metadata_len: int) -> bytes:
    """The metadata index, zero-filled to ``metadata_len`` (offsets from :func:`_plan`)."""
    versioned = bool(flags & L.FLAG_VERSIONED_HEADERS)
    meta = b"".join(
        L.pack_metadata_entry(i.name_b, L.TENSOR_TYPE_STATE_DICT, i.codec.encoded, i.shape,
                              i.long_shape, i.header_offset, i.data_offset, i.nbytes, versioned)
        for i in items)
    return meta + bytes(metadata_len - len(meta))


def _prologue(items: list[_Item], version: int, flags: int, metadata_len: int) -> bytes:
    return L.pack_prologue(version, flags, sum(i.nbytes for i in items), len(items), metadata_len)


def _infos(items: list[_Item]) -> list[L.TensorInfo]:
    return [L.TensorInfo(i.name, i.codec.dtype, i.shape, i.header_offset, i.data_offset, i.nbytes,
                         i.crc32, i.sha256.hex(), L.TENSOR_TYPE_STATE_DICT, i.is_meta)
            for i in items]


# ------------------------------------------------------------------ direct I/O


class _Bounce:
    """Page-aligned buffers for O_DIRECT writes, kept for the process's life and reused
    (fresh memory would cost a page fault per 4 KiB on every save)."""

    _free: list[mmap.mmap] = []
    _lock = threading.Lock()

    @classmethod
    def after_fork_in_child(cls) -> None:
        cls._free, cls._lock = [], threading.Lock()  # private copies; the lock may have been held

    def __enter__(self) -> tuple[memoryview, int]:
        with self._lock:
            self.buf = self._free.pop() if self._free else mmap.mmap(
                -1, DIRECT_BUF, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return memoryview(self.buf), ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._free.append(self.buf)


os.register_at_fork(after_in_child=_Bounce.after_fork_in_child)


class _Direct:
    """A second descriptor on the file being written, opened with ``O_DIRECT``."""

    def __init__(self, path: str) -> None:
        self.fd = -1
        self.usable = False
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
                self.usable = True
            except OSError as e:  # e.g. a filesystem without O_DIRECT: use the page cache
                log.debug("%s: O_DIRECT unavailable (%s); writing through the page cache", path, e.strerror)

    def write(self, fd: int, view: memoryview, off: int) -> None:
        """Write an aligned block run with O_DIRECT; through ``fd`` (the page cache) once
        refused. The descriptor stays open until :meth:`close`: other threads may be using it."""
        while len(view) and self.usable:
            try:
                n = os.pwrite(self.fd, view, off)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                log.debug("O_DIRECT write refused (%s); writing through the page cache", e.strerror)
                self.usable = False
                break
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
            view, off = view[n:], off + n
            if n % DIRECT_ALIGN:  # short and unaligned: the rest through the page cache
                break
        if len(view):
            pwrite_all(fd, view, off)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_hashed(fd: int, direct: "_Direct | None", mv: memoryview, src_addr: int, lo: int, hi: int,
                  off: int, sha: "hashlib._Hash | None", crc: int) -> int:
    """Write ``mv[lo:hi]`` at file offset ``off + lo`` in cache-sized chunks, CRC32 (and
    SHA-256 with ``sha``) on the way; returns the CRC. With ``direct``, the block-aligned
    part goes through two bounce buffers with O_DIRECT: one is filled (``memmove``, which
    releases the GIL) and hashed while in cache, while the other is being written."""
    p = lo
    if direct is not None and direct.usable and (off + lo) % DIRECT_ALIGN == 0 and hi - lo >= DIRECT_ALIGN:
        body_end = lo + (hi - lo) // DIRECT_ALIGN * DIRECT_ALIGN
        pending: list[Future[None] | None] = [None, None]
        with _Bounce() as first, _Bounce() as second:
            bounce = (first, second)
            try:
                k = 0
                while p < body_end:
                    if pending[k] is not None:
                        pending[k].result()  # this buffer's previous write is done: reuse it
                        pending[k] = None
                    buf, addr = bounce[k]
                    n = min(DIRECT_BUF, body_end - p)
                    for q in range(0, n, HASH_CHUNK):
                        m = min(HASH_CHUNK, n - q)
                        ctypes.memmove(addr + q, src_addr + p + q, m)
                        piece = buf[q:q + m]
                        if sha is not None:
                            sha.update(piece)
                        crc = isal_zlib.crc32(piece, crc)
                    pending[k] = io_pool(DIRECT_WRITERS).submit(direct.write, fd, buf[:n], off + p)
                    p += n
                    k ^= 1
            finally:  # no buffer goes back to the pool while a write still reads it
                errors = []
                for f in pending:
                    if f is not None:
                        try:
                            f.result()
                        except BaseException as e:  # noqa: BLE001 - re-raised below
                            errors.append(e)
            if errors:
                raise errors[0]
    for q in range(p, hi, HASH_CHUNK):
        chunk = mv[q:min(hi, q + HASH_CHUNK)]
        if sha is not None:
            sha.update(chunk)
        crc = isal_zlib.crc32(chunk, crc)
        pwrite_all(fd, chunk, off + q)
    return crc


# ------------------------------------------------------------------ hashing tasks


def _sha_of(it: _Item) -> "hashlib._Hash | None":
    """SHA-256 state started over the tensor's header (hash values zeroed); None for a
    CRC32-only header (``sha256=False``)."""
    assert it.plan is not None
    return hashlib.sha256(it.plan.buf) if it.plan.sha_at is not None else None


def _finish_item(it: _Item, crc: int, sha: "hashlib._Hash | None") -> bytearray:
    """Record the tensor's hashes and patch them into its header (returned)."""
    assert it.plan is not None
    it.crc32, it.sha256 = crc, sha.digest() if sha is not None else b""
    return it.plan.finish(it.crc32, it.sha256 if sha is not None else None)


def _fused_task(fd: int, it: _Item, direct: "_Direct | None" = None) -> Callable[[], None]:
    """Hash + write one tensor chunk by chunk, then its header."""
    def task() -> None:
        assert it.plan is not None and it.src is not None
        sha = _sha_of(it)
        crc = _write_hashed(fd, direct, tensor_memoryview(it.src), it.src.data_ptr(), 0, it.nbytes, it.data_offset,
                            sha, isal_zlib.crc32(it.plan.buf))
        pwrite_all(fd, memoryview(_finish_item(it, crc, sha)), it.header_offset)
    return task


def _group_task(fd: int, group: list[_Item]) -> Callable[[], None]:
    """Assemble consecutive small tensors (headers + data) in one buffer, one pwrite."""
    def task() -> None:
        start = group[0].header_offset
        buf = bytearray(group[-1].end - start)
        base = numpy.frombuffer(buf, dtype=numpy.uint8).ctypes.data
        view = memoryview(buf)
        for it in group:
            assert it.plan is not None
            h0 = it.header_offset - start
            d0 = it.data_offset - start
            view[h0:d0] = it.plan.buf
            if it.nbytes:
                assert it.src is not None
                ctypes.memmove(base + d0, it.src.data_ptr(), it.nbytes)
            region = view[h0:d0 + it.nbytes]
            sha = hashlib.sha256(region) if it.plan.sha_at is not None else None
            view[h0:d0] = _finish_item(it, isal_zlib.crc32(region), sha)
        pwrite_all(fd, view, start)
    return task


class _Split:
    """A tensor too large for one task: SHA-256 in one task (none for a CRC32-only
    header), CRC+write in others."""

    def __init__(self, fd: int, it: _Item, direct: "_Direct | None" = None) -> None:
        self.fd, self.it, self.direct = fd, it, direct
        self.mv = tensor_memoryview(it.src) if it.src is not None else memoryview(b"")
        n = it.nbytes
        self.ranges = [(p, min(n, p + COPY_TASK_BYTES)) for p in range(0, n, COPY_TASK_BYTES)]
        self.crcs: list[int] = [0] * len(self.ranges)
        self.sha = _sha_of(it)

    @property
    def hashes_sha256(self) -> bool:
        return self.sha is not None

    def sha_task(self) -> None:
        assert self.sha is not None
        for p in range(0, len(self.mv), 4 << 20):
            self.sha.update(self.mv[p:p + (4 << 20)])

    def copy_task(self, k: int) -> Callable[[], None]:
        def task() -> None:
            lo, hi = self.ranges[k]
            assert self.it.src is not None
            self.crcs[k] = _write_hashed(self.fd, self.direct, self.mv, self.it.src.data_ptr(), lo, hi,
                                         self.it.data_offset, None, 0)
        return task

    def finish(self) -> None:
        it = self.it
        assert it.plan is not None
        crc = isal_zlib.crc32(it.plan.buf)
        for (lo, hi), c in zip(self.ranges, self.crcs):
            crc = isal_zlib.crc32_combine(crc, c, hi - lo)
        pwrite_all(self.fd, memoryview(_finish_item(it, crc, self.sha)), it.header_offset)


def _build_tasks(fd: int, items: list[_Item], threads: int,
                 direct: "_Direct | None" = None) -> tuple[list[Callable[[], None]], list[_Split]]:
    """Tasks in the order to start them: split hashes, largest fused tensors, groups."""
    total = sum(i.nbytes for i in items)
    split_at = max(SPLIT_MIN, total // max(1, threads))
    splits: list[_Split] = []
    weighted: list[tuple[int, Callable[[], None]]] = []
    group: list[_Item] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            weighted.append((group_bytes, _group_task(fd, group)))
            group, group_bytes = [], 0

    for it in items:
        if it.nbytes < SMALL_TENSOR:
            group.append(it)
            group_bytes += it.nbytes + len(it.plan.buf if it.plan else b"")
            if group_bytes >= GROUP_BYTES:
                flush()
            continue
        flush()
        if threads > 1 and it.nbytes > split_at:
            splits.append(_Split(fd, it, direct))
        else:
            weighted.append((it.nbytes, _fused_task(fd, it, direct)))
    flush()
    tasks: list[Callable[[], None]] = [s.sha_task for s in splits if s.hashes_sha256]
    tasks += [s.copy_task(k) for s in splits for k in range(len(s.ranges))]
    tasks += [t for _, t in sorted(weighted, key=lambda w: -w[0])]
    return tasks, splits


def _run(tasks: list[Callable[[], None]], threads: int) -> None:
    if threads <= 1 or len(tasks) <= 1:
        for t in tasks:
            t()
        return
    # the threads serve the caller's I/O role (their direct writes use the caller's pools)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megashard-write",
                            initializer=take_io_role, initargs=io_role()) as pool:
        futures = [pool.submit(t) for t in tasks]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


class _EarlyWriteback:
    """While tensors are hashed and written, keep flushing what is already written.

    The disk then works during the (CPU-bound) hashing instead of after it, so the
    final fsync has little left to do. Only used when the caller asked for fsync.
    """

    def __init__(self, fd: int, enabled: bool) -> None:
        self.fd, self.enabled = fd, enabled
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                os.fdatasync(self.fd)
            except OSError:
                return  # the final fsync reports real errors
            self.stop.wait(0.02)

    def __enter__(self) -> "_EarlyWriteback":
        if self.enabled:
            self.thread = threading.Thread(target=self._loop, name="megashard-writeback", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def _planned(tensors: Mapping[str, torch.Tensor], align: int, threads: int | None,
             sha256: bool = True) -> tuple[list[_Item], int, int, int, int, int]:
    """What :func:`write_file` and :func:`file_segments` both start from: the checked items,
    their layout (version, flags, metadata length, file size) and the thread count."""
    _check_align(align)
    items = _prepare(tensors)
    if not isinstance(sha256, bool):
        raise FormatError(f"sha256 must be True or False, got {sha256!r}")
    version, flags, metadata_len, file_size = _plan(items, align, sha256)
    nthreads = threads if threads is not None else default_threads()
    if nthreads < 1:
        raise FormatError(f"threads must be >= 1, got {threads}")
    if sum(i.nbytes for i in items) < INLINE_BYTES:
        nthreads = 1  # starting threads would cost more than they save
    return items, version, flags, metadata_len, file_size, nthreads


def write_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *,
               align: int = 4096, fsync: bool = False,
               threads: int | None = None, direct: bool = False, sha256: bool = True) -> list[L.TensorInfo]:
    """Write `tensors` as a tensorizer `.tensors` file; return the entries in file order.

    align=1 reproduces tensorizer's write_state_dict byte for byte; align>1
    (power of two) pads inside each tensor header so that data starts on an
    `align` boundary. fsync=True makes the file durable before returning.
    direct=True writes large tensors' data with O_DIRECT (see the module docstring;
    it needs align >= 4096 to apply and otherwise changes nothing).
    sha256=False writes CRC32-only tensor headers (tensorizer's ``include_sha256=False``
    variant, one hash; its readers verify it) and computes no SHA-256, the dearest part
    of a save's CPU time; the infos' ``sha256`` is then ``""``.
    """
    path_s = os.fspath(path)
    items, version, flags, metadata_len, file_size, nthreads = _planned(tensors, align, threads, sha256)

    fd = os.open(path_s, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    ok = False
    dio: _Direct | None = None
    try:
        if direct and align >= DIRECT_ALIGN and any(i.nbytes >= DIRECT_ALIGN for i in items):
            dio = _Direct(path_s)
            if dio.usable:
                os.ftruncate(fd, file_size)  # direct writes then never extend the file (no inode-wide lock)
        tasks, splits = _build_tasks(fd, items, nthreads, dio)
        # early writeback would flush the device cache under the direct writes; what goes
        # through the page cache then is small
        with _EarlyWriteback(fd, enabled=fsync and file_size >= EARLY_WRITEBACK_MIN and not (dio is not None and dio.usable)):
            _run(tasks, nthreads)
        for s in splits:
            s.finish()
        pwrite_all(fd, memoryview(L.TERMINATOR), items[-1].end)
        pwrite_all(fd, memoryview(_metadata(items, flags, metadata_len)), L.PROLOGUE_SIZE)
        # The prologue goes last: until it is written the file has no magic.
        pwrite_all(fd, memoryview(_prologue(items, version, flags, metadata_len)), 0)
        if fsync:
            os.fsync(fd)  # also flushes the device cache under the O_DIRECT writes
        ok = True
    finally:
        if dio is not None:
            dio.close()
        os.close(fd)
        if not ok:
            try:
                os.unlink(path_s)
            except OSError:
                pass
    if fsync:
        _fsync_dir(path_s)
    log.debug("wrote %s: %d tensors, %d bytes, data version %d", path_s, len(items), file_size, version)
    return _infos(items)


def _hash_item(it: _Item) -> None:
    """CRC32 and SHA-256 of one tensor (header with zeroed hashes, then data) in cache-sized
    chunks, both while the chunk is hot; patches them into its header."""
    assert it.plan is not None
    sha = _sha_of(it)
    crc = isal_zlib.crc32(it.plan.buf)
    if it.nbytes:
        assert it.src is not None
        mv = tensor_memoryview(it.src)
        if sha is None:
            crc = isal_zlib.crc32(mv, crc)  # CRC32 alone: no reason to chunk
        else:
            for q in range(0, it.nbytes, HASH_CHUNK):
                chunk = mv[q:q + HASH_CHUNK]
                sha.update(chunk)
                crc = isal_zlib.crc32(chunk, crc)
    _finish_item(it, crc, sha)


def file_segments(tensors: Mapping[str, torch.Tensor], *, align: int = 4096, threads: int | None = None,
                  sha256: bool = True) -> Tuple[int, List[Tuple[int, memoryview]], List[L.TensorInfo]]:
    """The bytes :func:`write_file` would write, as ``(size, segments, infos)`` for storage
    that takes a file as parts (an object store's multipart upload) rather than a descriptor.

    ``segments`` are ``(offset, read-only view)`` tiling ``[0, size)`` in order: prologue,
    metadata index, then per tensor its header (hashes filled in) and a view of its data
    (no copy; none for zero-length and meta tensors), then the terminator. Each tensor is
    hashed here (tensors spread over ``threads``); the views share the tensors' memory, so
    the tensors must not change until the segments have been sent. ``infos`` are
    :func:`write_file`'s. Same layout code as :func:`write_file`, so the bytes are equal.
    (:func:`file_segments_deferred` returns before the hashes are done.)
    """
    size, segments, hashes = file_segments_deferred(tensors, align=align, threads=threads, sha256=sha256)
    return size, segments, hashes.finish()


class DeferredHashes:
    """The hashing of :func:`file_segments_deferred`: tensors hashed in file order on
    background threads while their data may already be sent.

    Only the tensor headers hold hashes, so only bytes inside :attr:`ranges` (each
    tensor's header) wait: a sender calls :meth:`wait` for a byte range before sending it.
    :meth:`finish` joins the threads (re-raising a hashing failure) and returns the infos.
    """

    def __init__(self, items: List[_Item], nthreads: int) -> None:
        self._items = items
        self.ranges: List[Tuple[int, int]] = []  # (start, end) of each tensor's header, in file order
        for it in items:
            assert it.plan is not None
            self.ranges.append((it.header_offset, it.header_offset + len(it.plan.buf)))
        self._ends = [e for _, e in self.ranges]
        self._done = [threading.Event() for _ in items]
        self._lock = threading.Lock()
        self._next = 0
        self._stop = False
        self._error: BaseException | None = None
        n = max(1, min(nthreads, len(items)))
        self._threads = [threading.Thread(target=self._work, name="megashard-hash", daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                i = self._next
                if self._stop or i >= len(self._items):
                    return
                self._next += 1
            try:
                _hash_item(self._items[i])
            except BaseException as e:  # noqa: B902 - handed to whoever waits
                with self._lock:
                    self._error = self._error or e
                    self._stop = True
                for ev in self._done:
                    ev.set()
                return
            self._done[i].set()

    def wait(self, a: int, b: int) -> None:
        """Block until every header overlapping bytes ``[a, b)`` holds its hashes (a bisection: an
        upload asks once per header, so a file of many tensors must not cost a scan per ask)."""
        i = bisect.bisect_right(self._ends, a)  # ranges are in file order and disjoint
        while i < len(self.ranges) and self.ranges[i][0] < b:
            self._done[i].wait()
            i += 1
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Hash no further tensor (the upload failed); :meth:`finish` still joins the threads."""
        with self._lock:
            self._stop = True

    def finish_quietly(self) -> None:
        """Join the threads without raising (the caller is already failing)."""
        for t in self._threads:
            t.join()

    def finish(self) -> List[L.TensorInfo]:
        """Join the hashing threads; the infos (:func:`write_file`'s) once every tensor is hashed."""
        for t in self._threads:
            t.join()
        if self._error is not None:
            raise self._error
        if not all(ev.is_set() for ev in self._done):
            raise FormatError("hashing was cancelled before every tensor was hashed")
        return _infos(self._items)


def file_segments_deferred(tensors: Mapping[str, torch.Tensor], *, align: int = 4096, threads: int | None = None,
                           sha256: bool = True) -> Tuple[int, List[Tuple[int, memoryview]], DeferredHashes]:
    """:func:`file_segments` without waiting for the hashes: the segments at once (the
    tensors' headers are filled in as each tensor is hashed) and the :class:`DeferredHashes`
    that says when a byte range is final and, at the end, gives the infos. Lets an upload
    send data while the file's tensors are still being hashed."""
    items, version, flags, metadata_len, file_size, nthreads = _planned(tensors, align, threads, sha256)
    segments: List[Tuple[int, memoryview]] = [
        (0, memoryview(_prologue(items, version, flags, metadata_len))),
        (L.PROLOGUE_SIZE, memoryview(_metadata(items, flags, metadata_len)))]
    for it in items:
        assert it.plan is not None
        segments.append((it.header_offset, memoryview(it.plan.buf).toreadonly()))
        if it.nbytes:
            assert it.src is not None
            segments.append((it.data_offset, tensor_memoryview(it.src).toreadonly()))
    segments.append((items[-1].end, memoryview(L.TERMINATOR)))
    return file_size, segments, DeferredHashes(items, nthreads)


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *,
              align: int = 4096, fsync: bool = False, threads: int | None = None, direct: bool = False,
              sha256: bool = True) -> None:
    """Like :func:`write_file`, without returning the entries."""
    write_file(tensors, path, align=align, fsync=fsync, threads=threads, direct=direct, sha256=sha256)


def _fsync_dir(path: str) -> None:
    """Make the directory entry durable too (a new file is not durable without it)."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


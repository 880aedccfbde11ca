"""Read `.tensors` files (tensorizer data versions 1, 2, 4, 5) straight into tensors.

Opening a file reads and validates the prologue and the metadata index only
(sizes are checked against the file size before anything is allocated).
Tensor headers are read lazily: for ``info()``/``infos()`` and for hash
verification. Plain reads trust the index (as tensorizer trusts its index to
size buffers) and go straight to ``os.preadv`` into the destination memory.
``mmap=True`` reads return views of one private (copy-on-write) mapping of the
whole file instead of copies.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
from typing import Iterator, Sequence

import torch
from isal import isal_zlib

from ..errors import ChecksumError, FormatError
from . import layout as L
from .fastio import default_read_threads, empty_buffer, preadv_all, read_requests, run_parallel, tensor_memoryview

log = logging.getLogger(__name__)

__all__ = ["TensorFileReader", "MissingTensorError", "open_file", "load_file"]

MAX_HEADER = 32 << 20  # generous: align <= 16 MiB padding + 64 KiB name + 255 dims
VERIFY_CHUNK = 256 << 10
LOAD_ALIGN = 64


class MissingTensorError(FormatError, KeyError):
    """The requested key is not in the file (also a KeyError, for mapping-style callers)."""

    __str__ = Exception.__str__


class TensorFileReader:
    """An open `.tensors` file. Use as a context manager; thread-safe for reads."""

    _map: torch.Tensor | None = None  # the whole file, mapped copy-on-write (made on first mmap read)

    def __init__(self, path: str | os.PathLike[str], *, threads: int | None = None,
                 dir_fd: int | None = None, nofollow: bool = False, shown: str | None = None) -> None:
        """``dir_fd``/``nofollow``: open ``path`` relative to an open directory and refuse a
        symbolic link (checkpoint shards must not lead out of their directory). ``shown``: the
        name messages give the file (an object's URL when ``path`` is a copy of it in memory),
        so even an error while opening names what the user has, not ``/proc/self/fd/N``."""
        self.path = shown or os.fspath(path)
        self._threads = threads or default_read_threads()
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
        try:
            self._fd = os.open(os.fspath(path), flags, dir_fd=dir_fd)
        except OSError as e:
            why = "a symbolic link (refused)" if nofollow and e.errno == errno.ELOOP else e.strerror
            raise FormatError(f"{self.path}: cannot open: {why}") from e
        self._headers: dict[str, L.ParsedHeader] = {}
        self._lock = threading.Lock()
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{self.path}: not a regular file")
            self._size = st.st_size
            prologue = self._pread(0, min(L.PROLOGUE_SIZE, self._size))
            self._file_header = L.parse_prologue(prologue, self.path, self._size)
            meta = self._pread(L.PROLOGUE_SIZE, self._file_header.metadata_len)
            entries = L.parse_metadata(meta, self._file_header, self.path)
            L.validate_entries(entries, self._file_header, self.path, self._size)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self._entries = entries
        self._by_name = {e.name: e for e in entries}

    # ------------------------------------------------------------ basics
    @property
    def version(self) -> int:
        """The file's tensorizer data version."""
        return self._file_header.version

    @property
    def file_size(self) -> int:
        return self._size

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return [e.name for e in self._entries]

    def __contains__(self, key: object) -> bool:
        return key in self._by_name

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __enter__(self) -> "TensorFileReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file; tensors already mapped from it stay valid (they own the mapping)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._map = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._fd < 0:
            raise FormatError(f"{self.path}: reader is closed")

    def _pread(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        if n:
            preadv_all(self._fd, [memoryview(buf)], offset, self.path)
        return bytes(buf)

    def _entry(self, key: str) -> L.MetaEntry:
        e = self._by_name.get(key)
        if e is None:
            raise MissingTensorError(f"{self.path}: no tensor named {key!r}")
        return e

    def _header(self, e: L.MetaEntry) -> L.ParsedHeader:
        h = self._headers.get(e.name)
        if h is None:
            self._check_open()
            n = e.data_offset - e.header_offset
            if n > MAX_HEADER:
                raise FormatError(f"{self.path}: tensor {e.name!r}: header of {n} bytes is implausibly large")
            h = L.parse_header(self._pread(e.header_offset, n), e, self.path)
            if h.crc32 is None:
                raise FormatError(f"{self.path}: tensor {e.name!r}: header lacks the CRC32 hash")
            with self._lock:
                self._headers[e.name] = h
        return h

    # ------------------------------------------------------------ info
    def info(self, key: str) -> L.TensorInfo:
        """Entry details including the stored hashes (reads the tensor's header)."""
        e = self._entry(key)
        h = self._header(e)
        assert h.crc32 is not None
        return L.TensorInfo(e.name, e.codec.dtype, e.shape, e.header_offset, e.data_offset,
                            e.data_length, h.crc32, h.sha256.hex() if h.sha256 is not None else "",
                            e.tensor_type, e.is_meta)

    def infos(self) -> list[L.TensorInfo]:
        return [self.info(e.name) for e in self._entries]

    # ------------------------------------------------------------ reading
    def _check_out(self, e: L.MetaEntry, out: torch.Tensor, numel: int, what: str) -> None:
        where = f"{self.path}: tensor {e.name!r}"
        if not isinstance(out, torch.Tensor):
            raise FormatError(f"{where}: out must be a tensor, got {type(out).__name__}")
        if out.dtype != e.codec.dtype:
            raise FormatError(f"{where}: out has dtype {out.dtype}, {what} is {e.codec.dtype}")
        if out.numel() != numel:
            raise FormatError(f"{where}: out has {out.numel()} elements, {what} has {numel}")
        if out.device.type != "cpu":
            raise FormatError(f"{where}: out must be a CPU tensor (got {out.device})")
        if not out.is_contiguous():
            raise FormatError(f"{where}: out must be contiguous")

    def _new(self, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> torch.Tensor:
        return empty_buffer(nbytes).view(dtype).view(tuple(shape))

    def read(self, key: str, out: torch.Tensor | None = None, *, verify: bool = False,
             mmap: bool = False) -> torch.Tensor:
        """Read one tensor into `out` (any contiguous CPU tensor of the right dtype and numel).

        Without `out`, a new tensor is allocated. Meta entries (no data) come back
        as meta tensors, or zero-fill `out`. ``mmap=True``: a view of a private
        (copy-on-write) mapping of the file instead of a copy; see :meth:`load`.
        """
        self._check_open()
        e = self._entry(key)
        if mmap and out is not None:
            raise FormatError(f"{self.path}: tensor {e.name!r}: mmap=True returns a mapped tensor; "
                              "it cannot fill out= (drop one of them)")
        if out is not None:
            self._check_out(e, out, e.numel, "the stored tensor")
        if e.is_meta:
            if verify:
                self.verify(key)
            if out is None:
                return torch.empty(e.shape, dtype=e.codec.dtype, device="meta")
            return out.zero_()
        if mmap and _mappable(e):
            t = self._mapped(e)
            if verify:
                self._verify_memory(e, tensor_memoryview(t))
            return t
        fresh = out is None
        dest = out if out is not None else self._new(e.codec.dtype, e.shape, e.data_length)
        mv = tensor_memoryview(dest)
        if e.data_length:
            read_requests(self._fd, [(e.data_offset, mv)], self.path, self._threads, fresh=fresh)
        if verify:
            self._verify_memory(e, mv)
        return dest

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read only rows [start, stop) along dim 0 (reads just those bytes; no hash check)."""
        self._check_open()
        e = self._entry(key)
        where = f"{self.path}: tensor {e.name!r}"
        if not e.shape:
            raise FormatError(f"{where}: read_rows needs at least one dimension (0-dim tensor)")
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= e.shape[0]):
            raise FormatError(f"{where}: rows [{start}, {stop}) out of range for dim 0 of size {e.shape[0]}")
        row_numel = 1
        for d in e.shape[1:]:
            row_numel *= d
        shape = (stop - start, *e.shape[1:])
        numel = (stop - start) * row_numel
        if out is not None:
            self._check_out(e, out, numel, f"rows [{start}, {stop})")
        if e.is_meta:
            if out is None:
                return torch.empty(shape, dtype=e.codec.dtype, device="meta")
            return out.zero_()
        row_bytes = row_numel * e.codec.itemsize
        nbytes = numel * e.codec.itemsize
        dest = out if out is not None else self._new(e.codec.dtype, shape, nbytes)
        if nbytes:
            read_requests(self._fd, [(e.data_offset + start * row_bytes, tensor_memoryview(dest))],
                          self.path, self._threads, fresh=out is None)
        return dest

    def load(self, keys: Sequence[str] | None = None, *, verify: bool = False,
             mmap: bool = False) -> dict[str, torch.Tensor]:
        """Read many tensors into one fresh buffer (pre-faulted in parallel); returns views into it.

        One allocation lets neighbouring small tensors share one preadv and the
        page faults be taken in batches (:func:`~megashard.format.fastio.prefault`).

        ``mmap=True``: views of one private, copy-on-write mapping of the whole file
        (``MAP_PRIVATE``), nothing is copied up front; pages are read from the page cache
        as they are first touched. Writes to such a tensor stay private to this process.
        The file must not be modified or truncated while any of them lives: the mapping
        shows later changes to pages not yet written to, and touching a page past a new
        end of file kills the process with SIGBUS. Tensors whose data is not aligned to
        their element size in the file (possible only in ``align=1`` and
        tensorizer-written files) are read into fresh memory instead, so every tensor
        is safe for every kernel. ``verify=True`` hashes the mapped bytes.
        """
        self._check_open()
        if keys is None:
            selected = list(self._entries)
        else:
            if isinstance(keys, str):
                raise FormatError(f"{self.path}: keys must be a sequence of names, not a str")
            selected = [self._entry(k) for k in dict.fromkeys(keys)]
        if not mmap:
            return self._load_copies(selected, verify)
        mapped = [e for e in selected if _mappable(e)]
        copies = self._load_copies([e for e in selected if not _mappable(e)], verify)
        views = {e.name: self._mapped(e) for e in mapped}
        if verify:
            tasks = [self._verify_task(e, tensor_memoryview(views[e.name]))
                     for e in sorted(mapped, key=lambda e: -e.data_length)]
            run_parallel(tasks, self._threads)
        if copies:
            log.debug("%s: %d of %d tensors are not aligned to their element size in the file: copied, "
                      "not mapped", self.path, sum(1 for e in selected if e.data_length and not _mappable(e)),
                      len(selected))
        return {e.name: views[e.name] if e.name in views else copies[e.name] for e in selected}

    def _mapping(self) -> torch.Tensor:
        """The whole file as one uint8 tensor over a private (copy-on-write) mapping, made once.

        The index was validated against the file size at open; the size is checked again
        here, so every entry lies inside the mapping. The mapping goes through
        ``/proc/self/fd`` (the very file this reader holds open, no second path lookup)
        and keeps no file descriptor; it lives as long as any tensor viewing it.
        """
        with self._lock:
            if self._map is not None:
                return self._map
            self._check_open()
            size = os.fstat(self._fd).st_size
            if size != self._size:
                raise FormatError(f"{self.path}: the file changed size since it was opened ({self._size} -> "
                                  f"{size} bytes); reopen it")
            try:
                # shared=False: MAP_PRIVATE, read-write, copy-on-write; torch checks the size again
                storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{self._fd}", shared=False, nbytes=size)
            except (RuntimeError, OSError) as e:
                raise FormatError(f"{self.path}: cannot map the file: {e}") from e
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._map = whole
            return whole

    def _mapped(self, e: L.MetaEntry) -> torch.Tensor:
        """A view of the mapping holding entry `e` (data non-empty and aligned to its element size)."""
        whole = self._mapping()
        return whole[e.data_offset:e.data_offset + e.data_length].view(e.codec.dtype).view(e.shape)

    def _load_copies(self, selected: list[L.MetaEntry], verify: bool) -> dict[str, torch.Tensor]:
        offsets: list[int] = []
        total = 0
        for e in selected:
            offsets.append(total)
            if not e.is_meta:
                total += e.data_length + (-e.data_length) % LOAD_ALIGN
        buf = empty_buffer(total)
        whole = tensor_memoryview(buf) if total else memoryview(bytearray(0))
        requests = [(e.data_offset, whole[o:o + e.data_length])
                    for e, o in zip(selected, offsets) if e.data_length]
        read_requests(self._fd, requests, self.path, self._threads, fresh=True)
        if verify:
            tasks = [self._verify_task(e, whole[o:o + e.data_length]) for e, o in zip(selected, offsets)]
            # Largest first: SHA-256 of one tensor is sequential.
            order = sorted(range(len(tasks)), key=lambda i: -selected[i].data_length)
            run_parallel([tasks[i] for i in order], self._threads)
        out: dict[str, torch.Tensor] = {}
        typed: dict[torch.dtype, torch.Tensor] = {}
        for e, o in zip(selected, offsets):
            if e.is_meta:
                out[e.name] = torch.empty(e.shape, dtype=e.codec.dtype, device="meta")
            elif e.data_length == 0:
                out[e.name] = torch.empty(e.shape, dtype=e.codec.dtype)
            else:
                # One typed view of the buffer per dtype; as_strided is ~4x cheaper than
                # slice + view + view when there are thousands of small tensors.
                t = typed.get(e.codec.dtype)
                if t is None:
                    t = typed[e.codec.dtype] = buf.view(e.codec.dtype)
                out[e.name] = t.as_strided(e.shape, _contiguous_strides(e.shape),
                                            t.storage_offset() + o // e.codec.itemsize)
        return out

    # ------------------------------------------------------------ hashes
    def _compare(self, e: L.MetaEntry, h: L.ParsedHeader, crc: int, sha: "hashlib._Hash | None") -> None:
        """``sha``: the SHA-256 state over header and data, None when the header stores none."""
        bad = []
        if crc != h.crc32:
            assert h.crc32 is not None
            bad.append(f"CRC32 {crc:08x} != stored {h.crc32:08x}")
        if sha is not None and h.sha256 is not None and sha.digest() != h.sha256:
            bad.append(f"SHA-256 {sha.hexdigest()[:16]}... != stored {h.sha256.hex()[:16]}...")
        if bad:
            raise ChecksumError(f"{self.path}: tensor {e.name!r}: hash mismatch: {'; '.join(bad)}")

    def _verify_memory(self, e: L.MetaEntry, data: memoryview) -> None:
        h = self._header(e)
        crc = isal_zlib.crc32(data, isal_zlib.crc32(h.zeroed))
        sha = None
        if h.sha256 is not None:  # a CRC32-only header (sha256=False): nothing more to check
            sha = hashlib.sha256(h.zeroed)
            sha.update(data)
        self._compare(e, h, crc, sha)

    def _verify_task(self, e: L.MetaEntry, data: memoryview):  # type: ignore[no-untyped-def]
        return lambda: self._verify_memory(e, data)

    def verify(self, key: str) -> None:
        """Recompute the tensor's CRC32 and SHA-256 (when its header stores one) from the file;
        ChecksumError on mismatch."""
        self._check_open()
        e = self._entry(key)
        h = self._header(e)
        crc = isal_zlib.crc32(h.zeroed)
        sha = hashlib.sha256(h.zeroed) if h.sha256 is not None else None
        scratch = memoryview(bytearray(min(VERIFY_CHUNK, e.data_length)))
        pos = 0
        while pos < e.data_length:
            n = min(len(scratch), e.data_length - pos)
            chunk = scratch[:n]
            preadv_all(self._fd, [chunk], e.data_offset + pos, self.path)
            crc = isal_zlib.crc32(chunk, crc)
            if sha is not None:
                sha.update(chunk)
            pos += n
        self._compare(e, h, crc, sha)

    def verify_all(self) -> list[str]:
        """Check every tensor; returns one message per problem (empty list: all good)."""
        self._check_open()
        problems: list[str | None] = [None] * len(self._entries)

        def task(i: int) -> None:
            try:
                self.verify(self._entries[i].name)
            except FormatError as exc:
                problems[i] = str(exc)

        order = sorted(range(len(self._entries)), key=lambda i: -self._entries[i].data_length)
        run_parallel([lambda i=i: task(i) for i in order], self._threads)
        return [p for p in problems if p is not None]


def _mappable(e: L.MetaEntry) -> bool:
    """Whether `e` can be a view of the file mapping: it has data, aligned to its element size."""
    return e.data_length > 0 and not e.is_meta and e.data_offset % e.codec.itemsize == 0


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def open_file(path: str | os.PathLike[str]) -> TensorFileReader:
    """Open a `.tensors` file for reading (a context manager)."""
    return TensorFileReader(path)


def load_file(path: str | os.PathLike[str], *, device: str | torch.device = "cpu",
              keys: Sequence[str] | None = None, verify: bool = False,
              mmap: bool = False) -> dict[str, torch.Tensor]:
    """Load tensors (all, or `keys`) from a `.tensors` file.

    CPU results are views into one fresh buffer (that memory is freed when the
    last of them is), or with ``mmap=True`` views of a private copy-on-write
    mapping of the file (see :meth:`TensorFileReader.load` for the caveats).
    Other devices: loaded on CPU, then copied. Meta entries come back as meta
    tensors.
    """
    with TensorFileReader(path) as r:
        tensors = r.load(keys, verify=verify, mmap=mmap)
    dev = torch.device(device)
    if dev.type != "cpu":
        tensors = {k: (v if v.is_meta else v.to(dev)) for k, v in tensors.items()}
    return tensors

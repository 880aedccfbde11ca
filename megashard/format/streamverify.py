"""Check a `.tensors` file while its bytes stream past, in order, once (``megashard copy``).

:func:`~megashard.format.verify.structure_problems` and
:meth:`~megashard.format.reader.TensorFileReader.verify_all` need the file at hand. A copy
sees each byte once, in order, and should keep only a bounded buffer: :class:`StreamVerifier`
keeps the prologue, the metadata index, every tensor header and the terminator (what
``structure_problems`` reads; kilobytes per tensor), hashes each tensor's data as it passes
(tensorizer's CRC32 over the zeroed header and the data, with isal), and at :meth:`finish`
runs ``structure_problems`` on what it kept and compares every tensor's CRC32 with the one
its header stores. That detects a flipped bit anywhere in the file except inside the stored
SHA-256 values (which no CRC32 covers); with ``sha256=True`` every tensor's SHA-256 is
computed and compared as well (hashlib's SHA-256 is several times slower than isal's CRC32)
and a single flipped bit anywhere is detected, as by ``megashard verify``. A CRC32-only header
(written with ``sha256=False``) stores no SHA-256: its tensor is checked by CRC32 alone, and
then a flipped bit anywhere is detected without ``sha256=True`` (the CRC32 covers the whole
header but its own value, and a flip there mismatches).
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional

from isal import isal_zlib

from ..errors import ChecksumError, FormatError
from . import layout as L
from .reader import MAX_HEADER
from .verify import structure_problems

__all__ = ["StreamVerifier"]


class StreamVerifier:
    """``StreamVerifier(path, size)``; ``feed(view)`` with consecutive bytes from offset 0;
    ``finish()`` raises :class:`FormatError` (:class:`ChecksumError` for a hash) naming
    ``path`` unless the file is intact, and returns ``{tensor name: CRC32}``."""

    def __init__(self, path: str, size: int, *, sha256: bool = False) -> None:
        self.path = path
        self.sha256 = sha256
        self._sha: Dict[str, Any] = {}
        self.file_size = size
        self.pos = 0
        self._head = bytearray()  # prologue + metadata index
        self._prologue: Optional[L.FileHeader] = None
        self._file_header: Optional[L.FileHeader] = None
        self._entries: List[L.MetaEntry] = []
        self._regions: List[tuple] = []  # (start, end, kind, entry), sorted, disjoint
        self._next = 0  # first region not yet complete
        self._buffers: Dict[str, bytearray] = {}  # tensor name -> header bytes
        self._crc: Dict[str, int] = {}
        self._headers: Dict[str, L.ParsedHeader] = {}
        self._tail = bytearray()  # the last 8 bytes (terminator)

    # ---------------------------------------------------------------- feeding
    def feed(self, view: memoryview) -> None:
        mv = view if isinstance(view, memoryview) else memoryview(view)
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        a, b = self.pos, self.pos + mv.nbytes
        if b > self.file_size:
            raise FormatError(f"{self.path}: more than the {self.file_size} bytes expected")
        if self._file_header is None:
            self._feed_head(mv)
        tail_start = self.file_size - len(L.TERMINATOR)
        if b > tail_start:
            self._tail += mv[max(0, tail_start - a):]
        i = self._next
        while i < len(self._regions):
            start, end, kind, e = self._regions[i]
            if start >= b:
                break
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                piece = mv[lo - a:hi - a]
                if kind == "header":
                    self._buffers[e.name] += piece
                    if hi == end:
                        self._parse_header(e)
                else:
                    self._crc[e.name] = isal_zlib.crc32(piece, self._crc[e.name])
                    sha = self._sha.get(e.name)
                    if sha is not None:
                        sha.update(piece)
            if end <= b:
                i += 1
                self._next = i
            else:
                break
        self.pos = b

    def _feed_head(self, mv: memoryview) -> None:
        """The prologue, then the metadata index (bytes arrive in order: the buffer holds [0, pos))."""
        while self._file_header is None:
            have = len(self._head)
            need = L.PROLOGUE_SIZE if self._prologue is None else L.PROLOGUE_SIZE + self._prologue.metadata_len
            off = have - self.pos
            if off >= mv.nbytes:
                return
            self._head += mv[off:off + min(need - have, mv.nbytes - off)]
            if len(self._head) < need:
                return
            if self._prologue is None:
                self._prologue = L.parse_prologue(bytes(self._head), self.path, self.file_size)
                continue
            h = self._prologue
            entries = L.parse_metadata(bytes(self._head[L.PROLOGUE_SIZE:]), h, self.path)
            L.validate_entries(entries, h, self.path, self.file_size)
            for e in sorted(entries, key=lambda e: e.header_offset):
                if e.data_offset - e.header_offset > MAX_HEADER:
                    raise FormatError(f"{self.path}: tensor {e.name!r}: header of "
                                      f"{e.data_offset - e.header_offset} bytes is implausibly large")
                self._buffers[e.name] = bytearray()
                self._crc[e.name] = 0
                self._regions.append((e.header_offset, e.data_offset, "header", e))
                if e.data_length:
                    self._regions.append((e.data_offset, e.data_offset + e.data_length, "data", e))
            self._file_header, self._entries = h, entries

    def _parse_header(self, e: L.MetaEntry) -> None:
        h = L.parse_header(bytes(self._buffers[e.name]), e, self.path)
        if h.crc32 is None:
            raise FormatError(f"{self.path}: tensor {e.name!r}: header lacks the CRC32 hash")
        self._headers[e.name] = h
        self._crc[e.name] = isal_zlib.crc32(h.zeroed)
        if self.sha256 and h.sha256 is not None:  # a CRC32-only header (sha256=False) stores none
            self._sha[e.name] = hashlib.sha256(h.zeroed)

    @property
    def entries(self) -> List[L.MetaEntry]:
        """The file's metadata index (empty until it has streamed past)."""
        return list(self._entries)

    # ---------------------------------------------------------------- what structure_problems reads
    def _pread(self, offset: int, n: int) -> bytes:
        if offset + n <= len(self._head):
            return bytes(self._head[offset:offset + n])
        tail_start = self.file_size - len(L.TERMINATOR)
        if offset >= tail_start and offset + n <= self.file_size:
            return bytes(self._tail[offset - tail_start:offset - tail_start + n])
        raise FormatError(f"{self.path}: bytes {offset}+{n} were not kept while streaming (internal error)")

    def _header(self, e: L.MetaEntry) -> L.ParsedHeader:
        h = self._headers.get(e.name)
        if h is None:
            raise FormatError(f"{self.path}: tensor {e.name!r}: its header at {e.header_offset} was never read")
        return h

    # ---------------------------------------------------------------- the verdict
    def finish(self) -> Dict[str, int]:
        if self.pos != self.file_size:
            raise FormatError(f"{self.path}: {self.pos} of {self.file_size} bytes arrived")
        if self._file_header is None:
            if self._prologue is None:
                L.parse_prologue(bytes(self._head), self.path, self.file_size)  # names what is wrong
            raise FormatError(f"{self.path}: truncated before the end of its metadata index")
        problems = structure_problems(self)  # type: ignore[arg-type]
        if problems:
            raise FormatError("; ".join(problems[:5]))
        for e in self._entries:
            h = self._header(e)
            if self._crc[e.name] != h.crc32:
                raise ChecksumError(f"{self.path}: tensor {e.name!r}: hash mismatch: CRC32 {self._crc[e.name]:08x} "
                                    f"!= stored {h.crc32:08x}")
            if e.name in self._sha and self._sha[e.name].digest() != h.sha256:
                raise ChecksumError(f"{self.path}: tensor {e.name!r}: hash mismatch: SHA-256 "
                                    f"{self._sha[e.name].hexdigest()[:16]}... != stored {h.sha256.hex()[:16]}...")
        return dict(self._crc)

"""Whole-file integrity: every byte of a `.tensors` file is accounted for.

tensorizer's hashes cover each tensor's header and data only; the file header, the
metadata index and its zero fill have no checksum. :func:`structure_problems` closes
that gap for files laid out as tensorizer (and megashard) write them: the data
version is the minimum the content needs, reserved bytes are zero, the index's zero
fill is zero, index entries agree with their tensor headers, tensors follow each
other without gaps from the end of the index to the zero terminator, and
``tensor_size`` is the sum of the data lengths. Together with the per-tensor hashes
(:meth:`TensorFileReader.verify_all`) a single flipped bit anywhere is detected.
"""
from __future__ import annotations

from . import layout as L
from .reader import TensorFileReader

__all__ = ["structure_problems", "expected_version"]

_ZERO_CHUNK = 1 << 20


def expected_version(entries: list[L.MetaEntry]) -> int:
    """The data version writers pick for this content (the minimum that can hold it)."""
    version = L.VERSION_NON_OPAQUE
    if any(e.codec.opaque for e in entries):
        version = L.VERSION_OPAQUE
    if any(e.is_meta for e in entries):
        version = L.VERSION_META
    if any(e.long_shape for e in entries):
        version = L.VERSION_LONG
    return version


def _nonzero_at(r: TensorFileReader, start: int, n: int) -> int:
    """Offset of the first non-zero byte in [start, start + n), or -1."""
    pos = start
    while pos < start + n:
        k = min(_ZERO_CHUNK, start + n - pos)
        chunk = r._pread(pos, k)
        if chunk.count(0) != k:
            return pos + next(i for i, b in enumerate(chunk) if b)
        pos += k
    return -1


def structure_problems(r: TensorFileReader) -> list[str]:
    """Everything outside tensor headers and data that is not exactly as written.

    Returns one message per problem (empty: the structure is intact). Hashes are not
    checked here; use ``verify_all`` as well.
    """
    path, h, entries, size = r.path, r._file_header, r._entries, r.file_size
    out: list[str] = []
    want = expected_version(entries)
    if h.version != want:
        out.append(f"{path}: data version {h.version}, but its tensors need exactly version {want}")
    prologue = r._pread(0, L.PROLOGUE_SIZE)
    if prologue[49:57] != bytes(8):
        out.append(f"{path}: reserved file-header bytes 49..56 are not zero")
    total = sum(e.data_length for e in entries)
    if h.tensor_size != total:
        out.append(f"{path}: file header says {h.tensor_size} data bytes, the tensors hold {total}")
    versioned = h.versioned_metadata
    used = sum(L.metadata_entry_size(len(e.raw_name), len(e.codec.encoded), len(e.shape), e.long_shape, versioned)
               for e in entries)
    bad = _nonzero_at(r, L.PROLOGUE_SIZE + used, h.metadata_len - used) if used <= h.metadata_len else -1
    if used > h.metadata_len:
        out.append(f"{path}: index entries ({used} bytes) overrun the {h.metadata_len}-byte index")
    elif bad >= 0:
        out.append(f"{path}: non-zero byte at offset {bad} in the index's zero fill")
    pos = L.PROLOGUE_SIZE + h.metadata_len
    for e in sorted(entries, key=lambda e: e.header_offset):
        if e.header_offset != pos:
            out.append(f"{path}: tensor {e.name!r}: header at {e.header_offset}, expected {pos} "
                       "(unaccounted bytes or a damaged offset)")
        try:
            ph = r._header(e)
        except Exception as exc:  # noqa: BLE001 - reported, the caller decides
            out.append(str(exc))
        else:
            if ph.tensor_type != e.tensor_type:
                out.append(f"{path}: tensor {e.name!r}: header type {ph.tensor_type} disagrees with the index "
                           f"{e.tensor_type}")
        pos = e.data_offset + e.data_length
    if pos + len(L.TERMINATOR) != size:
        out.append(f"{path}: {size - pos} bytes after the last tensor, expected the {len(L.TERMINATOR)}-byte "
                   "terminator only")
    elif r._pread(pos, len(L.TERMINATOR)) != L.TERMINATOR:
        out.append(f"{path}: the terminator after the last tensor is not zero")
    return out

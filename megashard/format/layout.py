"""Byte layout of tensorizer's `.tensors` files: structs, building and parsing.

Pure functions over bytes, no file I/O, so that the writer, the reader and the
tests share one definition. Layout (all little-endian; see
/work/shared/docs/tensorizer-format.md for the full reference)::

    "|TZR|" u32 version | 32s flags, u64 data bytes, 8x, u64 tensor_count
    u64 metadata_len | metadata entries (+ zero fill)
    per tensor: header | data        ... u64 0 terminator

Parsers raise :class:`FormatError` (never struct.error/IndexError/UnicodeDecodeError)
and never trust a length before checking it against the bytes available.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import FormatError, UnsupportedFormatError
from .dtypes import DtypeCodec, decode_dtype

MAGIC = b"|TZR|"
VERSION_NON_OPAQUE = 1
VERSION_OPAQUE = 2
VERSION_ENCRYPTION = 3
VERSION_META = 4
VERSION_LONG = 5
KNOWN_VERSIONS = frozenset({1, 2, 3, 4, 5})

FLAG_ENCRYPTED = 1
FLAG_VERSIONED_HEADERS = 2
KNOWN_FLAGS = FLAG_ENCRYPTED | FLAG_VERSIONED_HEADERS

TENSOR_TYPE_PARAM = 0
TENSOR_TYPE_BUFFER = 1
TENSOR_TYPE_STATE_DICT = 2

HASH_CRC32 = 0
HASH_SHA256 = 1

LONG_DIM = 1 << 32  # a dimension this large needs u64 shape fields (data version 5)
TENSORIZER_METADATA_SIZE = 256 * 1024  # what tensorizer's writer reserves

_VERSION = struct.Struct("<I")
_FILE_HEADER = struct.Struct("<32sQ8xQ")
_U64 = struct.Struct("<Q")
PROLOGUE_SIZE = len(MAGIC) + _VERSION.size + _FILE_HEADER.size + _U64.size  # 73
TERMINATOR = bytes(8)

_START = struct.Struct("<QHBH")  # header_size, module_idx, tensor_type, name_len
_HASH_HEAD = struct.Struct("<HB")  # hash section length, hash count
_CRC_SEG = struct.Struct("<BBI")
_SHA_SEG = struct.Struct("<BB32s")
_DATA_LEN = struct.Struct("<q")
_LOCATION = struct.Struct("<QQQ")
HASH_SECTION_LEN = 1 + _CRC_SEG.size + _SHA_SEG.size  # 41: bytes after the "H" length
HASH_SECTION_LEN_CRC32 = 1 + _CRC_SEG.size  # 7: a CRC32-only header (``sha256=False``)
# smallest possible metadata entry: name(2+1) type(1) dtype(1+1) ndim(1) location(24)
_MIN_ENTRY = 2 + 1 + 1 + 1 + 1 + 1 + _LOCATION.size


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a `.tensors` file, as the checkpoint manifest records it.

    crc32/sha256 are tensorizer's per-tensor hashes over (header with hash
    values zeroed) + data; ``sha256`` is ``""`` for a CRC32-only header (written with
    ``sha256=False``). ``is_meta``: stored without data (data version 4).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    header_offset: int
    data_offset: int
    nbytes: int
    crc32: int
    sha256: str
    tensor_type: int
    is_meta: bool


@dataclass(frozen=True)
class FileHeader:
    version: int
    flags: int
    tensor_size: int
    tensor_count: int
    metadata_len: int

    @property
    def versioned_metadata(self) -> bool:
        return bool(self.flags & FLAG_VERSIONED_HEADERS)


@dataclass(frozen=True)
class MetaEntry:
    """One parsed metadata-index entry."""

    name: str
    raw_name: bytes
    tensor_type: int
    codec: DtypeCodec
    shape: tuple[int, ...]
    header_offset: int
    data_offset: int
    data_length: int
    long_shape: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def expected_nbytes(self) -> int:
        return self.numel * self.codec.itemsize

    @property
    def is_meta(self) -> bool:
        return self.data_length == 0 and self.numel > 0


@dataclass(frozen=True)
class ParsedHeader:
    """A tensor header as read from the file (hash values kept separately)."""

    module_idx: int
    tensor_type: int
    raw_name: bytes
    dtype_raw: bytes
    shape: tuple[int, ...]
    crc32: int | None
    sha256: bytes | None  # None: a CRC32-only header
    data_length: int
    zeroed: bytes  # the header with hash values zeroed: the hashes' prefix


# --------------------------------------------------------------------- writing


def pack_prologue(version: int, flags: int, tensor_size: int, tensor_count: int,
                  metadata_len: int) -> bytes:
    """Magic, file header and metadata length (73 bytes)."""
    flag_bytes = flags.to_bytes(32, "little") if version >= VERSION_META else bytes(32)
    return (MAGIC + _VERSION.pack(version)
            + _FILE_HEADER.pack(flag_bytes, tensor_size, tensor_count)
            + _U64.pack(metadata_len))


def header_size(name_len: int, dtype_len: int, ndim: int, long_shape: bool, pad: int = 0,
                sha256: bool = True) -> int:
    """Header bytes from header_size through data_length (no encryption); ``sha256=False``:
    the CRC32-only variant (34 bytes shorter)."""
    dim = 8 if long_shape else 4
    return (_START.size + name_len + 1 + dtype_len + 1 + dim * ndim
            + _HASH_HEAD.size + _CRC_SEG.size + (_SHA_SEG.size if sha256 else 0) + pad + _DATA_LEN.size)


@dataclass
class HeaderPlan:
    """A built tensor header with zeroed hashes and where to patch them (``sha_at`` None:
    a CRC32-only header)."""

    buf: bytearray
    crc_at: int
    sha_at: int | None

    def finish(self, crc32: int, sha256: bytes | None) -> bytearray:
        struct.pack_into("<I", self.buf, self.crc_at, crc32)
        if self.sha_at is not None:
            assert sha256 is not None and len(sha256) == 32
            self.buf[self.sha_at:self.sha_at + 32] = sha256
        return self.buf


def build_header(module_idx: int, tensor_type: int, name: bytes, dtype: bytes,
                 shape: Sequence[int], long_shape: bool, data_length: int,
                 pad: int = 0, sha256: bool = True) -> HeaderPlan:
    """Tensor header with hash values zeroed; `pad` zero bytes go before data_length.

    Readers take data_length from the header's last 8 bytes, so padding there
    aligns the data without confusing any tensorizer release. ``sha256=False``: one hash
    (CRC32, hash_count 1), the header tensorizer's own serializer builds with
    ``include_sha256=False``; every tensorizer 2.x reader decodes and verifies it.
    """
    size = header_size(len(name), len(dtype), len(shape), long_shape, pad, sha256)
    head = f"<QHBH{len(name)}sB{len(dtype)}sB{len(shape)}{'Q' if long_shape else 'I'}"
    values = [size, module_idx, tensor_type, len(name), name, len(dtype), dtype, len(shape), *shape]
    if sha256:
        fmt = f"{head}HBBBIBB32s{pad}xq"
        values += [HASH_SECTION_LEN, 2, HASH_CRC32, 4, 0, HASH_SHA256, 32, bytes(32), data_length]
    else:
        fmt = f"{head}HBBBI{pad}xq"
        values += [HASH_SECTION_LEN_CRC32, 1, HASH_CRC32, 4, 0, data_length]
    buf = bytearray(struct.pack(fmt, *values))
    assert len(buf) == size
    hash_end = size - _DATA_LEN.size - pad
    if sha256:
        sha_at: int | None = hash_end - 32
        crc_at = hash_end - 32 - 2 - 4
    else:
        sha_at, crc_at = None, hash_end - 4
    return HeaderPlan(buf, crc_at, sha_at)


def pack_metadata_entry(name: bytes, tensor_type: int, dtype: bytes, shape: Sequence[int],
                        long_shape: bool, header_offset: int, data_offset: int,
                        data_length: int, versioned: bool) -> bytes:
    """One metadata-index entry; `versioned` prefixes the u32 entry version (v5 files)."""
    dim_fmt = "Q" if long_shape else "I"
    tag = _VERSION.pack(VERSION_LONG if long_shape else VERSION_NON_OPAQUE) if versioned else b""
    return b"".join((
        tag, struct.pack("<H", len(name)), name, bytes((tensor_type, len(dtype))), dtype,
        bytes((len(shape),)), struct.pack(f"<{len(shape)}{dim_fmt}", *shape),
        _LOCATION.pack(header_offset, data_offset, data_length),
    ))


def metadata_entry_size(name_len: int, dtype_len: int, ndim: int, long_shape: bool,
                        versioned: bool) -> int:
    return ((4 if versioned else 0) + 2 + name_len + 1 + 1 + dtype_len + 1
            + (8 if long_shape else 4) * ndim + _LOCATION.size)


# --------------------------------------------------------------------- parsing


def decode_name(raw: bytes, where: str) -> str:
    """A stored tensor name as a str key.

    Plain keys are UTF-8. tensorizer stores nested state-dict paths as
    ``\\x1e`` + a JSON array (``["model","layers",0,"w"]``); we return those
    joined with dots (``model.layers.0.w``), the usual state-dict spelling.
    """
    if not raw:
        raise FormatError(f"{where}: empty tensor name")
    if raw[0] == 0x1E:
        try:
            parts = json.loads(raw[1:].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise FormatError(f"{where}: malformed nested tensor path {raw[:80]!r}") from None
        if (not isinstance(parts, list) or not parts
                or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in parts)):
            raise FormatError(f"{where}: malformed nested tensor path {raw[:80]!r}")
        return ".".join(str(p) for p in parts)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{where}: tensor name {raw[:80]!r} is not valid UTF-8") from None


def parse_prologue(buf: bytes, path: str, file_size: int) -> FileHeader:
    """Validate magic, version, flags and sizes of the first 73 bytes."""
    if len(buf) < PROLOGUE_SIZE:
        if buf[:len(MAGIC)] != MAGIC[:len(buf)]:
            raise FormatError(f"{path}: not a tensorizer .tensors file (bad magic)")
        raise FormatError(f"{path}: truncated: {len(buf)} bytes, the file header needs {PROLOGUE_SIZE}")
    if buf[:5] != MAGIC:
        raise FormatError(f"{path}: not a tensorizer .tensors file (bad magic {bytes(buf[:5])!r})")
    (version,) = _VERSION.unpack_from(buf, 5)
    flag_bytes, tensor_size, count = _FILE_HEADER.unpack_from(buf, 9)
    (metadata_len,) = _U64.unpack_from(buf, 65)
    flags = int.from_bytes(flag_bytes, "little")
    if version not in KNOWN_VERSIONS:
        raise UnsupportedFormatError(
            f"{path}: unknown tensorizer data version {version} (megashard reads 1, 2, 4, 5)")
    if version == VERSION_ENCRYPTION or (version >= VERSION_META and flags & FLAG_ENCRYPTED):
        raise UnsupportedFormatError(
            f"{path}: encrypted tensorizer files are not supported by megashard; "
            "decrypt it with tensorizer (TensorDeserializer(..., encryption=...)) and re-save")
    if flags & ~KNOWN_FLAGS:
        raise UnsupportedFormatError(f"{path}: unknown feature flags 0x{flags:x}")
    if version < VERSION_META and flags:
        raise FormatError(f"{path}: feature flags 0x{flags:x} set in a data version {version} file")
    if flags & FLAG_VERSIONED_HEADERS and version < VERSION_LONG:
        raise FormatError(f"{path}: versioned-headers flag in a data version {version} file")
    if metadata_len > file_size - PROLOGUE_SIZE:
        raise FormatError(
            f"{path}: metadata length {metadata_len} runs past the end of the file ({file_size} bytes)")
    if count == 0:
        raise FormatError(f"{path}: the file holds no tensors (tensor_count is 0)")
    if count * _MIN_ENTRY > metadata_len:
        raise FormatError(
            f"{path}: tensor_count {count} cannot fit in a {metadata_len}-byte metadata section")
    return FileHeader(version, flags, tensor_size, count, metadata_len)


def parse_metadata(buf: bytes, header: FileHeader, path: str) -> list[MetaEntry]:
    """Parse `header.tensor_count` entries; trailing bytes are ignored (tensorizer does too)."""
    versioned = header.versioned_metadata
    entries: list[MetaEntry] = []
    end = len(buf)
    off = 0
    unpack_h = struct.unpack_from
    for i in range(header.tensor_count):
        where = f"{path}: metadata entry {i}"
        try:
            long_shape = False
            if versioned:
                (ev,) = unpack_h("<I", buf, off)
                off += 4
                if ev not in (VERSION_NON_OPAQUE, VERSION_LONG):
                    raise UnsupportedFormatError(f"{where}: unknown metadata entry version {ev}")
                long_shape = ev == VERSION_LONG
            (name_len,) = unpack_h("<H", buf, off)
            off += 2
            if off + name_len + 2 > end:
                raise FormatError(f"{where}: truncated (name runs past the metadata section)")
            raw_name = bytes(buf[off:off + name_len])
            off += name_len
            tensor_type = buf[off]
            dtype_len = buf[off + 1]
            off += 2
            if off + dtype_len + 1 > end:
                raise FormatError(f"{where}: truncated (dtype runs past the metadata section)")
            dtype_raw = bytes(buf[off:off + dtype_len])
            off += dtype_len
            ndim = buf[off]
            off += 1
            dim_size = 8 if long_shape else 4
            if off + ndim * dim_size + _LOCATION.size > end:
                raise FormatError(f"{where}: truncated (shape runs past the metadata section)")
            shape = unpack_h(f"<{ndim}{'Q' if long_shape else 'I'}", buf, off)
            off += ndim * dim_size
            header_offset, data_offset, data_length = _LOCATION.unpack_from(buf, off)
            off += _LOCATION.size
        except (struct.error, IndexError):
            raise FormatError(f"{where}: truncated metadata section") from None
        name = decode_name(raw_name, where)
        where = f"{path}: tensor {name!r}"
        if tensor_type not in (TENSOR_TYPE_PARAM, TENSOR_TYPE_BUFFER, TENSOR_TYPE_STATE_DICT):
            raise FormatError(f"{where}: unknown tensor type {tensor_type}")
        codec = decode_dtype(dtype_raw, where=where)
        entries.append(MetaEntry(name, raw_name, tensor_type, codec, tuple(shape),
                                 header_offset, data_offset, data_length, long_shape))
    return entries


def validate_entries(entries: list[MetaEntry], header: FileHeader, path: str,
                     file_size: int) -> None:
    """Reject duplicates, impossible sizes, out-of-file and overlapping extents."""
    data_start = PROLOGUE_SIZE + header.metadata_len
    seen: set[str] = set()
    for e in entries:
        where = f"{path}: tensor {e.name!r}"
        if e.name in seen:
            raise FormatError(f"{where}: duplicate tensor name")
        seen.add(e.name)
        if e.expected_nbytes >= 1 << 62:
            raise FormatError(f"{where}: shape {list(e.shape)} is too large to be a tensor")
        if e.data_length != e.expected_nbytes:
            if not (e.data_length == 0 and header.version >= VERSION_META):
                raise FormatError(
                    f"{where}: data length {e.data_length} does not match shape {list(e.shape)} "
                    f"x {e.codec.itemsize} bytes = {e.expected_nbytes}")
        min_header = header_size(len(e.raw_name), len(e.codec.encoded), len(e.shape), e.long_shape, sha256=False)
        if e.header_offset < data_start:
            raise FormatError(f"{where}: header offset {e.header_offset} lies inside the metadata")
        if e.data_offset < e.header_offset + min_header:
            raise FormatError(
                f"{where}: data offset {e.data_offset} leaves no room for its "
                f"{min_header}-byte header at {e.header_offset}")
        if e.data_offset + e.data_length > file_size:
            raise FormatError(
                f"{where}: data [{e.data_offset}, {e.data_offset + e.data_length}) runs past "
                f"the end of the file ({file_size} bytes; truncated?)")
    ordered = sorted(entries, key=lambda e: e.header_offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.data_offset + a.data_length > b.header_offset:
            raise FormatError(
                f"{path}: tensors {a.name!r} and {b.name!r} overlap "
                f"({a.name!r} ends at {a.data_offset + a.data_length}, "
                f"{b.name!r} starts at {b.header_offset})")


def zeroed_header_crcs(name: str, dtype: torch.dtype, shapes: Sequence[Sequence[int]], data_length: int,
                       size: int) -> list[int]:
    """CRC32s of the header (hash values zeroed) megashard's writer gives a tensor of this
    name, dtype and data length, ``size`` bytes long (alignment padding included), one per
    candidate shape and header variant (CRC32 + SHA-256, CRC32 only) that fits: what a
    tensor's CRC32 covers before its data, without reading it."""
    from .dtypes import encode_dtype
    from isal import isal_zlib

    name_b, enc = name.encode("utf-8"), encode_dtype(dtype).encoded
    out = []
    for shape in shapes:
        long_shape = any(d >= LONG_DIM for d in shape)
        for sha256 in (True, False):
            pad = size - header_size(len(name_b), len(enc), len(shape), long_shape, sha256=sha256)
            if pad >= 0 and len(shape) <= 255:
                out.append(isal_zlib.crc32(build_header(0, TENSOR_TYPE_STATE_DICT, name_b, enc, shape, long_shape,
                                                        data_length, pad, sha256).buf))
    return out


def _parse_hashes(buf: bytes, p: int, hash_end: int, hash_count: int, zeroed: bytearray,
                  where: str) -> tuple[int | None, bytes | None]:
    """The hash entries of a header's hash block ``buf[p:hash_end]`` (after the count byte):
    (CRC32, SHA-256), None for one that is absent; their values zeroed in ``zeroed``.

    Untrusted: every entry must lie inside the block, have a known type with that type's
    length, and no type may appear twice (the block could otherwise say two things)."""
    crc = sha = None
    for _ in range(hash_count):
        if p + 2 > hash_end:
            raise FormatError(f"{where}: hash block holds fewer hashes than its count ({hash_count})")
        htype, hlen = buf[p], buf[p + 1]
        if p + 2 + hlen > hash_end:
            raise FormatError(f"{where}: hash entry (type {htype}, {hlen} bytes) runs past the hash block")
        value = bytes(buf[p + 2:p + 2 + hlen])
        if htype == HASH_CRC32 and hlen == 4:
            if crc is not None:
                raise FormatError(f"{where}: the header holds a CRC32 hash twice")
            crc = struct.unpack("<I", value)[0]
        elif htype == HASH_SHA256 and hlen == 32:
            if sha is not None:
                raise FormatError(f"{where}: the header holds a SHA-256 hash twice")
            sha = value
        else:
            raise FormatError(f"{where}: unknown hash type {htype} (length {hlen})")
        zeroed[p + 2:p + 2 + hlen] = bytes(hlen)
        p += 2 + hlen
    return crc, sha


def parse_header(buf: bytes, entry: MetaEntry, path: str) -> ParsedHeader:
    """Parse and cross-check one tensor header against its metadata entry.

    `buf` holds exactly [header_offset, data_offset).
    """
    where = f"{path}: tensor {entry.name!r}"
    n = len(buf)
    try:
        size, module_idx, tensor_type, name_len = _START.unpack_from(buf, 0)
        if size != n:
            raise FormatError(
                f"{where}: header size {size} disagrees with the index "
                f"(data offset - header offset = {n})")
        off = _START.size
        raw_name = bytes(buf[off:off + name_len])
        off += name_len
        dtype_len = buf[off]
        dtype_raw = bytes(buf[off + 1:off + 1 + dtype_len])
        off += 1 + dtype_len
        ndim = buf[off]
        off += 1
        fmt = f"<{ndim}{'Q' if entry.long_shape else 'I'}"
        shape = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        hash_len, hash_count = _HASH_HEAD.unpack_from(buf, off)
        hash_start = off + 2
        hash_end = hash_start + hash_len
        if hash_end + _DATA_LEN.size > n or hash_len < 1:
            raise FormatError(f"{where}: hash block runs past the header")
        zeroed = bytearray(buf)
        crc, sha = _parse_hashes(buf, hash_start + 1, hash_end, hash_count, zeroed, where)
        (data_length,) = _DATA_LEN.unpack_from(buf, n - _DATA_LEN.size)
    except (struct.error, IndexError):
        raise FormatError(f"{where}: truncated tensor header") from None
    if raw_name != entry.raw_name:
        raise FormatError(f"{where}: header names the tensor {raw_name[:80]!r}")
    if dtype_raw != entry.codec.encoded:
        raise FormatError(f"{where}: header dtype {dtype_raw!r} disagrees with the index")
    if tuple(shape) != entry.shape:
        raise FormatError(f"{where}: header shape {list(shape)} disagrees with the index {list(entry.shape)}")
    if data_length != entry.data_length:
        raise FormatError(
            f"{where}: header data length {data_length} disagrees with the index {entry.data_length}")
    return ParsedHeader(module_idx, tensor_type, raw_name, dtype_raw, tuple(shape), crc, sha,
                        data_length, bytes(zeroed))

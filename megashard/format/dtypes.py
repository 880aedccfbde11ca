"""torch dtype <-> tensorizer dtype string.

tensorizer stores numpy's ``dtype.str`` for dtypes numpy knows (``<f4``, ``|b1``)
and an "opaque" string for the rest: the same-width numpy void type, a NUL,
then ``str(torch_dtype)`` (``<V2\\x00torch.bfloat16``). Opaque dtypes force data
version 2. The table is static (not derived from numpy at run time) so that the
bytes we write never depend on the installed numpy version.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError, UnsupportedFormatError

__all__ = ["DtypeCodec", "encode_dtype", "decode_dtype", "dtypes_by_name"]


@dataclass(frozen=True)
class DtypeCodec:
    """How one torch dtype is spelled in a `.tensors` file."""

    dtype: torch.dtype
    encoded: bytes  # exact bytes stored in headers and the metadata index
    itemsize: int
    opaque: bool  # True when numpy has no equivalent (forces data version >= 2)


# dtypes numpy represents natively: numpy's dtype.str on a little-endian machine.
_NUMPY_STRINGS: dict[str, str] = {
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "int8": "|i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "|u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "bool": "|b1",
    "complex64": "<c8",
    "complex128": "<c16",
}

# dtypes numpy lacks; stored as raw same-width integers ("opaque").
_OPAQUE_NAMES: tuple[str, ...] = (
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


def dtypes_by_name() -> dict[str, torch.dtype]:
    """Every dtype a `.tensors` file can hold (in this torch), by its name without ``torch.``:
    the one table the index's dtype names come from too."""
    out = {}
    for name in list(_NUMPY_STRINGS) + list(_OPAQUE_NAMES):
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            out[name] = dt
    return out


def _opaque_string(dtype: torch.dtype) -> str:
    size = dtype.itemsize
    prefix = "|" if size == 1 else "<"
    return f"{prefix}V{size}\0{dtype}"


def _build_tables() -> tuple[dict[torch.dtype, DtypeCodec], dict[bytes, DtypeCodec]]:
    by_dtype: dict[torch.dtype, DtypeCodec] = {}
    for name, np_str in _NUMPY_STRINGS.items():
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            by_dtype[dt] = DtypeCodec(dt, np_str.encode(), dt.itemsize, False)
    for name in _OPAQUE_NAMES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            by_dtype[dt] = DtypeCodec(dt, _opaque_string(dt).encode(), dt.itemsize, True)
    by_bytes = {c.encoded: c for c in by_dtype.values()}
    return by_dtype, by_bytes


_BY_DTYPE, _BY_BYTES = _build_tables()
# Opaque strings other writers may produce for dtypes numpy *does* know
# (e.g. an older torch that could not convert uint16 to numpy).
_BY_TORCH_NAME: dict[str, torch.dtype] = {str(dt): dt for dt in _BY_DTYPE}

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(_BY_DTYPE)


def encode_dtype(dtype: torch.dtype) -> DtypeCodec:
    """The codec for `dtype`; FormatError for dtypes the format cannot hold."""
    codec = _BY_DTYPE.get(dtype)
    if codec is None:
        raise FormatError(
            f"dtype {dtype} cannot be stored in a .tensors file "
            f"(supported: {', '.join(sorted(str(d) for d in _BY_DTYPE))})"
        )
    return codec


def decode_dtype(raw: bytes, *, where: str) -> DtypeCodec:
    """Parse a stored dtype string; `where` names the file and tensor for errors."""
    codec = _BY_BYTES.get(raw)
    if codec is not None:
        return codec
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{where}: dtype string {raw!r} is not UTF-8") from None
    np_part, sep, torch_part = text.partition("\0")
    if sep:
        dt = _BY_TORCH_NAME.get(torch_part)
        if dt is None:
            raise UnsupportedFormatError(f"{where}: unsupported torch dtype {torch_part!r}")
        # numpy part is "<V{n}" / "|V{n}" (or the int spelling "<i{n}")
        body = np_part[1:] if np_part[:1] in ("<", "|", "=") else ""
        if len(body) < 2 or body[0] not in "Vi" or not body[1:].isdigit():
            raise FormatError(f"{where}: malformed opaque dtype string {text!r}")
        if int(body[1:]) != dt.itemsize:
            raise FormatError(
                f"{where}: opaque dtype {text!r} says {body[1:]} bytes per element, "
                f"{dt} has {dt.itemsize}"
            )
        return DtypeCodec(dt, raw, dt.itemsize, True)
    if text[:1] == ">":
        raise UnsupportedFormatError(f"{where}: big-endian dtype {text!r} is not supported")
    # Accept the native-order spellings "=f4" too; the little-endian table is canonical.
    if text[:1] == "=":
        alt = ("<" + text[1:]).encode()
        if alt in _BY_BYTES:
            return _BY_BYTES[alt]
    raise UnsupportedFormatError(f"{where}: unsupported dtype string {text!r}")

"""safetensors files, streamed out and validated in: no dependency on the safetensors package.

Writing: the header (dtypes, shapes, offsets) is known before any data, so each tensor
is written as it arrives and dropped. Reading: a file from a Hugging Face directory is
untrusted input; its header is bounded, every entry's dtype, shape and byte range are
checked against the file's size before anything is mapped, and tensors are private
(copy-on-write) mappings of just their bytes, so an import holds page cache, not copies.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError, MegashardError
from ..manifest import dtype_name, itemsize
from ..plan import numel

__all__ = ["DTYPES", "SafetensorsWriter", "SafetensorsFile", "MAX_HEADER"]

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors library's own limit


class SafetensorsWriter:
    """``SafetensorsWriter(path, [(name, dtype, shape), ...])``; ``write`` in that order; ``close``."""

    def __init__(self, path: str, specs: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None, error: type = MegashardError) -> None:
        header: Dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        pos = 0
        self.order: List[Tuple[str, int]] = []
        for name, dtype, shape in specs:
            if dtype not in DTYPES:
                raise error(f"{name!r}: dtype {dtype_name(dtype)} has no safetensors equivalent; "
                            "export it with --to tensors or leave it out with --keys")
            n = numel(shape) * itemsize(dtype)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.order.append((name, n))
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.path = path
        self.next = 0
        self.f = open(path, "xb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        from ..format.fastio import tensor_memoryview

        want, n = self.order[self.next]
        t = tensor.detach().cpu().contiguous()
        if name != want or t.numel() * t.element_size() != n:
            raise MegashardError(f"{self.path}: expected {want!r} ({n} bytes) next, got {name!r} "
                                 f"({t.numel() * t.element_size()} bytes)")
        if n:
            self.f.write(tensor_memoryview(t))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            self.abort()
            raise MegashardError(f"{self.path}: only {self.next} of {len(self.order)} tensors were written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        self.f.close()


class SafetensorsFile:
    """One validated safetensors file, opened relative to its directory without following links."""

    def __init__(self, dir_fd: int, name: str, where: str) -> None:
        self.path = os.path.join(where, name)
        if "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{self.path}: not a plain file name inside {where}")
        try:
            self.fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror}); a symbolic link is refused: copy "
                                  "the model directory with real files (huggingface-cli download --local-dir)") from e
        try:
            self._parse()
        except BaseException:
            os.close(self.fd)
            raise

    def _parse(self) -> None:
        import stat

        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{self.path}: not a regular file")
        self.size = st.st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{self.path}: {self.size} bytes, too short for a safetensors header")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(MAX_HEADER, self.size - 8):
            raise CheckpointError(f"{self.path}: header length {hlen} exceeds the file ({self.size} bytes) "
                                  f"or {MAX_HEADER} bytes")
        raw = os.pread(self.fd, hlen, 8)
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: header is not JSON: {e}") from None
        except RecursionError:
            raise CheckpointError(f"{self.path}: header is not JSON this reader takes (nested too deeply)") from None
        if not isinstance(doc, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.data_start = 8 + hlen
        body = self.size - self.data_start
        self.metadata = doc.pop("__metadata__", None) or {}
        self.entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
        spans = []
        for name, e in doc.items():
            where = f"{self.path}: tensor {name!r}"
            if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"}:
                raise CheckpointError(f"{where}: malformed entry")
            dtype = _BY_NAME.get(e.get("dtype"))
            shape, offs = e.get("shape"), e.get("data_offsets")
            if dtype is None:
                raise CheckpointError(f"{where}: unsupported dtype {e.get('dtype')!r}")
            if (not isinstance(shape, list) or len(shape) > 8
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)):
                raise CheckpointError(f"{where}: bad shape {shape!r}")
            if (not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
                raise CheckpointError(f"{where}: bad data_offsets {offs!r}")
            a, b = offs
            n = numel(shape) * itemsize(dtype)
            if not 0 <= a <= b <= body or b - a != n:
                raise CheckpointError(f"{where}: bytes [{a}, {b}) do not hold {dtype_name(dtype)} {tuple(shape)} "
                                      f"({n} bytes) inside the {body}-byte data section")
            self.entries[name] = (dtype, tuple(shape), a, b)
            spans.append((a, b, name))
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise CheckpointError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor over a private mapping of its bytes (no copy until written to)."""
        dtype, shape, a, b = self.entries[name]
        if b == a:
            return torch.empty(shape, dtype=dtype)
        off = self.data_start + a
        start = off - off % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(self.fd, off + (b - a) - start, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=off - start)
        return t.view(dtype).view(shape)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""Write one `.tensors` file tensor by tensor, holding one tensor at a time.

:func:`~megashard.format.write_file` needs every tensor in memory at once. When the
names, dtypes and shapes are known up front (an export from a checkpoint), the file
layout can be planned first and each tensor written, hashed and dropped as it
arrives: memory stays at the largest tensor. Same bytes as ``write_file`` with the
same ``align`` (the planning and hashing code is the writer's own).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

from ..errors import FormatError
from . import layout as L
from .dtypes import encode_dtype
from .fastio import default_threads, pwrite_all
from .writer import INLINE_BYTES, _build_tasks, _fsync_dir, _plan, _prepare, _run

__all__ = ["StreamWriter"]


class StreamWriter:
    """``StreamWriter(path, [(name, dtype, shape), ...])``; ``write(name, tensor)`` in that order; ``close()``.

    The prologue is written last (in :meth:`close`), so an interrupted export never
    looks like a complete file.
    """

    def __init__(self, path: str | os.PathLike[str], specs: Sequence[Tuple[str, torch.dtype, Sequence[int]]], *,
                 align: int = 4096, threads: Optional[int] = None) -> None:
        if not specs:
            raise FormatError("refusing to write a .tensors file with no tensors (tensorizer cannot open it)")
        self.path = os.fspath(path)
        # names are validated by the writer's own checks (on zero-element stand-ins)
        self.items = _prepare({name: torch.empty(0, dtype=torch.uint8) for name, _, _ in specs})
        if len(self.items) != len(specs):
            raise FormatError("duplicate tensor names")
        for it, (name, dtype, shape) in zip(self.items, specs):
            codec = encode_dtype(dtype)
            shape = tuple(int(d) for d in shape)
            numel = 1
            for d in shape:
                numel *= d
            if numel == 0 and codec.opaque:
                raise FormatError(f"{name!r}: zero-element {dtype} tensors cannot be read by tensorizer; leave it out")
            it.codec, it.shape, it.nbytes = codec, shape, numel * codec.itemsize
            it.long_shape = any(d >= L.LONG_DIM for d in shape)
        self.version, self.flags, self.metadata_len, self.file_size = _plan(self.items, align)
        self.threads = threads if threads is not None else default_threads()
        self.next = 0
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Hash and write the next tensor (it may be freed as soon as this returns)."""
        if self.next >= len(self.items):
            raise FormatError(f"{self.path}: {name!r}: all {len(self.items)} planned tensors are written")
        it = self.items[self.next]
        if name != it.name:
            raise FormatError(f"{self.path}: expected tensor {it.name!r} next, got {name!r}")
        t = tensor.detach()
        if encode_dtype(t.dtype).encoded != it.codec.encoded or tuple(t.shape) != it.shape:
            raise FormatError(f"{self.path}: {name!r} is {t.dtype} {tuple(t.shape)}, planned {it.codec.dtype} {it.shape}")
        it.src = t.cpu().contiguous()
        threads = 1 if it.nbytes < INLINE_BYTES else self.threads
        tasks, splits = _build_tasks(self.fd, [it], threads)
        _run(tasks, threads)
        for s in splits:
            s.finish()
        it.src = torch.empty(0, dtype=torch.uint8)  # drop the data, keep the item "not meta"
        self.next += 1

    def close(self, fsync: bool = True) -> None:
        """Write the index and prologue (making the file valid) once every tensor is written."""
        if self.next != len(self.items):
            self.abort()
            raise FormatError(f"{self.path}: only {self.next} of {len(self.items)} tensors were written")
        try:
            versioned = bool(self.flags & L.FLAG_VERSIONED_HEADERS)
            meta = b"".join(
                L.pack_metadata_entry(i.name_b, L.TENSOR_TYPE_STATE_DICT, i.codec.encoded, i.shape,
                                      i.long_shape, i.header_offset, i.data_offset, i.nbytes, versioned)
                for i in self.items)
            meta += bytes(self.metadata_len - len(meta))
            pwrite_all(self.fd, memoryview(L.TERMINATOR), self.items[-1].end)
            pwrite_all(self.fd, memoryview(meta), L.PROLOGUE_SIZE)
            pwrite_all(self.fd, memoryview(L.pack_prologue(self.version, self.flags,
                                                           sum(i.nbytes for i in self.items), len(self.items),
                                                           self.metadata_len)), 0)
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        if fsync:
            _fsync_dir(self.path)

    def abort(self) -> None:
        """Close and delete a partial file."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass

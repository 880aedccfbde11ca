"""Writing and opening a checkpoint's index (``manifest.json`` + ``manifest.index``).

Version 2 (written): ``manifest.json`` is a small head, guarded by ``manifest.sha256``;
``manifest.index`` holds the sections it points to, each guarded by a CRC32 in the
head. :func:`open_index` returns a :class:`~megashard.manifest.LazyIndex` that reads
only the sections a rank asks for. Version 1 (one JSON document) is still read.
"""
from __future__ import annotations

import os
from typing import Union

from . import storage
from .errors import CheckpointError
from .manifest import INDEX_NAME, LazyIndex, Manifest, parse_head

Index = Union[Manifest, LazyIndex]


def write_index(directory: str, head: bytes, sections: bytes) -> int:
    """Write an index (see :class:`~megashard.manifest.IndexBuilder`) into ``directory``:
    sections first, then the digest, then the head (a checkpoint is one once its head
    exists). Returns the bytes written."""
    storage.write_file_atomic(os.path.join(directory, INDEX_NAME), sections)
    storage.write_file_atomic(os.path.join(directory, storage.MANIFEST_DIGEST_NAME), storage.manifest_digest(head))
    storage.write_file_atomic(os.path.join(directory, storage.MANIFEST_NAME), head)
    return len(head) + len(sections)


class _IndexFile:
    """A checked descriptor of ``manifest.index`` for positional reads of sections."""

    def __init__(self, base: str, size: int) -> None:
        self.fd = -1
        self.path = os.path.join(base, INDEX_NAME)
        with storage.CheckpointFiles(base) as cf:
            self.fd = os.dup(cf.open(INDEX_NAME, size))

    def read(self, start: int, length: int) -> bytes:
        out = bytearray(length)
        view, pos = memoryview(out), 0
        while pos < length:
            k = os.preadv(self.fd, [view[pos:]], start + pos)
            if k <= 0:
                raise CheckpointError(f"{self.path}: truncated while reading")
            pos += k
        return bytes(out)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def open_index(base: str) -> Index:
    """The index of the committed checkpoint in ``base`` (validated; read-only)."""
    with storage.CheckpointFiles(base) as files:
        head = files.read_manifest_bytes()
    where = os.path.join(base, storage.MANIFEST_NAME)
    doc = parse_head(head, where)
    if doc.get("version") == 1:
        m = Manifest.from_doc(doc, where)
        m.bytes_read = len(head)
        return m
    idx = doc.get("index")
    size = idx.get("bytes") if isinstance(idx, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CheckpointError(f"{where}: index.bytes must be an integer >= 0; the checkpoint is damaged")
    f = _IndexFile(base, size)
    return LazyIndex(doc, f.read, where, len(head), closer=f.close)


def read_manifest(checkpoint_dir: Union[str, os.PathLike]) -> Manifest:
    """The whole index of a committed checkpoint, validated; changes nothing on disk."""
    index = open_index(storage.checkpoint_location(checkpoint_dir))
    if isinstance(index, Manifest):
        return index
    try:
        return index.full()
    finally:
        index.close()

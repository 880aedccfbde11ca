"""Writing and opening a checkpoint's index (``manifest.json`` + ``manifest.index``).

Version 2 (written): ``manifest.json`` is a small head, guarded by ``manifest.sha256``;
``manifest.index`` holds the sections it points to, each guarded by a CRC32 in the
head. :func:`open_index` returns a :class:`~megashard.manifest.LazyIndex` that reads
only the sections a rank asks for. Version 1 (one JSON document) is still read.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Optional, Tuple, Union

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
    """``manifest.index``, checked on open, for positional reads of sections (through the
    files object's ``read_into``, so any storage's files object serves)."""

    def __init__(self, files: Any, size: int) -> None:
        """``files``: the files object that read the head (it owns it from here on)."""
        self.size, self.path = size, files.path(INDEX_NAME)
        self.files: Any = files
        try:
            self.files.read_into(INDEX_NAME, (), size=size, threads=1)  # the checks, before any section is read
        except BaseException:
            self.close()
            raise

    def read(self, start: int, length: int) -> bytes:
        if self.files is None:
            raise CheckpointError(f"{self.path}: read after the index was closed (internal error)")
        out = bytearray(length)
        self.files.read_into(INDEX_NAME, [(start, memoryview(out))], size=self.size, threads=1)
        return bytes(out)

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
            self.files = None

    def __del__(self) -> None:
        self.close()


def _open(head: bytes, where: str,
          sections: Callable[[int], Tuple[Callable[[int, int], bytes], Optional[Callable[[], None]]]]) -> Index:
    """An index from its head; ``sections(size)`` gives the section reader (and a closer)."""
    doc = parse_head(head, where)
    if doc.get("version") == 1:
        m = Manifest.from_doc(doc, where)
        m.bytes_read = len(head)
        return m
    idx = doc.get("index")
    size = idx.get("bytes") if isinstance(idx, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CheckpointError(f"{where}: index.bytes must be an integer >= 0; the checkpoint is damaged")
    read, closer = sections(size)
    index = LazyIndex(doc, read, where, len(head), closer=closer)
    index.data_prefix = doc.get("data_prefix")  # object stores: where the save's objects are (checked on use)
    index.index_etag = idx.get("etag")
    return index


def open_index(base: str) -> Index:
    """The index of the committed checkpoint in ``base`` (validated; read-only). Its
    ``confirm_file`` checks a member's real size against the index's claim."""
    files = storage.checkpoint_files(base)
    try:
        head = files.read_manifest_bytes()
        if not storage.is_url(base) and b'"data_prefix"' in head:
            _refuse_object_layout(head, base)
    except BaseException:
        files.close()
        raise
    opened: list = []

    def from_file(size: int) -> Tuple[Callable[[int, int], bytes], Optional[Callable[[], None]]]:
        f = _IndexFile(files, size)
        opened.append(f)
        return f.read, f.close

    try:
        index = _open(head, os.path.join(base, storage.MANIFEST_NAME), from_file)
    finally:
        if not opened:  # version 1, or refused before the sections: nothing keeps the files object
            files.close()
    index.check_file = partial(check_file_size, base, index=index)
    return index


def _refuse_object_layout(head: bytes, base: str) -> None:
    """A head naming a save prefix in a directory: objects of an object store's checkpoint
    copied as plain files (its files are one directory down, its index unreadable here)."""
    prefix = parse_head(head, os.path.join(base, storage.MANIFEST_NAME)).get("data_prefix")
    if prefix is not None:
        raise CheckpointError(
            f"{base}: its {storage.MANIFEST_NAME} names the object-store save prefix {str(prefix)[:80]!r}: the objects "
            "of an s3:// checkpoint copied as plain files (e.g. `aws s3 cp --recursive`), which is not a checkpoint "
            "on a file system. Copy it with `megashard copy s3://BUCKET/PREFIX DIR` instead")


def check_file_size(base: str, name: str, size: int, index: Any = None) -> None:
    """Member ``name`` of ``base`` is a regular file (no link) of exactly ``size`` bytes
    (on an object store: the object of that size and of the index's ETag)."""
    with storage.checkpoint_files(base, index) as cf:
        cf.open(name, size)


def read_index_bytes(base: str) -> Tuple[bytes, bytes]:
    """``manifest.json`` and the whole ``manifest.index`` (empty for version 1), checked
    against each other: what a node's reader sends ranks that cannot see the directory."""
    with storage.checkpoint_files(base) as cf:
        head = cf.read_manifest_bytes()
        doc = parse_head(head, cf.path(storage.MANIFEST_NAME))
        if doc.get("version") == 1:
            return head, b""
        idx = doc.get("index") if isinstance(doc.get("index"), dict) else {}
        sections = cf.read_bytes(INDEX_NAME, storage.max_manifest_bytes())
        if len(sections) != idx.get("bytes"):
            raise CheckpointError(f"{cf.path(INDEX_NAME)}: size differs from the manifest's")
    return head, sections


def index_from_bytes(head: bytes, sections: bytes, where: str) -> Index:
    """The index :func:`read_index_bytes` read, received from another rank (validated)."""
    def in_memory(size: int) -> Tuple[Callable[[int, int], bytes], Optional[Callable[[], None]]]:
        if len(sections) != size:
            raise CheckpointError(f"{where}: received {len(sections)} index bytes, the head says {size}")
        return (lambda s, n: sections[s:s + n]), None

    return _open(head, where, in_memory)


def read_manifest(checkpoint_dir: Union[str, os.PathLike]) -> Manifest:
    """The whole index of a committed checkpoint, validated; changes nothing on disk."""
    index = open_index(storage.checkpoint_location(checkpoint_dir))
    if isinstance(index, Manifest):
        return index
    try:
        m = index.full()
    finally:
        index.close()
    m.check_file = index.check_file
    return m

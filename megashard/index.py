"""A checkpoint's index (``manifest.json`` + ``manifest.index``) from its bytes or its files object.

Version 3 (written; version 2 is still read): ``manifest.json`` is a small head, guarded by
``manifest.sha256``; ``manifest.index`` holds the sections it points to, each guarded by a
CRC32 in the head, and (version 3) the records' CRC32s in one binary region. :func:`index_from_files` returns a :class:`~megashard.manifest.LazyIndex` that reads
only the sections a rank asks for. Version 1 (one JSON document) is still read.

No storage here: any store's files object serves (:func:`megashard.storage.open_index` opens one
at a location; the stores write the index, :func:`megashard.storage.posix.write_index`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

from .errors import CheckpointError
from .manifest import INDEX_NAME, LazyIndex, Manifest, parse_head

Index = Union[Manifest, LazyIndex]


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
        if start < 0 or length < 0 or start + length > self.size:  # before a claimed length sizes a buffer
            raise CheckpointError(f"{self.path}: section {start}+{length} lies past the index's {self.size} bytes; "
                                  "the checkpoint is damaged or hostile")
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


def index_from_files(files: Any, head: bytes, where: str) -> Index:
    """The index whose head ``head`` (``where``: for messages) the files object ``files`` read
    (validated); the index owns ``files`` from here on (closed with it, or here when nothing keeps it)."""
    opened: list = []

    def from_file(size: int) -> Tuple[Callable[[int, int], bytes], Optional[Callable[[], None]]]:
        f = _IndexFile(files, size)
        opened.append(f)
        return f.read, f.close

    try:
        return _open(head, where, from_file)
    finally:
        if not opened:  # version 1, or refused before the sections: nothing keeps the files object
            files.close()


def index_from_bytes(head: bytes, sections: bytes, where: str) -> Index:
    """The index :func:`read_index_bytes` read, received from another rank (validated)."""
    def in_memory(size: int) -> Tuple[Callable[[int, int], bytes], Optional[Callable[[], None]]]:
        if len(sections) != size:
            raise CheckpointError(f"{where}: received {len(sections)} index bytes, the head says {size}")
        return (lambda s, n: sections[s:s + n]), None

    return _open(head, where, in_memory)


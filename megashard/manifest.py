"""The checkpoint index: one JSON file that says where every byte of every tensor is.

Global tensors are listed by their global key with dtype and global shape; each
saved shard records its chunk (offset, shape), optional flat range, file, tensor
name inside that file, byte range and CRC32. Non-tensor state is stored as JSON
trees (see :mod:`megashard.jsonstate`), one per distinct rank structure. The
manifest is parsed defensively: anything malformed raises :class:`CheckpointError`
naming the manifest path and the offending field. It is never pickled.
"""
from __future__ import annotations

import bisect
import io
import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import CheckpointError
from .format.dtypes import dtypes_by_name
from .plan import Box, SavedPiece, ints_text, numel, text_ints

MANIFEST_FORMAT = "megashard"
MANIFEST_VERSION = 3  # written; versions 1 (one JSON document) and 2 (CRC32s inside records) are still read
READ_VERSIONS = (1, 2, 3)
INDEX_NAME = "manifest.index"  # version >= 2: the sections the head points into
CRC_BLOCK = 1024  # version 3: record CRC32s per checked block of the CRC32 region (4 KiB)

_DTYPES: Dict[str, torch.dtype] = dtypes_by_name()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "") -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}unknown dtype {name!r}") from None


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass
class ShardRecord:
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    flat: Optional[Tuple[int, int]]
    file: Optional[str]  # None for zero-byte shards (never written to a file)
    name: str
    header_offset: int
    data_offset: int
    nbytes: int
    crc32: int

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"offset": list(self.offset), "shape": list(self.shape)}
        if self.flat is not None:
            d["flat"] = list(self.flat)
        d.update(file=self.file, name=self.name, header_offset=self.header_offset,
                 data_offset=self.data_offset, nbytes=self.nbytes, crc32=self.crc32)
        return d

    def piece(self) -> SavedPiece:
        return SavedPiece(Box(self.offset, self.shape), self.flat or (0, numel(self.shape)),
                          self.file or "", self.data_offset)


@dataclass
class TensorRecord:
    key: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    shards: List[ShardRecord] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.global_shape),
                "shards": [s.to_json() for s in self.shards]}


class _FileSizes:
    """Real file sizes, checked before memory is allocated for a file's contents: the index's
    own claims (``files[*].bytes``) only bound offsets, a forged one could claim 64 GiB.
    ``check_file(name, claimed bytes)`` raises CheckpointError when the file differs; it is
    set where the directory can be seen (:func:`megashard.storage.open_index`)."""

    check_file: Optional[Callable[[str, int], None]] = None
    _confirmed: Optional[set] = None
    #: every read of a file checks its size and version itself before a byte of it is delivered (an
    #: object store's ranged GETs: ``Content-Range`` against the recorded size, ``If-Match`` the
    #: recorded ETag): a file whose bytes only go into the caller's own memory needs no check first
    reads_check_files: bool = False

    def confirm_file(self, name: str, reads_only: bool = False) -> None:
        """Raise unless file ``name`` exists with the size the index records (once per file).
        ``reads_only``: nothing is allocated for the bytes the caller plans to read from it (they go
        into memory the caller already holds); where :attr:`reads_check_files`, the reads are the
        check (one round trip less per object on an object store) and nothing is asked here."""
        if self.check_file is None or (reads_only and self.reads_check_files):
            return
        if self._confirmed is None:
            self._confirmed = set()
        if name not in self._confirmed:
            self.check_file(name, int(self.files[name].get("bytes", 0)))  # type: ignore[attr-defined]
            self._confirmed.add(name)


@dataclass
class Manifest(_FileSizes):
    """The whole index in memory (tools, conversion, version-1 checkpoints). Loads plan
    through the same methods on :class:`LazyIndex`, which reads only what a rank needs."""

    world_size: int
    layout: Dict[str, Any]
    files: Dict[str, Dict[str, Any]]  # file name -> {"rank": r, "bytes": n, "tensors": k}
    tensors: Dict[str, TensorRecord]
    objects: Dict[str, Any]  # ShardedObject unique_key -> encoded value
    trees: Dict[str, Any]  # tree id -> encoded state tree
    rank_trees: List[str]  # rank -> tree id
    created: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION
    bytes_read: int = 0  # index bytes read to build this (head + sections)

    def to_doc(self) -> Dict[str, Any]:
        """The logical document (version-1 shape): what :func:`encode` splits into files."""
        return {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "created": self.created,
            "world_size": self.world_size, "layout": self.layout, "files": self.files,
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "objects": self.objects, "trees": self.trees, "rank_trees": self.rank_trees, "extra": self.extra,
        }

    def close(self) -> None:
        """Nothing to release (the interface of :class:`LazyIndex`)."""

    # -- the planning interface (shared with LazyIndex) -----------------------
    def tensor(self, key: str) -> Optional[TensorRecord]:
        return self.tensors.get(key)

    def pieces(self, key: str, box: Box) -> List[ShardRecord]:
        """The saved shards of ``key`` whose chunks overlap ``box`` (or equal it, if empty)."""
        rec = self.tensors.get(key)
        if rec is None:
            return []
        return [s for s in rec.shards if _touches(s.offset, s.shape, box)]

    def object(self, ukey: str) -> Any:
        """The stored entry of ShardedObject ``ukey`` (``KeyError`` when absent)."""
        return self.objects[ukey]

    def has_object(self, ukey: str) -> bool:
        return ukey in self.objects

    def tree_for_rank(self, rank: int, keys: Optional[Any] = None) -> Any:
        """The saved state tree of ``rank`` (rank 0's when that rank did not exist);
        ``keys`` is a hint that only those top-level entries are needed."""
        tid = self.rank_trees[rank] if 0 <= rank < len(self.rank_trees) else self.rank_trees[0]
        return self.trees[tid]

    @property
    def total_bytes(self) -> int:
        return sum(int(f.get("bytes", 0)) for f in self.files.values())

    @classmethod
    def from_doc(cls, doc: Dict[str, Any], where: str = "manifest.json") -> "Manifest":
        """Validate a logical document (version-1 shape) into a Manifest."""
        p = _Parser(where)
        world = p.int(doc.get("world_size"), "world_size", lo=1)
        files = _parse_files(p, doc.get("files"))
        tensors: Dict[str, TensorRecord] = {}
        for key, t in p.dict(doc.get("tensors"), "tensors").items():
            w = f"tensors[{key!r}]"
            p.dict(t, w)
            dtype = dtype_from_name(t.get("dtype"), f"{where}: {w}: ")
            gshape = p.shape(t.get("shape"), f"{w}.shape")
            rec = TensorRecord(key, dtype, gshape)
            isz = itemsize(dtype)
            for i, s in enumerate(p.list(t.get("shards"), f"{w}.shards")):
                ws = f"{w}.shards[{i}]"
                p.dict(s, ws)
                off = p.shape(s.get("offset"), f"{ws}.offset")
                shp = p.shape(s.get("shape"), f"{ws}.shape")
                rec.shards.append(_parse_shard(p, ws, off, shp, gshape, isz, files, s.get("flat"), s.get("file"),
                                               s.get("name", ""), s.get("header_offset", 0), s.get("data_offset"),
                                               s.get("nbytes"), s.get("crc32", 0)))
            by_chunk: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], List[ShardRecord]] = {}
            for sr in rec.shards:
                by_chunk.setdefault((sr.offset, sr.shape), []).append(sr)
            _check_chunks(p, key, list(by_chunk))
            for (off, shp), recs in by_chunk.items():
                _check_flat_ranges(p, key, off, shp, recs)
            tensors[key] = rec
        trees = p.dict(doc.get("trees"), "trees")
        rank_trees = p.list(doc.get("rank_trees"), "rank_trees")
        p.require(len(rank_trees) >= 1 and all(isinstance(r, str) and r in trees for r in rank_trees),
                  "rank_trees refer to unknown trees")
        return cls(
            world_size=world, layout=p.dict(doc.get("layout", {}), "layout"), files=files, tensors=tensors,
            objects=p.dict(doc.get("objects", {}), "objects"), trees=trees, rank_trees=list(rank_trees),
            created=_created(doc), extra=p.dict(doc.get("extra", {}), "extra"),
            version=int(doc.get("version", MANIFEST_VERSION)),
        )


def shard_name(key: str, global_shape: Tuple[int, ...], offset: Tuple[int, ...], shape: Tuple[int, ...],
               flat: Optional[Tuple[int, int]]) -> str:
    """The tensor name of a saved shard inside its file. A version-2 index stores a shard's
    name only when it differs from this."""
    if tuple(shape) == tuple(global_shape) and flat is None:
        return key
    name = f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"
    if flat is not None:
        name += f"_flat{flat[0]}-{flat[1]}"
    return name


def _created(doc: Dict[str, Any]) -> float:
    c = doc.get("created", 0.0)
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else 0.0


def _touches(offset: Tuple[int, ...], shape: Tuple[int, ...], box: Box) -> bool:
    if len(offset) != len(box.offset):
        return False
    if box.numel == 0 or numel(shape) == 0:
        return tuple(offset) == tuple(box.offset) and tuple(shape) == tuple(box.shape)
    return all(o < bo + bs and bo < o + s for o, s, bo, bs in zip(offset, shape, box.offset, box.shape))


def _chunk_text(off: Sequence[int], shp: Sequence[int]) -> str:
    return f"{list(off)}+{list(shp)}"


def _check_chunks(p: "_Parser", key: str, chunks: Sequence[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> None:
    """A tensor's chunks are distinct and disjoint: a load counts the elements its chunks cover,
    so two chunks claiming the same elements (and leaving others unsaved) must be refused here."""
    from .plan import overlap_pairs

    seen: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], int] = {}
    for i, c in enumerate(chunks):
        j = seen.setdefault(c, i)
        if j != i:
            p.fail(f"tensor {key!r}: chunk {_chunk_text(*c)} is listed twice (chunks {j} and {i})")
    pairs = overlap_pairs([Box(o, s) for o, s in chunks], limit=1)
    if pairs:
        i, j = pairs[0]
        p.fail(f"tensor {key!r}: chunks {_chunk_text(*chunks[i])} and {_chunk_text(*chunks[j])} overlap "
               "(each element must be saved once)")


def _check_flat_ranges(p: "_Parser", key: str, off: Tuple[int, ...], shp: Tuple[int, ...],
                       recs: Sequence["ShardRecord"]) -> None:
    """The shards of one chunk hold disjoint flat ranges of it."""
    if len(recs) < 2:
        return
    n = numel(shp)
    spans = sorted(r.flat or (0, n) for r in recs)
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        if a1 < b0:
            p.fail(f"tensor {key!r}: chunk {_chunk_text(off, shp)} holds flat ranges {[a0, b0]} and {[a1, b1]} "
                   "that overlap (each element must be saved once)")


def parse_head(text: str | bytes, where: str) -> Dict[str, Any]:
    """``manifest.json`` parsed (bounded) with its format, version and head schema checked: the
    one rule of what is a megashard checkpoint (both stores; what a save may replace and a
    clean-up delete), so a user's ``manifest.json`` is never taken for one."""
    from .jsonstate import parse_json

    doc = parse_json(text, f"{where} (the checkpoint is damaged)")
    p = _Parser(where)
    p.require(isinstance(doc, dict), "top level is not an object")
    p.require(doc.get("format") == MANIFEST_FORMAT, f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    version = doc.get("version")
    p.require(version in READ_VERSIONS,
              f"manifest version {version!r} is not supported by this megashard (reads {list(READ_VERSIONS)}); "
              "upgrade megashard")
    p.int(doc.get("world_size"), "world_size", lo=1)
    p.list(doc.get("rank_trees"), "rank_trees")
    if version == 1:
        for k in ("files", "tensors", "trees"):
            p.dict(doc.get(k), k)
    else:
        for k in ("files", "tensors", "trees"):
            p.list(doc.get(k), k)
        p.require(p.dict(doc.get("index"), "index").get("file") == INDEX_NAME, f"index.file must be {INDEX_NAME!r}")
        if version >= 3:
            crcs = p.list(doc.get("crcs"), "crcs")
            p.require(len(crcs) == 3, "crcs must be [start, record count, CRC32 of the block table]")
            for v in crcs:
                p.int(v, "crcs")
    return doc


def _parse_files(p: "_Parser", files: Any) -> Dict[str, Dict[str, Any]]:
    p.dict(files, "files")
    for name, info in files.items():
        p.require(is_plain_file_name(name), f"file name {str(name)[:100]!r} is not a plain file name")
        p.dict(info, f"files[{name!r}]")
        p.int(info.get("bytes", 0), f"files[{name!r}].bytes")
    return files


def _parse_shard(p: "_Parser", ws: str, off: Tuple[int, ...], shp: Tuple[int, ...], gshape: Tuple[int, ...],
                 isz: int, files: Dict[str, Dict[str, Any]], flat: Any, file: Any, name: Any, header_offset: Any,
                 data_offset: Any, nbytes: Any, crc32: Any) -> ShardRecord:
    """One saved shard, checked: inside the global shape, byte count matching its
    elements, byte range inside a listed file. Shared by both index versions."""
    p.require(len(off) == len(gshape) == len(shp), f"{ws}: offset/shape rank differs from the tensor's")
    p.require(all(o + n <= g for o, n, g in zip(off, shp, gshape)),
              f"{ws}: chunk {list(off)}+{list(shp)} lies outside the global shape {list(gshape)}")
    if flat is not None:
        flat = p.shape(flat, f"{ws}.flat")
        p.require(len(flat) == 2 and flat[0] <= flat[1] <= numel(shp), f"{ws}.flat {list(flat)} invalid")
        n_el = flat[1] - flat[0]
    else:
        n_el = numel(shp)
    nbytes = p.int(nbytes, f"{ws}.nbytes")
    p.require(nbytes == n_el * isz, f"{ws}.nbytes={nbytes} but the shard has {n_el} x {isz} bytes")
    p.require(file is None or (isinstance(file, str) and file in files),
              f"{ws}.file {str(file)[:100]!r} is not listed in files")
    p.require(file is not None or nbytes == 0, f"{ws}: has bytes but no file")
    data_offset = p.int(data_offset, f"{ws}.data_offset")
    header_offset = p.int(header_offset, f"{ws}.header_offset")
    if file is not None:
        fbytes = files[file].get("bytes", 0)
        p.require(header_offset <= data_offset and data_offset + nbytes <= fbytes,
                  f"{ws}: bytes {data_offset}+{nbytes} do not fit in {file} ({fbytes} bytes)")
    p.require(isinstance(name, str), f"{ws}.name must be a string")
    return ShardRecord(off, shp, tuple(flat) if flat is not None else None, file, name, header_offset,
                       data_offset, nbytes, p.int(crc32, f"{ws}.crc32"))


# ---------------------------------------------------------------------------
# version 2: a small head (manifest.json) + sections (manifest.index)
#
# The head lists every tensor's chunks with the byte range of the section that holds
# that chunk's shard records, every object's and state-tree part's section, and the
# file table. Version 3 moves the records' CRC32s out of the chunk sections into one binary
# region (``crcs`` in the head), so the chunk sections of two saves of one layout are equal. A load reads the head and then only the sections of the chunks its own
# shards overlap, the objects its template names and its own state tree.

_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


class _Sections:
    """The index file being built, in one growing buffer (not a list of parts joined at the
    end: that held the index twice). Callers share equal sections themselves (state-tree parts)."""

    def __init__(self) -> None:
        self.buf: Optional[io.BytesIO] = io.BytesIO()
        self.size = 0

    def write(self, data: Any) -> None:
        """Append ``data`` (bytes-like) as it is, no section entry."""
        assert self.buf is not None, "the index sections were taken already"
        self.buf.write(data)
        self.size += len(data)

    def add(self, data: bytes) -> List[int]:
        """``[start, length, crc32]`` of ``data``, appended as a section of its own."""
        got = [self.size, len(data), zlib.crc32(data)]
        self.write(data)
        return got

    def take(self) -> bytes:
        """The sections as one bytes object: ``BytesIO.getvalue`` of an unshared buffer hands
        over the buffer itself (shrunk in place), so the index is never copied."""
        assert self.buf is not None, "the index sections were taken already"
        data, self.buf = self.buf.getvalue(), None
        assert len(data) == self.size
        return data


def record_text(key: str, global_shape: Sequence[int], offset: Sequence[int], shape: Sequence[int],
                flat: Optional[Sequence[int]], file: Optional[str], name: str, header_offset: int, data_offset: int,
                nbytes: int) -> str:
    """One shard's record as a version-3 chunk section stores it: ``[flat, file, name, header
    offset, data offset, bytes]`` (name ``null`` when :func:`shard_name` derives it). Its CRC32
    is stored apart, in the index's CRC32 region, so a later save of the same layout (only other
    data) repeats every record's text byte for byte (:class:`IndexSkeleton`). Writing ranks
    build their own records' texts, so the coordinator only groups and joins them."""
    if flat is not None and len(flat) != 2:
        raise ValueError("flat range must have two ends")
    fl = None if flat is None else (_int(flat[0]), _int(flat[1]))
    if name == shard_name(key, tuple(global_shape), tuple(offset), tuple(shape), fl):
        name_text = "null"
    else:
        name_text = _dumps(name)
    flat_text = "null" if fl is None else f"[{fl[0]},{fl[1]}]"
    file_text = "null" if file is None else _dumps(file)
    return f"[{flat_text},{file_text},{name_text},{_int(header_offset)},{_int(data_offset)},{_int(nbytes)}]"


def group_records(results: Sequence[Mapping[str, Any]], consume: bool = False) -> Dict[str, Any]:
    """A gather group's share of the index, made by its leader: its members' write records
    (``[key, chunk text, order, record text, CRC32]`` rows, ``results[i]["records"]``) grouped by
    chunk, each chunk's records sorted by flat start and joined as its section's body, so that
    rank 0 lays out the group's sections without touching a record (:meth:`IndexBuilder.group`).
    Returns ``counts`` (records per member), ``keys``, ``chunks`` (:func:`~megashard.plan.ints_text`; per chunk: the key's number,
    ndim, offset, shape, first record's order, record count, body length, and 1 when the
    group's records cover the chunk, 0 when other groups hold pieces of it too), ``body``, and
    ``crcs``/``slots`` (hex, little-endian u32, section order; slots count from the group's first
    record in member order). ``consume``: each member's records are dropped once grouped."""
    by: Dict[Tuple[str, str], List[Tuple[int, str, int, int]]] = {}
    counts: List[int] = []
    slot = 0
    for res in results:
        rows = res["records"]
        counts.append(len(rows))
        for key, chunk, order, text, crc in rows:
            got = by.get((key, chunk))
            if got is None:
                by[(key, chunk)] = [(_int(order), text, slot, crc)]
            else:
                got.append((_int(order), text, slot, crc))
            slot += 1
        if consume:
            res["records"] = None  # type: ignore[index]
    keys: Dict[str, int] = {}
    parsed: Dict[str, Tuple[List[int], List[int], int]] = {}
    ints: List[int] = []
    body: List[str] = []
    crcs: List[int] = []
    slots: List[int] = []
    for (key, chunk), recs in by.items():
        got = parsed.get(chunk)
        if got is None:
            off, shp = json.loads(chunk)
            if len(off) != len(shp) or not all(type(v) is int and v >= 0 for v in off + shp):  # noqa: E721
                raise ValueError(f"{key!r}: malformed chunk {chunk[:200]}")
            got = parsed[chunk] = (off, shp, math.prod(shp))
        off, shp, numel = got
        if len(recs) > 1:
            recs.sort(key=_first)
        text = ",".join([r[1] for r in recs])
        if not numel:  # an empty chunk every rank holding it records: joined with other groups' at rank 0
            whole = False
        elif text.startswith("[null,"):  # not flattened: the one record is the whole chunk
            whole = len(recs) == 1
        else:  # flat pieces: whole when their ranges add up to the chunk
            held = 0
            for r in recs:
                a, b = r[1][2:r[1].index("]")].split(",")
                held += int(b) - int(a)
            whole = held == numel
        ints += (keys.setdefault(key, len(keys)), len(off))
        ints += off
        ints += shp
        ints += (recs[0][0], len(recs), len(text), int(whole))
        body.append(text)
        crcs += [r[3] for r in recs]
        slots += [r[2] for r in recs]
    c = np.array(crcs, dtype=np.int64)
    if c.size and (c.min() < 0 or c.max() > 0xFFFFFFFF):
        raise ValueError("a CRC32 lies outside 0..2**32-1")
    return {"counts": counts, "keys": list(keys), "chunks": ints_text(ints), "body": "".join(body).encode(),
            "crcs": c.astype("<u4").tobytes().hex(), "slots": np.array(slots, dtype="<u4").tobytes().hex()}


def named_texts(members: Sequence[Optional[Mapping[str, str]]]) -> Dict[str, Any]:
    """A gather group's per-rank ``{name: JSON text}`` entries of one kind (its members' files,
    their objects) for rank 0, made by its leader: ``names``, ``counts`` (entries per member)
    and ``lengths`` (per entry, :func:`~megashard.plan.ints_text`) and ``body``, the texts
    joined as bytes (a bytes value travels beside a part's JSON: :func:`~megashard.transport.pack_led_part`).
    Rank 0 lays the index's tables out of them (:class:`NamedTexts`) without decoding a value."""
    names: List[str] = []
    counts: List[int] = []
    texts: List[str] = []
    for m in members:
        m = m or {}
        names += m
        texts += m.values()
        counts.append(len(m))
    if not all(type(t) is str for t in texts):  # noqa: E721
        raise TypeError("named_texts: every value must be a JSON text")
    body = "".join(texts).encode()
    lengths = [len(t) for t in texts]
    if len(body) != sum(lengths):  # not ASCII (texts of another encoder): each text's own bytes
        lengths = [len(t.encode()) for t in texts]
    return {"names": names, "counts": ints_text(counts), "lengths": ints_text(lengths), "body": body}


class NamedTexts:
    """Every rank's ``{name: JSON text}`` entries of one kind, in rank order, from the groups'
    :func:`named_texts`: ``names`` and the texts in one body (:meth:`cut`). It stands for the
    millions of small dicts the first commit at 100k+ ranks held (every rank's files and objects,
    kept for the next steady commit): the index's file and object tables are cut from it
    (:meth:`IndexBuilder.finish`) without decoding a value."""

    def __init__(self) -> None:
        self.names: List[str] = []
        self._bodies: List[bytes] = []  # the groups' bodies, joined once when first cut
        self._lengths: List[Any] = []
        self._counts: List[Any] = []
        self._cut: Optional[Tuple[Any, Any, Any]] = None  # (starts, ends, counts per rank) once asked for

    def add(self, part: Mapping[str, Any]) -> None:
        """One group's :func:`named_texts` (group order)."""
        names, body = part["names"], part["body"]
        counts, lengths = text_ints(part["counts"]), text_ints(part["lengths"])
        if not (type(names) is list and isinstance(body, bytes) and len(lengths) == len(names)  # noqa: E721
                and int(counts.sum()) == len(names) and (counts >= 0).all() and (lengths >= 0).all()
                and int(lengths.sum()) == len(body) and all(type(n) is str for n in names)):  # noqa: E721
            raise ValueError("a group's named texts are inconsistent")
        self._add(names, counts, lengths, body)

    def _add(self, names: List[str], counts: Any, lengths: Any, body: bytes) -> None:
        self.names += names
        self._bodies.append(body)
        self._lengths.append(lengths)
        self._counts.append(counts)
        self._cut = None

    @classmethod
    def of(cls, members: Sequence[Optional[Mapping[str, str]]]) -> "NamedTexts":
        t = cls()
        t.add(named_texts(members))
        return t

    def cut(self) -> Tuple[Any, Any, Any, Any]:
        """``(body, starts, ends, counts)``: the texts joined, each entry's start and end in them
        (numpy int64), each rank's entry count."""
        if self._cut is None:
            self._bodies = [b"".join(self._bodies)]
            lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
            counts = np.concatenate(self._counts) if self._counts else np.zeros(0, dtype=np.int64)
            self._lengths, self._counts = [lengths], [counts]
            ends = np.cumsum(lengths)
            self._cut = (ends - lengths, ends, counts)
        return (self._bodies[0],) + self._cut

    @property
    def ranks(self) -> int:
        return len(self.cut()[3])

    def by_rank(self) -> List[Dict[str, Any]]:
        """Every rank's entries, decoded: ``[{name: value}, ...]`` (the storage's commit checks files)."""
        body, starts, ends, counts = self.cut()
        with memoryview(body) as mv:
            values = json.loads(b"[" + b",".join([mv[a:e] for a, e in zip(starts.tolist(), ends.tolist())]) + b"]")
        out: List[Dict[str, Any]] = []
        i = 0
        for n in counts.tolist():
            out.append(dict(zip(self.names[i:i + n], values[i:i + n])))
            i += n
        return out

    def replaced(self, changes: Mapping[int, Mapping[str, str]]) -> "NamedTexts":
        """A copy with the entries of the ranks in ``changes`` (rank -> their new ``{name: text}``);
        the other ranks' entries are copied in runs, not one by one."""
        body, starts, ends, counts = self.cut()
        lengths = ends - starts
        firsts = (np.cumsum(counts) - counts).tolist()
        out = NamedTexts()
        r = 0
        for c in sorted(r for r in changes if 0 <= r < len(counts)) + [len(counts)]:
            if c > r:  # ranks r..c-1 unchanged
                i, j = firsts[r], firsts[c - 1] + int(counts[c - 1])
                a, b = (int(ends[i - 1]) if i else 0), (int(ends[j - 1]) if j else 0)
                out._add(self.names[i:j], counts[r:c], lengths[i:j], body[a:b])
            if c < len(counts):
                out.add(named_texts([changes[c]]))
            r = c + 1
        return out

    def order(self) -> List[int]:
        """Entry numbers sorted by name; of entries of equal names only the last (a dict's update)."""
        names = self.names
        idx = sorted(range(len(names)), key=names.__getitem__)
        return [j for k, j in enumerate(idx) if k + 1 == len(idx) or names[idx[k + 1]] != names[j]]


def check_crc(v: Any) -> int:
    """``v`` if it is a CRC32 (an int in 0..2**32-1), else ValueError."""
    if not 0 <= _int(v) <= 0xFFFFFFFF:
        raise ValueError(f"{v!r} is not a CRC32")
    return v


def _int(v: Any) -> int:
    if type(v) is not int:  # noqa: E721  (bool and float are not record integers)
        raise TypeError(f"{v!r} is not an integer")
    return v


def _crc_region(sec: "_Sections", crcs: Any) -> List[int]:
    """Append the CRC32 region (version 3): every record's CRC32 as little-endian u32 in
    chunk-section order, then one CRC32 per block of :data:`CRC_BLOCK` of them, so a reader
    checks the few blocks it reads. Returns the head's ``crcs`` entry: ``[start, record count,
    CRC32 of the block table]``."""
    data = np.ascontiguousarray(crcs, dtype="<u4").tobytes()
    view, step = memoryview(data), 4 * CRC_BLOCK
    table = np.array([zlib.crc32(view[a:a + step]) for a in range(0, len(data), step)], dtype="<u4").tobytes()
    start = sec.size
    sec.write(data)
    sec.write(table)
    return [start, len(data) // 4, zlib.crc32(table)]


class IndexBuilder:
    """Lays out a version-3 index (head + sections) from pre-encoded JSON texts: chunk
    records (:func:`record_text`) with their CRC32s, object values and state-tree parts.
    ``finish`` returns ``(manifest.json bytes, manifest.index bytes)``. Does not validate:
    the reader does.

    The index file holds, in order: the chunk sections, the tensor table's buckets, the
    CRC32 region (:func:`_crc_region`), then objects, state trees and the file table. The
    first two depend on the layout only: ``skeleton`` (after ``finish``) keeps them, encoded,
    with where each record given a ``slot`` sits in the CRC32 region; a later save of the
    same layout starts from it (:meth:`resume`) and only writes its CRC32s."""

    def __init__(self) -> None:
        self.sec = _Sections()
        self.tensors: Dict[str, Any] = {}
        self._chunks: Dict[str, Dict[Any, List[Tuple[Any, str, int, int]]]] = {}
        self._objects: Optional[NamedTexts] = None
        self._trees: List[Tuple[str, Sequence[Tuple[str, str]]]] = []
        self.slots = 0
        self.skeleton: Optional[IndexSkeleton] = None
        self._crcs: Any = None  # section order
        self._perm: Any = None  # section order -> slot
        self._resumed = False
        self.tail: Optional["IndexTail"] = None  # what finish laid out after the CRC32 region
        # fed by groups (group()): each key's chunks laid out so far, (offset + shape, start, length, crc32);
        # chunks whose pieces several groups hold, until finish; CRC32s and slots in section order
        self._table: Optional[Dict[str, List[Tuple[List[int], int, int, int]]]] = None
        self._open: Dict[Tuple[str, Tuple[int, ...]], List[Tuple[int, bytes, Any, Any]]] = {}
        self._crc_parts: List[Any] = []
        self._slot_parts: List[Any] = []
        self._placed = 0  # records whose CRC32s the sections laid out so far number

    @classmethod
    def resume(cls, skeleton: "IndexSkeleton", crcs: Any) -> "IndexBuilder":
        """A builder whose chunk sections and tensor table are ``skeleton``'s, with these
        CRC32s (one per slot, in slot order); objects, trees and files are added as usual."""
        c = np.asarray(crcs)
        if c.shape != skeleton.perm.shape:
            raise ValueError(f"the index skeleton holds {len(skeleton.perm)} records, got {c.size} CRC32s")
        if c.size and c.dtype.kind != "u" and (c.min() < 0 or c.max() > 0xFFFFFFFF):
            raise ValueError("a CRC32 lies outside 0..2**32-1")
        b = cls()
        b.sec.write(skeleton.prefix)
        b._crcs = c.astype("<u4", copy=False)[skeleton.perm]
        b.skeleton, b._resumed = skeleton, True
        return b

    def tensor(self, key: str, dtype: Any, shape: Any) -> None:
        self.tensors[key] = {"dtype": dtype, "shape": shape, "chunks": None}
        self._chunks[key] = {}

    def record(self, key: str, chunk: Any, order: Any, text: str, slot: int = -1, crc: int = 0) -> None:
        """Shard record ``text`` of chunk ``chunk`` (``(offset, shape)`` tuples) of ``key``,
        with its data's CRC32 ``crc``; records of a chunk are stored sorted by ``order`` (the
        flat range's start). ``slot`` (0, 1, 2, ... in the order later saves send their
        CRC32s): where the skeleton finds its CRC32."""
        got = self._chunks[key].get(chunk)
        if got is None:
            got = self._chunks[key][chunk] = []
        got.append((order, text, slot, crc))
        if slot >= self.slots:
            self.slots = slot + 1

    def group(self, part: Mapping[str, Any]) -> None:
        """One gather group's records (:func:`group_records`), slots numbered from :attr:`slots`
        on. Each chunk its records cover is laid out now as its section, written from the
        group's joined text in one piece: no record is decoded, sorted or encoded here (millions
        at 100k ranks). A chunk whose pieces other groups hold too waits for them (``finish``)."""
        if self._table is None:
            self._table = {k: [] for k in self._chunks}
        keys, ints, body = part["keys"], text_ints(part["chunks"]).tolist(), part["body"]
        if not isinstance(body, bytes):
            raise ValueError("a group's records are inconsistent: its body is not bytes")
        crcs = np.frombuffer(bytes.fromhex(part["crcs"]), dtype="<u4")
        slots = np.frombuffer(bytes.fromhex(part["slots"]), dtype="<u4").astype(np.int64) + self.slots
        count = sum(part["counts"])
        if not (len(crcs) == len(slots) == count and (count == 0 or int(slots.max()) < self.slots + count)):
            raise ValueError(f"a group's records are inconsistent: {count} records, {len(crcs)} CRC32s, "
                             f"{len(slots)} slots")
        tables = [self._table.get(k) for k in keys]
        sec = self.sec
        assert sec.buf is not None
        write, pos, crc32, mv, placed = sec.buf.write, sec.size, zlib.crc32, memoryview(body), self._placed
        wholes: List[int] = []  # per chunk, part order: 1 if laid out now
        counts: List[int] = []  # per chunk: its records
        i = a = r = 0
        while i < len(ints):
            k, nd = ints[i], ints[i + 1]
            e = i + 2 + 2 * nd
            where = ints[i + 2:e]  # offset, then shape: sorts as (offset, shape) among one key's chunks
            order, n, length, whole = ints[e:e + 4]
            i = e + 4
            table = tables[k]
            if table is None:
                raise ValueError(f"records of {keys[k]!r}, which the save's plan does not hold")
            wholes.append(whole)
            counts.append(n)
            if whole:
                data = b"[%d," % placed + mv[a:a + length] + b"]"
                write(data)
                table.append((where, pos, len(data), crc32(data)))
                pos += len(data)
                placed += n
            else:
                self._open.setdefault((keys[k], tuple(where)), []).append((order, bytes(mv[a:a + length]),
                                                                           crcs[r:r + n], slots[r:r + n]))
            a += length
            r += n
        if a != len(body) or r != count:
            raise ValueError("a group's records are inconsistent: its chunk table does not cover its records")
        if counts:  # the CRC32s and slots of the chunks laid out now, in section order
            now = np.repeat(np.array(wholes, dtype=bool), np.array(counts, dtype=np.int64))
            self._crc_parts.append(crcs[now])
            self._slot_parts.append(slots[now])
        self._placed = placed
        sec.size = pos
        self.slots += count

    def _group_sections(self) -> None:
        """After every group: the chunks several groups hold (pieces joined in flat order), then
        every key's chunk table, in chunk order."""
        assert self._table is not None and self.sec.buf is not None
        waiting = list(self._open.items())
        self._open = {}
        waiting.reverse()
        while waiting:  # each chunk's pieces dropped once its section is written: memory moves, not doubles
            (key, where), pieces = waiting.pop()
            pieces.sort(key=_first)
            data = b"[%d," % self._placed + b",".join([p[1] for p in pieces]) + b"]"
            self._table[key].append((list(where), self.sec.size, len(data), zlib.crc32(data)))
            self.sec.write(data)
            for p in pieces:
                self._placed += len(p[2])
                self._crc_parts.append(p[2])
                self._slot_parts.append(p[3])
            del pieces
        for key, rows in self._table.items():
            rows.sort(key=_first)
            chunks: List[int] = []
            for where, start, length, crc in rows:
                chunks += where
                chunks += (start, length, crc)
            self.tensors[key]["chunks"] = chunks
        self._table = None
        self._crcs = np.concatenate(self._crc_parts) if self._crc_parts else np.zeros(0, dtype="<u4")
        perm = np.concatenate(self._slot_parts) if self._slot_parts else np.zeros(0, dtype=np.int64)
        self._crc_parts, self._slot_parts = [], []
        n = perm.size
        if n == self.slots and (n == 0 or (perm.min() >= 0 and (np.bincount(perm, minlength=n) == 1).all())):
            self._perm = perm

    def objects(self, table: "NamedTexts") -> None:
        """Every rank's objects (unique key -> JSON text), each laid out as its own section."""
        self._objects = table

    def tree(self, tid: str, parts: Sequence[Tuple[str, str]]) -> None:
        """A state tree as (top-level key or TREE_WHOLE, JSON text) parts."""
        self._trees.append((tid, parts))

    def _chunk_sections(self) -> None:
        """Every chunk's records as one section, ``[first, record, ...]``: ``first`` is the
        position of its first record's CRC32 in the CRC32 region (the others follow). A chunk's
        records are dropped once written (with the caller's copies gone, their texts too:
        ``build_index(..., consume=True)``), so the records and the sections are not held
        whole at once."""
        sec = self.sec
        crcs: List[int] = []
        slots: List[int] = []
        # one section per chunk, hundreds of thousands of them at 100k ranks: sec.add inlined
        assert sec.buf is not None
        write, pos, crc32 = sec.buf.write, sec.size, zlib.crc32
        for key, groups in self._chunks.items():
            chunks: List[Any] = []  # flat: offset..., shape..., section start, length, crc32 per chunk
            try:
                order = sorted(groups, key=_chunk_order)
            except TypeError:  # malformed chunk coordinates: kept in arrival order
                order = list(groups)
            for chunk in order:
                recs = groups.pop(chunk)
                off, shp = json.loads(chunk) if isinstance(chunk, str) else chunk
                chunks += (off if isinstance(off, (list, tuple)) else [off])
                chunks += (shp if isinstance(shp, (list, tuple)) else [shp])
                r = recs[0]
                if len(recs) == 1 and type(r[1]) is str:
                    data = f"[{len(crcs)},{r[1]}]".encode()
                    crcs.append(r[3])
                    slots.append(r[2])
                else:
                    recs.sort(key=_first)
                    data = (f"[{len(crcs)}," + ",".join([r[1] for r in recs]) + "]").encode()
                    crcs += [r[3] for r in recs]
                    slots += [r[2] for r in recs]
                n = len(data)
                chunks += (pos, n, crc32(data))
                write(data)
                pos += n
            self.tensors[key]["chunks"] = chunks
        sec.size = pos
        self._crcs = np.array(crcs, dtype=np.int64)
        if self._crcs.size and (self._crcs.min() < 0 or self._crcs.max() > 0xFFFFFFFF):
            raise ValueError("a CRC32 lies outside 0..2**32-1")
        perm = np.array(slots, dtype=np.int64)
        n = perm.size
        if n == self.slots and (n == 0 or (perm.min() >= 0 and (np.bincount(perm, minlength=n) == 1).all())):
            self._perm = perm  # slots number the records 0..n-1: a skeleton can be kept

    def finish(self, head: Dict[str, Any], files: Any, tail: Optional["IndexTail"] = None) -> Tuple[bytes, bytes]:
        """The index; ``tail`` (an earlier ``tail`` of the same skeleton) stands for the
        objects and trees instead of those added (and their ids of ranks' trees), and for the
        file table too when ``files`` is None."""
        sec = self.sec
        prefix = -1  # bytes of a new skeleton's prefix (chunk sections and tensor table)
        if self._resumed:
            assert self.skeleton is not None
            tensors = self.skeleton.tensors
        else:
            if self._table is not None:
                self._group_sections()
            else:
                self._chunk_sections()
            tensors = _buckets(sec, self.tensors, TENSOR_BUCKET)
            if self._perm is not None:
                prefix = sec.size
        crcs = _crc_region(sec, self._crcs)
        head = dict(head)
        head.update(version=MANIFEST_VERSION, tensors=tensors, crcs=crcs)
        start = sec.size
        new_tail: Optional[Tuple[Dict[str, Any], Any, int]] = None  # (tables, rank_trees, files_at)
        if tail is not None and tail.start == start and files is None:
            sec.write(tail.data)
            self.tail = tail
        else:
            if tail is not None and tail.start == start:  # only the file table is new (an object store's ETags)
                sec.write(tail.data[:tail.files_at - start])
                tables = dict(tail.tables)
            else:
                tail = None
                objects = self._objects or NamedTexts()
                rows = _place_named(sec, objects)
                placed: Dict[str, List[int]] = {}  # part text -> its section: ranks' trees share most parts

                def part(text: str) -> List[int]:
                    got = placed.get(text)  # a str caches its hash; encoding + hashing bytes per tree did not
                    if got is None:
                        got = placed[text] = sec.add(text.encode())
                    return got

                trees = {tid: [[k] + part(text) for k, text in parts] for tid, parts in self._trees}
                tables = {"objects": _row_buckets(sec, objects, rows.__getitem__, OBJECT_BUCKET),
                          "trees": _buckets(sec, trees, TREE_BUCKET)}
            files_at = sec.size  # the file table comes last
            tables["files"] = (_text_buckets(sec, files, FILE_BUCKET) if isinstance(files, NamedTexts)
                               else _buckets(sec, files, FILE_BUCKET))
            new_tail = (tables, tail.rank_trees if tail is not None else head.get("rank_trees"), files_at)
        size = sec.size
        data = sec.take()
        # the skeleton and the tail are views of the index bytes, not copies of them
        if prefix >= 0:
            self.skeleton = IndexSkeleton(memoryview(data)[:prefix], tensors, self._perm)
        if new_tail is not None:
            self.tail = IndexTail(start, memoryview(data)[start:], *new_tail)
        assert self.tail is not None
        head.update(self.tail.tables)
        if tail is not None:
            head["rank_trees"] = self.tail.rank_trees
        head["index"] = {"file": INDEX_NAME, "bytes": size}
        return _dumps(head).encode(), data


@dataclass
class IndexSkeleton:
    """What of an index depends on the save's layout only: its chunk sections and tensor
    table (encoded: ``prefix``, the start of ``manifest.index``; ``tensors``, the head's
    buckets) and which slot's CRC32 goes where in the CRC32 region (``perm``: region position
    -> slot). A save whose every record equals the previous save's but for its CRC32 (the plan
    cache's steady state) reuses them: no record is encoded, grouped or sorted, no section
    checksummed again."""

    prefix: Any  # bytes-like (a view of the index bytes that laid it out)
    tensors: List[Any]
    perm: Any  # numpy int64
    tail: Optional["IndexTail"] = None  # the last index's objects, trees and files (set by its writer)
    meta: Optional[Dict[str, Any]] = None  # the writer's: what each rank sent last, by field (files, objects: NamedTexts)


@dataclass
class IndexTail:
    """The objects, state trees and file table of an index as laid out after its CRC32
    region (``start``): a steady-state save whose ranks all report them unchanged writes
    ``data`` again and puts ``tables`` and ``rank_trees`` in the head; one where only files
    changed writes ``data`` up to ``files_at`` and a new file table."""

    start: int
    data: Any  # bytes-like (a view of the index bytes that laid it out)
    tables: Dict[str, Any]
    rank_trees: Any
    files_at: int  # where the file table's sections start (the last of the tail)


def _place_named(sec: _Sections, table: "NamedTexts") -> List[bytes]:
    """Each entry's text as its own section, in rank order and in one write (no text is shared
    with another section: object texts name their key and offset); returns each entry's row
    of the table ``{name: [start, length, crc32]}`` as JSON text (``"name":[...]``)."""
    body, starts, ends, _ = table.cut()
    base = sec.size
    sec.write(body)
    with memoryview(body) as mv:
        crc32 = zlib.crc32
        return [b"%s:[%d,%d,%d]" % (_quote(n).encode(), base + a, e - a, crc32(mv[a:e]))
                for n, a, e in zip(table.names, starts.tolist(), ends.tolist())]


def _row_buckets(sec: _Sections, table: "NamedTexts", row: Callable[[int], bytes], size: int) -> List[Any]:
    """:func:`_buckets` of ``table``'s names (same bytes) from each entry's row (``row(j)``:
    ``"name":value`` of entry ``j``), made bucket by bucket."""
    order, names = table.order(), table.names
    return [[names[order[i]]] + sec.add(b"{" + b",".join([row(j) for j in order[i:i + size]]) + b"}")
            for i in range(0, len(order), size)]


def _text_buckets(sec: _Sections, table: "NamedTexts", size: int) -> List[Any]:
    """:func:`_buckets` of ``{name: value}`` from the values' texts (same bytes): no value decoded."""
    body, starts_, ends_, _ = table.cut()
    starts, ends, names = starts_.tolist(), ends_.tolist(), table.names
    with memoryview(body) as mv:
        return _row_buckets(sec, table, lambda j: b"%s:%s" % (_quote(names[j]).encode(), mv[starts[j]:ends[j]]), size)


_quote = json.encoder.encode_basestring_ascii  # a str's JSON text as _dumps writes it (ensure_ascii)


def _first(pair: Tuple[Any, ...]) -> Any:
    return pair[0]


def _chunk_order(chunk: Any) -> Any:
    return (0, chunk, "") if isinstance(chunk, tuple) else (1, (), chunk)


# Tables of the head are split into buckets of consecutive names (sorted): the head lists
# each bucket's first name and section; a lookup bisects and reads one bucket. Keys of one
# layer sort together, so a rank's keys fall into few buckets.
TENSOR_BUCKET = 16
OBJECT_BUCKET = 64
FILE_BUCKET = 256
TREE_BUCKET = 64


def _buckets(sec: _Sections, table: Any, size: int) -> Any:
    if not isinstance(table, dict):
        return table  # malformed: kept as is for the reader to refuse
    names = sorted(table)
    return [[names[i]] + sec.add(_dumps({k: table[k] for k in names[i:i + size]}).encode())
            for i in range(0, len(names), size)]


def with_files(head: Mapping[str, Any], sections: bytes, files: Mapping[str, Any]) -> Tuple[bytes, bytes]:
    """A version-2/3 index (``manifest.json``, ``manifest.index`` bytes) that is ``head`` and
    ``sections`` with the file table replaced by ``files``: the new table's sections are
    appended, everything else stays byte for byte (``megashard copy``: only the objects'
    ETags differ between storages). The old table's sections stay, unreferenced."""
    sec = _Sections()
    sec.write(sections)
    doc = dict(head)
    doc["files"] = _buckets(sec, dict(files), FILE_BUCKET)
    doc["index"] = {"file": INDEX_NAME, "bytes": sec.size}
    return _dumps(doc).encode(), sec.take()


TREE_WHOLE = "__whole__"  # a tree stored as one part (not a plain string-keyed dict)


class _Table(Mapping):
    """A bucketed head table (see :func:`_buckets`): a bucket is read, checked and cached on
    the first lookup that needs it; iterating reads them all (tools only)."""

    def __init__(self, index: "LazyIndex", entries: Any, what: str,
                 check: Optional[Callable[[str, Any], Any]] = None) -> None:
        p = index._p
        p.list(entries, what)
        for i, e in enumerate(entries):
            p.require(isinstance(e, list) and len(e) == 4 and isinstance(e[0], str), f"{what}[{i}] is malformed")
            p.require(i == 0 or entries[i - 1][0] < e[0], f"{what}: bucket names are not sorted")
        self.index, self.entries, self.what, self.check = index, entries, what, check
        self.firsts = [e[0] for e in entries]
        self.loaded: Dict[int, Dict[str, Any]] = {}

    def _bucket(self, i: int) -> Dict[str, Any]:
        got = self.loaded.get(i)
        if got is None:
            p = self.index._p
            w = f"{self.what}[{i}]"
            got = p.dict(self.index._section(self.entries[i][1:], w), w)
            hi = self.firsts[i + 1] if i + 1 < len(self.firsts) else None
            p.require(all(self.firsts[i] <= k and (hi is None or k < hi) for k in got), f"{w}: names out of order")
            if self.check is not None:
                got = {k: self.check(k, v) for k, v in got.items()}
            self.loaded[i] = got
        return got

    def __getitem__(self, name: str) -> Any:
        if not isinstance(name, str):
            raise KeyError(name)
        i = bisect.bisect_right(self.firsts, name) - 1
        if i < 0:
            raise KeyError(name)
        return self._bucket(i)[name]

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self.entries)):
            yield from self._bucket(i)

    def __len__(self) -> int:
        return sum(len(self._bucket(i)) for i in range(len(self.entries)))


class LazyIndex(_FileSizes):
    """A version-2 or -3 index: the head parsed, sections read and validated on first use.

    ``read(start, length)`` returns bytes of ``manifest.index`` (the caller has checked
    the file's size against the head). Everything a section holds is validated as a
    version-1 manifest's would be; its CRC32 guards it against damage."""

    def __init__(self, doc: Dict[str, Any], read: Callable[[int, int], bytes], where: str,
                 head_bytes: int = 0, closer: Optional[Callable[[], None]] = None) -> None:
        p = self._p = _Parser(where)
        self._closer = closer
        self.where = where
        self._read = read
        self.world_size = p.int(doc.get("world_size"), "world_size", lo=1)
        self.layout = p.dict(doc.get("layout", {}), "layout")
        self.extra = p.dict(doc.get("extra", {}), "extra")
        self.created = _created(doc)
        self.version = 3 if doc.get("version") == 3 else 2
        idx = p.dict(doc.get("index"), "index")
        p.require(idx.get("file") == INDEX_NAME, f"index.file must be {INDEX_NAME!r}")
        self.index_bytes = p.int(idx.get("bytes"), "index.bytes")
        self._crc_start = self._crc_count = self._crc_table_crc = 0
        if self.version == 3:
            crcs = p.list(doc.get("crcs"), "crcs")
            p.require(len(crcs) == 3, "crcs must be [start, record count, CRC32 of the block table]")
            self._crc_start, self._crc_count, self._crc_table_crc = (p.int(v, "crcs") for v in crcs)
            # bounded by the file's real size (checked against the head) before anything is allocated
            end = self._crc_start + 4 * (self._crc_count + -(-self._crc_count // CRC_BLOCK))
            p.require(end <= self.index_bytes,
                      f"crcs: {self._crc_count} record CRC32s at {self._crc_start} lie past the end of {INDEX_NAME} "
                      f"({self.index_bytes} bytes)")
        self._crc_table: Any = None
        self._crc_blocks: Dict[int, Any] = {}
        self.files = _Table(self, doc.get("files"), "files", self._check_file)
        self._tensors_doc = _Table(self, doc.get("tensors"), "tensors")
        self._objects_doc = _Table(self, doc.get("objects", []), "objects")
        self._trees_doc = _Table(self, doc.get("trees"), "trees")
        self.rank_trees = p.list(doc.get("rank_trees"), "rank_trees")
        p.require(len(self.rank_trees) >= 1 and all(isinstance(r, str) for r in self.rank_trees),
                  "rank_trees must be tree ids")
        self._tensors: Dict[str, Optional[Tuple[TensorRecord, Any, Any, List[Any]]]] = {}
        self._chunks: Dict[Tuple[str, int], List[ShardRecord]] = {}
        self._exact: Dict[str, Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], int]] = {}  # key -> {chunk box: i}
        self._objects: Dict[str, Any] = {}
        self.bytes_read = head_bytes

    def close(self) -> None:
        """Release the index file (sections already read stay available)."""
        if self._closer is not None:
            self._closer()
            self._closer = None

    def _check_file(self, name: str, info: Any) -> Dict[str, Any]:
        p = self._p
        p.require(is_plain_file_name(name), f"file name {str(name)[:100]!r} is not a plain file name")
        p.dict(info, f"files[{name!r}]")
        p.int(info.get("bytes", 0), f"files[{name!r}].bytes")
        return info

    # -- sections ----------------------------------------------------------------
    def _section(self, entry: Any, what: str) -> Any:
        from .jsonstate import parse_json

        p = self._p
        p.require(isinstance(entry, list) and len(entry) == 3, f"{what}: bad section reference")
        start, length, crc = (p.int(v, what) for v in entry)
        p.require(start + length <= self.index_bytes, f"{what}: section {start}+{length} lies past the end of "
                                                       f"{INDEX_NAME} ({self.index_bytes} bytes)")
        data = self._read(start, length)
        self.bytes_read += length
        p.require(len(data) == length and zlib.crc32(data) == crc,
                  f"{what}: section {start}+{length} of {INDEX_NAME} is damaged (CRC32 mismatch)")
        return parse_json(data, f"{self.where}: {what}")

    def _record_crcs(self, first: int, n: int, what: str) -> List[int]:
        """Version 3: the CRC32s of records ``first .. first+n-1`` from the CRC32 region, reading
        (and checking) only the blocks that hold them."""
        p = self._p
        p.require(first + n <= self._crc_count, f"{what}: its records' CRC32s {first}..{first + n - 1} lie past the "
                                                f"{self._crc_count} of the index's CRC32 region")
        if n == 0:
            return []
        if self._crc_table is None:
            nblocks = -(-self._crc_count // CRC_BLOCK)
            at, length = self._crc_start + 4 * self._crc_count, 4 * nblocks
            data = self._read(at, length)
            self.bytes_read += length
            p.require(len(data) == length and zlib.crc32(data) == self._crc_table_crc,
                      f"crcs: the block table {at}+{length} of {INDEX_NAME} is damaged (CRC32 mismatch)")
            self._crc_table = np.frombuffer(data, dtype="<u4")
        parts = []
        for blk in range(first // CRC_BLOCK, (first + n - 1) // CRC_BLOCK + 1):
            got = self._crc_blocks.get(blk)
            if got is None:
                a = blk * CRC_BLOCK
                at, length = self._crc_start + 4 * a, 4 * min(CRC_BLOCK, self._crc_count - a)
                data = self._read(at, length)
                self.bytes_read += length
                p.require(len(data) == length and zlib.crc32(data) == int(self._crc_table[blk]),
                          f"crcs: block {blk} ({at}+{length}) of {INDEX_NAME} is damaged (CRC32 mismatch)")
                got = self._crc_blocks[blk] = np.frombuffer(data, dtype="<u4")
            parts.append(got)
        a = first - (first // CRC_BLOCK) * CRC_BLOCK
        return (np.concatenate(parts) if len(parts) > 1 else parts[0])[a:a + n].tolist()

    # -- the planning interface ------------------------------------------------------
    def tensor(self, key: str) -> Optional[TensorRecord]:
        got = self._tensor(key)
        return got[0] if got is not None else None

    def _tensor(self, key: str) -> Optional[Tuple[TensorRecord, Any, Any, List[Any]]]:
        if key in self._tensors:
            return self._tensors[key]
        t = self._tensors_doc.get(key)
        if t is None:
            self._tensors[key] = None
            return None
        import numpy as np

        p, w = self._p, f"tensors[{key!r}]"
        p.dict(t, w)
        rec = TensorRecord(key, dtype_from_name(t.get("dtype"), f"{self.where}: {w}: "), p.shape(t.get("shape"), f"{w}.shape"))
        flat = p.list(t.get("chunks"), f"{w}.chunks")
        nd = len(rec.global_shape)
        width = 2 * nd + 3
        p.require(len(flat) % width == 0 and all(type(v) is int for v in flat),
                  f"{w}.chunks must hold {width} integers per chunk (offset, shape, section start, length, crc32)")
        try:
            arr = np.asarray(flat, dtype=np.int64).reshape(-1, width)
        except OverflowError:
            p.fail(f"{w}.chunks: integer out of range")
        offs, shps, secs = arr[:, :nd], arr[:, nd:2 * nd], arr[:, 2 * nd:]
        g = np.asarray(rec.global_shape, dtype=np.int64)
        bad = (offs < 0).any(axis=1) | (shps < 0).any(axis=1) | (offs + shps > g).any(axis=1) | (secs < 0).any(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            p.fail(f"{w}.chunks[{i}]: chunk {offs[i].tolist()}+{shps[i].tolist()} lies outside the global shape "
                   f"{list(rec.global_shape)} or has a negative field")
        _check_chunks(p, key, list(zip(map(tuple, offs.tolist()), map(tuple, shps.tolist()))))
        got = (rec, offs, shps, secs)
        self._tensors[key] = got
        return got

    def pieces(self, key: str, box: Box) -> List[ShardRecord]:
        """The saved shards of ``key`` whose chunks overlap ``box`` (a zero-size box: the
        chunks equal to it), their sections read and checked on first use."""
        got = self._tensor(key)
        if got is None or len(box.offset) != len(got[0].global_shape):
            return []
        import numpy as np

        rec, offs, shps, secs = got
        # a box that is exactly one saved chunk (any load in the saved layout) overlaps only that
        # chunk, chunks being distinct and disjoint (checked in _tensor): a dict lookup instead of
        # numpy's per-call cost on every chunk
        exact = self._exact.get(key)
        if exact is None:
            exact = self._exact[key] = {b: i for i, b in enumerate(zip(map(tuple, offs.tolist()),
                                                                       map(tuple, shps.tolist())))}
        i = exact.get((tuple(box.offset), tuple(box.shape)), -1)
        if i >= 0 and (box.numel == 0 or all(box.shape)):
            return list(self._chunk(key, i, rec, offs, shps, secs))
        bo, bs = np.asarray(box.offset, dtype=np.int64), np.asarray(box.shape, dtype=np.int64)
        if box.numel == 0:
            hit = np.all(offs == bo, axis=1) & np.all(shps == bs, axis=1)
        else:
            hit = np.all((offs < bo + bs) & (bo < offs + shps), axis=1) if len(offs) else np.zeros(0, dtype=bool)
            empty = np.prod(shps, axis=1) == 0 if len(offs) else hit
            hit &= ~empty
        out: List[ShardRecord] = []
        for i in np.flatnonzero(hit).tolist():
            out += self._chunk(key, i, rec, offs, shps, secs)
        return out

    def _chunk(self, key: str, i: int, rec: TensorRecord, offs: Any, shps: Any, secs: Any) -> List[ShardRecord]:
        got = self._chunks.get((key, i))
        if got is None:
            p, w = self._p, f"tensors[{key!r}].chunks[{i}]"
            off, shp = tuple(offs[i].tolist()), tuple(shps[i].tolist())
            isz = itemsize(rec.dtype)
            got = []
            recs = p.list(self._section(secs[i].tolist(), w), w)
            if self.version == 3:  # [first CRC32's position, record (6 fields), ...]: CRC32s from their region
                p.require(len(recs) >= 1, f"{w}: the section must start with its first record's CRC32 position")
                first = p.int(recs[0], f"{w}[0]")
                recs = recs[1:]
                for j, r in enumerate(recs):
                    p.require(isinstance(r, list) and len(r) == 6, f"{w}.shards[{j}] must have 6 fields")
                for r, c in zip(recs, self._record_crcs(first, len(recs), w)):
                    r.append(c)
            for j, r in enumerate(recs):
                ws = f"{w}.shards[{j}]"
                p.require(isinstance(r, list) and len(r) == 7, f"{ws} must have 7 fields")
                if r[2] is None:  # the name the writer derives (see shard_name)
                    fl = r[0]
                    p.require(fl is None or (isinstance(fl, list) and len(fl) == 2), f"{ws}.flat invalid")
                    r[2] = shard_name(key, rec.global_shape, off, shp, tuple(fl) if fl is not None else None)
                got.append(_parse_shard(p, ws, off, shp, rec.global_shape, isz, self.files, *r))
            _check_flat_ranges(p, key, off, shp, got)
            self._chunks[(key, i)] = got
        return got

    def object(self, ukey: str) -> Any:
        if ukey not in self._objects:
            if ukey not in self._objects_doc:
                raise KeyError(ukey)
            self._objects[ukey] = self._section(self._objects_doc[ukey], f"objects[{ukey!r}]")
        return self._objects[ukey]

    def has_object(self, ukey: str) -> bool:
        return ukey in self._objects_doc

    def tree_for_rank(self, rank: int, keys: Optional[Any] = None) -> Any:
        """Rank ``rank``'s state tree; with ``keys``, only those top-level entries are read."""
        tid = self.rank_trees[rank] if 0 <= rank < len(self.rank_trees) else self.rank_trees[0]
        return self._tree(tid, keys)

    def _tree(self, tid: str, keys: Optional[Any] = None) -> Any:
        p, w = self._p, f"trees[{tid!r}]"
        p.require(tid in self._trees_doc, f"rank_trees refer to unknown tree {tid[:40]!r}")
        parts = p.list(self._trees_doc[tid], w)
        out: Dict[str, Any] = {}
        for i, part in enumerate(parts):
            p.require(isinstance(part, list) and len(part) == 4 and isinstance(part[0], str), f"{w}[{i}] is malformed")
            if keys is not None and part[0] != TREE_WHOLE and part[0] not in keys:
                continue
            value = self._section(part[1:], f"{w}[{i}]")
            if part[0] == TREE_WHOLE:
                p.require(len(parts) == 1, f"{w}: a whole tree has one part")
                return value
            out[part[0]] = value
        return out

    @property
    def total_bytes(self) -> int:
        return sum(int(f.get("bytes", 0)) for f in self.files.values())

    def full(self) -> Manifest:
        """Everything, as a :class:`Manifest` (reads every section)."""
        tensors: Dict[str, TensorRecord] = {}
        for key in self._tensors_doc:
            rec, offs, shps, secs = self._tensor(key)
            full = TensorRecord(key, rec.dtype, rec.global_shape)
            for i in range(len(offs)):
                full.shards += self._chunk(key, i, rec, offs, shps, secs)
            full.shards.sort(key=lambda s: (s.offset, s.flat or (0, 0)))
            tensors[key] = full
        objects = {u: self.object(u) for u in self._objects_doc}
        trees = {tid: self._tree(tid) for tid in self._trees_doc}
        return Manifest(world_size=self.world_size, layout=self.layout, files=dict(self.files), tensors=tensors,
                        objects=objects, trees=trees, rank_trees=list(self.rank_trees), created=self.created,
                        extra=self.extra, version=self.version, bytes_read=self.bytes_read)


_PLAIN_NAME = re.compile(r"[^/\\\x00]{1,255}\Z")


def is_plain_file_name(name: object) -> bool:
    """One path component inside the checkpoint directory: no separator, NUL, ``.`` or ``..``."""
    return isinstance(name, str) and name not in (".", "..") and bool(_PLAIN_NAME.match(name))


class _Parser:
    """Small validators that turn malformed JSON into CheckpointError with a location."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, msg: str) -> None:
        raise CheckpointError(f"{self.where}: {msg}; the checkpoint is damaged or not a megashard checkpoint")

    def require(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(msg)

    def int(self, v: Any, what: str, lo: int = 0) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            self.fail(f"{what} must be an integer >= {lo}, got {v!r}")
        return v

    def dict(self, v: Any, what: str) -> Dict[str, Any]:
        if not isinstance(v, dict):
            self.fail(f"{what} must be an object")
        return v

    def list(self, v: Any, what: str) -> List[Any]:
        if not isinstance(v, list):
            self.fail(f"{what} must be a list")
        return v

    def shape(self, v: Any, what: str) -> Tuple[int, ...]:
        self.list(v, what)
        return tuple(self.int(x, what) for x in v)

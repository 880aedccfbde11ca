"""The checkpoint index: one JSON file that says where every byte of every tensor is.

Global tensors are listed by their global key with dtype and global shape; each
saved shard records its chunk (offset, shape), optional flat range, file, tensor
name inside that file, byte range and CRC32. Non-tensor state is stored as JSON
trees (see :mod:`megashard.jsonstate`), one per distinct rank structure. The
manifest is parsed defensively: anything malformed raises :class:`CheckpointError`
naming the manifest path and the offending field. It is never pickled.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .errors import CheckpointError
from .plan import Box, SavedPiece, numel

MANIFEST_FORMAT = "megashard"
MANIFEST_VERSION = 1

_DTYPES: Dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "") -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}unknown dtype {name!r}") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


@dataclass
class Manifest:
    """In-memory form of ``manifest.json``."""

    world_size: int
    layout: Dict[str, Any]
    files: Dict[str, Dict[str, Any]]  # file name -> {"rank": r, "bytes": n, "tensors": k}
    tensors: Dict[str, TensorRecord]
    objects: Dict[str, Any]  # ShardedObject unique_key -> encoded value
    trees: Dict[str, Any]  # tree id -> encoded state tree
    rank_trees: List[str]  # rank -> tree id
    created: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "created": self.created,
            "world_size": self.world_size,
            "layout": self.layout,
            "files": self.files,
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "objects": self.objects,
            "trees": self.trees,
            "rank_trees": self.rank_trees,
            "extra": self.extra,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    def tree_for_rank(self, rank: int) -> Any:
        """The saved state tree of ``rank`` (rank 0's when that rank did not exist)."""
        tid = self.rank_trees[rank] if 0 <= rank < len(self.rank_trees) else self.rank_trees[0]
        return self.trees[tid]

    @property
    def total_bytes(self) -> int:
        return sum(int(f.get("bytes", 0)) for f in self.files.values())

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest.json") -> "Manifest":
        from .jsonstate import parse_json

        doc = parse_json(text, f"{where} (the checkpoint is damaged)")
        p = _Parser(where)
        p.require(isinstance(doc, dict), "top level is not an object")
        p.require(doc.get("format") == MANIFEST_FORMAT, f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        version = doc.get("version")
        p.require(version == MANIFEST_VERSION,
                  f"manifest version {version!r} is not supported by this megashard (reads {MANIFEST_VERSION}); upgrade megashard")
        world = p.int(doc.get("world_size"), "world_size", lo=1)
        files = p.dict(doc.get("files"), "files")
        for name, info in files.items():
            p.require(is_plain_file_name(name), f"file name {str(name)[:100]!r} is not a plain file name")
            p.dict(info, f"files[{name!r}]")
            p.int(info.get("bytes", 0), f"files[{name!r}].bytes")
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
                p.require(len(off) == len(gshape) == len(shp), f"{ws}: offset/shape rank differs from the tensor's")
                p.require(all(o + n <= g for o, n, g in zip(off, shp, gshape)),
                          f"{ws}: chunk {list(off)}+{list(shp)} lies outside the global shape {list(gshape)}")
                flat = s.get("flat")
                if flat is not None:
                    flat = p.shape(flat, f"{ws}.flat")
                    p.require(len(flat) == 2 and flat[0] <= flat[1] <= numel(shp), f"{ws}.flat {flat} invalid")
                    n_el = flat[1] - flat[0]
                else:
                    n_el = numel(shp)
                nbytes = p.int(s.get("nbytes"), f"{ws}.nbytes")
                p.require(nbytes == n_el * isz, f"{ws}.nbytes={nbytes} but the shard has {n_el} x {isz} bytes")
                file = s.get("file")
                p.require(file is None or (isinstance(file, str) and file in files),
                          f"{ws}.file {str(file)[:100]!r} is not listed in files")
                p.require(file is not None or nbytes == 0, f"{ws}: has bytes but no file")
                data_offset = p.int(s.get("data_offset"), f"{ws}.data_offset")
                header_offset = p.int(s.get("header_offset", 0), f"{ws}.header_offset")
                if file is not None:
                    fbytes = files[file].get("bytes", 0)
                    p.require(header_offset <= data_offset and data_offset + nbytes <= fbytes,
                              f"{ws}: bytes {data_offset}+{nbytes} do not fit in {file} ({fbytes} bytes)")
                name = s.get("name", "")
                p.require(isinstance(name, str), f"{ws}.name must be a string")
                rec.shards.append(ShardRecord(
                    off, shp, tuple(flat) if flat is not None else None, file, name, header_offset,
                    data_offset, nbytes, p.int(s.get("crc32", 0), f"{ws}.crc32")))
            tensors[key] = rec
        trees = p.dict(doc.get("trees"), "trees")
        rank_trees = p.list(doc.get("rank_trees"), "rank_trees")
        p.require(len(rank_trees) >= 1 and all(r in trees for r in rank_trees), "rank_trees refer to unknown trees")
        return cls(
            world_size=world, layout=p.dict(doc.get("layout", {}), "layout"), files=files, tensors=tensors,
            objects=p.dict(doc.get("objects", {}), "objects"), trees=trees, rank_trees=list(rank_trees),
            created=float(doc.get("created", 0.0) or 0.0), extra=p.dict(doc.get("extra", {}), "extra"),
        )


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

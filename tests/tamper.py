"""Editing a saved checkpoint the way a hostile (or careless) author would.

``manifest.sha256`` guards ``manifest.json`` against corruption; an author who edits the
manifest on purpose rewrites the digest too, which these helpers do. A version-2 index is
edited as its logical document (version-1 shape: every shard listed under its tensor) and
written back through :func:`encode_doc` (megashard's ``IndexBuilder``, fed malformed entries
as given), so every attack reaches the reader of the head *and* of the sections.
"""
from __future__ import annotations

import json
import os
from typing import Any

from megashard import manifest, storage
from megashard.jsonstate import TAG
from megashard.manifest import TREE_WHOLE, IndexBuilder, NamedTexts, record_text

_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _section(sections: bytes, entry: Any) -> Any:
    start, length, _crc = entry
    return json.loads(sections[start:start + length])


def _table(sections: bytes, buckets: Any) -> dict:
    out: dict = {}
    for _first, *entry in buckets:
        out.update(_section(sections, entry))
    return out


def read_manifest_doc(ckpt: str) -> Any:
    with open(os.path.join(ckpt, storage.MANIFEST_NAME)) as f:
        doc = json.load(f)
    if doc.get("version") == 1:
        return doc
    with open(os.path.join(ckpt, manifest.INDEX_NAME), "rb") as f:
        sections = f.read()
    tensors = {}
    crcs: Any = None
    if doc.get("version", 2) >= 3:  # the records' CRC32s are in one region
        start, count, _crc = doc["crcs"]
        crcs = [int.from_bytes(sections[start + 4 * i:start + 4 * i + 4], "little") for i in range(count)]
    for key, t in _table(sections, doc["tensors"]).items():
        nd = len(t["shape"])
        width = 2 * nd + 3
        flat = t["chunks"]
        shards = []
        for i in range(0, len(flat), width):
            c = flat[i:i + width]
            off, shp = c[:nd], c[nd:2 * nd]
            recs = _section(sections, c[2 * nd:])
            if crcs is not None:
                first, recs = recs[0], recs[1:]
                recs = [r + [crcs[first + j]] for j, r in enumerate(recs)]
            for flat_r, file, name, hoff, doff, nbytes, crc in recs:
                if name is None:  # elided: the name the writer derives
                    name = manifest.shard_name(key, tuple(t["shape"]), tuple(off), tuple(shp),
                                               tuple(flat_r) if flat_r else None)
                shards.append({"offset": off, "shape": shp, "flat": flat_r, "file": file, "name": name,
                               "header_offset": hoff, "data_offset": doff, "nbytes": nbytes, "crc32": crc})
        tensors[key] = {"dtype": t["dtype"], "shape": t["shape"], "shards": shards}
    objects = {u: _section(sections, e) for u, e in _table(sections, doc["objects"]).items()}
    trees = {}
    for tid, parts in _table(sections, doc["trees"]).items():
        if len(parts) == 1 and parts[0][0] == manifest.TREE_WHOLE:
            trees[tid] = _section(sections, parts[0][1:])
        else:
            trees[tid] = {p[0]: _section(sections, p[1:]) for p in parts}
    out = {k: v for k, v in doc.items() if k not in ("index", "tensors", "objects", "trees", "files", "crcs")}
    out.update(tensors=tensors, objects=objects, trees=trees, files=_table(sections, doc["files"]))
    return out


def write_manifest_text(ckpt: str, text: str | bytes) -> None:
    """Replace manifest.json (the head) and keep its digest consistent."""
    data = text.encode() if isinstance(text, str) else text
    with open(os.path.join(ckpt, storage.MANIFEST_NAME), "wb") as f:
        f.write(data)
    with open(os.path.join(ckpt, storage.MANIFEST_DIGEST_NAME), "w") as f:
        f.write(storage.manifest_digest(data))


def write_manifest_doc(ckpt: str, doc: Any) -> None:
    """Write a (possibly damaged) logical document as a version-2 index."""
    head, sections = encode_doc(doc)
    with open(os.path.join(ckpt, manifest.INDEX_NAME), "wb") as f:
        f.write(sections)
    write_manifest_text(ckpt, head)


def encode_doc(doc: Any) -> tuple:
    """A logical document (version-1 shape) as (``manifest.json``, ``manifest.index``) bytes.
    Does not validate: malformed entries are stored as given, for the reader to refuse."""
    b = IndexBuilder()
    for key, t in doc.get("tensors", {}).items():
        shards = t.get("shards") if isinstance(t, dict) else None
        if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
            b.tensors[key] = ({"dtype": t.get("dtype"), "shape": t.get("shape"), "chunks": shards}
                              if isinstance(t, dict) else t)  # malformed: kept as is
            continue
        b.tensor(key, t.get("dtype"), t.get("shape"))
        for s in shards:
            off, shp, fl = s.get("offset"), s.get("shape"), s.get("flat")
            g: Any = None
            try:
                g = (tuple(off), tuple(shp))
                hash(g)
                text = record_text(key, t["shape"], g[0], g[1], fl, s.get("file"), s.get("name", ""),
                                   s.get("header_offset", 0), s.get("data_offset"), s.get("nbytes"))
            except (TypeError, ValueError, KeyError, IndexError):  # malformed: stored as given
                g = g if isinstance(g, tuple) and _hashable(g) else _dumps([off, shp])
                text = _dumps([fl, s.get("file"), s.get("name", ""), s.get("header_offset", 0),
                               s.get("data_offset"), s.get("nbytes")])
            b.record(key, g, _flat_start(fl), text, crc=s.get("crc32", 0))
    b.objects(NamedTexts.of([{u: _dumps(v) for u, v in doc.get("objects", {}).items()}]))
    for tid, tree in doc.get("trees", {}).items():
        if isinstance(tree, dict) and TREE_WHOLE not in tree and TAG not in tree:
            b.tree(tid, [(k, _dumps(v)) for k, v in tree.items()])
        else:
            b.tree(tid, [(TREE_WHOLE, _dumps(tree))])
    head = {k: doc[k] for k in ("format", "version", "created", "world_size", "layout", "extra",
                                "rank_trees") if k in doc}
    return b.finish(head, doc.get("files", {}))


def _hashable(v: Any) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


def _flat_start(fl: Any) -> tuple:
    """Sort key of a record within its chunk (malformed flat ranges sort last, by text)."""
    if fl is None:
        return (0, 0)
    try:
        return (0, int(fl[0]))
    except (TypeError, ValueError, IndexError, KeyError):
        return (1, _dumps(fl))


def flip_data_byte(ckpt: str, rec: Any, at: int = 5) -> None:
    """Flip one bit of the saved shard ``rec``'s data (its byte ``at``): a damaged shard on disk."""
    with open(os.path.join(ckpt, rec.file), "r+b") as f:
        f.seek(rec.data_offset + at)
        b = f.read(1)
        f.seek(rec.data_offset + at)
        f.write(bytes([b[0] ^ 0x01]))


def encode_doc_v2(doc: Any) -> tuple:
    """A well-formed logical document as a version-2 index (``manifest.json``, ``manifest.index``
    bytes): what megashard wrote before version 3, each record's CRC32 inside its chunk section."""
    import zlib

    sec: list = []
    size = [0]

    def add(data: bytes) -> list:
        ref = [size[0], len(data), zlib.crc32(data)]
        sec.append(data)
        size[0] += len(data)
        return ref

    def buckets(table: dict, n: int) -> list:
        names = sorted(table)
        return [[names[i]] + add(_dumps({k: table[k] for k in names[i:i + n]}).encode()) for i in range(0, len(names), n)]

    tensors = {}
    for key, t in doc["tensors"].items():
        groups: dict = {}
        for s in t["shards"]:
            groups.setdefault((tuple(s["offset"]), tuple(s["shape"])), []).append(s)
        chunks: list = []
        for (off, shp), shards in sorted(groups.items()):
            shards.sort(key=lambda s: _flat_start(s.get("flat")))
            recs = [[s.get("flat"), s["file"], s["name"], s["header_offset"], s["data_offset"], s["nbytes"], s["crc32"]]
                    for s in shards]
            chunks += list(off) + list(shp) + add(_dumps(recs).encode())
        tensors[key] = {"dtype": t["dtype"], "shape": t["shape"], "chunks": chunks}
    objects = {u: add(_dumps(v).encode()) for u, v in doc["objects"].items()}
    trees = {}
    for tid, tree in doc["trees"].items():
        if isinstance(tree, dict) and TREE_WHOLE not in tree and TAG not in tree:
            trees[tid] = [[k] + add(_dumps(v).encode()) for k, v in tree.items()]
        else:
            trees[tid] = [[TREE_WHOLE] + add(_dumps(tree).encode())]
    head = {k: doc[k] for k in ("format", "created", "world_size", "layout", "extra", "rank_trees") if k in doc}
    head.update(version=2, tensors=buckets(tensors, 16), objects=buckets(objects, 64), files=buckets(doc["files"], 256),
                trees=buckets(trees, 64))
    head["index"] = {"file": manifest.INDEX_NAME, "bytes": size[0]}
    return _dumps(head).encode(), b"".join(sec)

"""Editing a saved checkpoint the way a hostile (or careless) author would.

``manifest.sha256`` guards ``manifest.json`` against corruption; an author who edits the
manifest on purpose rewrites the digest too, which these helpers do. A version-2 index is
edited as its logical document (version-1 shape: every shard listed under its tensor) and
written back through ``megashard.manifest.encode``, so every attack reaches the reader of
the head *and* of the sections.
"""
from __future__ import annotations

import json
import os
from typing import Any

from megashard import manifest, storage


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
    for key, t in _table(sections, doc["tensors"]).items():
        nd = len(t["shape"])
        width = 2 * nd + 3
        flat = t["chunks"]
        shards = []
        for i in range(0, len(flat), width):
            c = flat[i:i + width]
            off, shp = c[:nd], c[nd:2 * nd]
            for flat_r, file, name, hoff, doff, nbytes, crc in _section(sections, c[2 * nd:]):
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
    out = {k: v for k, v in doc.items() if k not in ("index", "tensors", "objects", "trees", "files")}
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
    head, sections = manifest.encode(doc)
    with open(os.path.join(ckpt, manifest.INDEX_NAME), "wb") as f:
        f.write(sections)
    write_manifest_text(ckpt, head)

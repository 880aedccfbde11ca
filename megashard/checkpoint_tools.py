"""Checkpoint-level inspect and verify (used by ``megashard inspect|verify DIR``)."""
from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List

from . import storage
from .errors import MegashardError
from .manifest import Manifest, dtype_name
from .plan import Box, coverage_problems, numel


def _manifest(path: str) -> Manifest:
    from .api import read_manifest

    return read_manifest(path)


def inspect_checkpoint(path: str) -> Dict[str, Any]:
    """Summary of a checkpoint: layout, files, and every global tensor with its shards."""
    m = _manifest(path)
    tensors = {}
    for key, t in m.tensors.items():
        tensors[key] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.global_shape),
            "bytes": sum(s.nbytes for s in t.shards),
            "shards": len(t.shards),
            "files": sorted({s.file for s in t.shards if s.file}),
        }
    return {
        "path": os.path.abspath(path),
        "world_size": m.world_size,
        "layout": m.layout,
        "files": {name: dict(info) for name, info in sorted(m.files.items())},
        "total_bytes": m.total_bytes,
        "tensors": tensors,
        "objects": sorted(m.objects),
        "distinct_rank_trees": len(m.trees),
    }


def _tree_refs(node: Any) -> Iterator[Dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("kind") in ("tensor", "bytes") and "file" in node and "data_offset" in node:
            yield node
        for v in node.values():
            yield from _tree_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _tree_refs(v)


def verify_checkpoint(path: str) -> List[str]:
    """Every problem found (empty list = the checkpoint is intact).

    Checks: manifest parses; every listed file exists with the recorded size and
    passes its CRC32/SHA-256 hashes; every manifest entry matches the file's own
    index (name, offsets, length, CRC32); every global tensor is covered exactly once.
    """
    from .format import open_file

    problems: List[str] = []
    try:
        m = _manifest(path)
    except MegashardError as e:
        return [str(e)]
    base = os.path.abspath(path)
    if not os.path.isfile(os.path.join(base, storage.MANIFEST_NAME)):
        recovered = storage.recover(base)
        base = recovered or base
    entries: Dict[str, Dict[str, Any]] = {}
    for fname, info in sorted(m.files.items()):
        fpath = os.path.join(base, fname)
        if not os.path.isfile(fpath):
            problems.append(f"{fpath}: missing")
            continue
        size = os.path.getsize(fpath)
        if size != int(info.get("bytes", size)):
            problems.append(f"{fpath}: {size} bytes, manifest says {info.get('bytes')}")
        try:
            with open_file(fpath) as r:
                entries[fname] = {i.name: i for i in r.infos()}
                problems += [f"{fpath}: {p}" for p in r.verify_all()]
        except MegashardError as e:
            problems.append(str(e))
    def check_entry(where: str, file: Any, name: str, data_offset: int, nbytes: int, crc32: int) -> None:
        if not nbytes:
            return
        if file not in entries:
            return  # already reported
        info = entries[file].get(name)
        if info is None:
            problems.append(f"{where}: tensor {name!r} not found in {file}")
        elif (info.data_offset, info.nbytes, info.crc32) != (data_offset, nbytes, crc32):
            problems.append(f"{where}: manifest says {file}:{name} at {data_offset}+{nbytes} crc {crc32:#010x}, "
                            f"file has {info.data_offset}+{info.nbytes} crc {info.crc32:#010x}")
    for key, t in m.tensors.items():
        for s in t.shards:
            check_entry(f"tensor {key!r} shard {s.offset}", s.file, s.name, s.data_offset, s.nbytes, s.crc32)
        problems += coverage_problems(key, t.global_shape, [(Box(s.offset, s.shape), s.flat) for s in t.shards])
        total = sum((s.flat[1] - s.flat[0]) if s.flat else numel(s.shape) for s in t.shards)
        if total != numel(t.global_shape) and not any("cover" in p and key in p for p in problems):
            problems.append(f"{key}: shards hold {total} elements, tensor has {numel(t.global_shape)}")
    for tid, tree in list(m.trees.items()) + [(k, v) for k, v in m.objects.items()]:
        for ref in _tree_refs(tree):
            check_entry(f"state {tid}", ref.get("file"), ref.get("name", ""), int(ref.get("data_offset", 0)),
                        int(ref.get("nbytes", 0)), int(ref.get("crc32", 0)))
    return problems

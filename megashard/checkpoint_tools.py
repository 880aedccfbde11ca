"""Checkpoint-level inspect and verify (used by ``megashard inspect|verify DIR``)."""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

from . import jsonstate, saveroot, storage
from .errors import MegashardError
from .manifest import Manifest, dtype_name
from .plan import Box, coverage_problems, numel


def _manifest(path: str) -> Manifest:
    from .storage import read_manifest

    return read_manifest(path)


def _location(path: str) -> str:
    return storage.read_location(path)


def inspect_checkpoint(path: str) -> Dict[str, Any]:
    """Summary of a checkpoint: totals first (what a user asks first), then layout, files and
    every global tensor with its shards. For a Megatron save root, the checkpoint its tracker
    names, with the root's iterations (``save_root``); without a tracker, only those."""
    root = storage.save_root(path)
    if root is not None and root["tracker"] is None:
        return {"save_root": root}
    if root is not None:
        path = storage.root_checkpoint(root)
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
        "totals": _totals(path, m),
        **({"save_root": root} if root is not None else {}),
        "path": storage.location(path),
        "world_size": m.world_size,
        "layout": m.layout,
        "files": {name: dict(info) for name, info in sorted(m.files.items())},
        "total_bytes": m.total_bytes,
        "tensors": tensors,
        "objects": sorted(m.objects),
        "distinct_rank_trees": len(m.trees),
    }


OPTIMIZER_PREFIX = "optimizer."  # Megatron's global keys of optimizer state (e.g. optimizer.state.exp_avg.*)


def _top_level(m: Manifest) -> Dict[str, Any]:
    """Rank 0's top-level saved values, decoded without reading any tensor bytes."""
    from .loading import _decode_saved_tree, _LoadWork

    try:
        value = _decode_saved_tree(m.tree_for_rank(0), m, _LoadWork(), lazy=True)
    except MegashardError:
        return {}
    return value if isinstance(value, dict) else {}


def _totals(path: str, m: Manifest) -> Dict[str, Any]:
    """Bytes, files, tensors, layout, iteration and what the checkpoint holds (model/optimizer/RNG/args)."""
    model_keys = [k for k in m.tensors if not k.startswith(OPTIMIZER_PREFIX)]
    opt_keys = [k for k in m.tensors if k.startswith(OPTIMIZER_PREFIX)]

    def nbytes(keys: List[str]) -> int:
        return sum(s.nbytes for k in keys for s in m.tensors[k].shards)

    top = _top_level(m)
    iteration = top.get("iteration")
    if type(iteration) is not int:
        iteration = saveroot.parse_iteration_dir_name(os.path.basename(storage.location(path)))
    names = [str(k) for k in top] + [str(o).split("/", 1)[0] for o in m.objects]
    holds = {
        "model": f"{len(model_keys)} global tensors, {nbytes(model_keys)} bytes" if model_keys else None,
        "optimizer": (f"{len(opt_keys)} global tensors, {nbytes(opt_keys)} bytes" if opt_keys else
                      ("non-tensor state only" if "optimizer" in top else None)),
        "rng": "yes" if any("rng" in n for n in names) else None,
        "args": "yes" if "args" in top else None,
    }
    return {
        "bytes": m.total_bytes,
        "files": len(m.files),
        "global_tensors": len(m.tensors),
        "shards": sum(len(t.shards) for t in m.tensors.values()),
        "layout": ", ".join(f"{k}={v}" for k, v in m.layout.items()) or "(not recorded)",
        "world_size": m.world_size,
        "iteration": iteration,
        "holds": {k: v for k, v in holds.items() if v is not None},
        "saved_args": _saved_args(top.get("args")),
        "other_state": sorted(str(k) for k, v in top.items() if str(k) not in ("iteration", "args", "optimizer")
                              and "rng" not in str(k) and not _only_sharded(v)),
    }


#: The saved Megatron args a user checks first (model size and parallel sizes), by Megatron's names.
SUMMARY_ARGS = ("padded_vocab_size", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "ffn_hidden_size", "seq_length", "num_experts", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                "context_parallel_size", "data_parallel_size", "world_size")


def _saved_args(args: Any) -> Dict[str, Any]:
    """Those of :data:`SUMMARY_ARGS` the saved ``args`` (a Namespace or dict) hold as plain values."""
    values = args if isinstance(args, dict) else vars(args) if hasattr(args, "__dict__") else {}
    return {k: values[k] for k in SUMMARY_ARGS
            if k in values and type(values[k]) in (int, float, str, bool)}


def _only_sharded(value: Any) -> bool:
    """True for a subtree that holds nothing but global-tensor/object references (e.g. ``model``)."""
    from .loading import _SHARDED

    if value is _SHARDED:
        return True
    if isinstance(value, dict):
        return all(_only_sharded(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_only_sharded(v) for v in value)
    return False


def _check_ref(m: Manifest, ref: Any, path: str) -> None:
    from .loading import _checked_ref

    if isinstance(ref, dict) and ref.get("kind") in ("tensor", "bytes", "json"):
        _checked_ref(ref, m, path[len("state "):] if path.startswith("state ") else path)  # it says "state"


def _int(v: Any) -> int:
    """An integer field of an untrusted reference (-1 when it is not one: reported as a mismatch)."""
    return v if type(v) is int else -1


def _tree_refs(node: Any) -> Iterator[Dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("kind") in ("tensor", "bytes", "json") and "file" in node and "data_offset" in node:
            yield node
        for v in node.values():
            yield from _tree_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _tree_refs(v)


def _stored_object_problems(base: str, m: Manifest, readable: Mapping[str, Any]) -> List[str]:
    """Every ShardedObject stored as JSON in a readable file (``saving._object_in_file``) passes the
    checks a load makes of it (its header's CRC32) and decodes as strictly as the state trees."""
    from .loading import _LoadWork, _stored_json
    from .readers import read_own

    work, problems = _LoadWork(base=base), []
    for ukey, entry in m.objects.items():
        value = entry.get("value") if isinstance(entry, dict) else None
        ref = value.get("ref") if isinstance(value, dict) and value.get(jsonstate.TAG) == "ref" else None
        if isinstance(ref, dict) and ref.get("kind") == "json" and ref.get("file") in readable:
            try:
                _stored_json(ref, ukey, m, work).strict = True
            except MegashardError as e:
                problems.append(str(e))
    if not work.ops:
        return problems
    try:
        read_own(base, m, work.ops, work.view_ops, work.row_jobs, None)
    except MegashardError as e:
        return problems + [str(e)]
    for decode in work.finish:
        try:
            decode()
        except MegashardError as e:
            problems.append(str(e))
    return problems


def verify_checkpoint(path: str, progress: Optional[Callable[[int, int], None]] = None) -> List[str]:
    """Every problem found (empty list = every byte of the checkpoint is as saved).

    Checks: the manifest parses and matches ``manifest.sha256``; every listed file is a
    regular file inside the directory (no symlink) with the recorded size; every file's
    structure (header, index, zero fill, terminator) is intact and every tensor passes
    its CRC32/SHA-256; every manifest entry matches the file's own index (name, offsets,
    length, CRC32) and the file holds no tensor the manifest does not list; every global
    tensor is covered exactly once. Read-only. ``progress(bytes done, bytes in all)`` is called
    before the first file and after each. A Megatron save root: the checkpoint its tracker names.
    """
    from .format.verify import structure_problems

    problems: List[str] = []
    try:
        base = _location(path)
        m = _manifest(base)
    except MegashardError as e:
        return [str(e)]
    entries: Dict[str, Dict[str, Any]] = {}
    total, done = sum(max(0, _int(info.get("bytes", 0))) for info in m.files.values()), 0
    if progress is not None:
        progress(0, total)
    with storage.checkpoint_files(base, m) as cf:
        for fname, info in sorted(m.files.items()):
            if progress is not None and done:
                progress(done, total)
            done += max(0, _int(info.get("bytes", 0)))
            fpath = cf.path(fname)
            try:
                cf.open(fname, int(info.get("bytes", 0)))
                with cf.tensor_reader(fname) as r:
                    problems += structure_problems(r)
                    entries[fname] = {i.name: i for i in r.infos()}
                    problems += [f"{fpath}: {p}" for p in r.verify_all()]
                    if "tensors" in info and info["tensors"] != len(r):
                        problems.append(f"{fpath}: holds {len(r)} tensors, the manifest says {info['tensors']}")
            except MegashardError as e:
                problems.append(f"{fpath}: missing" if not storage.is_url(fpath) and not os.path.lexists(fpath)
                                else str(e))
    if progress is not None:
        progress(done, total)
    listed: Dict[str, Dict[str, str]] = {}  # file -> {tensor name: the index entry naming it}

    def check_entry(where: str, file: Any, name: str, data_offset: int, nbytes: int, crc32: Optional[int]) -> None:
        if not nbytes:
            return
        if file not in entries:
            return  # already reported
        first = listed.setdefault(file, {}).setdefault(name, where)
        if first != where:  # one tensor of a file holds one value
            problems.append(f"{os.path.join(base, file)}: tensor {name!r} is named twice by the index, by {first} "
                            f"and by {where}")
        info = entries[file].get(name)
        if info is None:
            problems.append(f"{where}: tensor {name!r} not found in {file}")
        elif (info.data_offset, info.nbytes, info.crc32 if crc32 is not None else None) != (data_offset, nbytes, crc32):
            said = f" crc {crc32:#010x}" if crc32 is not None else ""  # a stored object's: its header's CRC32 only
            problems.append(f"{where}: manifest says {file}:{name} at {data_offset}+{nbytes}{said}, "
                            f"file has {info.data_offset}+{info.nbytes} crc {info.crc32:#010x}")
    for key, t in m.tensors.items():
        for s in t.shards:
            check_entry(f"tensor {key!r} shard {s.offset}+{s.shape}" + (f" flat {s.flat}" if s.flat else ""),
                        s.file, s.name, s.data_offset, s.nbytes, s.crc32)
        problems += coverage_problems(key, t.global_shape, [(Box(s.offset, s.shape), s.flat) for s in t.shards])
        total = sum((s.flat[1] - s.flat[0]) if s.flat else numel(s.shape) for s in t.shards)
        if total != numel(t.global_shape) and not any("cover" in p and key in p for p in problems):
            problems.append(f"{key}: shards hold {total} elements, tensor has {numel(t.global_shape)}")
    for tid, tree in list(m.trees.items()) + [(k, v) for k, v in m.objects.items()]:
        for i, ref in enumerate(_tree_refs(tree)):
            check_entry(f"state {tid} value {i}", ref.get("file"), str(ref.get("name", "")),
                        _int(ref.get("data_offset", 0)),
                        _int(ref.get("nbytes", 0)), None if ref.get("kind") == "json" else _int(ref.get("crc32", 0)))
    for tid, tree in list(m.trees.items()) + [(k, v.get("value") if isinstance(v, dict) else v)
                                              for k, v in m.objects.items()]:
        try:  # every state tree decodes (tags, nesting, integer sizes, registered enums, valid refs)
            jsonstate.decode(tree, path=f"state {tid}", resolver=partial(_check_ref, m), strict=True)
        except MegashardError as e:  # a message naming only a key: named by the index that holds it
            problems.append(str(e) if base in str(e) else f"{cf.path(storage.MANIFEST_NAME)}: {e}")
    problems += _stored_object_problems(base, m, entries)
    for fname, names in sorted(entries.items()):
        extra = sorted(set(names) - set(listed.get(fname, ())))
        if extra:
            problems.append(f"{os.path.join(base, fname)}: {len(extra)} tensor(s) the manifest does not list, "
                            f"e.g. {extra[0]!r}")
    # one problem once: a damaged file is found by its own check and again by the state tree naming it
    return list(dict.fromkeys(problems))

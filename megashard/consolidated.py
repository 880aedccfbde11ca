"""The whole checkpoint in one process: every global tensor in full, no process group.

The "deserialize to CPU, then assign" path for evaluation, export and inference.
Each requested global tensor is planned exactly like an ``own``-mode load of one
rank that asks for the whole tensor (offset 0, full shape): the same planner, the
same parallel ``preadv`` reader, so every saved byte of a requested tensor is read
once and nothing else is read. Flattened-range shards (Megatron's distributed
optimizer) are reassembled into the full tensor. Nothing here calls
``torch.distributed``, so it works (and issues no collectives) whether or not a
process group is initialised.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .loading import LoadStats, _LoadWork, _plan_sharded
from .readers import read_own, verify_delivered
from .storage import read_location, read_manifest
from .errors import CheckpointError
from .manifest import Manifest, TensorRecord, itemsize
from .plan import numel
from .sharded import ShardedTensor

log = logging.getLogger(__name__)

__all__ = ["load_consolidated", "match_keys", "global_nbytes", "read_global_tensors", "read_boxes",
           "iter_global_tensors"]

DEFAULT_BATCH_BYTES = 256 << 20  # one read batch when streaming (a tensor larger than this is read alone)


def global_nbytes(rec: TensorRecord) -> int:
    """Bytes of the full global tensor (what reading it must cost)."""
    return numel(rec.global_shape) * itemsize(rec.dtype)


def match_keys(keys: Sequence[str], patterns: Optional[Iterable[str]]) -> List[str]:
    """The ``keys`` matching any of ``patterns`` (exact keys or shell globs), in order.

    ``None`` selects every key. A pattern that matches nothing is an error: a typo must
    not silently produce an empty export.
    """
    keys = list(keys)
    if patterns is None:
        return keys
    patterns = list(patterns)
    chosen = set()
    unmatched = []
    for p in patterns:
        hit = [k for k in keys if k == p or fnmatch.fnmatchcase(k, p)]
        if not hit:
            unmatched.append(p)
        chosen.update(hit)
    if unmatched:
        sample = ", ".join(repr(k) for k in keys[:5])
        raise CheckpointError(f"no global tensor matches {', '.join(map(repr, unmatched))} "
                              f"({len(keys)} tensors, e.g. {sample})")
    return [k for k in keys if k in chosen]


def read_global_tensors(
    base: str,
    manifest: Manifest,
    wants: Sequence[Tuple[str, Optional[torch.Tensor]]],
    *,
    threads: Optional[int] = None,
    verify: bool = False,
) -> Tuple[Dict[str, torch.Tensor], int]:
    """Read full global tensors ``(key, destination or None)``; returns them and the bytes read.

    A given destination (contiguous, CPU, the tensor's dtype and numel) is filled in
    place, e.g. a memory-mapped scratch buffer; otherwise a tensor is allocated.
    """
    boxes = []
    for key, dest in wants:
        rec = manifest.tensors.get(key)
        if rec is None:
            raise CheckpointError(f"{base}: no global tensor {key!r} in the checkpoint")
        shape = tuple(rec.global_shape)
        boxes.append((key, (0,) * len(shape), shape, dest))
    got, nread = read_boxes(base, manifest, boxes, threads=threads, verify=verify)
    return {key: t for (key, _), t in zip(wants, got)}, nread


def read_boxes(
    base: str,
    manifest: Manifest,
    wants: Sequence[Tuple[str, Sequence[int], Sequence[int], Optional[torch.Tensor]]],
    *,
    threads: Optional[int] = None,
    verify: bool = False,
) -> Tuple[List[torch.Tensor], int]:
    """Read boxes ``(key, offset, shape, destination or None)`` of global tensors, e.g. one
    layer of a stacked tensor or the real rows of a padded one; returns them (in order)
    and the bytes read. Planned like an own-mode load: only the box's bytes are read."""
    work = _LoadWork(rows_ok=True)
    out: List[torch.Tensor] = []
    for key, offset, shape, dest in wants:
        rec = manifest.tensors.get(key)
        if rec is None:
            raise CheckpointError(f"{base}: no global tensor {key!r} in the checkpoint")
        offset, shape = tuple(int(o) for o in offset), tuple(int(s) for s in shape)
        gshape = tuple(rec.global_shape)
        if len(offset) != len(gshape) or len(shape) != len(gshape) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, shape, gshape)):
            raise CheckpointError(f"{base}: box {offset}+{shape} is outside {key!r} (global shape {gshape})")
        if dest is not None:
            dest = dest.view(shape)
        sh = ShardedTensor(key, dest, gshape, offset, local_shape=shape, dtype=rec.dtype)
        out.append(_plan_sharded(sh, manifest, work, key))
    if work.problems:
        head = "\n  ".join(work.problems[:20])
        raise CheckpointError(f"{base}: cannot assemble {len(work.problems)} global tensor(s):\n  {head}\n"
                              "The checkpoint is incomplete; `megashard verify` shows what is missing.")
    nread = read_own(base, manifest, work.ops, work.view_ops, work.row_jobs, threads)
    with torch.no_grad():
        for f in work.finish:
            f()
    if verify:
        verify_delivered(base, work.touched, manifest)
    return out, nread


def iter_global_tensors(
    base: str,
    manifest: Manifest,
    keys: Sequence[str],
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    threads: Optional[int] = None,
    verify: bool = False,
    stats: Optional[LoadStats] = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` in ``keys`` order, reading batches of at most ``batch_bytes``.

    The next batch is read in the background while the caller consumes this one (e.g.
    hashes and writes it), so memory stays at two batches (or a tensor larger than a
    batch) as long as the caller drops each tensor it has handled.
    """
    batches: List[List[str]] = []
    size = 0
    for k in keys:
        n = global_nbytes(manifest.tensors[k])
        if not batches or (batches[-1] and size + n > batch_bytes):
            batches.append([])
            size = 0
        batches[-1].append(k)
        size += n

    def read(batch: List[str]) -> Tuple[Dict[str, torch.Tensor], int]:
        return read_global_tensors(base, manifest, [(k, None) for k in batch], threads=threads, verify=verify)

    with ThreadPoolExecutor(1, thread_name_prefix="megashard-prefetch") as pool:
        pending = pool.submit(read, batches[0]) if batches else None
        for i in range(len(batches)):
            got, n = pending.result()
            pending = pool.submit(read, batches[i + 1]) if i + 1 < len(batches) else None
            if stats is not None:
                stats.bytes_read += n
            for k in batches[i]:  # hand over and forget, so a consumer that drops a tensor frees it
                yield k, got.pop(k)
            del got


def load_consolidated(
    checkpoint_dir: str | os.PathLike,
    keys: Optional[Iterable[str]] = None,
    *,
    device: str | torch.device = "cpu",
    threads: Optional[int] = None,
    verify: bool = False,
    return_stats: bool = False,
) -> Any:
    """``{global key: full tensor}`` of a checkpoint, in this process alone (no process group).

    ``checkpoint_dir``: a checkpoint, or a Megatron save root (the checkpoint its tracker names).

    ``keys``: global keys or shell patterns (``"decoder.layers.*"``); default all.
    Tensors are read on CPU in parallel, then moved to ``device`` one by one. The
    bytes read (equal to the bytes of the requested tensors) are in the
    :class:`~megashard.loading.LoadStats` returned with ``return_stats=True`` (as
    ``(tensors, stats)``, mode ``"consolidated"``). The keys are
    Megatron's global keys: a serving stack needs its own name mapping.
    Non-tensor state (``args``, ``iteration``, ...) comes from :func:`megashard.load_common`.
    """
    t0 = time.perf_counter()
    # a Megatron save root: the checkpoint its tracker names; an interrupted re-save's complete copy is read in place
    base = read_location(checkpoint_dir)
    manifest = read_manifest(base)
    wanted = match_keys(list(manifest.tensors), keys)
    stats = LoadStats(mode="consolidated")
    target = torch.device(device)
    out: Dict[str, torch.Tensor] = {}
    if wanted:
        got, stats.bytes_read = read_global_tensors(base, manifest, [(k, None) for k in wanted], threads=threads,
                                                    verify=verify)
        for k in wanted:
            t = got.pop(k)
            out[k] = t if target.type == "cpu" else t.to(target)
    stats.seconds = time.perf_counter() - t0
    log.info("loaded %d global tensors of %s in one process (%.1f MB read, %.2f s)", len(out), base,
             stats.bytes_read / 1e6, stats.seconds)
    return (out, stats) if return_stats else out

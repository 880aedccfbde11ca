"""How planned byte ranges reach their destinations: the storage-reading seam of ``load``.

``own``: every rank reads its own ranges (parallel ``preadv`` per file). ``scatter``: one
reader per node opens the files and the node reads every range it needs once: through
the reader's passed descriptors, shared memory or the process group
(:mod:`megashard.scatter`). ``readonce``: every byte the job needs is read by one rank of the
job and sent to the others that need it (:mod:`megashard.readonce`). Both read members only through a files object
(:func:`megashard.storage.checkpoint_files`; in ``scatter`` only the reader has one, but where it
``every_rank_reads``, an object store, every rank opens one for the bytes only it needs): its
``read_into`` (``read_files``: several files at once) fills ``(offset, view)`` requests (rows back to back in a file as one
:class:`~megashard.format.fastio.Requests` row run), and only scatter's descriptor passing asks
for ``descriptor`` (where ``passes_descriptors``). Another storage (an object store) plugs
in as a files object with the same methods.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import readonce, scatter as scatter_mod, storage
from .devicecopy import DeviceCopier, device_targets, split_targets
from .errors import CheckpointError
from .format.fastio import Requests, default_read_threads
from .transport import Comm

SCATTER_TRANSPORTS = scatter_mod.TRANSPORTS


def _file_size(files: Mapping[str, Any], f: str) -> int:
    if f not in files:
        raise CheckpointError(f"{f!r} is not listed in the index's files")
    return int(files[f].get("bytes", 0))


def read_own(base: str, files: Any, ops: Sequence[Any], view_ops: Sequence[Tuple[str, int, memoryview]],
             row_jobs: Sequence[Tuple[str, int, int, List[memoryview]]], threads: Optional[int],
             arrived: Optional[Callable[[Any, Optional[int]], None]] = None) -> int:
    """Read every planned byte range straight into its destination; returns bytes read.
    ``files`` is the index (or its file table): names and sizes, checked on open.
    ``arrived(x, crc)``: called with each host op of ``ops`` and each row job of ``row_jobs`` as soon
    as all its bytes are in, from a reading thread, where the files object can say when (an
    object store's ``read_files``: while later bytes are still downloading); elsewhere never.
    ``crc``: the CRC32 of its bytes in order where the files object computed it as they landed
    (``crc_on_read``: an object store's GETs), else None."""
    index, files = files, getattr(files, "files", files)
    targets: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
    for op in ops:
        targets.setdefault(op.file, []).append((op.offset, op.dest))
    by_file: Dict[str, List[Tuple[int, memoryview]]] = {}
    on_device: Dict[str, List[Tuple[int, torch.Tensor]]] = {}  # GPU destinations: through pinned buffers
    for f, reqs in targets.items():
        by_file[f], dev = split_targets(reqs)
        if dev:
            on_device[f] = dev
    for f, off, mv in view_ops:
        by_file.setdefault(f, []).append((off, mv))
    names = sorted(set(by_file) | set(on_device) | {j[0] for j in row_jobs})
    nthreads = threads or default_read_threads()
    total = 0
    with storage.checkpoint_files(base, index) as cf:
        for f in names:  # every file checked (no requests: only the checks) before any byte is read
            cf.read_into(f, (), size=_file_size(files, f), threads=1)
        for f in names:
            path = os.path.join(base, f)
            size = _file_size(files, f)
            spans = [(o, len(mv)) for o, mv in by_file.get(f, ())] + [(o, t.numel()) for o, t in on_device.get(f, ())]
            for off, n in spans:
                if off < 0 or off + n > size:
                    raise CheckpointError(f"{path}: byte range {off}+{n} past end of file ({size} bytes)")
        rows: Dict[str, List[Tuple[int, int, List[memoryview]]]] = {}
        for f, off, run, views in row_jobs:  # rows back to back in the file: one row run (a request per row)
            size = _file_size(files, f)
            if off < 0 or off + run * len(views) > size:
                raise CheckpointError(f"{os.path.join(base, f)}: byte range {off}+{run * len(views)} past end of "
                                      f"file ({size} bytes)")
            rows.setdefault(f, []).append((off, run, views))
        if arrived is not None and getattr(cf, "batch_reads", False):
            total += _read_each(cf, files, ops, view_ops, row_jobs, nthreads, arrived)
        else:
            total += cf.read_files([(f, Requests(by_file.get(f, ()), rows[f]) if f in rows else by_file[f],
                                     _file_size(files, f)) for f in sorted(set(by_file) | set(rows))],
                                   threads=nthreads)
        if on_device:
            with DeviceCopier(device_targets(t for reqs in on_device.values() for _, t in reqs)) as copier:
                for f, dreqs in sorted(on_device.items()):
                    total += copier.read(partial(cf.read_into, f, size=_file_size(files, f), threads=nthreads), dreqs)
    return total


def _read_each(cf: Any, files: Mapping[str, Any], ops: Sequence[Any],
               view_ops: Sequence[Tuple[str, int, memoryview]],
               row_jobs: Sequence[Tuple[str, int, int, List[memoryview]]], threads: int,
               arrived: Callable[[Any, Optional[int]], None]) -> int:
    """:func:`read_own`'s host reads as one ``read_files`` job per op and per row job (the store
    still coalesces a file's jobs into shared GETs), so that ``arrived`` hears of each one as
    soon as its own bytes are in."""
    jobs: List[Tuple[str, Any, int]] = []
    whose: List[Any] = []  # per job: the op or row job to announce (None: view ops)
    for op in ops:
        host, _ = split_targets([(op.offset, op.dest)])
        if host:  # device destinations go through read_own's DeviceCopier
            jobs.append((op.file, host, _file_size(files, op.file)))
            whose.append(op)
    views: Dict[str, List[Tuple[int, memoryview]]] = {}
    for f, off, mv in view_ops:
        views.setdefault(f, []).append((off, mv))
    for f, reqs in views.items():
        jobs.append((f, reqs, _file_size(files, f)))
        whose.append(None)
    for job in row_jobs:
        jobs.append((job[0], Requests((), [job[1:]]), _file_size(files, job[0])))
        whose.append(job)

    crcs: Optional[List[Optional[int]]] = [None] * len(jobs) if getattr(cf, "crc_on_read", False) else None

    def done(i: int) -> None:
        if whose[i] is not None:
            arrived(whose[i], None if crcs is None else crcs[i])

    if crcs is None:
        return cf.read_files(jobs, threads=threads, done=done)
    return cf.read_files(jobs, threads=threads, done=done, crcs=crcs)


def scatter(comm: Comm, base: str, index: Any, ops: Sequence[Any], touched: Dict[str, Dict[str, Any]],
            node: Mapping[int, int], chunk: int, threads: Optional[int],
            transport: str) -> Tuple[Tuple[int, int, str], Optional[str]]:
    """One reader per node opens the files; the node reads each needed byte once (each rank
    its own bytes through the reader's descriptors, shared ones through shared memory; or all
    through the process group). ``node`` maps this node's ranks to their reader.
    On a reader, ``touched`` grows by what its node's other ranks touched, so ``verify``
    there covers every byte the node loaded."""
    return scatter_mod.scatter(comm, base, index, ops, touched, node, chunk, threads, transport,
                               partial(storage.checkpoint_files, base, index))


def read_once(comm: Comm, base: str, index: Any, ops: Sequence[Any], chunk: int,
              threads: Optional[int], node: int) -> Tuple[Tuple[int, int, int], Optional[str]]:
    """Every byte the job needs is read once, by ranks on every node (byte-balanced), and
    exchanged over the process group (:mod:`megashard.readonce`). ``node``: this rank's node
    reader; on a file system each file is read on one node (a network file system's client
    fetches whole files or large blocks), on an object store anywhere."""
    return readonce.read_once(comm, base, index, ops, chunk, threads, partial(storage.checkpoint_files, base, index),
                              None if storage.is_url(base) else node)


def verify_delivered(base: str, touched: Mapping[str, Mapping[str, Any]], index: Any = None) -> None:
    """Check every byte a load delivered: each touched file's structure (header, index,
    zero fill, terminator), that the index's byte range of every touched tensor is the one
    the file's own index names, and every touched tensor's hash."""
    from .format.verify import structure_problems

    files = getattr(index, "files", index)
    with storage.checkpoint_files(base, index) as cf:
        for f, names in sorted(touched.items()):
            cf.open(f, _file_size(files, f) if files is not None else None)  # name, type and size checks first
            with cf.tensor_reader(f) as r:
                problems = structure_problems(r)
                if problems:
                    raise CheckpointError("; ".join(problems[:5]))
                for n in sorted(names):
                    if n not in r:
                        raise CheckpointError(f"{cf.path(f)}: tensor {n!r} named by the index is not in the file")
                    e = r._entry(n)
                    want = names[n] if isinstance(names, Mapping) else None
                    if want is not None and tuple(want) != (e.data_offset, e.data_length):
                        raise CheckpointError(f"{cf.path(f)}: tensor {n!r}: the index says bytes {want[0]}+{want[1]}, "
                                              f"the file's index {e.data_offset}+{e.data_length}")
                    r.verify(n)

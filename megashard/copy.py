"""``megashard copy SRC DST``: a checkpoint between file systems and object stores, as a save would write it.

Each side is a directory or an object-store URL (``s3://``, ``msc://``). A checkpoint's
``.tensors`` files are byte-identical on both; what differs is around them: on an object store
they live under a save's own prefix named by the head (``data_prefix``), and the index records
every object's ETag. So a plain copy of the files (``aws s3 cp --recursive``, ``cp -r``) is not a
checkpoint there, and this command rewrites what must differ.

How: the source's head and index are read through the read seam
(:func:`megashard.storage.checkpoint_files`; on S3 every GET pinned to the ETags the index
recorded), every file is streamed in chunks (``chunk_bytes``, 32 MiB; on an object store whole
parts, 64 MiB by default), the next read while the last is written, at most ``jobs`` (4) files at
once, so memory stays at ``2 * jobs`` chunks, and checked on the way
(:class:`~megashard.format.streamverify.StreamVerifier`: every tensor's CRC32 against its header
and against the index, the file's whole structure; SHA-256 too with ``sha256=True``), and written
through the save seam (:func:`megashard.storage.save_target`): into a save's temp dir with its
owner record, committed by rename, on a file system; under a new save prefix, committed by the
conditional PUT of the head, on an object store. So ownership, clean-up (``megashard recover``),
atomicity and what may be replaced are exactly a save's: DST is absent, or a megashard checkpoint
that the copy replaces as a re-save would; anything else is refused before a byte is written. A
file that fails a check fails the copy, and DST is left as it was.

The index is kept byte for byte except its file table (the new ETags; none on a file system),
which is appended (:func:`megashard.manifest.with_files`).

A Megatron save root (``iter_XXXXXXX`` checkpoints and ``latest_checkpointed_iteration.txt``) as
SRC: the tracker's iteration is copied (``iteration=N``: that one; ``all_iterations=True``: every
committed one) to ``DST/iter_XXXXXXX``, and DST's tracker is written last, after every commit:
the tracker's iteration (the newest copied without one), unless DST's tracker already names a
later iteration.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import index as index_mod, saveroot, storage
from .errors import CheckpointError
from .manifest import Manifest, parse_head, with_files

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 32 * MiB
DEFAULT_JOBS = 4
Iteration = Union[int, str]


class CopyInputError(CheckpointError):
    """SRC is not a checkpoint or save root, or the arguments do not fit it: nothing was written."""


@dataclass
class CopyResult:
    src: str
    dst: str
    checkpoints: List[Tuple[str, str]] = field(default_factory=list)  # (read, written)
    tracker: Optional[Iteration] = None  # written at DST (a save root)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        gbs = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        what = (f"{len(self.checkpoints)} checkpoint(s)" if len(self.checkpoints) != 1
                else f"{self.checkpoints[0][0]} -> {self.checkpoints[0][1]}")
        tracker = f", tracker {self.tracker}" if self.tracker is not None else ""
        return (f"copied {what}{tracker}: {self.files} files, {self.bytes / 1e9:.3f} GB verified in "
                f"{self.seconds:.2f} s ({gbs:.3g} GB/s)")


# --------------------------------------------------------------------------- what SRC is


def _plan(src: str, dst: str, iteration: Optional[Iteration], all_iterations: bool
          ) -> Tuple[List[Tuple[str, str]], Optional[Iteration]]:
    """(SRC checkpoint, DST checkpoint) pairs and the iteration DST's tracker names (None: no tracker)."""
    if storage.locate(src) is not None:
        if iteration is not None or all_iterations:
            raise CopyInputError(f"{src} is a single checkpoint; --iteration and --all apply to a Megatron save root")
        return [(src, dst)], None
    tracked = storage.read_tracker(src)
    if all_iterations:
        if iteration is not None:
            raise CopyInputError("--iteration and --all exclude each other")
        its = storage.save_root_iterations(src)
        if not its:
            raise CopyInputError(f"{src} holds no committed iter_XXXXXXX checkpoints "
                                 f"({storage.why_not_checkpoint(src)})")
        tracker = tracked if tracked in its else its[-1]
    else:
        it = iteration if iteration is not None else tracked
        if it is None:
            its = storage.save_root_iterations(src)
            found = ", ".join(saveroot.iteration_dir_name(i) for i in its[:5])
            hint = f"; pass --iteration N or --all (found {found})" if its else ""
            raise CopyInputError(f"{src} is not a megashard checkpoint ({storage.why_not_checkpoint(src)}) and holds no "
                                 f"{saveroot.TRACKER_NAME}{hint}")
        its = [it]
        tracker = it
    names = [saveroot.iteration_dir_name(it) for it in its]
    pairs = [(storage.child(src, n), storage.child(dst, n)) for n in names]
    for s, _ in pairs:
        if storage.locate(s) is None:
            raise CopyInputError(f"{s}: not a megashard checkpoint ({storage.why_not_checkpoint(s)})")
    return pairs, tracker


def _refuse_overlap(src: str, dst: str) -> None:
    if storage.is_url(src) != storage.is_url(dst):
        return
    if storage.is_url(src):
        a, b = src.rstrip("/") + "/", dst.rstrip("/") + "/"
        inside = a.startswith(b) or b.startswith(a)
    else:
        real_src = os.path.realpath(src)
        real_dst = os.path.join(os.path.realpath(os.path.dirname(dst)), os.path.basename(dst))
        inside = os.path.commonpath([real_src, real_dst]) in (real_src, real_dst)
    if inside:
        raise CopyInputError(f"{dst} and {src} are the same or one holds the other; copy to another place")


# --------------------------------------------------------------------------- one checkpoint


def _data_name(name: str, where: str) -> str:
    if not (isinstance(name, str) and name.endswith(".tensors") and not name.startswith(".")
            and storage.check_member_name(name, where)):
        raise CheckpointError(f"{where}: the index lists the file {str(name)[:100]!r}, not a megashard shard file "
                              "name (NAME.tensors); the manifest is damaged or hostile")
    return name


def _expected(m: Manifest) -> Dict[str, Dict[str, Tuple[int, int, Optional[int]]]]:
    """{file: {tensor name: (data offset, bytes, CRC32)}} as the index records them: shards of global
    tensors and the tensors the state trees and objects refer to (a stored object's CRC32 is None: its
    reference holds none, the file's header does and the copy's verifier checks it)."""
    from .checkpoint_tools import _tree_refs

    out: Dict[str, Dict[str, Tuple[int, int, int]]] = {}
    for t in m.tensors.values():
        for s in t.shards:
            if s.file is not None:
                out.setdefault(s.file, {})[s.name] = (s.data_offset, s.nbytes, s.crc32)
    for tree in list(m.trees.values()) + list(m.objects.values()):
        for ref in _tree_refs(tree):
            if isinstance(ref.get("file"), str) and ref.get("nbytes"):
                out.setdefault(ref["file"], {})[str(ref.get("name", ""))] = (
                    ref.get("data_offset"), ref.get("nbytes"), ref.get("crc32"))
    return out


class _Stop(Exception):
    """Another file failed: this one stops at its next chunk."""


def _chunks(cf: Any, name: str, size: int, chunk: int, verifier: Any, stop: threading.Event,
            threads: int) -> Iterator[memoryview]:
    """The file's bytes in order, each chunk checked before it is handed on; the next chunk is
    read (into the other of two buffers) while the caller writes this one."""
    offsets = list(range(0, size, chunk))
    bufs = [memoryview(bytearray(min(chunk, size))) for _ in range(min(2, len(offsets)))]

    def read(i: int) -> memoryview:
        mv = bufs[i % len(bufs)][:min(chunk, size - offsets[i])]
        cf.read_into(name, [(offsets[i], mv)], size=size, threads=threads)
        return mv

    with ThreadPoolExecutor(1, thread_name_prefix="megashard-copy-read") as ahead:
        pending = ahead.submit(read, 0) if offsets else None
        for i in range(len(offsets)):
            mv = pending.result()  # type: ignore[union-attr]
            if stop.is_set():
                raise _Stop()
            pending = ahead.submit(read, i + 1) if i + 1 < len(offsets) else None  # the other buffer
            verifier.feed(mv)
            yield mv


def _copy_file(src: str, index: Any, name: str, size: int, want: Mapping[str, Tuple[int, int, int]], target: Any,
               dst_dir: str, sha256: bool, chunk: int, stop: threading.Event) -> Dict[str, Any]:
    """Stream one file, checked on the way and against the index, into ``dst_dir`` (``target``'s writer:
    :meth:`~megashard.storage.posix.DirectorySave.write_stream`); returns the extra file record (the ETag)."""
    from .format.streamverify import StreamVerifier

    with storage.checkpoint_files(src, index) as cf:
        cf.open(name, size)  # name, type, size (and ETag) before a byte is read
        verifier = StreamVerifier(cf.path(name), size, sha256=sha256)
        threads = cf.read_threads()
        extra = target.write_stream(
            dst_dir, name, size, chunk, lambda n: _chunks(cf, name, size, n, verifier, stop, threads))
        _check_against_index(cf.path(name), verifier, verifier.finish(), want)
        return extra


def _check_against_index(path: str, verifier: Any, crcs: Mapping[str, int],
                         want: Mapping[str, Tuple[int, int, int]]) -> None:
    entries = {e.name: e for e in verifier.entries}
    for tname, (do, nb, crc) in sorted(want.items()):
        e = entries.get(tname)
        if e is None:
            raise CheckpointError(f"{path}: tensor {tname!r} named by the index is not in the file")
        if (e.data_offset, e.data_length) != (do, nb):
            raise CheckpointError(f"{path}: tensor {tname!r}: the index says bytes {do}+{nb}, the file's own index "
                                  f"{e.data_offset}+{e.data_length}")
        if crc is not None and crcs[tname] != crc:  # None: a stored object's, guarded by its header's CRC32
            shown = f"{crc:08x}" if type(crc) is int else repr(str(crc)[:20])
            raise CheckpointError(f"{path}: tensor {tname!r}: CRC32 {crcs[tname]:08x} differs from the index's "
                                  f"{shown}; the file or the index is damaged")


def copy_checkpoint(src: str, dst: str, *, sha256: bool = False, jobs: int = DEFAULT_JOBS,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Tuple[int, int]:
    """Copy the committed checkpoint ``src`` to ``dst`` (see the module docstring); returns
    (files, bytes). On any failure ``dst`` is as it was."""
    loc = storage.checkpoint_location(src)
    head, sections = storage.read_index_bytes(loc)
    where = f"{loc}/{storage.MANIFEST_NAME}"
    doc = parse_head(head, where)
    idx = index_mod.index_from_bytes(head, sections, where)
    try:
        m = idx if isinstance(idx, Manifest) else idx.full()
    finally:
        idx.close()
    files = {_data_name(n, loc): dict(info) for n, info in dict(idx.files).items()}
    want = _expected(m)
    to_url = storage.is_url(dst)
    if doc.get("version") == 1 and to_url:
        raise CopyInputError(f"{loc} has a version-1 index (an early megashard), which object stores do not take; "
                             "load it and save it again with this megashard, then copy that")

    target = storage.save_target(dst)
    target.validate()
    target.check()  # DST absent or a megashard checkpoint (and nothing else there): before a byte is written
    token = secrets.token_hex(6)
    created = target.create(token)
    try:
        dst_dir, ident = target.writer(token)
        stop = threading.Event()
        records: Dict[str, Dict[str, Any]] = {}
        order = sorted(files, key=lambda n: -int(files[n].get("bytes", 0)))
        with ThreadPoolExecutor(max(1, min(jobs, len(order) or 1)), thread_name_prefix="megashard-copy") as pool:
            futures = {pool.submit(_copy_file, loc, idx, n, int(files[n].get("bytes", 0)), want.get(n, {}), target,
                                   dst_dir, sha256, chunk_bytes, stop): n for n in order}
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            finally:
                if any(not f.done() or f.exception() is not None for f in futures):
                    stop.set()  # a file failed (or this thread was interrupted): the others stop at their next chunk
                    wait(futures)
            errors = [f.exception() for f in futures if f.exception() is not None
                      and not isinstance(f.exception(), _Stop)]
            if errors:
                raise errors[0]
            for f, n in futures.items():
                rec = {k: v for k, v in files[n].items() if k != "etag"}
                rec.update(f.result())
                records[n] = rec
        total = sum(int(r.get("bytes", 0)) for r in records.values())
        clean = {k: v for k, v in doc.items() if k != "data_prefix"}
        if doc.get("version") == 1:
            new_head, new_sections = head, b""
        elif to_url or records != files or clean != doc or "etag" in doc.get("index", {}):
            new_head, new_sections = with_files(clean, sections, records)
        else:
            new_head, new_sections = head, sections
        target.commit(token, {0: {n: dict(r) for n, r in records.items()}}, {0: ident}, new_head, new_sections)
        created = None
    except BaseException:
        if created is not None:
            try:
                target.discard(created)
            except Exception as e:  # noqa: BLE001 - the copy's own error is what the caller needs
                log.warning("could not remove %s of the failed copy: %s", created, e)
        raise
    try:
        target.after_commit()
    except Exception as e:  # noqa: BLE001 - committed; clean-up is best effort
        log.warning("could not remove leftovers of earlier saves beside %s: %s", dst, e)
    log.info("copied %s -> %s: %d files, %d bytes", loc, dst, len(records), total)
    return len(records), total


# --------------------------------------------------------------------------- entry point


def copy(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], *, iteration: Optional[Iteration] = None,
         all_iterations: bool = False, sha256: bool = False, jobs: int = DEFAULT_JOBS,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> CopyResult:
    """Copy a checkpoint, or a Megatron save root's iterations, from SRC to DST (see the module
    docstring). :class:`CopyInputError` when SRC or the arguments are wrong (nothing written);
    another :class:`~megashard.errors.MegashardError` when the copy fails (DST as it was)."""
    t0 = time.perf_counter()
    src_s, dst_s = storage.location(src), storage.location(dst)
    if type(jobs) is not int or jobs < 1:
        raise CopyInputError(f"jobs must be an integer >= 1, got {jobs!r}")
    if type(chunk_bytes) is not int or chunk_bytes < 1:
        raise CopyInputError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    _refuse_overlap(src_s, dst_s)
    pairs, tracker = _plan(src_s, dst_s, iteration, all_iterations)
    if tracker is not None:
        storage.read_tracker(dst_s)  # a garbage tracker at DST is refused before anything is copied
    res = CopyResult(src_s, dst_s)
    for s, d in pairs:
        n, b = copy_checkpoint(s, d, sha256=sha256, jobs=jobs, chunk_bytes=chunk_bytes)
        res.checkpoints.append((s, d))
        res.files += n
        res.bytes += b
    if tracker is not None:
        current = storage.read_tracker(dst_s)
        if isinstance(current, int) and isinstance(tracker, int) and current > tracker:
            log.info("%s: its tracker names iteration %d, later than the copied %d: left as it is", dst_s, current,
                     tracker)
        else:
            storage.write_tracker(dst_s, tracker)
            res.tracker = tracker
    res.seconds = time.perf_counter() - t0
    log.info("%s", res.summary())
    return res

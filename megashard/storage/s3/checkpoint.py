"""A megashard checkpoint in an object store: its layout, the commit protocol, reading it.

Objects have no rename, so the commit point is one small object written last with a
conditional PUT. For the checkpoint ``s3://bucket/P``:

* ``P/.megashard-save-<token>/``: every object of one save (``*.tensors``,
  ``manifest.index``, ``manifest.sha256``); each rank uploads its own files there, each
  with ``If-None-Match: *``.
* ``P/manifest.json``: the head (the commit point). It names its save's prefix
  (``data_prefix``) and carries every object's ETag, so every ranged GET of a load is
  pinned (``If-Match``) to the bytes the save wrote. Rank 0 writes it last, with
  ``If-None-Match: *`` for a new checkpoint or ``If-Match: <ETag it saw when the save
  was planned>`` for a re-save: a re-save that another save overtook fails
  (:class:`~megashard.errors.CommitConflictError`) and removes only its own prefix.
* after the commit rank 0 deletes the prefix of the head it replaced; the Megatron
  tracker (``<root>/latest_checkpointed_iteration.txt``) is written after that.

A crash at any moment leaves either the old head (and the old prefix, untouched) or the
new one: never a head that names missing objects. A head PUT that fails without a decisive
answer is settled by reading the head back (:meth:`ObjectSave._settle`); when that cannot
decide, every object is kept (:class:`~megashard.errors.CommitOutcomeUnknownError`).
What a dead save leaves (its prefix, unfinished multipart uploads) is removed by
:func:`cleanup` (``megashard recover URL``; also each later save of the same checkpoint)
once older than ``older_than_s``.
A save never deletes an object outside the prefixes it created or the one the head it
replaced named, and refuses a target that holds objects megashard did not write.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ...errors import CheckpointError, CommitConflictError, CommitOutcomeUnknownError
from ...saveroot import TRACKER_MAX, TRACKER_NAME, parse_iteration_dir_name, parse_tracker
from ..base import MANIFEST_DIGEST_NAME as DIGEST_NAME, MANIFEST_NAME, PathLike, Recovery, manifest_digest
from ..base import max_manifest_bytes as _max_head
from ..ownership import DEFAULT_STALE_AGE_S, why_kept
from .client import (GAP_BYTES, FileRange, MiB, ObjectInfo, ObjectStore, ObjectTooLargeError, _env_int,
                     _run_parallel, connections, get_bytes_limit, part_bytes, single_put_bytes)
from .url import check_object_name, child, parse_url

log = logging.getLogger(__name__)

__all__ = ["ObjectCheckpointFiles", "ObjectSave", "checkpoint_files", "checkpoint_location", "child", "cleanup",
           "foreign_format", "is_checkpoint", "iteration_names", "locate", "location", "occupied", "read_tracker",
           "recover", "save_target", "why_not_checkpoint", "write_tracker"]

DATA_PREFIX = ".megashard-save-"
HEAD_FIELD = "data_prefix"
_DATA_PREFIX_RE = re.compile(r"\.megashard-save-[A-Za-z0-9_-]{1,64}\Z")
_DIGEST_RE = re.compile(rb"[0-9a-f]{64}\n")
_INDEX_CACHE_BYTES = 64 * MiB  # index blocks a load keeps (a rank needs a few MiB of them; verify reads on)


def index_whole_bytes() -> int:
    """Largest ``manifest.index`` a load fetches whole, in one GET beside the digest's
    (``MEGASHARD_S3_INDEX_WHOLE_BYTES``, default 4 MiB): below it a rank needs a large share of
    it anyway and ranged reads would cost more round trips than the bytes they save; above it
    (Llama-3-70B at 16,384 ranks: 8.2 MB; at 131,072: 47 MB, more for larger models) a rank reads
    only the blocks holding its sections."""
    return _env_int("MEGASHARD_S3_INDEX_WHOLE_BYTES", 4 * MiB, 0)


def index_block_bytes() -> int:
    """The unit of ranged index reads (``MEGASHARD_S3_INDEX_BLOCK_BYTES``, default 256 KiB): a rank's
    ~150 sections fall into ~12 such blocks at 16,384 ranks (64 KiB: ~30 GETs; 1 MiB: twice the bytes)."""
    return _env_int("MEGASHARD_S3_INDEX_BLOCK_BYTES", 256 << 10, 1)


class IndexBlocks:
    """Ranged reads of one ``manifest.index`` of ``size`` bytes (already checked against the
    object's real size) in aligned blocks of ``block`` bytes, kept (least recently used first
    out, beyond ``cache_bytes``) so a rank's neighbouring sections share GETs. A miss right after
    the previous one's blocks (a scan: ``verify``, ``inspect``) reads ahead, doubling up to one
    ``MEGASHARD_S3_GET_BYTES``. ``fetch(reqs)``: fill ``(offset, view)`` requests (one call per
    miss, its blocks adjacent). No store here: the simulator counts what a load would fetch."""

    def __init__(self, size: int, fetch: Callable[[List[Tuple[int, memoryview]]], Any], where: str,
                 block: Optional[int] = None, cache_bytes: int = _INDEX_CACHE_BYTES,
                 ahead_bytes: Optional[int] = None) -> None:
        self.size, self.fetch, self.where = size, fetch, where
        self.block = block or index_block_bytes()
        self.cache: "OrderedDict[int, bytes]" = OrderedDict()
        self.cache_blocks = max(1, cache_bytes // self.block)
        self.max_ahead = max(0, (ahead_bytes if ahead_bytes is not None else get_bytes_limit()) // self.block - 1)
        self.ahead = 0
        self.next_block = -1  # the block after the last miss's
        self.fetched = self.gets = 0  # bytes and fetch calls

    def read_into(self, reqs: Sequence[Tuple[int, memoryview]]) -> int:
        for off, mv in reqs:  # before anything is fetched or allocated
            if off < 0 or off + len(mv) > self.size:
                raise CheckpointError(f"{self.where}: byte range {off}+{len(mv)} past its end ({self.size} bytes); "
                                      "the checkpoint is damaged or hostile")
        n = 0
        for off, mv in reqs:
            if not len(mv):
                continue
            first, last = off // self.block, (off + len(mv) - 1) // self.block
            missing = [b for b in range(first, last + 1) if b not in self.cache]
            if missing:
                self._miss(missing[0], missing[-1])
            pos = 0
            for b in range(first, last + 1):
                data = self.cache[b]
                self.cache.move_to_end(b)
                a = off + pos - b * self.block
                take = min(len(mv) - pos, len(data) - a)
                mv[pos:pos + take] = data[a:a + take]
                pos += take
            n += len(mv)
            while len(self.cache) > self.cache_blocks:  # after the copy: never a block this request needs
                self.cache.popitem(last=False)
        return n

    def _miss(self, first: int, last: int) -> None:
        self.ahead = min(max(1, 2 * self.ahead), self.max_ahead) if first == self.next_block else 0
        end, stop = last + 1, min(last + 1 + self.ahead, -(-self.size // self.block))
        while end < stop and end not in self.cache:  # read ahead up to the first block already here
            end += 1
        bufs = [(b, bytearray(min(self.block, self.size - b * self.block))) for b in range(first, end)
                if b not in self.cache]
        self.fetch([(b * self.block, memoryview(buf)) for b, buf in bufs])
        self.gets += 1
        for b, buf in bufs:
            self.fetched += len(buf)
            self.cache[b] = bytes(buf)
        self.next_block = end


def _index_name() -> str:
    from ...manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)

    return INDEX_NAME


def _location(url: str) -> Tuple[ObjectStore, str, str]:
    """(store, key prefix P, the URL as given without a trailing slash) of a checkpoint URL."""
    url = url.rstrip("/")
    parse_url(url)  # a CheckpointError naming it when it is not a usable URL
    store, key = ObjectStore.for_url(url)
    if not key:
        raise CheckpointError(f"{url}: a checkpoint needs a key prefix inside the bucket (s3://bucket/run/iter_0000100)")
    return store, key, url


def check_data_prefix(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _DATA_PREFIX_RE.match(name):
        raise CheckpointError(f"{where}: {HEAD_FIELD} {str(name)[:80]!r} is not a megashard save prefix "
                              f"({DATA_PREFIX}<token>); the manifest is damaged or hostile")
    return name


def _parse_head(data: bytes, where: str) -> Dict[str, Any]:
    from ...manifest import parse_head

    return parse_head(data, where)


# --------------------------------------------------------------------------- saving


class ObjectSave:
    """The save seam of :mod:`megashard.saving` for an object store (see the module docstring)."""

    def __init__(self, url: str, new_only: bool = False) -> None:
        self.url = url.rstrip("/")
        self.new_only = new_only  # commit only where no head is (If-None-Match), never replace
        self.prev_etag: Optional[str] = None
        self.prev_prefix: Optional[str] = None
        self.stale: List[str] = []  # other save prefixes seen while planning
        self.outcome_unknown = False  # the head PUT may have landed: discard nothing

    def _loc(self) -> Tuple[ObjectStore, str]:
        store, key, _ = _location(self.url)
        return store, key

    def validate(self) -> None:
        self._loc()

    def check(self) -> None:
        """Rank 0, before any rank writes: the target is absent or a megashard checkpoint
        (and nothing else is under it); remembers the head's ETag for the conditional commit."""
        store, key = self._loc()
        objects, prefixes = store.list(key + "/", delimiter="/")
        foreign = [o.key[len(key) + 1:] for o in objects if o.key != f"{key}/{MANIFEST_NAME}"]
        foreign += [p[len(key) + 1:] for p in prefixes if not _DATA_PREFIX_RE.match(p[len(key) + 1:].rstrip("/"))]
        if foreign:
            shown = ", ".join(repr(f) for f in sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
            raise CheckpointError(
                f"refusing to save to {self.url}: it holds objects megashard did not write ({shown}); a save "
                "only ever replaces a megashard checkpoint. Save to another prefix, or move them away first")
        self.stale = [p[len(key) + 1:].rstrip("/") for p in prefixes]
        if any(o.key == f"{key}/{MANIFEST_NAME}" for o in objects):
            if self.new_only:
                raise CommitConflictError(f"refusing to save to {self.url}: a checkpoint exists there (new_only: a "
                                          "save never replaces it)")
            data, etag = store.get_bytes(f"{key}/{MANIFEST_NAME}", _max_head())
            doc = _parse_head(data, f"{self.url}/{MANIFEST_NAME}")
            self.prev_prefix = check_data_prefix(doc.get(HEAD_FIELD), f"{self.url}/{MANIFEST_NAME}")
            self.prev_etag = etag

    def create(self, token: str) -> str:
        """Nothing to create on an object store: the save's prefix exists once written to."""
        return self.temp_location(token)

    def temp_location(self, token: str) -> str:
        name = DATA_PREFIX + token
        check_data_prefix(name, self.url)
        return f"{self.url}/{name}"

    def writer(self, token: str) -> Tuple[str, None]:
        return self.temp_location(token), None

    @staticmethod
    def write_file(tensors: Mapping[str, Any], url: str, align: int, fsync: bool, threads: Optional[int],
                   direct: bool = False, sha256: bool = True) -> Tuple[List[Any], int, Dict[str, Any]]:
        """Upload one ``.tensors`` file straight from the tensors (the bytes ``write_file``
        would write; multipart above one part), hashing its tensors (``threads`` hashing
        threads) while the parts clear of their headers are already sent; connections are
        the store's (``MEGASHARD_S3_CONNECTIONS``). Durable once the PUT returns. ``sha256=False``:
        CRC32-only tensor headers (see ``megashard.save``)."""
        from ...format.writer import file_segments_deferred

        size, segments, hashes = file_segments_deferred(tensors, align=align, threads=threads, sha256=sha256)
        try:
            store, key = ObjectStore.for_url(url)
            etag = store.upload(key, size, segments, if_none_match=True, pending=hashes)
        except BaseException:
            hashes.cancel()
            hashes.finish_quietly()
            raise
        return hashes.finish(), size, {"etag": etag}

    @staticmethod
    def write_stream(url: str, name: str, size: int, chunk_bytes: int,
                     chunks: Callable[[int], Iterable[memoryview]]) -> Dict[str, Any]:
        """Upload member ``name`` of ``size`` bytes under :meth:`writer`'s save prefix ``url`` (created
        new: If-None-Match) from ``chunks(n)``, the bytes in order: ``n`` is ``chunk_bytes`` rounded up
        to whole parts (one PUT: one chunk) (``megashard copy``). Returns the file's extra record for
        the index: its ETag."""
        part = part_bytes(size) if size > single_put_bytes() else max(1, size)  # one PUT: one chunk
        chunk = max(part, -(-chunk_bytes // part) * part)  # whole parts per chunk
        store, key = ObjectStore.for_url(child(url, name))
        return {"etag": store.upload_chunks(key, size, chunks(chunk), if_none_match=True)}

    def commit(self, token: str, files: Mapping[int, Mapping[str, Mapping[str, Any]]],
               where: Mapping[int, Any], head: bytes, sections: bytes) -> None:
        """Rank 0: check every reported object, write index and digest under the save's
        prefix, then the head (the commit point) conditionally."""
        store, key = self._loc()
        prefix = f"{key}/{DATA_PREFIX}{token}"
        objects, _ = store.list(prefix + "/")
        found = {o.key[len(prefix) + 1:]: o for o in objects}
        bad: Dict[int, List[str]] = {}
        for r, fs in sorted(files.items()):
            for name, rec in sorted(fs.items()):
                o = found.get(check_object_name(name, self.url))
                if o is None:
                    bad.setdefault(r, []).append(f"{name} (missing, {rec['bytes']} bytes uploaded)")
                elif o.size != rec["bytes"] or (rec.get("etag") and o.etag != rec["etag"]):
                    bad.setdefault(r, []).append(f"{name} ({o.size} bytes, ETag {o.etag}; uploaded {rec['bytes']} "
                                                 f"bytes, ETag {rec.get('etag')})")
        if bad:
            shown = "; ".join(f"rank {r}: {', '.join(v[:5])}" for r, v in sorted(bad.items())[:16])
            raise CheckpointError(f"{self.url}/{DATA_PREFIX}{token}: objects reported by rank(s) "
                                  f"{sorted(bad)[:20]} are not there as uploaded ({shown}); nothing was committed")
        from ...manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)
        index_etag = store.put_bytes(f"{prefix}/{INDEX_NAME}", sections, if_none_match=True)
        doc = json.loads(head)
        doc["index"]["etag"] = index_etag
        doc[HEAD_FIELD] = DATA_PREFIX + token
        head = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        store.put_bytes(f"{prefix}/{DIGEST_NAME}", manifest_digest(head).encode(), if_none_match=True)
        try:
            if self.prev_etag is None:
                store.put_bytes(f"{key}/{MANIFEST_NAME}", head, if_none_match=True)
            else:
                store.put_bytes(f"{key}/{MANIFEST_NAME}", head, if_match=self.prev_etag)
        except CommitConflictError as e:  # answered 412/409, or a retry's 412 and the head is not ours
            self._lost(e)
        except Exception as e:  # noqa: BLE001 - no answer: the PUT may have been applied
            self._settle(store, f"{key}/{MANIFEST_NAME}", head, token, e)
        except BaseException:  # interrupted mid-PUT: it may be the checkpoint now
            self.outcome_unknown = True
            raise
        self.committed = DATA_PREFIX + token

    def _lost(self, e: Exception) -> None:
        if self.new_only:
            raise CommitConflictError(f"{self.url}: a checkpoint appeared there while this save ran (another writer "
                                      f"committed it; new_only: it is never replaced) ({e}); this save is discarded"
                                      ) from None
        raise CommitConflictError(
            f"{self.url}: another save committed this checkpoint after this save was planned ({e}); this "
            "save lost and is discarded, the other save's checkpoint stands untouched") from None

    def _settle(self, store: ObjectStore, head_key: str, head: bytes, token: str, err: Exception) -> None:
        """The head PUT failed without a decisive answer: read the head back. Ours: the save
        succeeded. Another save's (neither ours nor the one this save replaces): ours can never
        apply, the save lost. Otherwise (absent, unchanged, unreadable) a PUT still in flight may
        yet land: keep every object and say so (:class:`CommitOutcomeUnknownError`)."""
        mine = DATA_PREFIX + token
        try:
            info = store.head(head_key)
            if info is not None and info.size == len(head):
                data, _ = store.get_bytes(head_key, info.size, if_match=info.etag)
                if data == head:
                    log.warning("%s: the commit's answer was lost (%s), but the head names this save: committed",
                                self.url, err)
                    return
            if info is not None and info.etag != self.prev_etag:
                self._lost(err)
            seen = "is absent" if info is None else "is still the one this save replaces"
        except CheckpointError as e2:
            if isinstance(e2, CommitConflictError):
                raise
            seen = f"could not be read back ({e2})"
        self.outcome_unknown = True
        raise CommitOutcomeUnknownError(
            f"{self.url}: the outcome of this save's commit is unknown: the conditional PUT of {MANIFEST_NAME} "
            f"failed without a decisive answer ({err}) and the head {seen}; a PUT still in flight may yet land. "
            f"Every object of the save is kept ({self.url}/{mine}/). Check with `megashard verify {self.url}`: "
            f"if it passes and names {mine}, this save is the checkpoint; if not, save again (`megashard recover "
            f"{self.url}` removes a save that never committed once it is a day old)")

    def after_commit(self) -> None:
        """Delete the prefix of the head this commit replaced, then leftovers of dead saves."""
        store, key = self._loc()
        if self.prev_prefix and self.prev_prefix != self.committed:
            _delete_prefix(store, f"{key}/{self.prev_prefix}/")
        cleanup(self.url, keep=self.committed)

    def discard(self, created: str) -> None:
        """A failed save removes its own prefix (objects and unfinished uploads), nothing else;
        never after a commit whose outcome is unknown (the head may name it)."""
        if self.outcome_unknown:
            log.warning("%s: kept %s (the commit's outcome is unknown)", self.url, created)
            return
        store, key = self._loc()
        name = created.rstrip("/").rsplit("/", 1)[-1]
        check_data_prefix(name, created)
        _delete_prefix(store, f"{key}/{name}/")


def _delete_prefix(store: ObjectStore, prefix: str) -> int:
    objects, _ = store.list(prefix)
    store.delete([o.key for o in objects])
    n = len(objects)
    for k, upload_id, _t in store.list_uploads(prefix):
        store.abort_upload(k, upload_id)
        n += 1
    return n


def _save_of_upload(rel: str) -> Optional[str]:
    """The save prefix (relative to the URL cleaned) an upload key belongs to: ``<save>/<file>`` of a
    checkpoint, or ``<child>/<save>/<file>`` of a save root's checkpoint; None for anything else (not
    megashard's: never aborted)."""
    parts = rel.split("/")
    if len(parts) == 2 and _DATA_PREFIX_RE.match(parts[0]):
        return parts[0]
    if len(parts) == 3 and _DATA_PREFIX_RE.match(parts[1]) and parts[0] not in ("", ".", ".."):
        return f"{parts[0]}/{parts[1]}"
    return None


def cleanup(url: str, *, keep: Optional[str] = None, older_than_s: float = DEFAULT_STALE_AGE_S) -> List[str]:
    """Remove what dead saves of checkpoint ``url`` left: save prefixes the head does not
    name whose newest object is older than ``older_than_s``, and multipart uploads of save
    prefixes (``url``'s, or its children's when ``url`` is a save root) started longer ago
    than that, unless their prefix was written to within that time. Uploads outside save
    prefixes are another client's and never touched. Returns the prefixes/uploads removed."""
    store, key, url = _location(url)
    now = time.time()

    def kept(newest: float) -> bool:
        """The clean-up rule of every store (no owner records here; a save prefix is megashard's by its name)."""
        return why_kept(None, lambda: True, lambda: newest, older_than_s, now) is not None

    current = keep
    if current is None:
        info = store.head(f"{key}/{MANIFEST_NAME}")
        if info is not None:
            data, _ = store.get_bytes(f"{key}/{MANIFEST_NAME}", _max_head(), if_match=info.etag)
            current = check_data_prefix(_parse_head(data, f"{url}/{MANIFEST_NAME}").get(HEAD_FIELD),
                                        f"{url}/{MANIFEST_NAME}")
    _, prefixes = store.list(key + "/", delimiter="/")
    removed: List[str] = []
    live = {current}
    for p in prefixes:
        name = p[len(key) + 1:].rstrip("/")
        if not _DATA_PREFIX_RE.match(name) or name == current:
            continue
        objects, _ = store.list(f"{key}/{name}/")
        if objects and kept(max(o.last_modified for o in objects)):
            live.add(name)
            continue  # possibly a save in progress
        store.delete([o.key for o in objects])
        removed.append(f"{url}/{name}/")
    for k, upload_id, started in store.list_uploads(key + "/"):
        save = _save_of_upload(k[len(key) + 1:])
        if save is None or save in live or kept(started):
            continue  # another client's upload, or a save that may still run
        if "/" in save:  # a save of a checkpoint under a save root (iter_N/.megashard-save-*): its own age
            objects, _ = store.list(f"{key}/{save}/")
            if objects and kept(max(o.last_modified for o in objects)):
                live.add(save)
                continue
        store.abort_upload(k, upload_id)
        removed.append(f"{url}: unfinished upload of {k[len(key) + 1:]}")
    for r in removed:
        log.info("removed %s (left by a save that did not finish)", r)
    return removed


# --------------------------------------------------------------------------- reading


class ObjectCheckpointFiles:
    """The read seam (like :class:`megashard.storage.CheckpointFiles`) for a checkpoint in
    an object store. Member names are checked before any request; every data read is a
    ranged GET pinned to the ETag the committed index recorded."""

    passes_descriptors = False
    #: any rank may GET what it needs itself (scatter's non-readers: the bytes only they need)
    every_rank_reads = True
    #: one caller's requests at most this far apart share a GET (the gap is fetched too)
    read_gap_bytes = GAP_BYTES
    #: scatter's ring reader reads every free slot's extent in one call (coalesced, parallel GETs)
    batch_reads = True
    #: ``read_files(..., crcs=)``: each job's CRC32 computed by the GETs as its bytes land
    crc_on_read = True

    def __init__(self, url: str, index: Any = None) -> None:
        self.store, self.key, self.base = _location(url)
        self.index = index
        self._prefix: Optional[str] = getattr(index, "data_prefix", None)
        self._index_etag: Optional[str] = getattr(index, "index_etag", None)
        self._infos: Dict[str, ObjectInfo] = {}
        self._index_bytes: Optional[bytes] = None  # the whole index (fetched whole: small, or a scatter reader's)
        self._index_info: Optional[ObjectInfo] = None  # its HEAD, fetched with the digest (ranged reads)
        self._index_blocks: Optional[IndexBlocks] = None  # ranged reads of a large index

    @staticmethod
    def read_threads() -> int:
        """Parallel GETs one bulk read uses: the store's connections (``MEGASHARD_S3_CONNECTIONS``)."""
        return connections()

    def __enter__(self) -> "ObjectCheckpointFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def _data_prefix(self) -> str:
        if self._prefix is None:
            self.read_manifest_bytes()
        assert self._prefix is not None
        return self._prefix

    def object_key(self, name: str) -> str:
        if name == MANIFEST_NAME:
            return f"{self.key}/{MANIFEST_NAME}"
        check_object_name(name, self.base)
        return f"{self.key}/{self._data_prefix()}/{name}"

    def path(self, name: str) -> str:
        if name == MANIFEST_NAME or self._prefix is None:
            return f"{self.base}/{name}"
        return f"{self.base}/{self._prefix}/{name}"

    def _etag(self, name: str) -> Optional[str]:
        from ...manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)
        if name == INDEX_NAME:
            return self._index_etag
        files = getattr(self.index, "files", None)
        if files is not None and name in files:
            e = files[name].get("etag")
            return e if isinstance(e, str) else None
        return None

    def read_manifest_bytes(self) -> bytes:
        """The head, checked against the digest its save wrote (no listing). A head that names its
        index's ETag and claims at most :func:`index_whole_bytes` has the index fetched whole (pinned
        to that ETag, at most the head's size limit) at the same time as the digest: one round trip
        less for every load. A larger index has its last block fetched then instead (a ranged GET
        pinned to that ETag, whose ``Content-Range`` proves the object's real size equals the head's
        claim: the checks of a HEAD, with bytes every rank reads: the state trees and the file table
        are at the end), and later only the blocks holding the sections a rank reads
        (:meth:`_read_index`); a head without the index's ETag has the index's HEAD fetched instead.
        Nothing fetched beside the digest is used before the digest has matched the head."""
        where = f"{self.base}/{MANIFEST_NAME}"
        data, etag = self.store.get_bytes(f"{self.key}/{MANIFEST_NAME}", _max_head())
        doc = _parse_head(data, where)
        if HEAD_FIELD not in doc:
            raise CheckpointError(
                f"{where} has no {HEAD_FIELD}: a file-system checkpoint copied as plain objects (e.g. `aws s3 cp "
                f"--recursive`), which is not a checkpoint in an object store. Copy the checkpoint directory with "
                f"`megashard copy DIR {self.base}` instead (it writes the save layout and records the ETags)")
        self._prefix = check_data_prefix(doc.get(HEAD_FIELD), where)
        idx = doc.get("index")
        self._index_etag = idx.get("etag") if isinstance(idx, dict) and isinstance(idx.get("etag"), str) else None
        self._index_bytes = self._index_info = self._index_blocks = None
        self._infos.pop(_index_name(), None)
        claimed = idx.get("bytes") if isinstance(idx, dict) else None
        gets: List[Callable[[], Any]] = [lambda: self.store.get_bytes(self.object_key(DIGEST_NAME), 1024)]
        ranged = isinstance(claimed, int) and not isinstance(claimed, bool) and claimed > index_whole_bytes()
        whole = False
        if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed < 0:
            pass  # version 1, or refused when the index is opened
        elif ranged and self._index_etag is not None and claimed <= _max_head():
            gets.append(lambda: self._prefetch_index_tail(claimed))
        elif ranged:
            gets.append(self._prefetch_index_info)
        elif self._index_etag is not None:
            whole = True
        if whole:  # both sent from this thread before either answer is read (no thread to wake)
            got = self.store.get_bytes_many([(self.object_key(DIGEST_NAME), 1024, None),
                                             (self.object_key(_index_name()), _max_head(), self._index_etag)])
            if isinstance(got[0], BaseException):
                raise got[0]
            # the index's error (if any) is :meth:`_read_index`'s to report, after the digest's verdict
            raw, index = got[0][0], [None if isinstance(got[1], BaseException) else got[1][0]]
        else:
            (raw, _), *index = _run_parallel(gets, len(gets))
        if not _DIGEST_RE.fullmatch(raw):
            raise CheckpointError(f"{self.path(DIGEST_NAME)}: not one line of 64 lowercase hex digits; the checkpoint "
                                  "is damaged")
        if hashlib.sha256(data).hexdigest() != raw[:64].decode():
            raise CheckpointError(f"{where}: SHA-256 does not match {self.path(DIGEST_NAME)}: the manifest is damaged "
                                  "(or was replaced while it was read: try again)")
        self.head_etag = etag
        if index and isinstance(index[0], IndexBlocks):
            self._index_blocks = index[0]
        elif index and ranged:
            self._index_info = index[0]
        elif index:
            self._index_bytes = index[0]
        return data

    def _prefetch_index_tail(self, size: int) -> Optional[IndexBlocks]:
        """A block reader of the index with its last block in (its GET pinned to the head's index
        ETag and checked against ``size``), or None (:meth:`_read_index` checks with a HEAD, and says why)."""
        blocks = self._new_index_blocks(size, self._index_etag)
        try:
            blocks.read_into([(size - 1, memoryview(bytearray(1)))])
        except CheckpointError:
            return None
        return blocks

    def _new_index_blocks(self, size: int, etag: Optional[str]) -> IndexBlocks:
        key = self.object_key(_index_name())

        def fetch(got: List[Tuple[int, memoryview]]) -> None:
            self.store.read_many([(key, got, size, etag)])

        return IndexBlocks(size, fetch, self.path(_index_name()))

    def _prefetch_index_info(self) -> Optional[ObjectInfo]:
        """The index's HEAD, or None (:meth:`open` asks again, and says why)."""
        try:
            return self.store.head(self.object_key(_index_name()))
        except CheckpointError:
            return None

    def open(self, name: str, size: Optional[int] = None) -> ObjectInfo:
        """The object's size and ETag (one HEAD, cached), checked against ``size`` and the
        index's ETag: what a file system load checks with ``fstat`` before allocating."""
        info = self._infos.get(name)
        if info is None:
            key = self.object_key(name)
            info = self._index_info if name == _index_name() and self._index_info is not None else self.store.head(key)
            if info is None:
                raise CheckpointError(f"{self.path(name)}: no such object")
            want = self._etag(name)
            if want is not None and info.etag != want:
                raise CheckpointError(f"{self.path(name)}: ETag {info.etag} differs from the index's {want}; the "
                                      "object was replaced after the checkpoint was committed")
            self._infos[name] = info
        if size is not None and info.size != size:
            raise CheckpointError(f"{self.path(name)}: size {info.size} differs from the manifest's {size} bytes; "
                                  "the object is damaged or was replaced")
        return info

    def size(self, name: str) -> int:
        return self.open(name).size

    def read_bytes(self, name: str, limit: int) -> bytes:
        from ...manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)

        if name == INDEX_NAME and self._index_bytes is not None and len(self._index_bytes) <= limit:
            return self._index_bytes  # fetched with the digest (read_manifest_bytes), pinned to the head's ETag
        data, _ = self.store.get_bytes(self.object_key(name), limit, if_match=self._etag(name))
        return data

    @staticmethod
    def file_range(fd: int, offset: int, nbytes: int) -> FileRange:
        """A destination for :meth:`read_files` that is ``nbytes`` of open file ``fd`` at ``offset``
        (scatter's ring slots: written with ``pwrite``, see :class:`FileRange`)."""
        return FileRange(fd, offset, nbytes)

    def read_into(self, name: str, reqs: Sequence[Tuple[int, memoryview]], *, size: Optional[int] = None,
                  threads: Optional[int] = None) -> int:
        """Fill ``(offset, view)`` requests from member ``name``; ``threads`` (the CPU count's
        reader threads) does not apply: the store's connections (``MEGASHARD_S3_CONNECTIONS``) do."""
        return self.read_files([(name, reqs, size)])

    def read_files(self, jobs: Sequence[Tuple[str, Sequence[Tuple[int, memoryview]], Optional[int]]], *,
                   threads: Optional[int] = None, done: Optional[Callable[[int], None]] = None,
                   crcs: Optional[List[Optional[int]]] = None) -> int:
        """:meth:`read_into` of several members ``(name, reqs, size)`` at once: every GET of every
        object in one queue on the store's connections, none idle while bytes remain (jobs of one
        member share GETs where adjacent). ``done(i)``: called as soon as job ``i``'s bytes are all
        in (from a GET's thread; see :meth:`ObjectStore.read_many`). ``crcs`` (one entry per job):
        ``crcs[i]`` set before ``done(i)`` to the CRC32 of job ``i``'s bytes (its requests in order),
        computed as they land (:meth:`ObjectStore.read_many`); None for the index's."""
        from ...manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)

        n = 0
        jobs_s3 = []
        where: List[int] = []  # jobs_s3's positions in jobs
        for i, (name, reqs, size) in enumerate(jobs):
            if name == INDEX_NAME:
                n += self._read_index(reqs, size)  # no requests: the check on open (size against the head)
            elif reqs:  # none: nothing to check here, every GET checks size (Content-Range) and ETag itself
                if size is None:
                    size = self.open(name).size
                jobs_s3.append((self.object_key(name), reqs, size, self._etag(name)))
                where.append(i)
                continue
            elif crcs is not None:
                crcs[i] = 0  # the CRC32 of no bytes
            if done is not None:
                done(i)
        sub: Optional[List[Optional[int]]] = None if crcs is None else [None] * len(jobs_s3)

        def finished(j: int) -> None:
            if crcs is not None and sub is not None:
                crcs[where[j]] = sub[j]
            if done is not None:
                done(where[j])

        track = done is not None or crcs is not None
        return n + self.store.read_many(jobs_s3, done=finished if track else None, crcs=sub)

    def _read_index(self, reqs: Sequence[Tuple[int, memoryview]], size: Optional[int]) -> int:
        """The index's sections are small and many. An index of at most :func:`index_whole_bytes`
        (or one read without its size): the whole index in one GET, once. A larger one: its blocks
        holding the sections asked for (:class:`IndexBlocks`), each GET pinned to the head's index
        ETag (or, where the head has none, to the one its HEAD saw) and checked against its size
        (the last block came with the digest, :meth:`read_manifest_bytes`; without it, a HEAD first).
        Checked on the first call, even one without requests (the index is opened that way,
        :class:`megashard.index._IndexFile`): its size against the head's ``size``, before any
        section's length, which the head claims, sizes a buffer."""
        from ...manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)

        if self._index_bytes is None and size is not None and size > index_whole_bytes():
            return self._read_index_ranged(reqs, size)
        if self._index_bytes is None and (reqs or size is not None):
            limit = _max_head() if size is None else min(size, _max_head())
            try:
                data = self.read_bytes(INDEX_NAME, limit)
            except ObjectTooLargeError:
                if size is None:
                    raise
                raise CheckpointError(f"{self.path(INDEX_NAME)}: larger than the {size} bytes the manifest says "
                                      f"(or than MEGASHARD_MAX_MANIFEST_BYTES={_max_head()}); the checkpoint is "
                                      "damaged or hostile") from None
            if size is not None and len(data) != size:
                raise CheckpointError(f"{self.path(INDEX_NAME)}: {len(data)} bytes, the manifest says {size}; "
                                      "the checkpoint is damaged or hostile")
            self._index_bytes = data
        if size is not None and self._index_bytes is not None and len(self._index_bytes) != size:
            # also when it came with the digest: checked on open, before a section's claimed length sizes a buffer
            raise CheckpointError(f"{self.path(INDEX_NAME)}: {len(self._index_bytes)} bytes, the manifest says {size}; "
                                  "the checkpoint is damaged or hostile")
        if not reqs:
            return 0
        data, n = self._index_bytes, 0
        for off, mv in reqs:
            if off < 0 or off + len(mv) > len(data):
                raise CheckpointError(f"{self.path(INDEX_NAME)}: byte range {off}+{len(mv)} past its end")
            mv[:] = data[off:off + len(mv)]
            n += len(mv)
        return n

    def _read_index_ranged(self, reqs: Sequence[Tuple[int, memoryview]], size: int) -> int:
        name = _index_name()
        if self._index_blocks is None or self._index_blocks.size != size:
            if size > _max_head():
                raise CheckpointError(f"{self.path(name)}: the manifest claims {size} bytes, more than "
                                      f"MEGASHARD_MAX_MANIFEST_BYTES={_max_head()}; the checkpoint is damaged or hostile")
            info = self.open(name, size)  # real size and ETag (a HEAD), before any buffer
            self._index_blocks = self._new_index_blocks(size, self._index_etag or info.etag)
        return self._index_blocks.read_into(reqs)

    def tensor_reader(self, name: str) -> Any:
        """A :class:`~megashard.format.TensorFileReader` of a copy of the whole object in an
        anonymous memory file (what checking every hash needs; one object at a time)."""
        import os

        from ...format import TensorFileReader
        from ...format.fastio import tensor_memoryview

        size = self.open(name).size
        fd = os.memfd_create(f"megashard-{name}"[:200], os.MFD_CLOEXEC)
        try:
            if size:
                import torch

                os.ftruncate(fd, size)
                buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
                self.read_into(name, [(0, tensor_memoryview(buf))], size=size)
                del buf
            return TensorFileReader(f"/proc/self/fd/{fd}", shown=self.path(name))
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- the store's interface
# (megashard.storage.base.Store: megashard.storage calls these for s3:// and msc:// locations)


def location(path: PathLike) -> str:
    """The URL checked (a CheckpointError naming the rule it breaks), without a trailing slash."""
    url = str(path)
    parse_url(url)
    return url.rstrip("/")


def locate(url: PathLike) -> Optional[str]:
    """``url`` when a committed head is there (one HEAD), else None."""
    store, key, url = _location(str(url))
    return url if store.head(f"{key}/{MANIFEST_NAME}") is not None else None


def is_checkpoint(url: PathLike) -> bool:
    return locate(url) is not None


def checkpoint_location(url: PathLike) -> str:
    found = locate(location(url))
    if found is None:
        raise CheckpointError(f"{url} is not a megashard checkpoint ({why_not_checkpoint(url)})")
    return found


def why_not_checkpoint(url: PathLike) -> str:
    try:
        with ObjectCheckpointFiles(str(url)) as f:
            f.read_manifest_bytes()
    except CheckpointError as e:
        return str(e)
    return f"{url} is a checkpoint"


def recover(url: PathLike, older_than_s: float, into: Recovery) -> Optional[str]:
    """No rename to undo on an object store: remove what dead saves left (:func:`cleanup`)."""
    loc = location(url)
    for gone in cleanup(loc, older_than_s=older_than_s):
        log.warning("removed %s", gone)
        into.removed.append(gone)
    return locate(loc)


def save_target(url: PathLike, new_only: bool = False) -> ObjectSave:
    return ObjectSave(str(url), new_only)


def checkpoint_files(url: PathLike, index: Any = None) -> ObjectCheckpointFiles:
    """``index``: the checkpoint's index, whose ETags pin every read."""
    return ObjectCheckpointFiles(str(url), index)


def occupied(url: PathLike) -> bool:
    """Anything at or under ``url``: an object named like it, or any key below it (one HEAD, one LIST)."""
    store, key, _ = _location(str(url))
    if store.head(key) is not None:
        return True
    objects, prefixes = store.list(key + "/", delimiter="/")
    return bool(objects or prefixes)


def foreign_format(url: PathLike) -> Optional[str]:
    """``"torch_dist"`` when a ``metadata.json`` is directly under ``url`` (one HEAD; by name only,
    unlike the file system's, which reads it), else None. A Hugging Face directory is not looked for."""
    store, key, _ = _location(str(url))
    return "torch_dist" if store.head(f"{key}/metadata.json") is not None else None


def iteration_names(root: str, kinds: Sequence[str] = ("old",)) -> List[str]:
    """The ``iter_N`` / ``release`` names directly under ``root`` that hold objects, sorted (one LIST;
    ``kinds`` does not apply: an object store has no renamed-aside copies)."""
    store, key, _ = _location(root)
    _, prefixes = store.list(key + "/", delimiter="/")
    return sorted(n for n in (p[len(key) + 1:].rstrip("/") for p in prefixes) if parse_iteration_dir_name(n) is not None)


def write_tracker(root: PathLike, text: str, new_only: bool = False) -> None:
    """``new_only``: only where there is none yet (If-None-Match), else CommitConflictError."""
    store, key, _ = _location(str(root))
    store.put_bytes(f"{key}/{TRACKER_NAME}", text.encode(), if_none_match=new_only)


def read_tracker(root: PathLike) -> Optional[Union[int, str]]:
    store, key, url = _location(str(root))
    if store.head(f"{key}/{TRACKER_NAME}") is None:
        return None
    data, _ = store.get_bytes(f"{key}/{TRACKER_NAME}", TRACKER_MAX + 1)
    return parse_tracker(data, f"{url}/{TRACKER_NAME}")


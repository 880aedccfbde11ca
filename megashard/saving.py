"""``save``: every rank writes its own shards; a coordinator plans and commits.

Collectives per save, whatever the world size (none per tensor):
  1. *plan*: every rank sends its announcement (shards, objects, state-tree parts) to its
     gather group's leader, which condenses the group's (:class:`megashard.plan.PlanLead`);
     rank 0 validates the whole from the groups' parts (:func:`megashard.plan.plan_groups`)
     and each rank receives only its own writer assignment. A save whose layout equals the previous
     save's on every rank reuses that plan instead (one all-reduce of four integers, then
     rank 0 broadcasts the save's token; see :func:`plan_vote`);
  2. every rank writes its files into a shared temporary directory and fsyncs them;
  3. *commit*: every rank sends rank 0 the records of what it wrote; rank 0 checks that
     every reported file is in the directory with its size, writes the index
     (:mod:`megashard.index`) and commits by rename; every rank learns the outcome. After a
     reused plan whose records changed only in their CRC32s, ranks send those CRC32s (and what
     else changed since their last commit) and rank 0 writes them after the previous index's
     skeleton (see :func:`_finish_save`).
A rank receives O(its own metadata). Above 64 ranks both gathers go through groups of
~sqrt(world) ranks whose leaders send rank 0 one compressed part each
(:meth:`megashard.transport.Comm.coordinate`), so no process receives a message from every
rank. A failure anywhere raises on every rank.

Where a save writes (:mod:`megashard.storage`): the target must be absent, an empty
directory or a megashard checkpoint holding only megashard's files (rank 0 checks while
planning, so a refused save writes nothing anywhere). Rank 0 creates the temporary
directory; the other ranks must find it, so ranks whose path is another directory (node-
local disks, another mount, a relative path with per-rank working directories) make the
save fail on every rank: saving needs one directory every rank shares. A failed save
removes its temporary directory; a commit removes the abandoned ones of dead saves beside it.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from . import async_save as async_save_mod, jsonstate, plan, storage
from .errors import (CheckpointError, DistributedError, NoSpaceError, StateDictError, distributed_error,
                     no_space_error)
from .format import write_file
from .logs import log_summary, rank_prefix
from .manifest import (MANIFEST_FORMAT, MANIFEST_VERSION, TREE_WHOLE, IndexBuilder, IndexSkeleton, check_crc, dtype_name,
                       NamedTexts, group_records, itemsize, named_texts, record_text, shard_name)
from .sharded import (ShardedTensor, check_data, is_main_replica, looks_like_sharded_object,
                      looks_like_sharded_tensor, object_unique_key, reject_unapplied)
from .transport import SOLO, Comm, gather_group_size, gc_paused

log = logging.getLogger(__name__)

MODEL_CHUNK_PREFIX = "model"
REST_STEM = "__rest__"
BYTES_IN_FILE_THRESHOLD = 64 * 1024  # larger bytes values go into .tensors files, not JSON
# A ShardedObject whose JSON is larger goes into its writer's file, the index keeping a reference: per-rank objects
# (Megatron's RNG state under expert parallelism, ~20 KB each) would otherwise pass through rank 0 and sit in the index.
OBJECT_IN_FILE_THRESHOLD = 2048
SHA256_ENV = "MEGASHARD_SHA256"
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def sha256_default() -> bool:
    """Whether a save computes and stores tensorizer's per-tensor SHA-256 when ``save`` is not
    told (``sha256=None``): ``MEGASHARD_SHA256`` (``0``/``false``/``no``/``off`` to leave it
    out, ``1``/``true``/``yes``/``on`` or unset to keep it; default on)."""
    raw = os.environ.get(SHA256_ENV, "").strip().lower()
    if raw in ("",) + _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise CheckpointError(f"{SHA256_ENV}={os.environ[SHA256_ENV]!r} is not a yes/no value; set it to 0 (CRC32-only "
                          "tensor headers) or 1 (CRC32 and SHA-256, the default), or unset it")


@dataclass
class _LocalTensor:
    name: str
    tensor: torch.Tensor
    stem: str
    ref: Dict[str, Any]  # JSON ref dict patched with file/offsets after writing
    path: str = ""


@dataclass
class _SaveState:
    rank: int
    shards: List[Tuple[str, ShardedTensor, str]] = field(default_factory=list)  # (path, shard, stem)
    objects: List[Tuple[str, Any, str]] = field(default_factory=list)  # (path, sharded object, stem)
    local: List[_LocalTensor] = field(default_factory=list)
    obj_local: Dict[str, List[_LocalTensor]] = field(default_factory=dict)
    tree: Any = None
    tree_parts: List[Tuple[str, str]] = field(default_factory=list)
    parts: Dict[str, Any] = field(default_factory=dict)  # part id -> encoded value
    order: List[int] = field(default_factory=list)  # announcement position -> index into shards


def _stem_for(path: str, file_stems: Optional[Mapping[str, str]]) -> str:
    top = path.split(".", 1)[0].split("[", 1)[0]
    if file_stems and top in file_stems:
        return file_stems[top]
    if top.startswith(MODEL_CHUNK_PREFIX) and (top == MODEL_CHUNK_PREFIX or top[len(MODEL_CHUNK_PREFIX):].isdigit()):
        return top
    return (file_stems or {}).get(REST_STEM, "state")


def _shard_name(sh: ShardedTensor) -> str:
    return shard_name(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.chunk_shape), sh.flat_range)


# Names inside a file that megashard gives rank-local tensors and ShardedObject contents;
# a global key may not start with them (its tensor would share a name with one of those).
_RESERVED_PREFIX = re.compile(r"__rank\d+__/|__object__/")


def check_key(key: str, path: str) -> None:
    """Refuse a global key that starts with a prefix reserved for megashard's own names."""
    m = _RESERVED_PREFIX.match(key) if isinstance(key, str) else None
    if m is not None:
        raise StateDictError(f"cannot save {path!r}: ShardedTensor key {key!r} starts with {m.group()!r}, which is "
                             "reserved for megashard's names of rank-local tensors and ShardedObject contents "
                             "inside files; rename the key")


def _tensor_ref(t: torch.Tensor) -> Dict[str, Any]:
    return {"kind": "tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def _make_save_hook(st: _SaveState, file_stems: Optional[Mapping[str, str]]) -> Callable[[str, Any], Any]:
    def hook(path: str, value: Any) -> Any:
        reject_unapplied(path, value)
        if looks_like_sharded_tensor(value):
            sh = ShardedTensor.from_any(value)
            if sh.data is None:
                raise StateDictError(f"cannot save {path!r}: ShardedTensor {sh.key!r} has no data")
            check_data(sh, path)
            check_key(sh.key, path)
            st.shards.append((path, sh, _stem_for(path, file_stems)))
            return {"kind": "sharded", "key": sh.key}
        if looks_like_sharded_object(value):
            st.objects.append((path, value, _stem_for(path, file_stems)))
            # the global key, as for a ShardedTensor: a load takes the object from its template, so a per-rank
            # object (its offset differs on every rank) leaves the ranks' state trees equal (stored once)
            return {"kind": "object", "key": value.key}
        if isinstance(value, torch.Tensor):
            ref = _tensor_ref(value)
            st.local.append(_LocalTensor(f"__rank{st.rank}__/{path}", value, _stem_for(path, file_stems), ref, path))
            return ref
        if isinstance(value, (bytes, bytearray)) and len(value) > BYTES_IN_FILE_THRESHOLD:
            t = torch.frombuffer(bytearray(value), dtype=torch.uint8)
            ref = _tensor_ref(t)
            ref["kind"] = "bytes"
            st.local.append(_LocalTensor(f"__rank{st.rank}__/{path}", t, _stem_for(path, file_stems), ref, path))
            return ref
        return jsonstate.UNHANDLED

    return hook


def _encode_object_value(st: _SaveState, ukey: str, value: Any, stem: str) -> Any:
    items: List[_LocalTensor] = st.obj_local.setdefault(ukey, [])

    def hook(path: str, v: Any) -> Any:
        reject_unapplied(path, v)
        if isinstance(v, torch.Tensor) or (isinstance(v, (bytes, bytearray)) and len(v) > BYTES_IN_FILE_THRESHOLD):
            t = v if isinstance(v, torch.Tensor) else torch.frombuffer(bytearray(v), dtype=torch.uint8)
            ref = _tensor_ref(t)
            if not isinstance(v, torch.Tensor):
                ref["kind"] = "bytes"
            items.append(_LocalTensor(f"__object__/{ukey}/{len(items)}", t, stem, ref))
            return ref
        return jsonstate.UNHANDLED

    return jsonstate.encode(value, path=ukey, hook=hook)


_object_capacity: Dict[str, int] = {}  # unique key -> bytes its JSON was padded to at this process's last save


def _object_in_file(st: _SaveState, ukey: str, encoded: Any, stem: str) -> Any:
    """``encoded`` itself, or a reference to its JSON text stored as a uint8 tensor in this rank's
    file when that text is over :data:`OBJECT_IN_FILE_THRESHOLD` and refers to nothing else (an
    object holding tensors keeps its value in the index: loads resolve one level of references).

    The text is padded with spaces to a capacity kept from this process's last save of the object
    (while the text fits in it and fills half of it), and the reference holds no CRC32 (the
    tensor's header in the file holds it): an RNG state changes at every save, its reference does
    not, so a steady-state save (the plan cache) sends and lays out no object again."""
    if st.obj_local.get(ukey):
        return encoded
    text = _dumps(encoded).encode()
    n = len(text)
    if n <= OBJECT_IN_FILE_THRESHOLD:
        return encoded
    cap = _object_capacity.get(ukey, 0)
    if not n <= cap <= 2 * n:
        cap = -(-(n + n // 8) // 4096) * 4096  # room for the value to grow a little between saves
    _object_capacity[ukey] = cap
    t = torch.full((cap,), ord(" "), dtype=torch.uint8)
    t[:n] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    ref = _tensor_ref(t)
    ref["kind"] = "json"
    st.obj_local[ukey] = [_LocalTensor(f"__object__/{ukey}", t, stem, ref)]
    return {jsonstate.TAG: "ref", "ref": ref}


def _shard_meta(sh: ShardedTensor) -> List[Any]:
    flat = list(sh.flat_range) if sh.flat_range is not None else None
    n = sh.data.numel() if sh.data is not None else 0
    return [sh.key, dtype_name(sh.dtype), list(sh.global_shape), list(sh.global_offset), list(sh.chunk_shape),
            flat, n * itemsize(sh.dtype)]


def _tree_parts(st: _SaveState, rank: int) -> List[Tuple[str, str]]:
    """The state tree as (top-level key, part id) pairs: parts identical on many ranks
    (Megatron's args, iteration, ...) get the same id and are sent and stored once;
    parts holding this rank's own tensors are this rank's alone."""
    tree = st.tree
    local_tops = _path_prefixes(lt.path for lt in st.local)
    if isinstance(tree, dict) and jsonstate.TAG not in tree and TREE_WHOLE not in tree:
        items = list(tree.items())
    else:
        items, local_tops = [(TREE_WHOLE, tree)], {TREE_WHOLE} if st.local else set()
    out = []
    for k, v in items:
        if k in local_tops:
            pid = f"rank{rank}/{k}"
        else:
            pid = hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
        st.parts[pid] = v
        out.append((k, pid))
    return out


def _path_prefixes(paths: Iterable[str]) -> Set[str]:
    """Every prefix of these state paths that ends where a key or index does (``a.b[0].c``:
    ``a``, ``a.b``, ``a.b[0]``, itself). A top-level key may hold dots itself
    (``layer.0.weight``), so its tensors' paths cannot be cut back to it at the first dot: a key
    in this set may hold one of these paths (a key that merely looks like a prefix is taken as
    this rank's own too, which costs only sharing)."""
    out: Set[str] = set()
    for p in paths:
        out.add(p)
        out.update(p[:i] for i, ch in enumerate(p) if ch in ".[")
    return out


def announce(st: _SaveState, rank: int) -> Dict[str, Any]:
    """This rank's announcement for the coordinator (see :func:`megashard.plan.announcement`)."""
    msg, st.order = plan.announcement(
        [_shard_meta(sh) for _, sh, _ in st.shards], [is_main_replica(sh.replica_id) for _, sh, _ in st.shards],
        [object_unique_key(o) for _, o, _ in st.objects], [is_main_replica(o.replica_id) for _, o, _ in st.objects],
        st.tree_parts)
    return msg


@dataclass
class _Coordinator:
    """What rank 0 keeps between planning and commit."""

    tensors: Dict[str, Tuple[str, Tuple[int, ...]]] = field(default_factory=dict)
    temp_dir: Optional[str] = None  # created by this save (rank 0): removed if the save fails
    target: Any = None  # the storage seam (storage.save_target), on rank 0


def coordinate(messages: List[Dict[str, Any]], token: str, keep: Optional[_Coordinator] = None) -> List[Dict[str, Any]]:
    """Rank 0: validate and assign (a StateDictError names every inconsistency)."""
    plan_id = secrets.randbits(62)  # names this plan in later saves' votes (plan_vote)
    with gc_paused():  # the replies too: a collection there rescans the whole plan (0.3 s at 16,384 ranks)
        try:
            assignment = plan.coordinate_save(messages)
        except ValueError as e:
            raise StateDictError(str(e)) from None
        if keep is not None:
            keep.tensors = assignment.tensors
        replies = assignment.replies
        for r in replies:
            r["token"] = token
            r["plan"] = plan_id
        return replies


class _SaveLead(plan.PlanLead):
    """A gather group leader's share of the plan (:class:`megashard.plan.PlanLead`); its
    refusals are the StateDictErrors rank 0's are."""

    def reduce(self, payloads: List[Any]) -> Dict[str, Any]:
        try:
            return super().reduce(payloads)
        except ValueError as e:
            raise StateDictError(str(e)) from None


def coordinate_parts(parts: List[Dict[str, Any]], token: str, keep: Optional[_Coordinator] = None) -> List[Dict[str, Any]]:
    """Rank 0: validate and assign from the gather groups' parts (:class:`_SaveLead`), one reply
    per group (a StateDictError names every inconsistency)."""
    plan_id = secrets.randbits(62)  # names this plan in later saves' votes (plan_vote)
    with gc_paused():
        try:
            replies, tensors, _owner = plan.plan_groups(parts)
        except ValueError as e:
            raise StateDictError(str(e)) from None
        if keep is not None:
            keep.tensors = tensors
        for r in replies:
            r["extra"] = {"token": token, "plan": plan_id}
        return replies


# ---------------------------------------------------------------------------
# the plan cache: a save whose announcement equals the previous save's on every rank reuses
# that save's plan (writer assignment, and on rank 0 the index's tensor table) after one
# all-reduce of four integers instead of gathering every announcement on rank 0.
#
# Kept in each process's memory only (never on disk: nothing to trust or clean up); a new
# job starts empty. A rank may reuse its entry when its announcement's layout (shards with
# dtype, global shape, offsets, flat ranges and replica flags, objects, state-tree keys) has
# the digest it had; the all-reduce then checks that every rank may, that every rank holds
# the same plan, and that the state-tree blobs (whose content, e.g. the iteration, changes
# from save to save) still group as they did, so that each blob's uploader still holds what
# every rank sharing it holds. The last two are sums of hashes modulo two 31-bit primes that
# are zero when all is as planned (and, otherwise, zero with probability about 2**-62).

_LANES = (2147483647, 2147483629)  # primes


@dataclass
class PlanEntry:
    """What one rank keeps of the last plan it took part in."""

    plan_id: int
    digest: str  # plan_digest of this rank's announcement
    write: List[int]
    objects: List[int]
    owners: List[int]  # uploader rank of each of this rank's state-tree blob entries
    lead: List[Tuple[int, int]]  # (entry, entries sharing it on all ranks) of the blobs this rank uploads
    tensors: Dict[str, Tuple[str, Tuple[int, ...]]]  # rank 0: the index's tensor table; else empty
    records: Optional[str] = None  # records_digest of this rank's last committed write records
    meta: Optional[Dict[str, str]] = None  # meta_digests of this rank's last committed commit message
    skeleton: Optional[IndexSkeleton] = None  # rank 0: the last committed index's skeleton
    steady_commits: int = 0  # commits that reused the skeleton (ranks sent CRC32s only)


_PLAN_CACHE: Dict[Tuple[int, int], PlanEntry] = {}  # (world size, rank) -> the last plan


def plan_digest(msg: Mapping[str, Any]) -> str:
    """The layout an announcement describes, without the content hashes of shared state-tree
    parts (they change every save; :func:`plan_vote` checks how they group)."""
    layout = [msg["fixed"], msg["flat"], msg["main"], msg["objects"], msg["objects_main"],
              [[k, pid if pid.startswith("rank") else ""] for k, pid, *_ in msg["blobs"]]]
    return hashlib.sha256(_dumps(layout).encode()).hexdigest()


def remember_plan(msg: Mapping[str, Any], reply: Mapping[str, Any],
                  tensors: Optional[Mapping[str, Tuple[str, Tuple[int, ...]]]] = None) -> PlanEntry:
    """The cache entry of a plan this rank received (rank 0 also keeps ``tensors``)."""
    return PlanEntry(int(reply["plan"]), plan_digest(msg), list(reply["write"]), list(reply["objects"]),
                     [int(o) for o in reply["blob_owners"]], [(int(j), int(n)) for j, n in reply["blob_lead"]],
                     dict(tensors or {}))


def _lane_hash(*parts: Any) -> Tuple[int, int]:
    d = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(d[:8], "little") % _LANES[0], int.from_bytes(d[8:16], "little") % _LANES[1]


def plan_vote(entry: Optional[PlanEntry], msg: Mapping[str, Any], rank: int, world: int) -> List[int]:
    """This rank's part of the all-reduce (sum): ``[misses, lane, lane]``. Summed over the
    ranks, the plan may be reused when :func:`plan_agreed` holds: no rank missed, every rank
    names rank 0's plan id, and each blob's entries all hash like their uploader's."""
    if entry is None or entry.digest != plan_digest(msg) or len(entry.owners) != len(msg["blobs"]):
        return [1, 0, 0]
    v = [0, 0]

    def add(h: Tuple[int, int], times: int) -> None:
        v[0] = (v[0] + times * h[0]) % _LANES[0]
        v[1] = (v[1] + times * h[1]) % _LANES[1]

    add(_lane_hash("plan", entry.plan_id), 1 - world if rank == 0 else 1)  # zero iff every rank has rank 0's id
    pids = [b[1] for b in msg["blobs"]]
    for j, o in enumerate(entry.owners):  # zero iff every entry holds what its uploader holds
        add(_lane_hash(entry.plan_id, o, pids[j]), -1)
    for j, n in entry.lead:
        add(_lane_hash(entry.plan_id, rank, pids[j]), n)
    return [0] + v


def plan_agreed(total: Sequence[int]) -> bool:
    """Whether the summed :func:`plan_vote` lets every rank reuse its plan."""
    return total[0] == 0 and total[1] % _LANES[0] == 0 and total[2] % _LANES[1] == 0


def cached_reply(entry: PlanEntry, msg: Mapping[str, Any]) -> Dict[str, Any]:
    """The reply this rank's plan gives for this save: its writes, and the blobs it uploads
    (their current content hashes)."""
    pids = [b[1] for b in msg["blobs"]]
    return {"write": entry.write, "objects": entry.objects, "blobs": list(dict.fromkeys(pids[j] for j, _n in entry.lead))}


def _reuse_plan(comm: Comm, msg: Any, err: Optional[str], keep: _Coordinator, target: Any,
                token: str) -> Optional[Dict[str, Any]]:
    """Collective: this save's reply from the cached plan, or None (every rank alike) when
    any rank failed to prepare or cannot reuse it; then the full plan runs, which also
    reports the failures."""
    key = (comm.world_size, comm.rank)
    entry = _PLAN_CACHE.get(key) if err is None else None
    vote = plan_vote(entry, msg, comm.rank, comm.world_size) if entry is not None else [1, 0, 0]
    try:
        total = comm.all_reduce([1 if err else 0] + vote, "sum")
    except DistributedError as e:
        raise comm._with_own(e, err, "save") from None
    if total[0] or not plan_agreed(total[1:]) or entry is None:
        _PLAN_CACHE.pop(key, None)
        return None

    def start() -> Dict[str, Any]:  # rank 0: what plan_save does besides planning
        target.check()
        keep.tensors = entry.tensors
        keep.temp_dir = target.create(token)
        return {"token": token}

    with _discard_on_failure(keep):
        out: Any = None
        if comm.rank == 0:
            got, e = comm.run("save", start)
            out = got if e is None else {"failures": {"0": e}}
        try:
            out = comm.broadcast_json(out, 0)
        except DistributedError as e:
            raise comm._with_own(e, None, "save") from None
        if "failures" in out:
            raise distributed_error({int(r): m for r, m in out["failures"].items()}, "save")
    log.debug("%ssave reuses plan %x", rank_prefix(comm), entry.plan_id)
    return dict(cached_reply(entry, msg), token=out["token"])


def _finish_save(comm: Comm, err: Optional[str], result: Any, *, keep: _Coordinator, target: Any, token: str,
                 final_dir: str, layout: Optional[Mapping[str, Any]], t0: float, fsync: bool,
                 is_async: bool = False, entry: Optional[PlanEntry] = None, reused: bool = False) -> None:
    """Gather every rank's records on rank 0, which checks them against the storage,
    writes the index and commits; every rank learns the outcome.

    A save that reused its plan first votes (one all-reduce): when every rank's records equal
    its previous commit's but for their CRC32s, and rank 0 holds that commit's index skeleton,
    ranks send their CRC32s instead of their records, and of their files, objects and state-tree
    parts only those that differ from their last commit's (:func:`steady_commit`); rank 0 writes
    the skeleton (:class:`~megashard.manifest.IndexSkeleton`: chunk sections and tensor table,
    byte for byte) and the CRC32 region after it instead of building the index afresh, and the
    rest of the last index again when no rank sent anything else."""
    digest = records_digest(result["records"]) if err is None and result is not None else None
    meta = meta_digests(result) if digest is not None else None
    steady = False
    if reused and entry is not None:
        same = digest is not None and digest == entry.records and (comm.rank != 0 or entry.skeleton is not None)
        try:
            steady = comm.all_reduce([0 if same else 1], "max")[0] == 0
        except DistributedError as e:
            raise comm._with_own(e, err, "save") from None
    built: List[Optional[IndexSkeleton]] = [None]

    def commit(results: List[Dict[str, Any]]) -> List[Any]:
        """Steady: every rank's message; else the gather groups' commit parts (:func:`commit_part`)."""
        if steady:
            head, sections, built[0] = build_index(results, keep.tensors, comm.world_size, layout,
                                                   entry.skeleton if entry is not None else None)
            where = [res.get("where") for res in results]
            files = [res.get("files") for res in results]
        else:  # the groups' parts, decoded one at a time as the index is laid out from them
            seen: Dict[str, List[Any]] = {"where": [], "files": []}
            head, sections, built[0] = build_index_from_parts(results, keep.tensors, comm.world_size, layout, seen)
            where, files = seen["where"], seen["files"]
        if steady and built[0] is not None and built[0].meta:  # its ranks may leave out what they sent last
            files = built[0].meta["files"].by_rank()  # time: the skeleton keeps it
        target.commit(token, dict(enumerate(files)), dict(enumerate(where)), head, sections)
        keep.temp_dir = None  # committed: it is the checkpoint now
        try:
            target.after_commit()
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; clean-up is best effort
            log.warning("%scould not remove leftovers of earlier saves: %s", rank_prefix(comm), e)
        total = sum(f["bytes"] for fs in files for f in fs.values())
        return [total] * (len(results) if steady else len(range(0, comm.world_size, gather_group_size(comm.world_size))))

    payload = steady_commit(result, entry.meta if entry is not None else None) if steady else result
    if entry is not None:
        entry.records = entry.meta = None  # set again once this commit succeeds
    with _discard_on_failure(keep):
        total = comm.coordinate("save", err, payload, commit, None if steady else _CommitLead())
    if entry is not None:
        entry.records, entry.meta = digest, meta
        entry.skeleton = built[0]
        entry.steady_commits += steady
    log_summary(log, comm, "saved", final_dir, total, time.perf_counter() - t0,
                f"{'async, ' if is_async else ''}{comm.world_size} rank(s), fsync={fsync}")


@contextlib.contextmanager
def _discard_on_failure(keep: _Coordinator) -> Any:
    """Rank 0: a save that fails removes the temporary directory it created (and nothing else)."""
    try:
        yield
    except BaseException:
        tmp, keep.temp_dir = keep.temp_dir, None
        if tmp is not None:
            try:
                keep.target.discard(tmp)
            except Exception as e:  # noqa: BLE001 - the save's own error is what the caller needs
                log.warning("could not remove %s of the failed save: %s", tmp, e)
        raise


def save(
    state_dict: Mapping[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: Any = None,
    file_stems: Optional[Mapping[str, str]] = None,
    layout: Optional[Mapping[str, Any]] = None,
    align: int = 4096,
    fsync: bool = True,
    threads: Optional[int] = None,
    timeout: Optional[float] = None,
    async_save: bool = False,
    direct_io: bool = False,
    new_only: bool = False,
    sha256: Optional[bool] = None,
) -> Optional["async_save_mod.AsyncSaveHandle"]:
    """Save a (sharded) state dict to ``checkpoint_dir``; collective: every rank of
    ``process_group`` calls it with its own ``state_dict``.

    ``state_dict``: a nested dict whose leaves are ``ShardedTensor`` (megashard's or
    megatron-core's: this rank's part of a global tensor; :func:`megashard.sharded_state_dict`
    builds them from a model), megatron-core ``ShardedObject``, plain tensors (rank-local: loaded
    back by the same rank), JSON-representable values and bytes. Anything else raises
    ``StateDictError`` naming its key path, before anything is written.
    ``checkpoint_dir``: a directory (created; it must not exist, or hold a megashard
    checkpoint or nothing: anything else is refused) or an ``s3://`` URL. It appears
    atomically once every rank's files are durable.
    ``process_group``: the ranks that save together (default: the world; none: one process;
    ``megashard.transport.SOLO``: this process alone inside a job).
    ``file_stems``: ``{top-level key: file stem}``, which ``.tensors`` file each top-level
    entry's tensors go to (each rank writes its own ``STEM-rNNNNN.tensors``); default: entries
    named ``model`` or ``modelN`` each their own stem, everything else ``state``.
    ``layout``: JSON values recorded in the manifest (e.g. ``{"tp": 2, "pp": 1}``), shown by
    ``megashard inspect``.
    ``align``: byte alignment of every tensor's data in the files (4096; 1 gives tensorizer's
    own bytes).
    ``fsync``: make every file durable before the commit (off only for scratch data).
    ``threads``: writer threads per rank (default: from the CPU count).
    ``timeout``: seconds that bound every collective; default: the process group's.
    ``async_save``: return an :class:`~megashard.async_save.AsyncSaveHandle` as soon as
    every rank holds a snapshot of its tensors (the caller may change them at once); files
    are written in the background and the checkpoint is committed by the collective
    ``handle.result()``. A save started while another is in flight first finalizes that one,
    raising its error if it failed (see :mod:`megashard.async_save`); a synchronous
    ``process_group=SOLO`` save does not (it leaves the job's async save running).
    ``direct_io``: write the bulk of every large tensor with ``O_DIRECT``: its bytes bypass
    the page cache, which keeps a save from allocating and dirtying as much page cache as
    the checkpoint is large, but leaves nothing cached for a load on the same node
    afterwards (see :mod:`megashard.format.writer`). The files are identical.
    ``sha256``: whether every tensor header also stores tensorizer's SHA-256 (the default,
    ``None``: the ``MEGASHARD_SHA256`` environment variable, on unless ``0``). ``False``
    writes CRC32-only headers, tensorizer's own one-hash variant (its readers verify them
    with ``verify_hash=True``), and skips the SHA-256, most of a save's CPU time. Loads,
    ``megashard verify`` and ``megashard copy`` check the CRC32 of such files, which detects
    any flipped bit; a SHA-256 also guards against deliberate tampering, which a CRC32 does not.

    ``new_only``: create the checkpoint or fail, never replace one. Anything at
    ``checkpoint_dir`` when the save starts, or created there by another writer before
    the commit, makes it raise :class:`~megashard.errors.CommitConflictError` naming it
    and leaves it untouched (a rename that refuses to replace; ``If-None-Match: *`` on
    an object store's head).

    Returns ``None`` once the checkpoint is committed on every rank (``async_save=True``: the
    handle). Raises on every rank if any rank fails (``DistributedError``); the previous
    content of ``checkpoint_dir`` then stays.
    """
    # at most one save in flight (collective, like this save); a synchronous save of this process alone
    # (the local checkpoint tier) uses no staging memory and leaves the job's async save running
    previous = None if process_group is SOLO and not async_save else async_save_mod.in_flight()
    if previous is not None:
        previous.result()
    comm = Comm(process_group, timeout)
    target = storage.save_target(checkpoint_dir, new_only)  # checks nothing yet: a bad location is refused in prepare (agreed)
    final_dir = os.fspath(checkpoint_dir) if storage.is_url(checkpoint_dir) else os.path.abspath(checkpoint_dir)
    t0 = time.perf_counter()
    st = _SaveState(comm.rank)
    opts: Dict[str, Any] = {}

    def prepare() -> Dict[str, Any]:
        target.validate()
        if sha256 is not None and not isinstance(sha256, bool):
            raise CheckpointError(f"sha256 must be True, False or None, got {sha256!r}")
        opts["sha256"] = sha256_default() if sha256 is None else sha256
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        st.tree = jsonstate.encode(dict(state_dict), hook=_make_save_hook(st, file_stems))
        st.tree_parts = _tree_parts(st, comm.rank)
        return announce(st, comm.rank)

    msg, err = comm.run("save/prepare", prepare)
    keep = _Coordinator(target=target)
    token = secrets.token_hex(6) if comm.rank == 0 else ""

    def plan_save(parts: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        target.check()  # before any rank writes a byte
        replies = coordinate_parts(parts, token, keep)
        keep.temp_dir = target.create(token)
        return replies

    reply = _reuse_plan(comm, msg, err, keep, target, token)  # collective 1: the plan cache's vote
    reused = reply is not None
    if reply is None:
        with _discard_on_failure(keep):
            # collective 1': the full plan, each gather group's leader condensing its members' announcements
            reply = comm.coordinate("save", err, msg, plan_save, _SaveLead(comm.rank))
        _PLAN_CACHE[(comm.world_size, comm.rank)] = remember_plan(msg, reply, keep.tensors)
    entry = _PLAN_CACHE[(comm.world_size, comm.rank)]
    temp_dir = target.temp_location(reply["token"])
    finish = partial(_finish_save, keep=keep, target=target, token=reply["token"], final_dir=final_dir, layout=layout,
                     t0=t0, fsync=fsync, is_async=async_save, entry=entry, reused=reused)
    write = partial(target.write_file or _write_tensors, direct=direct_io, sha256=opts.get("sha256", True))
    if not async_save:
        result, err = comm.run("save/write", lambda: _write_into(_select(st, reply), target, reply["token"],
                                                                 comm.rank, align, fsync, threads, write))
        finish(comm, err, result)
        return None

    def snapshot() -> _WriteJob:
        job = _select(st, reply)
        async_save_mod.wait_idle(comm.timeout)
        keys = job.tensors()
        copies = async_save_mod.staging().snapshot([job.groups[s][n] for s, n in keys], threads)
        for (s, n), c in zip(keys, copies):
            job.groups[s][n] = c
        return job

    t_plan = time.perf_counter()
    job, err = comm.run("save/snapshot", snapshot)
    t_copy = time.perf_counter()
    st = _SaveState(comm.rank)  # drop every reference to the caller's tensors
    with _discard_on_failure(keep):
        comm.agree(err, "save")  # every rank holds its snapshot
    t_snap = time.perf_counter()
    log.debug("%sasync save %s: snapshot in %.3f s", rank_prefix(comm), final_dir, t_snap - t0)
    handle = async_save_mod.start(
        async_save_mod._Commit(comm, final_dir, temp_dir, finish),
        lambda: _write_into(job, target, reply["token"], comm.rank, align, fsync, threads, write))
    handle.timings = {"plan_s": t_plan - t0, "copy_s": t_copy - t_plan, "agree_s": t_snap - t_copy}
    return handle


def build_index(results: Sequence[Mapping[str, Any]], tensors: Mapping[str, Tuple[str, Sequence[int]]], world: int,
                layout: Optional[Mapping[str, Any]],
                skeleton: Optional[IndexSkeleton] = None, *,
                consume: bool = False) -> Tuple[bytes, bytes, Optional[IndexSkeleton]]:
    """Rank 0: the index (``manifest.json``, ``manifest.index`` bytes) from every rank's
    write records, and its skeleton for the next save of the same layout. Ranks send their
    records, objects and tree parts as JSON texts (:func:`_write_job`), so this groups and
    joins; it encodes almost nothing itself. With ``skeleton`` (a steady-state commit, see
    :func:`_finish_save`), ranks send their records' CRC32s (``crcs``) and only the fields of
    :data:`META_FIELDS` that changed; the skeleton keeps the others (``skeleton.meta``).
    ``consume``: each result's ``records`` are taken out of it (``None`` after) as they are
    grouped, so that rank 0 does not hold every rank's decoded records and the index
    built from them at once (the commit's peak memory)."""
    if skeleton is None:
        return build_index_from_parts([commit_part(results, consume)], tensors, world, layout)
    with gc_paused():
        return _steady_index(results, tensors, world, layout, skeleton)


def commit_part(results: Sequence[Mapping[str, Any]], consume: bool = False) -> Dict[str, Any]:
    """A gather group's first-save commit for rank 0 (its leader's :class:`_CommitLead` reduce):
    its members' records grouped by chunk (:func:`~megashard.manifest.group_records`) and, per
    member, the fields of :data:`META_FIELDS` and ``where``."""
    part: Dict[str, Any] = {"records": group_records(results, consume)}
    for k in META_FIELDS + ("where",):
        part[k] = [r.get(k) for r in results]
    # every member's files and objects as texts in one bytes body: rank 0 cuts the index's tables from
    # them and keeps them for the next steady commit without making a dict per file or object
    part["files"] = named_texts(_file_texts(part["files"]))
    part["objects"] = named_texts(part["objects"])
    # most members' state trees are equal (same stage, objects named by global key): each sent once, so rank 0
    # decodes and holds one list per distinct tree, not one per rank
    number: Dict[str, int] = {}
    trees: List[Any] = []
    tree_of: List[int] = []
    for t in part["tree"]:
        i = number.setdefault(_dumps(t), len(trees))
        if i == len(trees):
            trees.append(t)
        tree_of.append(i)
    part["tree"], part["tree_of"] = trees, tree_of
    return part


def _file_texts(files: Sequence[Optional[Mapping[str, Any]]]) -> List[Dict[str, str]]:
    """Each rank's files with their records as JSON texts (:func:`~megashard.manifest.named_texts`)."""
    return [{n: _dumps(f) for n, f in (fs or {}).items()} for fs in files]


class _CommitLead:
    """A gather group leader's share of a first save's commit (``Comm.coordinate(..., lead=)``):
    it groups its members' records (:func:`commit_part`); rank 0 lays the index out from the
    groups' parts (:func:`build_index_from_parts`) and answers each group with the saved total."""

    streams = True  # rank 0 lays out each group's part as it is decoded (transport.Lead)

    def reduce(self, payloads: List[Any]) -> Dict[str, Any]:
        return commit_part(payloads, consume=True)

    def expand(self, group_reply: Any, payloads: List[Any]) -> List[Any]:
        return [group_reply] * len(payloads)


def build_index_from_parts(parts: Iterable[Dict[str, Any]], tensors: Mapping[str, Tuple[str, Sequence[int]]],
                           world: int, layout: Optional[Mapping[str, Any]],
                           seen: Optional[Dict[str, List[Any]]] = None) -> Tuple[bytes, bytes, Optional[IndexSkeleton]]:
    """Rank 0: :func:`build_index` of a first save from its gather groups' commit parts
    (:func:`commit_part`, group order), in one pass: each part is laid out and dropped before
    the next is taken, so ``parts`` may decode them as they are reached. ``seen``: lists
    whose keys (``where``, ``files``) get every member's value, in rank order."""
    with gc_paused():
        b = IndexBuilder()
        for k, (dt, gs) in sorted(tensors.items()):
            b.tensor(k, dt, list(gs))
        meta: Dict[str, Any] = {k: NamedTexts() if k in _TABLES else [] for k in META_FIELDS}
        for part in parts:
            b.group(part["records"])
            part["records"] = None  # laid out: the builder holds what it needs of it
            trees = part["tree"]
            part["tree"] = [trees[i] for i in part["tree_of"]]  # one shared list per distinct tree
            for k in META_FIELDS:
                if k in _TABLES:
                    meta[k].add(part[k])
                else:
                    meta[k] += part[k]
            for k, got in (seen or {}).items():
                if k not in _TABLES:
                    got += part[k]
        for k, got in (seen or {}).items():
            if k in _TABLES:
                got += meta[k].by_rank()
        return _index_from_builder(b, meta, set(META_FIELDS), None, world, layout)


def _steady_index(results: Sequence[Mapping[str, Any]], tensors: Mapping[str, Tuple[str, Sequence[int]]], world: int,
                  layout: Optional[Mapping[str, Any]], skeleton: IndexSkeleton) -> Tuple[bytes, bytes, Optional[IndexSkeleton]]:
    """A steady-state commit's index: every rank's CRC32s (and what changed) into ``skeleton``."""
    b = IndexBuilder.resume(skeleton, _steady_crcs(results))
    meta = skeleton.meta
    if meta is None or any((col.ranks if isinstance(col, NamedTexts) else len(col)) != len(results)
                           for col in meta.values()):
        raise ValueError(f"the index skeleton holds no commit of {len(results)} ranks to reuse")
    changed: Dict[str, Dict[int, Any]] = {}
    for r, res in enumerate(results):
        if len(res) - ("crcs" in res) - ("where" in res):  # more than its CRC32s (and "where"): what changed
            for k in META_FIELDS:
                if k in res:
                    changed.setdefault(k, {})[r] = res[k]
    for k, got in changed.items():
        if k in _TABLES:
            meta[k] = meta[k].replaced(dict(zip(got, _file_texts(list(got.values())) if k == "files"
                                                 else got.values())))
        else:
            for r, v in got.items():
                meta[k][r] = v
    return _index_from_builder(b, meta, set(changed), skeleton, world, layout)


def _index_from_builder(b: IndexBuilder, meta: Dict[str, Any], changed: Set[str],
                        skeleton: Optional[IndexSkeleton], world: int,
                        layout: Optional[Mapping[str, Any]]) -> Tuple[bytes, bytes, Optional[IndexSkeleton]]:
    """The head and sections once ``b`` holds every chunk: files, objects and trees from ``meta``."""
    head = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "created": time.time(), "world_size": world,
            "layout": dict(layout or {}), "rank_trees": [], "extra": {}}
    # objects and trees as last time (every rank sent at most its files): the last index's
    reuse = skeleton is not None and skeleton.tail is not None and changed <= {"files"}
    files: Optional[NamedTexts] = meta["files"] if not reuse or "files" in changed else None
    if reuse:
        assert skeleton is not None
        head_bytes, sections = b.finish(head, files, tail=skeleton.tail)
        skeleton.tail = b.tail
        return head_bytes, sections, b.skeleton
    parts: Dict[str, str] = {}
    for ps in meta["parts"]:
        parts.update(ps)
    b.objects(meta["objects"])
    rank_trees: List[str] = []
    tids: Dict[Any, str] = {}  # a state tree's (key, part id) pairs -> its id: most ranks share a few
    shared: Dict[int, str] = {}  # id of a tree list many ranks share (commit_part) -> its id
    for pairs in meta["tree"]:
        tid = shared.get(id(pairs))
        if tid is None:
            k = tuple(map(tuple, pairs))
            tid = tids.get(k)
            if tid is None:
                tid = tids[k] = hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()[:16]
                b.tree(tid, [(key, parts[pid]) for key, pid in pairs])
            shared[id(pairs)] = tid  # meta holds every list while this runs: an id is not reused
        rank_trees.append(tid)
    head["rank_trees"] = rank_trees
    head_bytes, sections = b.finish(head, files)
    if b.skeleton is not None:
        b.skeleton.tail, b.skeleton.meta = b.tail, meta
    return head_bytes, sections, b.skeleton


META_FIELDS = ("files", "objects", "tree", "parts")  # what a steady commit leaves out when unchanged
_TABLES = ("files", "objects")  # of META_FIELDS: kept as NamedTexts (per rank, {name: JSON text})


def records_digest(records: Sequence[Sequence[Any]]) -> str:
    """This rank's write records without their CRC32s: equal to the previous save's when the
    index skeleton may take this save's CRC32s (:func:`_finish_save`)."""
    return hashlib.sha256(_dumps([rec[:4] for rec in records]).encode()).hexdigest()


def meta_digests(result: Mapping[str, Any]) -> Dict[str, str]:
    """Digests of this rank's commit message fields that a steady commit may leave out
    (:data:`META_FIELDS`): a field equal to the last committed one's is not sent again."""
    return {k: hashlib.sha256(_dumps(result[k]).encode()).hexdigest()[:32] for k in META_FIELDS if k in result}


def steady_commit(result: Mapping[str, Any], previous: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """A rank's commit message when the index skeleton is reused: its records' CRC32s
    instead of the records, and only the fields that differ from its last committed message
    (``previous``: that message's :func:`meta_digests`; rank 0 keeps the others)."""
    now = meta_digests(result) if previous else {}
    out = {k: v for k, v in result.items() if k != "records" and not (k in now and previous.get(k) == now[k])}
    # hex: 8 characters a CRC32, and rank 0 decodes every rank's as one text
    out["crcs"] = np.array([rec[4] for rec in result["records"]], dtype="<u4").tobytes().hex()
    return out


def _steady_crcs(results: Sequence[Mapping[str, Any]]) -> Any:
    """Every rank's CRC32s (:func:`steady_commit`), in rank order, as one array."""
    texts = [res.get("crcs") for res in results]
    try:
        raw = bytes.fromhex("".join(texts))  # type: ignore[arg-type]
        ok = all(len(t) % 8 == 0 for t in texts)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        for r, t in enumerate(texts):
            try:
                if not isinstance(t, str) or len(t) % 8:
                    raise ValueError
                bytes.fromhex(t)
            except ValueError:
                raise ValueError(f"rank {r} sent a malformed CRC32 list") from None
    return np.frombuffer(raw, dtype="<u4")


@dataclass
class _WriteJob:
    """What this rank writes, selected on the calling thread; tensors may be replaced by snapshots."""

    groups: Dict[str, Dict[str, torch.Tensor]]  # stem -> {name in file: tensor}
    shard_records: List[Tuple[str, str, "_ShardMeta"]]  # (stem, name in file, shard)
    zero_records: List[Tuple[str, "_ShardMeta"]]  # (name, shard) of shards without elements
    objects: Dict[str, Any]
    local_refs: List[Tuple[str, str, Dict[str, Any]]]  # (stem, name, JSON ref to patch)
    tree: List[Tuple[str, str]]  # (top-level key, part id) of this rank's state tree
    parts: Dict[str, Any]  # the parts this rank uploads (their refs are patched by the write)

    def tensors(self) -> List[Tuple[str, str]]:
        return [(stem, name) for stem, ts in sorted(self.groups.items()) for name in ts]


def _select(st: _SaveState, reply: Mapping[str, Any]) -> _WriteJob:
    """Everything this rank writes: the shards and objects the coordinator assigned to it,
    its own tensors, and the state-tree parts it uploads."""
    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    shard_records: List[Tuple[str, str, _ShardMeta]] = []
    zero_records: List[Tuple[str, _ShardMeta]] = []
    owner: Dict[Tuple[str, str], Tuple[Any, str]] = {}  # (stem, name in file) -> (what it holds, for messages)

    def claim(stem: str, name: str, ident: Any, what: str) -> bool:
        """False when ``name`` already holds the same thing (a shard listed twice: tied weights);
        StateDictError when it holds something else (two values would share one name)."""
        got = owner.get((stem, name))
        if got is None:
            owner[(stem, name)] = (ident, what)
            return True
        if got[0] == ident:
            return False
        raise StateDictError(f"cannot save: {what} and {got[1]} would both be stored as tensor {name!r} in "
                             f"{stem}-r{st.rank:05d}.tensors; rename one of them")

    for j in reply["write"]:
        path, sh, stem = st.shards[st.order[j]]
        name = _shard_name(sh)
        if sh.data.numel() == 0:
            zero_records.append((name, _ShardMeta.of(sh)))
            continue
        meta = _ShardMeta.of(sh)
        what = f"ShardedTensor {sh.key!r} (at {path!r}, offset {list(sh.global_offset)})"
        if not claim(stem, name, ("shard", meta.key, meta.offset, meta.shape, meta.flat), what):
            continue  # the same shard listed twice on this rank (tied weights)
        groups.setdefault(stem, {})[name] = sh.data
        shard_records.append((stem, name, meta))
    objects: Dict[str, Any] = {}
    for i in reply["objects"]:
        _path, obj, stem = st.objects[i]
        ukey = object_unique_key(obj)
        if ukey in objects:
            continue
        objects[ukey] = {"key": obj.key, "offset": list(obj.global_offset), "shape": list(obj.global_shape),
                         "value": _object_in_file(st, ukey, _encode_object_value(st, ukey, obj.data, stem), stem)}
    local_refs: List[Tuple[str, str, Dict[str, Any]]] = []
    for lt in st.local + [lt for items in st.obj_local.values() for lt in items]:
        if lt.tensor.numel() == 0:
            lt.ref.update(file=None, name=lt.name, data_offset=0, nbytes=0, crc32=0)
        else:
            claim(lt.stem, lt.name, ("local", lt.name, id(lt)), f"rank-local value at {lt.path or lt.name!r}")
            groups.setdefault(lt.stem, {})[lt.name] = lt.tensor
            local_refs.append((lt.stem, lt.name, lt.ref))
    upload = set(reply["blobs"])
    parts = {pid: st.parts[pid] for _k, pid in st.tree_parts if pid in upload}
    return _WriteJob(groups, shard_records, zero_records, objects, local_refs, st.tree_parts, parts)


def _write_tensors(tensors: Mapping[str, torch.Tensor], path: str, align: int, fsync: bool,
                   threads: Optional[int], direct: bool = False,
                   sha256: bool = True) -> Tuple[List[Any], int, Dict[str, Any]]:
    infos = write_file(tensors, path, align=align, fsync=fsync, threads=threads, direct=direct, sha256=sha256)
    return infos, os.path.getsize(path), {}


def _write_into(job: _WriteJob, target: Any, token: str, rank: int, align: int, fsync: bool,
                threads: Optional[int], write: Callable[..., Tuple[Any, ...]]) -> Dict[str, Any]:
    """Write this rank's files where rank 0 prepared (on a file system the temp dir is found,
    never created, here: a rank that does not see it is in another directory) and say
    where that was."""
    temp_dir, where = target.writer(token)
    out = _write_job(job, temp_dir, rank, align, fsync, threads, write=write)
    out["where"] = where
    return out


def _write_job(job: _WriteJob, temp_dir: str, rank: int, align: int, fsync: bool, threads: Optional[int],
               write: Callable[..., Tuple[List[Any], int, Dict[str, Any]]] = _write_tensors) -> Dict[str, Any]:
    """Write this rank's files into the save's temporary directory; the records the index
    needs. ``write(tensors, path, align, fsync, threads) -> (infos, file size, extra file record)``."""
    files: Dict[str, Dict[str, Any]] = {}
    placed: Dict[Tuple[str, str], Any] = {}
    needed = sum(t.numel() * t.element_size() for ts in job.groups.values() for t in ts.values())
    for stem, tensors in sorted(job.groups.items()):
        fname = f"{stem}-r{rank:05d}.tensors"
        try:
            infos, size, extra = write(tensors, f"{temp_dir}/{fname}", align, fsync, threads)  # extra: e.g. the ETag
        except OSError as e:
            if e.errno != errno.ENOSPC or isinstance(e, NoSpaceError):
                raise
            raise no_space_error(f"{temp_dir}/{fname}", needed) from e
        files[fname] = {"rank": rank, "bytes": size, "tensors": len(infos), **extra}
        for inf in infos:
            placed[(stem, inf.name)] = (fname, inf)
    records = [m.record(name, None, 0, 0, 0) for name, m in job.zero_records]
    for stem, name, m in job.shard_records:
        fname, inf = placed[(stem, name)]
        records.append(m.record(name, fname, inf.header_offset, inf.data_offset, inf.crc32))
    for stem, name, ref in job.local_refs:
        fname, inf = placed[(stem, name)]
        ref.update(file=fname, name=name, header_offset=inf.header_offset, data_offset=inf.data_offset,
                   nbytes=inf.nbytes)
        if ref["kind"] != "json":  # a stored object's reference stays equal across saves (_object_in_file)
            ref["crc32"] = inf.crc32
    # JSON texts as the index stores them: the coordinator only places them
    return {"files": files, "records": records, "objects": {u: _dumps(v) for u, v in job.objects.items()},
            "tree": job.tree, "parts": {pid: _dumps(v) for pid, v in job.parts.items()}}


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


@dataclass(frozen=True)
class _ShardMeta:
    """What a shard's index record needs (no reference to the caller's tensor)."""

    key: str
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    flat: Optional[Tuple[int, int]]
    nbytes: int

    @classmethod
    def of(cls, sh: ShardedTensor) -> "_ShardMeta":
        return cls(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.chunk_shape),
                   tuple(sh.flat_range) if sh.flat_range is not None else None,
                   sh.data.numel() * itemsize(sh.dtype))

    def record(self, name: str, file: Optional[str], header_offset: int, data_offset: int, crc32: int) -> List[Any]:
        """``[key, chunk text, order in chunk, record text, CRC32]`` for :func:`build_index`: the chunk
        (offset and shape) as one JSON text, ``[[offset...],[shape...]]``, which the coordinator
        parses once per distinct chunk, not once per record (the records of a flattened
        parameter's data-parallel pieces share it)."""
        text = record_text(self.key, self.global_shape, self.offset, self.shape, self.flat, file, name,
                           header_offset, data_offset, self.nbytes)
        return [self.key, _dumps([self.offset, self.shape]), self.flat[0] if self.flat else 0, text, check_crc(crc32)]

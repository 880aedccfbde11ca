"""The only module that talks to ``torch.distributed``.

Metadata travels as JSON inside uint8 tensors (never pickled, unlike torch's
``*_object`` collectives). Every phase of a save or load ends in :meth:`Comm.agree`,
which exchanges each rank's success or error message, so one failing rank makes
every rank raise the same :class:`DistributedError` instead of leaving peers
waiting in a later collective. Works without an initialised process group (a
single process is a world of one).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import math
import os
import threading
import traceback
import zlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple, TypeVar

import torch

from .errors import DistributedError, MegashardError, distributed_error

log = logging.getLogger(__name__)
T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist


#: ``process_group=SOLO``: this process alone, also inside a job whose process group is initialised
#: (the local checkpoint tier: every rank saves and loads its own bytes, no collective).
SOLO: Any = type("Solo", (), {"__repr__": lambda self: "SOLO"})()


class Comm:
    """A process group plus the handful of operations checkpointing needs."""

    def __init__(self, group: Any = None, timeout: Optional[float] = None) -> None:
        """``timeout`` (seconds) bounds every collective and wait; default: the process group's.
        ``group=SOLO``: a world of one (no collective), whatever the process group."""
        dist = _dist()
        solo = group is SOLO
        self.group = None if solo else group
        self.timeout = _timeout(self.group, timeout)
        self.is_dist = not solo and dist.is_available() and dist.is_initialized()
        if self.is_dist:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group)).lower()
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"
        #: the rank that log lines name: the job's rank also in a SOLO world
        self.label_rank = dist.get_rank() if solo and dist.is_available() and dist.is_initialized() else self.rank
        self.device = torch.device("cpu")
        if "nccl" in self.backend:
            self.device = torch.device("cuda", torch.cuda.current_device())

    # -- helpers -----------------------------------------------------------
    def global_rank(self, group_rank: int) -> int:
        if not self.is_dist or self.group is None:
            return group_rank
        return _dist().get_global_rank(self.group, group_rank)

    def _bytes_tensor(self, data: bytes, size: int) -> torch.Tensor:
        t = torch.zeros(size, dtype=torch.uint8)
        if data:
            t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return t.to(self.device)

    def wait(self, work: Any, what: str) -> None:
        """Wait for an async collective or point-to-point op within the timeout.

        A dead or stuck peer surfaces here as a DistributedError naming this rank instead
        of a hang or a backend-specific exception."""
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            # gloo raises on its timeout ("Timed out waiting 3000ms for ..."), NCCL returns False
            why = (f"no answer within {self.timeout:.0f} s (a peer rank died or hangs)"
                   if "timed out" in str(e).lower() else "a peer rank failed or exited")
            raise DistributedError({self.rank: f"{what}: {why} ({type(e).__name__}: {str(e)[:300]})"},
                                   what) from None
        if ok is False:
            raise DistributedError({self.rank: f"{what}: no answer within {self.timeout:.0f} s "
                                    "(a peer rank died or hangs)"}, what)

    def _collective(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            work = fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise DistributedError({self.rank: f"{what}: {type(e).__name__}: {str(e)[:300]}"}, what) from None
        self.wait(work, what)

    # -- collectives (JSON) --------------------------------------------------
    def all_gather_json(self, obj: Any) -> List[Any]:
        """Every rank's object on every rank: O(world) per rank, so only for small groups
        (e.g. the ranks of one node or one data-parallel group), never the whole job."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if not self.is_dist or self.world_size == 1:
            return [json.loads(data)]
        dist = _dist()
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        self._collective("all_gather", dist.all_gather, sizes, n)
        lens = [int(s.item()) for s in sizes]
        m = max(lens)
        out = [torch.empty(m, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        self._collective("all_gather", dist.all_gather, out, self._bytes_tensor(data, m))
        return [json.loads(bytes(t[:k].cpu().numpy())) for t, k in zip(out, lens)]

    def gather_json(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        """Every rank's object on ``dst`` (None elsewhere), each message its own size.

        A rank sends its bytes once and receives nothing but the 8-byte size exchange;
        ``dst`` receives the sum of the messages (no padding to the largest)."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if not self.is_dist or self.world_size == 1:
            return [json.loads(data)]
        dist = _dist()
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = ([torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
                 if self.rank == dst else None)
        self._collective("gather", dist.gather, n, gather_list=sizes, dst=self.global_rank(dst))
        if self.rank != dst:
            if data:
                self.isend(self._bytes_tensor(data, len(data)), dst).wait()
            return None
        bufs: List[Optional[torch.Tensor]] = []
        pending = []
        for r, s in enumerate(sizes or []):
            k = int(s.item())
            if r == dst or k == 0:
                bufs.append(None)
                continue
            buf = torch.empty(k, dtype=torch.uint8)
            pending.append(self.irecv(buf, r))
            bufs.append(buf)
        for p in pending:
            p.wait()
        return [json.loads(data) if r == dst else json.loads(bytes(b.numpy())) if b is not None else None
                for r, b in enumerate(bufs)]

    def scatter_json(self, objs: Optional[Sequence[Any]], src: int = 0) -> Any:
        """Rank ``r`` receives ``objs[r]`` from ``src``: each rank only its own message."""
        if not self.is_dist or self.world_size == 1:
            return objs[0] if objs else None
        dist = _dist()
        datas = [json.dumps(o, separators=(",", ":")).encode() for o in objs] if self.rank == src else []
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        lens = ([torch.tensor([len(d)], dtype=torch.int64, device=self.device) for d in datas]
                if self.rank == src else None)
        self._collective("scatter", dist.scatter, n, scatter_list=lens, src=self.global_rank(src))
        if self.rank == src:
            pending = [self.isend(self._bytes_tensor(d, len(d)), r) for r, d in enumerate(datas) if r != src]
            for p in pending:
                p.wait()
            return json.loads(datas[src])
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        self.irecv(buf, src).wait()
        return json.loads(bytes(buf.numpy()))

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        if not self.is_dist or self.world_size == 1:
            return obj
        dist = _dist()
        data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._collective("broadcast", dist.broadcast, n, src=self.global_rank(src))
        buf = self._bytes_tensor(data, int(n.item()))
        self._collective("broadcast", dist.broadcast, buf, src=self.global_rank(src))
        return json.loads(bytes(buf.cpu().numpy())) if self.rank != src else obj

    def all_reduce_max(self, value: int) -> int:
        """The maximum of an integer over the group."""
        return self.all_reduce([value], "max")[0]

    def all_reduce(self, values: Sequence[int], op: str = "sum") -> List[int]:
        """Element-wise ``sum`` or ``max`` of a few integers over the group."""
        if not self.is_dist or self.world_size == 1:
            return [int(v) for v in values]
        dist = _dist()
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        self._collective("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return [int(x) for x in t.cpu().tolist()]

    def barrier(self) -> None:
        if self.is_dist and self.world_size > 1:
            self.all_reduce([0])

    # -- error aggregation ---------------------------------------------------
    def agree(self, error: Optional[str], what: str) -> None:
        """Raise on every rank if any rank failed: one 8-byte all-reduce when all is well;
        on failure the messages are gathered on rank 0 and broadcast (bounded)."""
        try:
            failed = self.all_reduce([1 if error else 0], "max")[0]
            if not failed:
                return
            msgs = self.gather_json(error, 0)
            failures = _bounded_failures({r: m for r, m in enumerate(msgs or []) if m})
            failures = self.broadcast_json({str(r): m for r, m in failures.items()}, 0)
        except DistributedError as e:  # a peer died: report our own error too, if any
            raise self._with_own(e, error, what) from None
        raise distributed_error({int(r): m for r, m in failures.items()}, what)

    def _with_own(self, e: DistributedError, error: Optional[str], what: str) -> DistributedError:
        """A failed exchange's error, with this rank's own failure (if any) first: it
        usually explains the rest."""
        if error:
            e.failures[self.rank] = f"{error}\n(then: {e.failures.get(self.rank, 'the agreement failed')})"
        return distributed_error(e.failures, what)

    def coordinate(self, what: str, error: Optional[str], payload: Any,
                   compute: Callable[[List[Any]], List[Any]], lead: Optional["Lead"] = None) -> Any:
        """Gather every rank's payload on rank 0, run ``compute`` there (payloads -> one
        reply per rank) and send each rank its reply; raise on every rank if any rank's
        payload or the computation failed. A rank receives only its own reply.

        Two levels (:func:`gather_groups`): each group's leader receives its members'
        messages and sends rank 0 one compressed part with the values its members share sent
        once (:func:`pack_part`); replies travel back down the same tree. No process receives
        a message from every rank; a job of up to 64 ranks is one group (a flat gather).

        ``lead`` (:class:`Lead`): the leaders do their group's share of the work. Each leader
        (rank 0 too, for its own group) decodes its members' payloads and sends rank 0
        ``lead.reduce(payloads)`` (one JSON-able part); ``compute`` then runs on rank 0 over
        the groups' parts (group order) and returns one reply per group; each leader turns its
        group's reply into one reply per member with ``lead.expand(reply, payloads)``. A
        member's error, a ``reduce`` or ``compute`` that raises reach every rank, naming the
        failing ranks, as without ``lead``."""
        if lead is not None:
            return self._coordinate_led(what, error, payload, compute, lead)
        size, leader = self._gather_place()
        mine = encode_message(error, payload)
        try:
            if self.rank != leader:
                reply = self._member_exchange(mine, leader, what)
            elif leader != 0:
                members = self._recv_bytes(list(range(leader + 1, min(self.world_size, leader + size))), what)
                self._send_bytes(pack_part([mine] + members), 0, what)
                del members
                texts = unpack_replies(self._recv_bytes([0], what)[0])
                self._send_many(texts[1:], list(range(leader + 1, leader + len(texts))), what)
                reply = json.loads(texts[0])
            else:
                members = self._recv_bytes(list(range(1, min(self.world_size, size))), what)
                parts = self._recv_bytes(list(range(size, self.world_size, size)), what)
                # one pause for every part, the computation and the replies: a pause per part let the
                # collector run between parts, each time over every object decoded so far (about a quarter
                # of decoding the commit of 2,048 simulated DeepSeek-V3 ranks); what is freed inside is
                # never scanned
                with gc_paused():
                    got = [unpack_messages([mine] + members)]
                    del members
                    got += [unpack_part(p) for p in parts]
                    del parts
                    replies = self._compute_replies(what, got, compute)
                    del got
                    groups = [replies[g:g + size] for g in range(0, self.world_size, size)]
                    texts = [_dumps_bytes(r) for r in groups[0][1:]] + [pack_replies(p) for p in groups[1:]]
                self._send_many(texts, list(range(1, len(groups[0]))) + list(range(size, self.world_size, size)), what)
                del texts
                reply = replies[0]
        except DistributedError as e:
            raise self._with_own(e, error, what) from None
        return _reply_value(reply, what)

    def _coordinate_led(self, what: str, error: Optional[str], payload: Any,
                        compute: Callable[[List[Any]], List[Any]], lead: "Lead") -> Any:
        """:meth:`coordinate` with ``lead``: leaders reduce, rank 0 computes over the parts."""
        size, leader = self._gather_place()
        mine = encode_message(error, payload)
        try:
            if self.rank != leader:
                return _reply_value(self._member_exchange(mine, leader, what), what)
            members = list(range(leader + 1, min(self.world_size, leader + size)))
            texts = [mine] + self._recv_bytes(members, what)
            with gc_paused():
                errors, payloads = unpack_messages(texts)
                del texts
                part = self._lead_reduce(what, leader, errors, payloads, lead)
                if leader != 0:
                    self._send_bytes(pack_led_part(part), 0, what)
                    del part
                    group_reply = json.loads(zlib.decompress(self._recv_bytes([0], what)[0]))
                else:
                    raw = self._recv_bytes(list(range(size, self.world_size, size)), what)
                    if getattr(lead, "streams", False):  # parts decoded one at a time by compute
                        got = [part] + [unpack_led_part(p) if led_part_failed(p) else p for p in raw]
                    else:
                        got = [part] + [unpack_led_part(p) for p in raw]
                    del part, raw
                    group_replies = self._compute_group_replies(what, got, compute, size)
                    del got
                    self._send_many([zlib.compress(_dumps_bytes(r), PART_ZLIB_LEVEL) for r in group_replies[1:]],
                                    list(range(size, self.world_size, size)), what)
                    group_reply = group_replies[0]
                    del group_replies
                replies = self._lead_expand(what, group_reply, payloads, lead)
                del payloads
                out = [_dumps_bytes(r) for r in replies[1:]]
            self._send_many(out, members, what)
            del out
            reply = replies[0]
        except DistributedError as e:
            raise self._with_own(e, error, what) from None
        return _reply_value(reply, what)

    def _gather_place(self) -> Tuple[int, int]:
        """(group size, this rank's leader) of the two-level gather (:func:`gather_groups`)."""
        size = gather_group_size(self.world_size)
        return size, self.rank - self.rank % size

    def _member_exchange(self, mine: bytes, leader: int, what: str) -> Any:
        """A member's share of a gather: its message up to its leader, its reply (decoded) back."""
        self._send_bytes(mine, leader, what)
        return json.loads(self._recv_bytes([leader], what)[0])

    def _lead_reduce(self, what: str, leader: int, errors: Dict[int, str], payloads: List[Any],
                     lead: "Lead") -> Dict[str, Any]:
        """A leader's part for rank 0: ``{"part": ...}``, or its group's failures by rank
        (its members' errors, else the reduce's own, on the leader's rank)."""
        if not errors:
            part, err = self.run(what, lambda: lead.reduce(payloads))
            if err is None:
                return {"part": part}
            errors = {0: f"{what} (group of ranks {leader}..{leader + len(payloads) - 1}): {err}"}
        return {"failures": {str(leader + i): m for i, m in _bounded_failures(errors).items()}}

    def _compute_group_replies(self, what: str, got: List[Dict[str, Any]],
                               compute: Callable[[List[Any]], List[Any]], size: int) -> List[Any]:
        """Rank 0: one reply per group (``{"ok": ...}``), or everybody's failures."""
        groups = len(range(0, self.world_size, size))
        failures = {int(r): m for g in got if isinstance(g, dict) for r, m in g.get("failures", {}).items()}
        if not failures:
            streamed = not all(isinstance(g, dict) for g in got)  # a streaming lead's: decoded as reached
            parts: Any = _decoded_parts(got) if streamed else [g["part"] for g in got]
            if not streamed:
                got.clear()
            out, err = self.run(what, lambda: compute(parts))
            del parts
            if err is None and (not isinstance(out, list) or len(out) != groups):
                err = f"internal error: {what} produced no reply per group"
            if err is None:
                return [{"ok": o} for o in out]
            failures = {0: err}
        fail = {str(r): m for r, m in _bounded_failures(failures).items()}
        return [{"failures": fail}] * groups

    def _lead_expand(self, what: str, group_reply: Mapping[str, Any], payloads: List[Any],
                     lead: "Lead") -> List[Any]:
        """A leader: one reply per member (``{"ok": ...}`` or the failures) from its group's."""
        n = len(payloads)
        if "failures" in group_reply:
            return [group_reply] * n
        out, err = self.run(what, lambda: lead.expand(group_reply["ok"], payloads))
        if err is None and (not isinstance(out, list) or len(out) != n):
            err = f"internal error: {what} produced no reply per member"
        if err is None:
            return [{"ok": o} for o in out]
        # rank 0 has answered the other groups already: this group raises now and the others
        # at the phase's next agreement, where this group's ranks report this failure
        return [{"failures": {str(self.rank): err}}] * n

    def _compute_replies(self, what: str, got: List[Tuple[Dict[int, str], List[Any]]],
                         compute: Callable[[List[Any]], List[Any]]) -> List[Any]:
        """Rank 0: every rank's reply (``{"ok": ...}``), or everybody's failures."""
        size = gather_group_size(self.world_size)
        failures = {g * size + i: m for g, (errs, _p) in enumerate(got) for i, m in errs.items()}
        if not failures:
            payloads = [p for _e, ps in got for p in ps]
            got.clear()
            out, err = self.run(what, lambda: compute(payloads))
            if err is None and (not isinstance(out, list) or len(out) != self.world_size):
                err = f"internal error: {what} produced no reply per rank"
            if err is None:
                return [{"ok": o} for o in out]
            failures = {0: err}
        fail = {str(r): m for r, m in _bounded_failures(failures).items()}
        return [{"failures": fail}] * self.world_size

    def _send_bytes(self, data: bytes, dst: int, what: str) -> None:
        self._send_many([data], [dst], what)

    def _send_many(self, datas: Sequence[bytes], dsts: Sequence[int], what: str) -> None:
        """Send each ``datas[i]`` to ``dsts[i]``: its size (int64), then its bytes."""
        pending = []
        keep = []
        for d, dst in zip(datas, dsts):
            n = torch.tensor([len(d)], dtype=torch.int64)
            keep.append(n)
            pending.append(self.isend(n, dst))
            if d:
                pending.append(self.isend(self._bytes_tensor(d, len(d)), dst))
        for p in pending:
            p.wait()

    def _recv_bytes(self, srcs: Sequence[int], what: str) -> List[bytes]:
        """One message (:meth:`_send_many`) from each of ``srcs``, all posted at once."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in srcs]
        for p in [self.irecv(n, s) for n, s in zip(sizes, srcs)]:
            p.wait()
        bufs = [torch.empty(int(n.item()), dtype=torch.uint8) for n in sizes]
        for p in [self.irecv(b, s) for b, s in zip(bufs, srcs) if b.numel()]:
            p.wait()
        return [bytes(b.numpy()) for b in bufs]

    def run(self, what: str, fn: Callable[[], T]) -> Tuple[Optional[T], Optional[str]]:
        """Run ``fn`` locally, capturing any exception as a message for :meth:`agree`."""
        try:
            return fn(), None
        except MegashardError as e:
            log.debug("rank %d: %s failed", self.rank, what, exc_info=True)
            return None, f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
            return None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        except BaseException as e:  # SystemExit, KeyboardInterrupt: still agree, never strand peers
            return None, f"{type(e).__name__} during {what}: {e!r}"

    # -- point to point --------------------------------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send a contiguous tensor to group rank ``dst`` (staged through the device for NCCL)."""
        self.isend(t, dst).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into a contiguous tensor from group rank ``src``."""
        self.irecv(t, src).wait()

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        """Start sending a contiguous tensor; returns a handle with ``wait()``.

        The tensor must stay untouched until the handle completes."""
        if t.device != self.device:
            t = t.to(self.device, non_blocking=False)
        return _Pending(self, _dist().isend(t, dst=self.global_rank(dst), group=self.group), f"send to rank {dst}")

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        """Start receiving into a contiguous tensor; returns a handle with ``wait()``."""
        what = f"receive from rank {src}"
        if t.device != self.device:
            # NCCL receives into device memory, gloo into host memory: stage the other kind
            tmp = torch.empty_like(t, device=self.device)
            work = _dist().irecv(tmp, src=self.global_rank(src), group=self.group)
            return _Pending(self, work, what, tmp, t)
        return _Pending(self, _dist().irecv(t, src=self.global_rank(src), group=self.group), what)

    def exchange(self, sends: Sequence[Tuple[torch.Tensor, int]], recvs: Sequence[Tuple[torch.Tensor, int]],
                 what: str) -> "_Batch":
        """Start sending ``(tensor, group rank)`` pairs and receiving into ``(tensor, group rank)``
        pairs as one batch (NCCL: one group, so two ranks that send to each other cannot deadlock);
        returns a handle whose ``wait()`` completes them all. Messages between two ranks are
        matched in the order each side lists them. Tensors are contiguous; NCCL's are staged
        through the device, gloo's through the host."""
        dist = _dist()
        p2p: List[Any] = []
        copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for t, dst in sends:
                if t.device != self.device:
                    t = t.to(self.device, non_blocking=False)
                p2p.append(dist.P2POp(dist.isend, t, self.global_rank(dst), self.group))
            for t, src in recvs:
                tmp = t
                if t.device != self.device:
                    tmp = torch.empty_like(t, device=self.device)
                    copies.append((tmp, t))
                p2p.append(dist.P2POp(dist.irecv, tmp, self.global_rank(src), self.group))
            works = dist.batch_isend_irecv(p2p) if p2p else []
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            raise DistributedError({self.rank: f"{what}: {type(e).__name__}: {str(e)[:300]}"}, what) from None
        return _Batch(self, list(works or []), what, copies)


class _Pending:
    """A point-to-point op in flight; ``wait()`` honours the Comm's timeout and, for a
    receive staged through device memory, copies to the host destination."""

    def __init__(self, comm: Comm, work: Any, what: str, tmp: Optional[torch.Tensor] = None,
                 dest: Optional[torch.Tensor] = None) -> None:
        self.comm, self.work, self.what, self.tmp, self.dest = comm, work, what, tmp, dest

    def wait(self) -> None:
        self.comm.wait(self.work, self.what)
        if self.dest is not None and self.tmp is not None:
            self.dest.copy_(self.tmp)


class _Batch:
    """A batch of point-to-point ops in flight (:meth:`Comm.exchange`)."""

    def __init__(self, comm: Comm, works: List[Any], what: str,
                 copies: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.comm, self.works, self.what, self.copies = comm, works, what, copies

    def wait(self) -> None:
        for w in self.works:
            self.comm.wait(w, self.what)
        for tmp, dest in self.copies:
            dest.copy_(tmp)
        self.works, self.copies = [], []


def _timeout(group: Any, timeout: Optional[float]) -> float:
    """Seconds: the caller's, else the process group's own timeout, else 30 minutes."""
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        return float(timeout)
    try:
        from torch.distributed.distributed_c10d import _get_default_group  # type: ignore

        pg = group if group is not None else _get_default_group()
        for dev in ("cpu", "cuda"):
            try:
                return float(pg._get_backend(torch.device(dev)).options._timeout.total_seconds())
            except Exception:  # noqa: BLE001 - no backend for that device
                continue
    except Exception:  # noqa: BLE001 - not initialised, or a torch without these internals
        pass
    return 1800.0


MAX_REPORTED_FAILURES = 64
MAX_FAILURE_CHARS = 4096


def _bounded_failures(failures: Dict[int, str]) -> Dict[int, str]:
    """At most 64 ranks' messages (4 KiB each) travel back: a job of 16,384 failing ranks
    must not broadcast 16,384 tracebacks. The rest are counted in the last entry."""
    ranks = sorted(failures)
    out = {r: failures[r][:MAX_FAILURE_CHARS] for r in ranks[:MAX_REPORTED_FAILURES]}
    if len(ranks) > MAX_REPORTED_FAILURES:
        rest = ranks[MAX_REPORTED_FAILURES:]
        out[rest[0]] = f"... and {len(rest)} more rank(s) failed (ranks {rest[0]}..{rest[-1]})"
    return out


#: ``MEGASHARD_GATHER_GROUP``: ranks per group of :meth:`Comm.coordinate`'s two-level gather
#: (default: about the square root of the world size; a world up to FLAT_GATHER_MAX ranks is one group).
FLAT_GATHER_MAX = 64
PART_ZLIB_LEVEL = 1  # rank 0's replies to a leader (rank 0 compresses every group's): fast
#: a leader's part for rank 0 (:func:`pack_part`, :func:`pack_led_part`): zlib level 6. xz preset 1
#: made parts ~2.5x smaller but rank 0 decompresses every leader's part, and at 131,072 DeepSeek-V3
#: ranks that cost it 1.07 CPU-s against zlib's 0.44 (scripts/simulate_scale.py; rank 0 then receives
#: ~27 MB instead of ~13 MB, well under the 64 MB bound); leaders compress in parallel
PART_UP_ZLIB_LEVEL = 6


def gather_group_size(world: int) -> int:
    """Ranks per group of the two-level gather (a group's first rank leads it): the whole
    world up to 64 ranks, else ``ceil(sqrt(world))``, so rank 0 hears from ~2*sqrt(world)
    ranks and each leader from ~sqrt(world). ``MEGASHARD_GATHER_GROUP`` sets it (tests)."""
    v = os.environ.get("MEGASHARD_GATHER_GROUP")
    if v:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"MEGASHARD_GATHER_GROUP={v!r} is not an integer") from None
        return max(1, min(n, world)) if n > 0 else max(1, world)
    if world <= FLAT_GATHER_MAX:
        return max(1, world)
    return math.isqrt(world - 1) + 1


@contextlib.contextmanager
def gc_paused() -> Any:
    """Rank 0's decoding, planning and index building create millions of small objects that
    form no cycles; the cyclic collector would rescan all of them again and again (half of
    rank 0's decoding and a third of its planning at 16,384 ranks, scripts/simulate_scale.py)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _dumps_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_message(error: Optional[str], payload: Any) -> bytes:
    """A rank's message for :meth:`Comm.coordinate`: one JSON line (its error, and the names and
    text lengths of its payload's fields), then each field's JSON text. A leader finds the values
    its members share by comparing those texts (:func:`pack_part`), without decoding any; a
    payload that is not a dict with string keys is one text."""
    if isinstance(payload, dict) and all(type(k) is str for k in payload):
        texts = [_dumps_bytes(v) for v in payload.values()]
        fields: Optional[List[Any]] = [[k, len(t)] for k, t in zip(payload, texts)]
    else:
        texts, fields = [_dumps_bytes(payload)], None
    return _dumps_bytes({"error": error, "fields": fields}) + b"\n" + b"".join(texts)


def _split_message(text: bytes) -> Tuple[Optional[str], Optional[List[str]], List[bytes]]:
    """:func:`encode_message`'s parts: (error, field names or None, field texts)."""
    nl = text.index(b"\n")  # JSON text holds no raw newline
    head = json.loads(text[:nl])
    if head["fields"] is None:
        return head["error"], None, [text[nl + 1:]]
    names, texts, pos = [], [], nl + 1
    for name, n in head["fields"]:
        names.append(name)
        texts.append(text[pos:pos + n])
        pos += n
    if pos != len(text):
        raise ValueError(f"a gathered message holds {len(text) - pos} bytes past its fields")
    return head["error"], names, texts


def unpack_messages(texts: Sequence[bytes]) -> Tuple[Dict[int, str], List[Any]]:
    """A group's messages (:func:`encode_message`) as (errors by position, payloads)."""
    errors: Dict[int, str] = {}
    payloads: List[Any] = []
    with gc_paused():
        for i, t in enumerate(texts):
            error, names, values = _split_message(t)
            if error:
                errors[i] = error
            payloads.append(json.loads(values[0]) if names is None
                            else {k: json.loads(v) for k, v in zip(names, values)})
    return errors, payloads


def pack_part(texts: Sequence[bytes]) -> bytes:
    """A leader's part for rank 0: its group's messages, the field texts that several members
    share (the same announcement of data-parallel replicas, the same state-tree keys) stored
    once, zlib-compressed (:data:`PART_UP_ZLIB_LEVEL`). Fields are compared and copied as the
    members' JSON texts: the leader decodes only each message's first line."""
    errors: Dict[str, str] = {}
    fields: List[str] = []
    pos: Dict[str, int] = {}
    table: List[bytes] = []
    index: Dict[bytes, int] = {}
    rows: List[Any] = []

    def ref(t: bytes) -> int:
        j = index.get(t)
        if j is None:
            j = index[t] = len(table)
            table.append(t)
        return j

    for i, t in enumerate(texts):
        error, names, values = _split_message(t)
        if error:
            errors[str(i)] = error
        if names is None:
            rows.append({"v": ref(values[0])})
            continue
        row = []
        for k, v in zip(names, values):
            f = pos.get(k)
            if f is None:
                f = pos[k] = len(fields)
                fields.append(k)
            row.append([f, ref(v)])
        rows.append(row)
    part = b"".join((b'{"errors":', _dumps_bytes(errors), b',"fields":', _dumps_bytes(fields),
                     b',"table":[', b",".join(table), b'],"rows":', _dumps_bytes(rows), b"}"))
    return zlib.compress(part, PART_UP_ZLIB_LEVEL)


def unpack_part(data: bytes) -> Tuple[Dict[int, str], List[Any]]:
    """Rank 0: a leader's :func:`pack_part` as (errors by position in the group, payloads);
    members' shared values are one object."""
    with gc_paused():
        part = json.loads(zlib.decompress(data))
        fields, table = part["fields"], part["table"]
        payloads = [table[row["v"]] if isinstance(row, dict) else {fields[f]: table[j] for f, j in row}
                    for row in part["rows"]]
    return {int(i): m for i, m in part["errors"].items()}, payloads


class Lead(Protocol):
    """What a group leader does in :meth:`Comm.coordinate` (``lead=``). A lead whose class sets
    ``streams = True`` has rank 0's ``compute`` take the parts as an iterator, each part decoded
    when reached and dropped once passed, so that rank 0 never holds every decoded part at once
    (a first save's commit at 131,072 ranks decoded to 872 MB)."""

    def reduce(self, payloads: List[Any]) -> Any:
        """Its group's decoded payloads (leader first, rank order) -> one JSON-able part for rank 0."""

    def expand(self, group_reply: Any, payloads: List[Any]) -> List[Any]:
        """Rank 0's reply for the group -> one reply per member (leader first)."""


def pack_led_part(part: Mapping[str, Any]) -> bytes:
    """A leader's reduced part (``{"part": ...}`` or ``{"failures": ...}``) for rank 0: one tag
    byte (``F``: failures, ``P``: a part), so that rank 0 finds failures without decoding
    every part, then, compressed: the JSON text's length (u64), the JSON, and each bytes value
    of the part as it is. A bytes value (a group's joined records, object texts) travels
    outside the JSON: no escaped quote to encode or decode, no str made of it at rank 0."""
    blobs: List[bytes] = []
    at = 0

    def blob(v: Any) -> Any:
        nonlocal at
        if isinstance(v, (bytes, bytearray)):
            blobs.append(bytes(v))
            at += len(v)
            return {_BLOB: [at - len(v), len(v)]}
        raise TypeError(f"a part holds a {type(v).__name__}, which JSON cannot carry")

    data = json.dumps(part, separators=(",", ":"), default=blob).encode()
    tag = b"F" if "failures" in part else b"P"
    body = zlib.compressobj(PART_UP_ZLIB_LEVEL)
    out = [tag, body.compress(len(data).to_bytes(8, "little")), body.compress(data)]
    out += [body.compress(b) for b in blobs]
    out.append(body.flush())
    return b"".join(out)


#: the key of the JSON object that stands for a :func:`pack_led_part` bytes value (where it lies after the JSON)
_BLOB = "\x00blob"


def led_part_failed(data: bytes) -> bool:
    """Whether a leader's :func:`pack_led_part` carries failures (decode it) rather than a part."""
    return data[:1] != b"P"


def _decoded_parts(got: List[Any]) -> Iterator[Any]:
    """Rank 0's parts for a streaming lead's compute: each ``got`` item (a decoded
    ``{"part": ...}`` or a leader's packed bytes) decoded when reached; ``got`` empties as it
    goes, so a part is garbage once compute moves past it."""
    got.reverse()
    while got:
        g = got.pop()
        yield (g if isinstance(g, dict) else unpack_led_part(g))["part"]
        del g


def unpack_led_part(data: bytes) -> Dict[str, Any]:
    """Rank 0: a leader's :func:`pack_led_part`, its bytes values in place. A part that does not
    decode (a damaged one, a leader of another version) is a DistributedError, never a bare one."""
    if data[:1] not in (b"F", b"P"):
        raise DistributedError({0: "a group leader's part has no tag byte: run every rank with the same "
                                   "megashard version"}, "gather")
    try:
        raw = zlib.decompress(data[1:])
        n = int.from_bytes(raw[:8], "little")
        out = json.loads(raw[8:8 + n]) if len(raw) >= 8 + n else None
    except (zlib.error, ValueError) as e:
        raise DistributedError({0: f"a group leader's part is malformed ({type(e).__name__}: {e})"}, "gather") from None
    if type(out) is not dict:  # noqa: E721
        raise DistributedError({0: "a group leader's part is malformed (not a JSON object)"}, "gather")
    base = 8 + n
    todo = [out]  # bytes values are looked for in dicts only (parts hold them there); no recursive closure:
    while todo:   # its reference cycle would keep every decompressed part while the collector is paused
        d = todo.pop()
        for k, v in d.items():
            if type(v) is dict:  # noqa: E721
                if len(v) == 1 and _BLOB in v:
                    ref = v[_BLOB]
                    if not (type(ref) is list and len(ref) == 2  # noqa: E721
                            and all(type(x) is int for x in ref)  # noqa: E721
                            and 0 <= ref[0] <= ref[0] + ref[1] <= len(raw) - base):
                        raise DistributedError({0: "a group leader's part is malformed (a bytes value's "
                                                   f"reference {str(ref)[:60]} is not a range of the part)"},
                                               "gather")
                    d[k] = raw[base + ref[0]:base + ref[0] + ref[1]]
                else:
                    todo.append(v)
    return out


def pack_replies(replies: Sequence[Any]) -> bytes:
    """Rank 0: one group's replies, for its leader."""
    return zlib.compress(_dumps_bytes(list(replies)), PART_ZLIB_LEVEL)


def unpack_replies(data: bytes) -> List[bytes]:
    """A leader: its members' replies (JSON, leader first) from :func:`pack_replies`."""
    return [_dumps_bytes(r) for r in json.loads(zlib.decompress(data))]


def _reply_value(reply: Mapping[str, Any], what: str) -> Any:
    if "failures" in reply:
        raise distributed_error({int(r): m for r, m in reply["failures"].items()}, what)
    return reply["ok"]


def node_id() -> str:
    """This process's node: ``MEGASHARD_NODE_ID`` (tests simulate nodes on one host with it), else
    torchrun's ``GROUP_RANK``, else the host name."""
    return str(os.environ.get("MEGASHARD_NODE_ID") or os.environ.get("GROUP_RANK") or os.uname().nodename)


_SIDE: Dict[str, Any] = {}
_SIDE_LOCK = threading.Lock()


def side_group() -> Any:
    """A gloo process group over the whole job, created once (collective: the first call must be made
    by every rank, from the main thread, in the same order as the job's other collectives), for
    traffic that runs beside the job's own collectives, e.g. a background thread's transfers: a
    separate group never interleaves with the default group's operations. None without an
    initialised process group."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    with _SIDE_LOCK:
        if _SIDE.get("world") is not world:  # a new default group (tests re-initialise): a new side group
            _SIDE["group"] = dist.new_group(backend="gloo")
            _SIDE["world"] = world
        return _SIDE["group"]


def node_readers(node_ids: Sequence[str]) -> Dict[int, int]:
    """Map each rank to its node's reader: the lowest rank on the same node."""
    first: Dict[str, int] = {}
    for r, n in enumerate(node_ids):
        first.setdefault(n, r)
    return {r: first[n] for r, n in enumerate(node_ids)}

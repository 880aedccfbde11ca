"""Read-once loads: every byte the job needs leaves storage once, then travels over the process group.

Protocol (collective over the load's process group):

1. every rank sends rank 0 its byte ranges ``(file, offset, nbytes)`` (its load's ops); rank 0
   plans (:func:`megashard.plan.plan_read_once`: the union cut into extents of at most
   ``chunk`` bytes, each read by one rank, byte-balanced over the job's ranks on every node)
   and sends each rank its part: the extents it reads, in rounds, with the messages each one
   sends, and the messages it receives per round;
2. transfer, round by round: a rank reads its extent of the round (one only it needs straight
   into its tensors; any other into one of two staging buffers of at most ``chunk`` bytes),
   copies its own pieces out, and posts the round's sends and receives as one batch
   (:meth:`~megashard.transport.Comm.exchange`: one NCCL group, so ranks that send to each
   other never deadlock); it reads the next round's extent while that batch is in flight. A
   message that is exactly one piece of a destination lands there directly; others land in a
   temporary of at most ``chunk`` bytes, copied out and freed when the batch completes.

So a rank holds at most two staging extents plus the round's received runs, whatever the
checkpoint's size, besides the resharding temporaries that ``load`` allocates when their
first bytes arrive and frees once placed. A rank that fails to read keeps sending (stale
bytes) and one that fails to place keeps receiving (into scratch), so no rank waits for a
failed one: the error reaches every rank in ``load``'s final agreement. Nothing here calls
``torch.distributed`` (see :class:`~megashard.transport.Comm`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import plan
from .devicecopy import on_host
from .errors import CheckpointError
from .format import empty_buffer
from .format.fastio import default_read_threads, tensor_memoryview
from .scatter import _copy
from .transport import Comm


def _plan_replies(requests: List[Any], chunk: int) -> List[Dict[str, Any]]:
    """Rank 0: every rank's part of the plan. ``requests[r]``: ``{"ops": [[file, offset,
    nbytes], ...], "node": its node's id, or None on an object store}``."""
    reqs = [[(str(f), int(a), int(n)) for f, a, n in r["ops"]] for r in requests]
    nodes = [r["node"] for r in requests]
    by_node = None if any(n is None for n in nodes) else [int(n) for n in nodes]
    return plan.plan_read_once(reqs, chunk, by_node).replies()


def read_once(comm: Comm, base: str, index: Any, ops: Sequence[Any], chunk: int, threads: Optional[int],
              open_files: Callable[[], Any], node: Optional[int] = None) -> Tuple[Tuple[int, int, int], Optional[str]]:
    """Deliver every op's ``file``/``offset``/``nbytes`` into ``op.target()``, then
    ``op.arrived(nbytes)`` per piece. Returns ``((bytes read from storage, bytes received,
    peak bytes of staging buffers), error or None)``; raises DistributedError (on every rank)
    when the plan fails. ``open_files()`` returns the files object
    (:func:`~megashard.storage.checkpoint_files`). ``node``: this rank's node (its node
    reader's rank) when the checkpoint is on a file system, so that each file is read on one
    node (see :func:`~megashard.plan.plan_read_once`); None on an object store."""
    chunk = max(1, int(chunk))
    req = {"ops": [[op.file, op.offset, op.nbytes] for op in ops], "node": node}
    mine = comm.coordinate("read-once load (plan)", None, req, lambda reqs: _plan_replies(reqs, chunk))
    return _Transfer(comm, base, index, ops, mine, threads, open_files).run()


class _Transfer:
    def __init__(self, comm: Comm, base: str, index: Any, ops: Sequence[Any], sched: Dict[str, Any],
                 threads: Optional[int], open_files: Callable[[], Any]) -> None:
        self.comm, self.base, self.index, self.ops = comm, base, index, ops
        self.reads: List[List[Any]] = sched["reads"]
        self.recvs: Dict[int, List[List[Any]]] = {int(k): v for k, v in sched["recvs"].items()}
        self.threads = threads or default_read_threads()
        self.open_files = open_files
        self.files: Any = None
        self.err: Optional[str] = None
        self.nread = self.nrecv = 0
        self.held = self.peak = 0  # bytes of staging buffers
        self.scratch: Optional[torch.Tensor] = None

    def fail(self, msg: str) -> None:
        if self.err is None:
            self.err = msg

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def size(self, f: str) -> int:
        files = getattr(self.index, "files", self.index)
        if f not in files:
            raise CheckpointError(f"{self.base}: the read-once plan names {f!r}, which the index does not list")
        return int(files[f].get("bytes", 0))

    def check(self) -> None:
        """The plan against this rank's ops and the files (opened and size-checked) before any byte moves."""
        n_ops = len(self.ops)

        def piece_ok(i: int, pos: int, n: int) -> bool:
            return 0 <= i < n_ops and 0 <= pos and 0 < n and pos + n <= self.ops[i].nbytes

        for f, a, b, mine, runs in self.reads:
            if not (0 <= a < b <= self.size(f)):
                raise CheckpointError(f"{self.base}/{f}: byte range {a}+{b - a} past end of file ({self.size(f)} bytes)")
            for i, pos, n, off in mine:
                if not (piece_ok(i, pos, n) and self.ops[i].file == f and self.ops[i].offset + pos == a + off):
                    raise CheckpointError(f"read-once plan: a piece of {f} {a}+{b - a} is not this rank's op {i}")
            for _, off, n in runs:
                if not (0 <= off and 0 < n and off + n <= b - a):
                    raise CheckpointError(f"read-once plan: a message past extent {f} {a}+{b - a}")
        for msgs in self.recvs.values():
            for _, n, pieces in msgs:
                for i, pos, m, off in pieces:
                    if not (piece_ok(i, pos, m) and 0 <= off and off + m <= n):
                        raise CheckpointError(f"read-once plan: a received piece is not this rank's op {i}")
        if self.reads:
            self.files = self.open_files()
            for f in sorted({r[0] for r in self.reads}):  # name, type and size checks first
                self.files.read_into(f, (), size=self.size(f), threads=1)

    def run(self) -> Tuple[Tuple[int, int, int], Optional[str]]:
        try:
            self.check()
        except Exception as e:  # noqa: BLE001 - still take part: peers expect this rank's messages
            self.fail(f"{type(e).__name__}: read-once load: {e}")
        rounds = max([len(self.reads)] + [k + 1 for k in self.recvs])
        biggest = max((b - a for _, a, b, _, _ in self.reads), default=0)  # at most the chunk
        staging: List[Optional[torch.Tensor]] = [None, None]
        prev: Optional[Tuple[Any, List[Any]]] = None
        try:
            for k in range(rounds):
                sends: List[Tuple[torch.Tensor, int]] = []
                if k < len(self.reads):
                    f, a, b, mine, runs = self.reads[k]
                    if not runs and self.err is None and self.direct_ok(mine, b - a):
                        self.read_direct(f, a, mine)
                    else:
                        if staging[k % 2] is None:
                            staging[k % 2] = empty_buffer(biggest)
                            self.hold(biggest)
                        buf = staging[k % 2][:b - a]
                        self.read_staged(f, a, buf, mine)
                        sends = [(buf[off:off + n], dst) for dst, off, n in runs]
                recvs, landing = self.post_recvs(k)
                batch = self.comm.exchange(sends, recvs, "read-once load: exchange")
                if prev is not None:
                    self.complete(*prev)
                prev = (batch, landing)
            if prev is not None:
                self.complete(*prev)
        except Exception as e:  # noqa: BLE001 - a transport failure ends the load on every rank
            self.fail(f"{type(e).__name__}: read-once load: exchange failed: {e}")
        finally:
            if self.files is not None:
                self.files.close()
            staging = [None, None]
            self.held = 0
        return (self.nread, self.nrecv, self.peak), self.err

    # -- reads ---------------------------------------------------------------------
    def direct_ok(self, mine: Sequence[Sequence[int]], size: int) -> bool:
        """This rank's pieces tile the extent, all in host memory: read in place."""
        return (sum(p[2] for p in mine) == size and not _overlap(mine)
                and all(self.ops[i].lazy is not None or on_host(self.ops[i].dest) for i, _, _, _ in mine))

    def read_direct(self, f: str, a: int, mine: Sequence[Sequence[int]]) -> None:
        if self.err is not None:
            return
        try:
            targets = [(i, n, self.ops[i].target()[pos:pos + n]) for i, pos, n, _ in mine]
            reqs = [(a + off, tensor_memoryview(t)) for (_, _, _, off), (_, _, t) in zip(mine, targets)]
            self.nread += self.files.read_into(f, reqs, size=self.size(f), threads=self.threads)
            del reqs
            for i, n, _ in targets:
                self.ops[i].arrived(n)
        except Exception as e:  # noqa: BLE001 - reported in the final agreement
            self.fail(f"{type(e).__name__}: read-once load: reading {self.base}/{f}: {e}")

    def read_staged(self, f: str, a: int, buf: torch.Tensor, mine: Sequence[Sequence[int]]) -> None:
        """Read an extent into ``buf`` and copy this rank's pieces out. After a failure the
        buffer's stale bytes are still sent (the receivers must not wait)."""
        if self.err is not None:
            return
        try:
            self.nread += self.files.read_into(f, [(a, tensor_memoryview(buf))], size=self.size(f),
                                               threads=self.threads)
            for i, pos, n, off in mine:
                _copy(self.ops[i].target()[pos:pos + n], buf[off:off + n])
                self.ops[i].arrived(n)
        except Exception as e:  # noqa: BLE001
            self.fail(f"{type(e).__name__}: read-once load: reading {self.base}/{f}: {e}")

    # -- receives --------------------------------------------------------------------
    def post_recvs(self, k: int) -> Tuple[List[Tuple[torch.Tensor, int]], List[Any]]:
        """Where round ``k``'s messages land: straight into a destination when one message is
        exactly one piece of it, else into a temporary (copied out by :meth:`complete`)."""
        recvs: List[Tuple[torch.Tensor, int]] = []
        landing: List[Any] = []
        for src, n, pieces in self.recvs.get(k, ()):
            t: Optional[torch.Tensor] = None
            staged = not (len(pieces) == 1 and pieces[0][2] == n)
            if self.err is None:
                try:
                    if staged:
                        t = torch.empty(n, dtype=torch.uint8)
                        self.hold(n)
                    else:
                        i, pos, m, _ = pieces[0]
                        t = self.ops[i].target()[pos:pos + m]
                except Exception as e:  # noqa: BLE001 - the bytes still arrive, into scratch
                    self.fail(f"{type(e).__name__}: read-once load: receiving from rank {src}: {e}")
                    t = None
            if t is None:
                if self.scratch is None or self.scratch.numel() < n:
                    self.scratch = torch.empty(n, dtype=torch.uint8)
                t = self.scratch[:n]
                staged = False
                pieces = []
            recvs.append((t, src))
            landing.append((t, staged, pieces))
        return recvs, landing

    def complete(self, batch: Any, landing: List[Any]) -> None:
        batch.wait()
        for t, staged, pieces in landing:
            self.nrecv += t.numel()
            if self.err is not None or not pieces:
                if staged:
                    self.held -= t.numel()
                continue
            try:
                for i, pos, m, off in pieces:
                    if staged:
                        _copy(self.ops[i].target()[pos:pos + m], t[off:off + m])
                    self.ops[i].arrived(m)
            except Exception as e:  # noqa: BLE001
                self.fail(f"{type(e).__name__}: read-once load: placing received bytes: {e}")
            if staged:
                self.held -= t.numel()
        landing.clear()


def _overlap(pieces: Sequence[Sequence[int]]) -> bool:
    spans = sorted((off, off + n) for _, _, n, off in pieces)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))

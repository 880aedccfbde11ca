"""Scatter loads: one reader per node reads each needed byte once and hands it out.

Protocol (collective over the load's process group; every rank takes every step,
so a failure anywhere surfaces in the same agreement on every rank):

1. each non-reader sends its node's reader one JSON request: its byte ranges
   ``(file, offset, nbytes)``, the shards it touches (for ``verify``), its pid and,
   unless the transport is ``group``, the name of a socket it listens on
   (:mod:`megashard.fdpass`);
2. the reader checks the ranges (opening every file), splits the node's bytes into
   those only one rank needs and those several ranks need, and plans the transfer:
   ``shm`` (within one kernel and PID namespace), ``group``, or ``none`` when no other
   rank of the node needs bytes (the reader then reads its own in place). With ``shm``, where
   the storage has descriptors to pass (its files object's ``passes_descriptors``), it hands
   each rank, over that rank's socket, its own descriptors of the files holding bytes
   only that rank needs, tells it which files and its own pid (the only peer that rank
   accepts descriptors from) and waits for its answer: a rank whose socket fails on
   either side gets those bytes through the ring instead (logged once by the reader).
   An object store has no descriptors but lets every rank read (``every_rank_reads``,
   every GET pinned to the index's ETag): each rank reads its runs of bytes only it needs
   through a files object of its own, except runs whose reads would also fetch bytes
   other ranks need, or too small to be worth a request of their own (:func:`_read_alone`);
   then it sends each rank a schedule: which byte
   ranges it reads itself (through the passed descriptors or its own files object), where to open the ring (an
   anonymous memory file the reader created first: its pid, descriptor, device and
   inode; it has no name, so nothing outlives the node's ranks) and where this rank's
   shared ranges lie in it; or, for ``group``, that chunks come as point-to-point
   messages in a fixed order;
3. agreement "setup" (reader: files present and ranges valid, ring created; the
   others: schedule received and consistent with the descriptors they took); the
   ranks open the ring through ``/proc/<reader pid>/fd/<fd>``; agreement "open";
4. transfer. ``shm``: every rank reads the bytes only it needs straight into its
   tensors (``preadv``, as in ``own`` mode), while the reader fills ring slots
   (:mod:`megashard.shm`) with the bytes several ranks need and each rank copies
   its pieces out of the mapping. ``group``: double-buffered staging and async sends;
   a rank that fails keeps taking its messages (into scratch) and a reader that fails
   keeps sending (stale bytes), so no rank waits for a failed one: the error reaches
   every rank in the final agreement once the transfer is through.

So the node reads each byte from storage exactly once (a rank's reads through a
passed descriptor or its own object-store GETs count as its own ``bytes_read``), no
non-reader ever opens a path in the checkpoint directory, and on a warm page cache the
node's ranks copy in parallel as in ``own`` mode. Nothing here calls ``torch.distributed`` directly (see
:class:`~megashard.transport.Comm`).
"""
from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import threading
from collections import deque
from functools import partial
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from . import fdpass, plan, shm
from .devicecopy import DeviceCopier, device_targets, on_host, split_targets
from .errors import CheckpointError, MegashardError
from .format import empty_buffer
from .format.fastio import default_read_threads, read_requests, tensor_memoryview
from .transport import Comm

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "group")

Range = Tuple[str, int, int]  # file, offset, nbytes
Direct = Tuple[str, int, int, int, int]  # file, offset, nbytes, op index, offset in op
DIRECT_BATCH_MIN = 64 << 20  # bytes per direct-read batch, at least (fewer hand-offs between threads)


def _send_json(comm: Comm, obj: Any, dst: int) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    comm.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    comm.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _recv_json(comm: Comm, src: int) -> Any:
    n = torch.zeros(1, dtype=torch.int64)
    comm.recv(n, src)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    comm.recv(buf, src)
    return json.loads(bytes(buf.numpy()))


def _copy(dst: torch.Tensor, src: torch.Tensor, copier: Optional[DeviceCopier] = None) -> None:
    """Copy bytes between contiguous uint8 CPU tensors with libc memcpy (measured 16 GB/s
    from a ring slot vs 1-3 GB/s for ``Tensor.copy_`` of uint8 here; ctypes drops the GIL).
    A GPU ``dst`` with a ``copier``: an asynchronous copy, complete after ``copier.sync()``."""
    if on_host(dst) and on_host(src) and dst.is_contiguous() and src.is_contiguous():
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    elif copier is not None and not on_host(dst):
        copier.copy(dst, src)
    else:
        dst.copy_(src)


def _place(ops: Sequence[Any], lock: threading.Lock, src: torch.Tensor,
           pieces: Sequence[Tuple[int, int, int, int]], copier: Optional[DeviceCopier]) -> int:
    """Copy ``(op index, position in op, bytes, offset in src)`` pieces of a ring slot
    into their ops' targets; returns the bytes placed, all complete (the slot may be
    reused at once). The lock guards the ops, which the direct-read thread completes too."""
    placed = 0
    for i, pos, n, off in pieces:
        with lock:
            dst = ops[i].target()[pos:pos + n]
        _copy(dst, src[off:off + n], copier)
        del dst
        placed += n
    if copier is not None:
        copier.sync()
    with lock:
        for i, _, n, _ in pieces:
            ops[i].arrived(n)
    return placed


def _err(e: BaseException, what: str) -> str:
    return f"{type(e).__name__}: {what}: {e}"


def scatter(comm: Comm, base: str, manifest: Any, ops: Sequence[Any], touched: Dict[str, Dict[str, Any]],
            readers: Mapping[int, int], chunk: int, threads: Optional[int], transport: str,
            open_files: Callable[[], Any]) -> Tuple[Tuple[int, int, str], Optional[str]]:
    """Deliver every op's ``file``/``offset``/``nbytes``: into ``op.target()`` (a contiguous CPU
    uint8 tensor, possibly allocated on that call), then ``op.arrived(nbytes)`` per piece.

    Returns ``((bytes read from storage, bytes received, transport used), error or None)``. On a node's
    reader, ``touched`` is extended with what the node's other ranks touch, so that
    ``verify`` there covers every byte the node loaded. Raises DistributedError (on
    every rank) when the setup fails. ``open_files()`` returns the files object
    (:func:`~megashard.storage.checkpoint_files`): the reader reads through its ``read_into``,
    passes descriptors (``descriptor``) only where ``passes_descriptors``, and closes it; a
    non-reader opens one only where the reader's has ``every_rank_reads`` (an object store),
    to read the bytes no other rank of its node needs.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"scatter_transport must be one of {TRANSPORTS}, got {transport!r}")
    chunk = max(1, int(chunk))
    devices = device_targets(op.dest for op in ops)
    copier = DeviceCopier(devices) if devices else None  # GPU destinations (lazy temporaries are on the host)
    try:
        if readers[comm.rank] == comm.rank:
            return _Reader(comm, base, manifest, ops, touched, readers, chunk, threads, transport, open_files,
                           copier).run()
        return _Consumer(comm, base, manifest, ops, touched, readers[comm.rank], chunk, transport, threads,
                         copier, open_files).run()
    finally:
        if copier is not None:
            copier.close()


# ---------------------------------------------------------------------------
# non-readers


class _Consumer:
    """A non-reader's side: request, (descriptors,) schedule, transfer."""

    def __init__(self, comm: Comm, base: str, manifest: Any, ops: Sequence[Any], touched: Mapping[str, Dict[str, Any]],
                 reader: int, chunk: int, transport: str, threads: Optional[int],
                 copier: Optional[DeviceCopier], open_files: Callable[[], Any]) -> None:
        self.comm, self.base, self.manifest, self.ops, self.touched = comm, base, manifest, ops, touched
        self.copier, self.open_files = copier, open_files
        self.reader, self.chunk, self.transport = reader, chunk, transport
        self.threads = threads or default_read_threads()
        self.fds: Dict[str, int] = {}
        self.files: Any = None  # this rank's own files object, where the schedule says it reads itself
        self.lock = threading.Lock()  # ops' lazy temporaries, shared by the ring and direct-read threads
        self.copied_all = False  # every byte is out of the ring: it is unmapped off this load's path

    def run(self) -> Tuple[Tuple[int, int, str], Optional[str]]:
        err: Optional[str] = None
        sched: Dict[str, Any] = {}
        listener: Optional[fdpass.Listener] = None
        req = {"ops": [[op.file, op.offset, op.nbytes] for op in self.ops], "pid": os.getpid(),
               "host": shm.host_identity(), "touched": self.touched}
        if self.transport != "group" and any(op.nbytes for op in self.ops):
            try:
                listener = fdpass.Listener()
                req["fd_socket"] = listener.name
            except MegashardError as e:
                req["fd_error"] = str(e)
        ring: Optional[shm.Ring] = None
        direct: Optional[_DirectReads] = None
        try:
            try:
                _send_json(self.comm, req, self.reader)
                sched = _recv_json(self.comm, self.reader)
                if "fd_pass" in sched:  # descriptors first; any failure here means "use the ring"
                    _send_json(self.comm, {"error": self.receive_fds(listener, sched["fd_pass"])}, self.reader)
                    sched = _recv_json(self.comm, self.reader)
                if sched.get("self_read"):  # an object store: this rank GETs its own bytes (no descriptors)
                    fdpass.close_all(list(self.fds.values()))
                    self.fds.clear()
                    self.files = self.open_files()
                elif [str(f) for f in sched.get("fd_files", [])] != list(self.fds):
                    if sched.get("fd_files"):
                        raise CheckpointError(f"scatter schedule from reader rank {self.reader} names files "
                                              "whose descriptors this rank did not receive")
                    fdpass.close_all(list(self.fds.values()))  # the schedule does without them
                    self.fds.clear()
                if sched.get("transport") == "shm":  # this rank's own bytes need nothing more: read them
                    # while the agreements run (a failed setup stops the reads before anything returns)
                    direct = _DirectReads(self.ops, self.lock,
                                          self.read_self if self.files is not None else self.read_passed,
                                          self.base, self.direct_batches(sched), self.threads, self.copier)
                    direct.start()
            except MegashardError as e:
                err = _err(e, f"exchanging the scatter schedule with reader rank {self.reader}")
            finally:
                if listener is not None:  # descriptors not accepted by now are dropped with the socket
                    listener.close()
            self.comm.agree(err, "scatter load (setup)")
            if sched["transport"] == "shm":
                try:
                    ring = shm.Ring.attach(sched["ring"], sched["consumers"], sched["slots"], sched["slot_bytes"],
                                           sched["index"], populate=sched.get("populate", True) is not False)
                    needed = [k for k, _ in sched["extents"]]
                    ring.set_done(sched["index"], needed[0] if needed else sched["n_extents"])
                    if not shm.pid_alive(sched["reader_pid"]):
                        raise shm.ShmError(f"reader pid {sched['reader_pid']} is not visible from this rank")
                except MegashardError as e:
                    err = _err(e, f"opening the node's shared memory from reader rank {self.reader}")
            self.comm.agree(err, "scatter load (open)")
            if ring is not None and direct is not None:
                return self.transfer_shm(ring, sched, direct)
            if sched["transport"] == "none":  # this rank needs no bytes; its reader reads its own alone
                return (0, 0, "none"), None
            nbytes = sum(op.nbytes for op in self.ops)
            return (0, nbytes, "group"), _consume_group(self.comm, self.ops, self.reader, sched["chunk"])
        finally:
            if direct is not None:
                direct.finish(True)  # (a no-op after a transfer) before its descriptors close
            fdpass.close_all(list(self.fds.values()))
            self.fds.clear()
            if self.files is not None:
                self.files.close()
            if ring is not None:
                if self.copied_all:
                    ring.close_in_background()
                else:
                    ring.close()

    def read_passed(self, f: str, reqs: List[Tuple[int, memoryview]], threads: int) -> None:
        """Fill ``reqs`` from ``f`` through the descriptor the reader passed (checked on receipt)."""
        read_requests(self.fds[f], reqs, os.path.join(self.base, f), threads)

    def read_self(self, f: str, reqs: List[Tuple[int, memoryview]], threads: int) -> None:
        """Fill ``reqs`` from ``f`` through this rank's own files object (every read pinned to the
        index's ETag and checked against its size, as the reader's are)."""
        self.files.read_into(f, reqs, size=int(self.manifest.files[f].get("bytes", 0)), threads=threads)

    def receive_fds(self, listener: Optional[fdpass.Listener], offer: Dict[str, Any]) -> Optional[str]:
        """Take the reader's descriptors of ``offer["files"]`` (only from ``offer["reader_pid"]``) and
        check each against the index; returns why not (the reader then uses the ring), or None."""
        fds: List[int] = []
        try:
            files = [str(f) for f in offer["files"]]
            if listener is None:
                raise fdpass.FdPassError("the reader sent descriptors but this rank has no socket")
            fds = listener.receive(int(offer["reader_pid"]), len(files))
            for f, fd in zip(files, fds):
                if f not in self.manifest.files:
                    raise CheckpointError(f"{self.base}: the reader passed {f!r}, which the index does not list")
                fdpass.check_file(fd, int(self.manifest.files[f].get("bytes", 0)), os.path.join(self.base, f))
        except Exception as e:  # noqa: BLE001 - any failure here is answered by the ring
            fdpass.close_all(fds)
            return f"{type(e).__name__}: {e}"[:300]
        self.fds = dict(zip(files, fds))
        return None

    def direct_batches(self, sched: Dict[str, Any]) -> List[List[Direct]]:
        """This rank's own reads from the schedule, each checked against its own request."""
        files = [str(f) for f in sched.get("fd_files", [])]
        out: List[Direct] = []
        for fi, a, n, i, pos in sched.get("direct", []):
            op = self.ops[i]
            if not (0 <= pos and n > 0 and pos + n <= op.nbytes and files[fi] == op.file and a == op.offset + pos):
                raise CheckpointError(f"scatter schedule from reader rank {self.reader} names bytes outside "
                                      f"this rank's request (op {i}: {files[fi]} {a}+{n})")
            out.append((files[fi], a, n, i, pos))
        return _batches(out, _direct_batch_bytes(self.chunk), self.ops)

    def transfer_shm(self, ring: shm.Ring, sched: Dict[str, Any],
                     direct: "_DirectReads") -> Tuple[Tuple[int, int, str], Optional[str]]:
        """Copy the shared bytes out of the ring while ``direct`` (a second thread, started
        with the schedule) reads this rank's own bytes through the passed descriptors."""
        me, total, reader_pid = sched["index"], sched["n_extents"], sched["reader_pid"]
        extents = sched["extents"]
        received = 0
        err: Optional[str] = None
        try:
            if self.copier is not None:
                self.copier.register(ring.data)
            for j, (k, pieces) in enumerate(extents):
                ring.wait_produced(k, reader_pid)
                src = ring.slot(k, ring.slot_bytes)
                received += _place(self.ops, self.lock, src, pieces, self.copier)
                del src
                ring.set_done(me, extents[j + 1][0] if j + 1 < len(extents) else total)
                if direct.error is not None:
                    break
        except Exception as e:  # noqa: BLE001 - reported in the final agreement
            ring.fail_consumer(me)
            err = _err(e, "copying from the node's shared memory")
        direct.finish(err is not None)
        if self.copier is not None:
            self.copier.unregister_all()  # before the ring is unmapped
        if direct.error is not None:
            ring.fail_consumer(me)
            err = err or _err(direct.error, "reading this rank's own ranges through the reader's descriptors"
                              if self.files is None else "reading this rank's own ranges from the store itself "
                              "(scatter_transport='group' leaves every request to the node's reader)")
        self.copied_all = err is None
        return (direct.nread, received, "shm"), err


def _subops(ops: Sequence[Any], chunk: int) -> List[Tuple[str, int, int, int, int]]:
    """Ops split into ≤chunk pieces ``(file, offset, nbytes, op index, offset in op)``, in serving order."""
    out = []
    for i, op in enumerate(ops):
        for f, off, n, pos in plan.split_op((op.file, op.offset, op.nbytes), chunk):
            out.append((f, off, n, i, pos))
    out.sort(key=lambda s: (s[0], s[1], s[2], s[3], s[4]))
    return out


def _consume_group(comm: Comm, ops: Sequence[Any], reader: int, chunk: int) -> Optional[str]:
    """Receive in serving order with at most ~4 chunks posted ahead, so that temporaries
    (allocated on first use) exist only while their bytes are in flight.

    After a failure here (a destination that cannot be allocated or placed) the rest still
    arrives, into one scratch buffer: the reader's sends must complete, or it would wait for
    this rank until the process group's timeout. A transport failure ends it at once."""
    subops = _subops(ops, chunk)
    window = 4 * chunk
    posted: Deque[Tuple[Any, int, int, bool]] = deque()
    ahead = j = 0
    err: Optional[str] = None
    scratch: Optional[torch.Tensor] = None
    try:
        while j < len(subops) or posted:
            while j < len(subops) and (not posted or ahead + subops[j][2] <= window):
                _, _, n, i, pos = subops[j]
                dst: Optional[torch.Tensor] = None
                if err is None:
                    try:
                        dst = ops[i].target()[pos:pos + n]
                    except Exception as e:  # noqa: BLE001 - reported once the reader is through
                        err = _err(e, f"receiving from reader rank {reader}")
                if dst is None:
                    if scratch is None:
                        scratch = torch.empty(max(s[2] for s in subops), dtype=torch.uint8)
                    dst = scratch[:n]
                posted.append((comm.irecv(dst, reader), n, i, err is None))
                ahead += n
                j += 1
            h, n, i, real = posted.popleft()
            h.wait()
            ahead -= n
            if real and err is None:
                try:
                    ops[i].arrived(n)
                except Exception as e:  # noqa: BLE001
                    err = _err(e, f"placing bytes from reader rank {reader}")
    except Exception as e:  # noqa: BLE001 - a transport failure ends the load on every rank
        return err or _err(e, f"receiving from reader rank {reader}")
    return err


# ---------------------------------------------------------------------------
# the reader


class _Reader:
    """The node reader's side: plan, schedule, set up the transport, transfer."""

    def __init__(self, comm: Comm, base: str, manifest: Any, ops: Sequence[Any], touched: Dict[str, Dict[str, Any]],
                 readers: Mapping[int, int], chunk: int, threads: Optional[int], transport: str,
                 open_files: Callable[[], Any], copier: Optional[DeviceCopier]) -> None:
        self.comm, self.base, self.manifest, self.ops, self.touched = comm, base, manifest, ops, touched
        self.copier = copier
        self.chunk, self.transport, self.open_files = chunk, transport, open_files
        self.threads = threads or default_read_threads()
        self.consumers = sorted(r for r, rd in readers.items() if rd == comm.rank and r != comm.rank)
        self.requests: Dict[int, List[Range]] = {}
        self.pids: List[int] = []
        self.sockets: List[Optional[str]] = []  # per consumer: its fd socket's name
        self.no_socket: Dict[int, str] = {}  # consumer rank -> why it has no socket
        self.err: Optional[str] = None
        self.nread = 0
        self.files: Any = None
        self.lock = threading.Lock()  # ops' lazy temporaries, shared by the ring and direct-read threads
        self.ring_handed_off = False  # the ring is closed by its release thread (shm.Ring.close_when_consumed)

    def fail(self, msg: str) -> None:
        if self.err is None:
            self.err = msg

    def run(self) -> Tuple[Tuple[int, int, str], Optional[str]]:
        same_host = True
        for r in self.consumers:
            try:
                req = _recv_json(self.comm, r)
            except MegashardError as e:
                self.fail(_err(e, f"receiving rank {r}'s scatter request"))
                req = {"ops": [], "touched": {}, "pid": 0, "host": ""}
            self.requests[r] = [(str(f), int(a), int(n)) for f, a, n in req["ops"]]
            self.pids.append(int(req["pid"]))
            sock = req.get("fd_socket")
            self.sockets.append(sock if isinstance(sock, str) else None)
            if req.get("fd_error"):
                self.no_socket[r] = str(req["fd_error"])[:300]
            same_host = same_host and bool(req["host"]) and req["host"] == shm.host_identity()
            for f, names in req.get("touched", {}).items():
                if isinstance(names, dict):
                    self.touched.setdefault(str(f), {}).update({str(n): r for n, r in names.items()})
        sched: Dict[str, Any] = {}
        mode = "group"
        try:
            self.check_ranges()
            if not any(n for r in self.consumers for _, _, n in self.requests[r]):
                mode = "none"  # only this rank needs bytes: it reads them itself, nothing travels
            elif self.wants_ring():
                passes = bool(self.files.passes_descriptors)
                if passes:
                    candidates = {c for c, s in enumerate(self.sockets) if s}
                elif self.self_reads():  # an object store: each rank GETs the bytes only it needs itself
                    candidates = set(range(len(self.consumers)))
                else:  # every other rank's bytes through the ring
                    candidates = set()
                sched = self.plan_shm(candidates)
                mode = self.choose(same_host, self.ring_bytes(sched))
                if mode == "shm" and passes:
                    passed = self.pass_fds(sched, candidates)
                    if passed != candidates:  # those ranks take their bytes from the ring instead
                        sched = self.plan_shm(passed)
                        mode = self.choose(same_host, self.ring_bytes(sched))
        except Exception as e:  # noqa: BLE001 - still send schedules: the ranks must reach the agreement
            self.fail(f"{type(e).__name__}: planning the scatter load: {e}")
            mode = "group"
        ring: Optional[shm.Ring] = None
        direct: Optional[_DirectReads] = None
        try:
            if mode == "shm" and self.err is None:
                direct = self.start_direct(sched)  # this rank's own bytes: read while the ring is made and handed out
                try:  # before the schedules: they say where to open it
                    ring = shm.Ring.create(len(self.consumers), sched["slots"], sched["slot_bytes"],
                                           populate=self.populate_ring(), reserve=not self.writes_file_ranges())
                except MegashardError as e:
                    self.fail(_err(e, "creating the node's shared memory ring"))
                    direct.finish(True)  # the load fails; stop reading before the error path touches the tensors
            if mode == "shm":
                scheds = self.shm_schedules(sched, ring.handle() if ring is not None else None)
            else:
                scheds = {r: {"transport": mode, "chunk": self.chunk} for r in self.consumers}
            for r in self.consumers:
                try:
                    _send_json(self.comm, scheds[r], r)
                except MegashardError as e:
                    self.fail(_err(e, f"sending rank {r} its scatter schedule"))
            self.comm.agree(self.err, "scatter load (setup)")
            self.comm.agree(None, "scatter load (open)")  # every rank has the ring open (or said why not)
            if ring is not None and direct is not None:
                self.transfer_shm(ring, sched, direct)
            elif mode == "none":
                self.read_alone()
            else:
                self.transfer_group()
        finally:
            if direct is not None:
                direct.finish(True)  # (a no-op after a transfer) before its files close
            if self.files is not None:
                self.files.close()
            if ring is not None and not self.ring_handed_off:
                ring.close()
        return (self.nread, 0, mode), self.err

    # -- planning ---------------------------------------------------------------
    def check_ranges(self) -> None:
        mine = [(op.file, op.offset, op.nbytes) for op in self.ops]
        ranges = mine + [x for r in self.consumers for x in self.requests[r]]
        files = sorted({f for f, _, _ in ranges})
        unknown = [f for f in files if f not in self.manifest.files]
        if unknown:
            raise CheckpointError(f"{self.base}: ranks asked for files the manifest does not list: {unknown[:5]}")
        self.files = self.open_files()
        for f in files:  # no requests: only the checks (name, type, size), before anything is planned
            self.read(f, (), 1)
        for f, a, n in ranges:
            size = int(self.manifest.files[f].get("bytes", 0))
            if a < 0 or n < 0 or a + n > size:
                raise CheckpointError(f"{os.path.join(self.base, f)}: byte range {a}+{n} past end of file ({size} bytes)")

    def self_reads(self) -> bool:
        """Whether the node's other ranks read the bytes only they need through files objects of their
        own: the store needs no descriptor for that (``every_rank_reads``: an object store, whose every
        GET is pinned to the index's ETag). Their bytes then cross no process, and scatter costs what
        ``own`` does where nothing is shared; the ring carries only bytes several ranks need."""
        return bool(getattr(self.files, "every_rank_reads", False))

    def wants_ring(self) -> bool:
        """Whether shared memory is an option: other ranks need bytes and the caller allows it."""
        return self.transport != "group" and any(n for r in self.consumers for _, _, n in self.requests[r])

    def choose(self, same_host: bool, need: int) -> str:
        """``shm`` or ``group`` for this node (the other ranks learn it from their schedule)."""
        free = shm.available_bytes()
        problem = None
        if not same_host:
            problem = ("the node's ranks do not all share this rank's kernel (boot id), PID namespace and user id: "
                       "no shared memory through /proc/PID/fd, or their pids cannot be watched for crashes")
        elif not shm.dumpable():
            problem = ("this process is not dumpable (it changed its user id without an exec, or called "
                       "prctl(PR_SET_DUMPABLE, 0)): the node's other ranks cannot open its shared memory "
                       "through /proc/PID/fd")
        elif free < need:
            problem = (f"{free / 2**20:.1f} MiB of memory available for shared memory (MEGASHARD_SHM_MAX_BYTES "
                       f"caps it), the ring needs {need / 2**20:.1f} MiB; lower scatter_chunk_bytes")
        if problem is None:
            return "shm"
        if self.transport == "shm":
            self.fail(f"ShmError: scatter_transport='shm' is not possible: {problem}")
            return "group"
        log.warning("[rank %d] scatter load: %s; sending over the process group instead "
                    "(scatter_transport='group' selects that without this check)", self.comm.rank, problem)
        return "group"

    def plan_shm(self, fd_ok: Set[int]) -> Dict[str, Any]:
        """Split the node's bytes: those only one rank needs are read by that rank itself
        (the reader's, and those of consumers in ``fd_ok``, which get descriptors); the rest
        (bytes several ranks need, and everything for consumers without descriptors) goes
        through the ring in disjoint extents of ≤ ``chunk`` bytes. Each byte is read once."""
        ranges: List[Range] = []
        owners: List[Tuple[int, int]] = []  # (consumer index or -1 for the reader, op index)
        for c, r in enumerate(self.consumers):
            for i, op in enumerate(self.requests[r]):
                ranges.append(op)
                owners.append((c, i))
        for i, op in enumerate(self.ops):
            ranges.append((op.file, op.offset, op.nbytes))
            owners.append((-1, i))
        ring_ranges: List[Range] = []
        ring_owners: List[Tuple[int, int, int]] = []  # (consumer or -1, op index, offset in op)
        direct: List[List[Direct]] = [[] for _ in self.consumers]
        mine_direct: List[Direct] = []
        alone: List[Tuple[int, Direct]] = []  # (consumer or -1, piece) bytes only one rank needs
        for (f, a, _), (c, i), pieces in zip(ranges, owners, split_shared(ranges)):
            for pos, n, shared in pieces:
                if shared or (c >= 0 and c not in fd_ok):
                    ring_ranges.append((f, a + pos, n))
                    ring_owners.append((c, i, pos))
                else:
                    alone.append((c, (f, a + pos, n, i, pos)))
        gap = int(getattr(self.files, "read_gap_bytes", 0) or 0)
        for (c, d), own in zip(alone, _read_alone(alone, ranges, gap)):
            if own:
                (mine_direct if c < 0 else direct[c]).append(d)
            else:  # its GETs would also fetch bytes other ranks need: read once, in the ring's extents
                ring_ranges.append((d[0], d[1], d[2]))
                ring_owners.append((c, d[3], d[4]))
        extents, pieces = plan.partition(ring_ranges, self.chunk)
        mine: Dict[int, List[Tuple[int, int, int, int]]] = {}  # ring extent -> (op, pos, n, offset in slot)
        per_consumer: List[Dict[int, List[List[int]]]] = [{} for _ in self.consumers]
        for (c, i, base), ps in zip(ring_owners, pieces):
            for k, off, pos, n in ps:
                if c < 0:
                    mine.setdefault(k, []).append((i, base + pos, n, off))
                else:
                    per_consumer[c].setdefault(k, []).append([i, base + pos, n, off])
        slot_bytes = max((e.stop - e.start for e in extents), default=1)
        # the ring's memory is RING_SLOTS chunks at most; small extents (replicated norms, biases) get
        # more, smaller slots, up to one each, so the reader rarely waits for a slot to be freed
        # (an object store's batched reads get 4x the slots: enough extents at once to keep its connections busy)
        base = shm.RING_SLOTS * (4 if getattr(self.files, "batch_reads", False) else 1)
        slots = min(len(extents), max(base, base * self.chunk // slot_bytes))
        return {"extents": extents, "mine": mine, "direct": direct, "mine_direct": mine_direct,
                "per_consumer": per_consumer, "slots": max(1, slots), "slot_bytes": slot_bytes}

    def populate_ring(self) -> bool:
        """Map the ring's pages up front (local files: their reads fill slots at memory speed), or
        as they are first touched (an object store: each GET's thread maps its slot's pages while
        it waits on the network, and the ring's GETs start that much sooner)."""
        return not getattr(self.files, "batch_reads", False)

    def writes_file_ranges(self) -> bool:
        """Whether the ring's slots are filled with ``pwrite`` (:meth:`slot_destination`), not through
        the mapping: then the ring needs no reservation up front (``shm.Ring.create``'s ``reserve``)."""
        return getattr(self.files, "file_range", None) is not None and bool(getattr(self.files, "batch_reads", False))

    def ring_bytes(self, sched: Dict[str, Any]) -> int:
        return shm.segment_bytes(len(self.consumers), sched["slots"], sched["slot_bytes"])

    def pass_fds(self, sched: Dict[str, Any], candidates: Set[int]) -> Set[int]:
        """Hand each candidate consumer the descriptors of the files it reads itself, then tell
        it which files (and this rank's pid) and take its answer; returns those that got them.
        Any other rank's bytes go through the ring (one log line: who, why)."""
        passed: Set[int] = set()
        problems = dict(self.no_socket)
        offered: List[Tuple[int, List[str]]] = []
        for c in sorted(candidates):
            files = sorted({d[0] for d in sched["direct"][c]})
            if not files:
                passed.add(c)
                continue
            try:
                fdpass.send(self.sockets[c], self.pids[c], [self.opened().descriptor(f, self.size(f)) for f in files])
                offered.append((c, files))
            except fdpass.FdPassError as e:
                problems[self.consumers[c]] = str(e)
        asked = []
        for c, files in offered:  # every rank first takes its descriptors, then all answer
            try:
                _send_json(self.comm, {"fd_pass": {"files": files, "reader_pid": os.getpid()}}, self.consumers[c])
                asked.append(c)
            except MegashardError as e:
                self.fail(_err(e, f"offering rank {self.consumers[c]} its descriptors"))
        for c in asked:
            try:
                answer = _recv_json(self.comm, self.consumers[c])
            except MegashardError as e:
                self.fail(_err(e, f"receiving rank {self.consumers[c]}'s answer to its descriptors"))
                continue
            if isinstance(answer, dict) and answer.get("error") is None:
                passed.add(c)
            else:
                problems[self.consumers[c]] = "the rank could not take them: " + (
                    str(answer.get("error")) if isinstance(answer, dict) else repr(answer))[:300]
        if problems:
            first = min(problems)
            log.warning("[rank %d] scatter load: cannot hand file descriptors to rank(s) %s (rank %d: %s); their "
                        "bytes go through the shared-memory ring instead", self.comm.rank, sorted(problems), first,
                        problems[first])
        return passed

    def shm_schedules(self, sched: Dict[str, Any], ring: Optional[List[int]]) -> Dict[int, Dict[str, Any]]:
        out = {}
        for c, r in enumerate(self.consumers):
            files = sorted({d[0] for d in sched["direct"][c]})
            where = {f: j for j, f in enumerate(files)}
            out[r] = {"transport": "shm", "ring": ring, "populate": self.populate_ring(),
                      "self_read": bool(files) and self.self_reads(),
                      "consumers": len(self.consumers), "index": c,
                      "slots": sched["slots"], "slot_bytes": sched["slot_bytes"], "reader_pid": os.getpid(),
                      "n_extents": len(sched["extents"]), "extents": sorted(sched["per_consumer"][c].items()),
                      "fd_files": files, "direct": [[where[f], a, n, i, pos] for f, a, n, i, pos in sched["direct"][c]]}
        return out

    # -- transfer ---------------------------------------------------------------
    def opened(self) -> Any:
        """The files object (opened by :meth:`check_ranges`)."""
        if self.files is None:
            raise CheckpointError(f"{self.base}: files not opened (the setup failed)")
        return self.files

    def size(self, f: str) -> int:
        return int(self.manifest.files[f].get("bytes", 0))

    def read(self, f: str, reqs: Sequence[Tuple[int, memoryview]], threads: int) -> int:
        """Fill ``(offset, view)`` requests from ``f`` through the files object (checked: the
        file has the index's size)."""
        return self.opened().read_into(f, reqs, size=self.size(f), threads=threads)

    def ring_threads(self, sched: Dict[str, Any]) -> int:
        """Read threads for filling the ring: the bigger of the two streams gets the threads
        (with descriptors passed, the ring holds only shared bytes)."""
        ring_total = sum(e.stop - e.start for e in sched["extents"])
        direct_total = sum(d[2] for d in sched["mine_direct"])
        return max(1, self.threads // 2) if ring_total >= direct_total else 1

    def start_direct(self, sched: Dict[str, Any]) -> "_DirectReads":
        """Start reading this rank's own ranges straight into place (a second thread)."""
        ring_threads = self.ring_threads(sched)
        direct = _DirectReads(self.ops, self.lock, self.read, self.base,
                              _batches(sched["mine_direct"], _direct_batch_bytes(self.chunk), self.ops),
                              self.threads if ring_threads == 1 else max(1, self.threads - ring_threads), self.copier)
        direct.start()
        return direct

    def transfer_shm(self, ring: shm.Ring, sched: Dict[str, Any], direct: "_DirectReads") -> None:
        """Fill the ring in extent order while ``direct`` reads this rank's own ranges
        straight into place (the two streams keep two cores busy without per-call hand-offs)."""
        extents, mine = sched["extents"], sched["mine"]
        ring_threads = self.ring_threads(sched)
        if self.copier is not None and mine:
            self.copier.register(ring.data)
        try:
            if self.err is not None:
                raise shm.ShmError("not transferring: the setup failed")
            batch_reads = bool(getattr(self.opened(), "batch_reads", False))
            k = 0
            while k < len(extents):
                ring.wait_slot_free(k, self.pids)
                end = k + 1  # an object store: every extent whose slot is free now, in one coalesced read
                while (batch_reads and end < len(extents) and end - k < ring.slots
                       and ring.wait_slot_free(end, self.pids, blocking=False)):
                    end += 1
                if batch_reads:  # one job per extent, adjacent ones coalesced into shared GETs; each
                    # extent is published (in order) as soon as its bytes are in, while later ones still arrive
                    first = k
                    arrived = [False] * (end - k)
                    publish_lock = threading.Lock()

                    def arrive(i: int) -> None:
                        nonlocal first
                        with publish_lock:
                            arrived[i] = True
                            while first < end and arrived[first - k]:
                                self.publish(ring, extents, mine, first)
                                first += 1

                    jobs = []
                    for j in range(k, end):
                        e = extents[j]
                        jobs.append((e.file, [(e.start, self.slot_destination(ring, j, e.stop - e.start))],
                                     self.size(e.file)))
                    self.opened().read_files(jobs, threads=ring_threads, done=arrive)
                    if first != end:
                        raise CheckpointError(f"{self.base}: ring extents {first}..{end - 1} were read but not "
                                              f"reported as arrived (internal error)")
                else:
                    e = extents[k]
                    self.read(e.file, [(e.start, ring.slot_memoryview(k, e.stop - e.start))], ring_threads)
                    self.publish(ring, extents, mine, k)
                k = end
                if direct.error is not None:
                    break
        except Exception as e:  # noqa: BLE001 - the consumers stop; every rank learns it in the final agreement
            ring.fail_reader()
            self.fail(_err(e, "filling the node's shared memory ring"))
        finally:
            direct.finish(self.err is not None)
            if self.copier is not None:
                self.copier.unregister_all()  # before the ring is unmapped
        self.nread += direct.nread
        if direct.error is not None:
            ring.fail_reader()
            self.fail(_err(direct.error, "reading into this rank's tensors"))
        if self.err is None:  # everything is published: free the ring once the consumers are through with
            ring.close_when_consumed(len(extents), self.pids)  # it, on a thread of its own (off every load's path)
            self.ring_handed_off = True

    def slot_destination(self, ring: shm.Ring, j: int, nbytes: int) -> Any:
        """Where extent ``j``'s bytes go: a byte range of the ring's file where the files object can write
        one (an object store: ``pwrite`` from a reused buffer costs the reader a third of what faulting in
        each fresh shared page of the mapping does), else the slot's memory."""
        if self.writes_file_ranges() and ring.fd is not None:
            return self.opened().file_range(ring.fd, ring.slot_offset(j), nbytes)
        return ring.slot_memoryview(j, nbytes)

    def publish(self, ring: shm.Ring, extents: Sequence[Any], mine: Mapping[int, Any], j: int) -> None:
        """Extent ``j`` is in its slot: hand it to the consumers, place the reader's own share."""
        size = extents[j].stop - extents[j].start
        self.nread += size
        ring.publish(j)
        if j in mine:
            src = ring.slot(j, size)
            _place(self.ops, self.lock, src, mine[j], self.copier)
            del src

    def read_alone(self) -> None:
        """No other rank of the node needs bytes: read this rank's straight into place, as ``own`` does."""
        mine = [(op.file, op.offset, op.nbytes, i, 0) for i, op in enumerate(self.ops) if op.nbytes]
        direct = _DirectReads(self.ops, self.lock, self.read, self.base,
                              _batches(mine, _direct_batch_bytes(self.chunk), self.ops), self.threads, self.copier)
        direct.run()  # in this thread
        self.nread += direct.nread
        if direct.error is not None:
            self.fail(_err(direct.error, "reading into this rank's tensors"))

    def transfer_group(self) -> None:
        """Every node rank's sub-ops in serving order, staged in two buffers; sends overlap reads.

        A reader that fails mid-way keeps sending (stale bytes) so that no receiver blocks;
        the error surfaces in the final agreement."""
        me = self.comm.rank
        subops: List[Range] = []
        owners: List[Tuple[int, int, int]] = []  # (rank, op index, offset in op)
        per_rank = dict(self.requests)
        per_rank[me] = [(op.file, op.offset, op.nbytes) for op in self.ops]
        for r in sorted(per_rank):
            for i, op in enumerate(per_rank[r]):
                for f, a, n, pos in plan.split_op(op, self.chunk):
                    subops.append((f, a, n))
                    owners.append((r, i, pos))
        sched = plan.schedule_extents(subops, self.chunk)
        biggest = max((e.stop - e.start for e, _ in sched), default=0)
        staging = [empty_buffer(biggest), empty_buffer(biggest)] if biggest else []
        in_flight: List[List[Any]] = [[], []]
        try:
            for k, (ext, members) in enumerate(sched):
                half = k % 2
                for h in in_flight[half]:  # the buffer is reused: its sends must have finished
                    h.wait()
                in_flight[half] = []
                size = ext.stop - ext.start
                buf = staging[half]
                if self.err is None:
                    try:
                        self.read(ext.file, [(ext.start, tensor_memoryview(buf[:size]))], self.threads)
                        self.nread += size
                    except Exception as e:  # noqa: BLE001
                        self.fail(_err(e, f"reading {ext.file}"))
                members = sorted(members, key=lambda j: (subops[j][1], subops[j][2], owners[j]))
                for j in members:
                    r, i, pos = owners[j]
                    f, a, n = subops[j]
                    src = buf[a - ext.start:a - ext.start + n]
                    if r == me:
                        _copy(self.ops[i].target()[pos:pos + n], src)
                        self.ops[i].arrived(n)
                    else:
                        in_flight[half].append(self.comm.isend(src, r))
            for group in in_flight:
                for h in group:
                    h.wait()
        except Exception as e:  # noqa: BLE001
            self.fail(_err(e, "scatter send failed"))



class _DirectReads(threading.Thread):
    """A rank's ranges that no other rank of the node needs, read straight into its tensors
    in batches (:func:`_batches`), concurrently with the ring. ``read(file, reqs, threads)``
    fills ``(offset, view)`` requests: through the reader's files object, or through the
    descriptor the reader passed to this rank."""

    def __init__(self, ops: Sequence[Any], lock: threading.Lock,
                 read: Callable[[str, List[Tuple[int, memoryview]], int], Any], base: str,
                 batches: List[List[Direct]], threads: int, copier: Optional[DeviceCopier]) -> None:
        super().__init__(name="megashard-scatter-direct", daemon=True)
        self.ops, self.lock, self.read, self.base, self.copier = ops, lock, read, base, copier
        self.batches, self.threads = batches, threads
        self.nread = 0
        self.error: Optional[BaseException] = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            for batch in self.batches:
                if self.stop.is_set():
                    return
                f = batch[0][0]
                path = os.path.join(self.base, f)
                with self.lock:
                    dsts = [self.ops[i].target()[pos:pos + n] for _, _, n, i, pos in batch]
                reqs, dev = split_targets((a, d) for (_, a, _, _, _), d in zip(batch, dsts))
                if reqs:
                    self.read(f, reqs, self.threads)
                if dev:
                    if self.copier is None:
                        raise MegashardError(f"{path}: a GPU destination but no device copier (internal error)")
                    self.copier.read(partial(self.read, f, threads=self.threads), dev)
                del reqs, dsts, dev
                with self.lock:
                    for _, _, n, i, _ in batch:
                        self.ops[i].arrived(n)
                self.nread += sum(n for _, _, n, _, _ in batch)
        except BaseException as e:  # noqa: BLE001 - reported by the owner after join
            self.error = e

    def finish(self, failed: bool) -> None:
        """Wait for the reads (stopping after the current batch if the ring side ``failed``)."""
        if failed:
            self.stop.set()
        self.join()


def _direct_batch_bytes(chunk: int) -> int:
    return max(int(chunk), DIRECT_BATCH_MIN)


def _batches(direct: Sequence[Direct], cap: int, ops: Sequence[Any]) -> List[List[Direct]]:
    """Direct reads in (file, offset) order, one batch per file, cut where the batch's resharding
    temporaries (allocated when it starts, freed when placed) pass about ``cap`` bytes. Reads into
    existing destinations are never cut: every cut is a wait for the batch's slowest thread."""
    batches: List[List[Direct]] = []
    size = 0
    for d in sorted(direct):
        temp = d[2] if ops[d[3]].lazy is not None else 0
        if not batches or batches[-1][0][0] != d[0] or (temp and size + temp > cap):
            batches.append([])
            size = 0
        batches[-1].append(d)
        size += temp
    return batches


def _read_alone(alone: Sequence[Tuple[int, Direct]], ranges: Sequence[Range], gap: int) -> List[bool]:
    """Per piece that only its rank needs, whether that rank reads it itself. A store whose reads
    fetch the gaps of up to ``gap`` bytes between one caller's requests (an object store's GETs)
    would fetch bytes other ranks need along with a rank's own (column halves of row-major
    tensors: every other row piece); such pieces go through the ring, whose extents are read once
    for all ranks. A rank's pieces are taken in runs, as its reads would be coalesced: a run stays
    the rank's own while the needed bytes of its gaps are at most 1/16 of its own, and it holds at
    least ``gap`` bytes (a smaller one costs a request of its own; in the ring it shares the GETs of
    the extents around it)."""
    out = [True] * len(alone)
    if gap <= 0:
        return out
    merged: Dict[str, List[List[int]]] = {}  # file -> the union of every rank's ranges, [start, end] in order
    for f, a, n in sorted(r for r in ranges if r[2] > 0):
        m = merged.setdefault(f, [])
        if m and a <= m[-1][1]:
            m[-1][1] = max(m[-1][1], a + n)
        else:
            m.append([a, a + n])
    starts = {f: [a for a, _ in m] for f, m in merged.items()}
    below: Dict[str, List[int]] = {}  # file -> needed bytes before each merged range
    for f, m in merged.items():
        acc = below[f] = [0]
        for a, b in m:
            acc.append(acc[-1] + b - a)

    def needed_below(f: str, x: int) -> int:
        k = bisect.bisect_right(starts[f], x) - 1
        return 0 if k < 0 else below[f][k] + min(x, merged[f][k][1]) - merged[f][k][0]

    runs: Dict[Tuple[int, str], List[int]] = {}
    for j, (c, d) in enumerate(alone):
        runs.setdefault((c, d[0]), []).append(j)
    for (c, f), js in runs.items():
        js.sort(key=lambda j: alone[j][1][1])
        run: List[int] = []
        for j in js + [-1]:
            d = alone[j][1] if j >= 0 else None
            if run and (d is None or d[1] - (alone[run[-1]][1][1] + alone[run[-1]][1][2]) > gap):
                first, last = alone[run[0]][1], alone[run[-1]][1]
                own = sum(alone[k][1][2] for k in run)
                others = needed_below(f, last[1] + last[2]) - needed_below(f, first[1]) - own
                if own < gap or 16 * others > own:
                    for k in run:
                        out[k] = False
                run = []
            if j >= 0:
                run.append(j)
    return out


def split_shared(ranges: Sequence[Range]) -> List[List[Tuple[int, int, bool]]]:
    """Per range, its pieces ``(offset in range, nbytes, shared)`` in order, where ``shared``
    bytes are covered by at least one other range too (those must be read once for all)."""
    events: Dict[str, List[Tuple[int, int]]] = {}
    for f, a, n in ranges:
        if n > 0:
            events.setdefault(f, []).extend(((a, 1), (a + n, -1)))
    spans: Dict[str, Tuple[List[int], List[int]]] = {}  # file -> (starts, stops) of spans covered ≥ 2 times
    for f, ev in events.items():
        ev.sort()  # at equal offsets ends (-1) come first: touching ranges do not overlap
        starts: List[int] = []
        stops: List[int] = []
        depth = 0
        for x, d in ev:
            depth += d
            if d > 0 and depth == 2:
                if stops and stops[-1] == x:  # continue the previous span
                    stops.pop()
                else:
                    starts.append(x)
            elif d < 0 and depth == 1:
                stops.append(x)
        spans[f] = (starts, stops)
    out: List[List[Tuple[int, int, bool]]] = []
    for f, a, n in ranges:
        pieces: List[Tuple[int, int, bool]] = []
        if n > 0:
            starts, stops = spans[f]
            k = max(0, bisect.bisect_right(stops, a))
            pos = a
            while pos < a + n:
                if k < len(starts) and starts[k] <= pos:  # inside span k
                    end = min(a + n, stops[k])
                    pieces.append((pos - a, end - pos, True))
                    k += 1
                else:
                    end = min(a + n, starts[k]) if k < len(starts) else a + n
                    pieces.append((pos - a, end - pos, False))
                pos = end
        out.append(pieces)
    return out

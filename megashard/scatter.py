"""Scatter loads: one reader per node reads each needed byte once and hands it out.

Protocol (collective over the load's process group; every rank takes every step,
so a failure anywhere surfaces in the same agreement on every rank):

1. each non-reader sends its node's reader one JSON request: its byte ranges
   ``(file, offset, nbytes)``, the shards it touches (for ``verify``), its pid;
2. the reader plans the node's transfer and sends each of its ranks a schedule:
   either ``shm`` (ring segment name, and per extent where this rank's ranges lie in
   it) or ``group`` (chunks come as point-to-point messages in a fixed order);
3. agreement "setup" (reader: files present and ranges valid, ring created);
   the ranks open the ring; agreement "open"; every rank unlinks the ring's name;
4. transfer. ``shm``: the reader fills ring slots (:mod:`megashard.shm`) and reads
   its own ranges that no other rank needs straight into its tensors while the ring
   is full; the other ranks copy out of the mapping into their tensors.
   ``group``: as before, double-buffered staging and async sends.

Nothing here calls ``torch.distributed`` directly (see :class:`~megashard.transport.Comm`).
"""
from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from . import plan, shm
from .errors import CheckpointError, MegashardError
from .format import empty_buffer
from .format.fastio import default_read_threads, read_requests, tensor_memoryview
from .transport import Comm

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "group")

Range = Tuple[str, int, int]  # file, offset, nbytes


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


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy bytes between contiguous uint8 CPU tensors with libc memcpy (measured 16 GB/s
    from a ring slot vs 1-3 GB/s for ``Tensor.copy_`` of uint8 here; ctypes drops the GIL)."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src)


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
    every rank) when the setup fails. ``open_files()`` (readers only) returns an object
    whose ``open(name, size)`` gives a checked, cached read-only descriptor and whose
    ``close()`` closes them all.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"scatter_transport must be one of {TRANSPORTS}, got {transport!r}")
    chunk = max(1, int(chunk))
    if readers[comm.rank] == comm.rank:
        return _Reader(comm, base, manifest, ops, touched, readers, chunk, threads, transport, open_files).run()
    return _consume(comm, ops, touched, readers[comm.rank])


# ---------------------------------------------------------------------------
# non-readers


def _consume(comm: Comm, ops: Sequence[Any], touched: Mapping[str, Dict[str, Any]],
             reader: int) -> Tuple[Tuple[int, int, str], Optional[str]]:
    err: Optional[str] = None
    sched: Dict[str, Any] = {}
    req = {"ops": [[op.file, op.offset, op.nbytes] for op in ops], "pid": os.getpid(), "host": shm.host_identity(),
           "touched": touched}
    try:
        _send_json(comm, req, reader)
        sched = _recv_json(comm, reader)
    except MegashardError as e:
        err = _err(e, f"exchanging the scatter schedule with reader rank {reader}")
    ring: Optional[shm.Ring] = None
    name = sched.get("name")
    try:
        comm.agree(err, "scatter load (setup)")
        if sched["transport"] == "shm":
            try:
                ring = shm.Ring.attach(name, sched["consumers"], sched["slots"], sched["slot_bytes"], sched["index"])
                needed = [k for k, _ in sched["extents"]]
                ring.set_done(sched["index"], needed[0] if needed else sched["n_extents"])
                if not shm.pid_alive(sched["reader_pid"]):
                    raise shm.ShmError(f"reader pid {sched['reader_pid']} is not visible from this rank")
            except MegashardError as e:
                err = _err(e, f"opening the node's shared memory from reader rank {reader}")
        comm.agree(err, "scatter load (open)")
        if name:
            shm.unlink(name)
        nbytes = sum(op.nbytes for op in ops)
        if ring is not None:
            return (0, nbytes, "shm"), _consume_shm(ring, sched, ops)
        return (0, nbytes, "group"), _consume_group(comm, ops, reader, sched["chunk"])
    finally:
        if name:
            shm.unlink(name)
        if ring is not None:
            ring.close()


def _consume_shm(ring: shm.Ring, sched: Dict[str, Any], ops: Sequence[Any]) -> Optional[str]:
    me, total, reader_pid = sched["index"], sched["n_extents"], sched["reader_pid"]
    extents = sched["extents"]
    try:
        for j, (k, pieces) in enumerate(extents):
            ring.wait_produced(k, reader_pid)
            src = ring.slot(k, ring.slot_bytes)
            for i, pos, n, off in pieces:
                _copy(ops[i].target()[pos:pos + n], src[off:off + n])
                ops[i].arrived(n)
            del src
            ring.set_done(me, extents[j + 1][0] if j + 1 < len(extents) else total)
    except Exception as e:  # noqa: BLE001 - reported in the final agreement
        ring.fail_consumer(me)
        return _err(e, "copying from the node's shared memory")
    return None


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
    (allocated on first use) exist only while their bytes are in flight."""
    subops = _subops(ops, chunk)
    window = 4 * chunk
    posted: Deque[Tuple[Any, int, int]] = deque()
    ahead = j = 0
    try:
        while j < len(subops) or posted:
            while j < len(subops) and (not posted or ahead + subops[j][2] <= window):
                _, _, n, i, pos = subops[j]
                posted.append((comm.irecv(ops[i].target()[pos:pos + n], reader), n, i))
                ahead += n
                j += 1
            h, n, i = posted.popleft()
            h.wait()
            ahead -= n
            ops[i].arrived(n)
    except Exception as e:  # noqa: BLE001 - a transport failure ends the load on every rank
        return _err(e, f"receiving from reader rank {reader}")
    return None


# ---------------------------------------------------------------------------
# the reader


class _Reader:
    """The node reader's side: plan, schedule, set up the transport, transfer."""

    def __init__(self, comm: Comm, base: str, manifest: Any, ops: Sequence[Any], touched: Dict[str, Dict[str, Any]],
                 readers: Mapping[int, int], chunk: int, threads: Optional[int], transport: str,
                 open_files: Callable[[], Any]) -> None:
        self.comm, self.base, self.manifest, self.ops, self.touched = comm, base, manifest, ops, touched
        self.chunk, self.transport, self.open_files = chunk, transport, open_files
        self.threads = threads or default_read_threads()
        self.consumers = sorted(r for r, rd in readers.items() if rd == comm.rank and r != comm.rank)
        self.requests: Dict[int, List[Range]] = {}
        self.pids: List[int] = []
        self.err: Optional[str] = None
        self.nread = 0
        self.files: Any = None
        self.lock = threading.Lock()  # ops' lazy temporaries, shared by the ring and direct-read threads

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
            same_host = same_host and bool(req["host"]) and req["host"] == shm.host_identity()
            for f, names in req.get("touched", {}).items():
                if isinstance(names, dict):
                    self.touched.setdefault(str(f), {}).update({str(n): r for n, r in names.items()})
        sched: Dict[str, Any] = {}
        mode, name = "group", None
        try:
            self.check_ranges()
            if self.wants_ring():
                sched = self.plan_shm()
                mode = self.choose(same_host, shm.segment_bytes(len(self.consumers), sched["slots"], sched["slot_bytes"]))
        except Exception as e:  # noqa: BLE001 - still send schedules: the ranks must reach the agreement
            self.fail(f"{type(e).__name__}: planning the scatter load: {e}")
            mode = "group"
        if mode == "shm":
            name = shm.new_name()
            scheds = self.shm_schedules(sched, name)
        else:
            scheds = {r: {"transport": "group", "chunk": self.chunk} for r in self.consumers}
        ring: Optional[shm.Ring] = None
        try:
            for r in self.consumers:
                try:
                    _send_json(self.comm, scheds[r], r)
                except MegashardError as e:
                    self.fail(_err(e, f"sending rank {r} its scatter schedule"))
            if mode == "shm" and self.err is None:
                try:
                    ring = shm.Ring.create(name, len(self.consumers), sched["slots"], sched["slot_bytes"])
                except MegashardError as e:
                    self.fail(_err(e, "creating the node's shared memory ring"))
            self.comm.agree(self.err, "scatter load (setup)")
            self.comm.agree(None, "scatter load (open)")
            if name:
                shm.unlink(name)
            if ring is not None:
                self.transfer_shm(ring, sched)
            else:
                self.transfer_group()
        finally:
            if self.files is not None:
                self.files.close()
            if name:
                shm.unlink(name)
            if ring is not None:
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
        for f in files:
            self.fd(f)
        for f, a, n in ranges:
            size = int(self.manifest.files[f].get("bytes", 0))
            if a < 0 or n < 0 or a + n > size:
                raise CheckpointError(f"{os.path.join(self.base, f)}: byte range {a}+{n} past end of file ({size} bytes)")

    def wants_ring(self) -> bool:
        """Whether shared memory is an option: other ranks need bytes and the caller allows it."""
        return self.transport != "group" and any(n for r in self.consumers for _, _, n in self.requests[r])

    def choose(self, same_host: bool, need: int) -> str:
        """``shm`` or ``group`` for this node (the other ranks learn it from their schedule)."""
        free = shm.available_bytes()
        problem = None
        if not same_host:
            problem = ("the node's ranks do not all share this rank's kernel (boot id) and PID namespace: "
                       "no common /dev/shm, or their pids cannot be watched for crashes")
        elif not os.path.isdir(shm.SHM_DIR):
            problem = f"{shm.SHM_DIR} does not exist (mount a tmpfs there, e.g. docker --shm-size)"
        elif free < need:
            problem = (f"{shm.SHM_DIR} has {free / 2**20:.1f} MiB free (MEGASHARD_SHM_MAX_BYTES caps it), the ring needs "
                       f"{need / 2**20:.1f} MiB; enlarge it (docker --shm-size) or lower scatter_chunk_bytes")
        if problem is None:
            return "shm"
        if self.transport == "shm":
            self.fail(f"ShmError: scatter_transport='shm' is not possible: {problem}")
            return "group"
        log.warning("[rank %d] scatter load: %s; sending over the process group instead "
                    "(scatter_transport='group' selects that without this check)", self.comm.rank, problem)
        return "group"

    def consumer_subops(self) -> Tuple[List[Range], List[Tuple[int, int, int]]]:
        subops: List[Range] = []
        owners: List[Tuple[int, int, int]] = []  # (consumer index, op index, offset in op)
        for c, r in enumerate(self.consumers):
            for i, op in enumerate(self.requests[r]):
                for f, a, n, pos in plan.split_op(op, self.chunk):
                    subops.append((f, a, n))
                    owners.append((c, i, pos))
        return subops, owners

    def plan_shm(self) -> Dict[str, Any]:
        """Disjoint extents over every range of the node (each byte read once). Those another
        rank needs go through the ring (the reader copies its own pieces out of the slot);
        the rest the reader reads straight into its tensors, in batches of ≤ ``chunk`` bytes."""
        ranges: List[Range] = []
        owners: List[Tuple[int, int]] = []  # (consumer index or -1 for the reader, op index)
        for c, r in enumerate(self.consumers):
            for i, op in enumerate(self.requests[r]):
                ranges.append(op)
                owners.append((c, i))
        for i, op in enumerate(self.ops):
            ranges.append((op.file, op.offset, op.nbytes))
            owners.append((-1, i))
        extents, pieces = partition(ranges, self.chunk)
        users: List[Set[int]] = [set() for _ in extents]
        for j, ps in enumerate(pieces):
            for k, _, _, _ in ps:
                users[k].add(owners[j][0])
        ring_index: Dict[int, int] = {}
        for k in range(len(extents)):
            if any(c >= 0 for c in users[k]):
                ring_index[k] = len(ring_index)
        mine: Dict[int, List[Tuple[int, int, int, int]]] = {}  # ring extent -> (op, pos, n, offset in slot)
        per_consumer: List[Dict[int, List[List[int]]]] = [{} for _ in self.consumers]
        direct: List[Tuple[str, int, int, int, int]] = []  # file, offset, n, op, pos
        for j, ps in enumerate(pieces):
            c, i = owners[j]
            for k, off, pos, n in ps:
                if k not in ring_index:
                    e = extents[k]
                    direct.append((e.file, e.start + off, n, i, pos))
                elif c < 0:
                    mine.setdefault(ring_index[k], []).append((i, pos, n, off))
                else:
                    per_consumer[c].setdefault(ring_index[k], []).append([i, pos, n, off])
        batches: List[List[Tuple[str, int, int, int, int]]] = []
        size = 0
        for d in sorted(direct):
            if not batches or batches[-1][0][0] != d[0] or size + d[2] > self.chunk:
                batches.append([])
                size = 0
            batches[-1].append(d)
            size += d[2]
        ring = [extents[k] for k in sorted(ring_index)]
        slot_bytes = max((e.stop - e.start for e in ring), default=1)
        return {"extents": ring, "mine": mine, "batches": batches, "per_consumer": per_consumer,
                "slots": max(1, min(shm.RING_SLOTS, len(ring))), "slot_bytes": slot_bytes}

    def shm_schedules(self, sched: Dict[str, Any], name: str) -> Dict[int, Dict[str, Any]]:
        return {r: {"transport": "shm", "name": name, "consumers": len(self.consumers), "index": c,
                    "slots": sched["slots"], "slot_bytes": sched["slot_bytes"], "reader_pid": os.getpid(),
                    "n_extents": len(sched["extents"]), "extents": sorted(sched["per_consumer"][c].items())}
                for c, r in enumerate(self.consumers)}

    # -- transfer ---------------------------------------------------------------
    def fd(self, f: str) -> int:
        """A checked, cached descriptor (the file has the manifest's size)."""
        if self.files is None:
            raise CheckpointError(f"{self.base}: files not opened (the setup failed)")
        return self.files.open(f, int(self.manifest.files[f].get("bytes", 0)))

    def transfer_shm(self, ring: shm.Ring, sched: Dict[str, Any]) -> None:
        """Fill the ring in extent order while a second thread reads this rank's own ranges
        straight into place (the two streams keep two cores busy without per-call hand-offs)."""
        extents, mine, batches = sched["extents"], sched["mine"], sched["batches"]
        ring_threads = max(1, self.threads // 2)
        direct = _DirectReads(self, batches, max(1, self.threads - ring_threads))
        direct.start()
        try:
            if self.err is not None:
                raise shm.ShmError("not transferring: the setup failed")
            for k, e in enumerate(extents):
                ring.wait_slot_free(k, self.pids)
                size = e.stop - e.start
                path = os.path.join(self.base, e.file)
                read_requests(self.fd(e.file), [(e.start, ring.slot_memoryview(k, size))], path, ring_threads)
                self.nread += size
                ring.publish(k)
                if k in mine:
                    src = ring.slot(k, size)
                    for i, pos, n, off in mine[k]:
                        with self.lock:
                            dst = self.ops[i].target()[pos:pos + n]
                        _copy(dst, src[off:off + n])
                        del dst
                        with self.lock:
                            self.ops[i].arrived(n)
                    del src
                if direct.error is not None:
                    break
        except Exception as e:  # noqa: BLE001 - the consumers stop; every rank learns it in the final agreement
            ring.fail_reader()
            self.fail(_err(e, "filling the node's shared memory ring"))
        finally:
            direct.finish()
        self.nread += direct.nread
        if direct.error is not None:
            ring.fail_reader()
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
                        read_requests(self.fd(ext.file), [(ext.start, tensor_memoryview(buf[:size]))],
                                      os.path.join(self.base, ext.file), self.threads)
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
    """The reader's own ranges that no other rank needs, read straight into its tensors in
    batches of at most ``chunk`` bytes, concurrently with filling the ring."""

    def __init__(self, reader: "_Reader", batches: List[List[Tuple[str, int, int, int, int]]], threads: int) -> None:
        super().__init__(name="megashard-scatter-direct", daemon=True)
        self.reader, self.batches, self.threads = reader, batches, threads
        self.nread = 0
        self.error: Optional[BaseException] = None
        self.stop = threading.Event()

    def run(self) -> None:
        r = self.reader
        try:
            for batch in self.batches:
                if self.stop.is_set():
                    return
                f = batch[0][0]
                with r.lock:
                    dsts = [r.ops[i].target()[pos:pos + n] for _, _, n, i, pos in batch]
                reqs = [(a, tensor_memoryview(d)) for (_, a, _, _, _), d in zip(batch, dsts)]
                read_requests(r.fd(f), reqs, os.path.join(r.base, f), self.threads)
                del reqs, dsts
                with r.lock:
                    for _, _, n, i, _ in batch:
                        r.ops[i].arrived(n)
                self.nread += sum(n for _, _, n, _, _ in batch)
        except BaseException as e:  # noqa: BLE001 - reported by the reader after join
            self.error = e

    def finish(self) -> None:
        """Wait for the reads (stopping early if the ring side failed)."""
        if self.reader.err is not None:
            self.stop.set()
        self.join()


def partition(ranges: Sequence[Range], chunk: int) -> Tuple[List[plan.Extent], List[List[Tuple[int, int, int, int]]]]:
    """Cut the union of byte ranges into disjoint extents of at most ``chunk`` bytes.

    Returns the extents in (file, offset) order and, per range, its pieces
    ``(extent index, offset in extent, offset in range, nbytes)``, so every byte any
    range needs is read exactly once however ranges overlap or ``chunk`` splits them.
    """
    extents: List[plan.Extent] = []
    starts: Dict[str, Tuple[int, List[int]]] = {}  # file -> (first extent index, extent starts)
    order = sorted(range(len(ranges)), key=lambda j: (ranges[j][0], ranges[j][1]))
    j = 0
    while j < len(order):
        f = ranges[order[j]][0]
        first = len(extents)
        while j < len(order) and ranges[order[j]][0] == f:
            a, b = ranges[order[j]][1], ranges[order[j]][1] + ranges[order[j]][2]
            j += 1
            while j < len(order) and ranges[order[j]][0] == f and ranges[order[j]][1] <= b:
                b = max(b, ranges[order[j]][1] + ranges[order[j]][2])
                j += 1
            for s0 in range(a, b, chunk):
                extents.append(plan.Extent(f, s0, min(b, s0 + chunk)))
        starts[f] = (first, [e.start for e in extents[first:]])
    pieces: List[List[Tuple[int, int, int, int]]] = []
    for f, a, n in ranges:
        out: List[Tuple[int, int, int, int]] = []
        if n:
            first, st = starts[f]
            k = first + bisect.bisect_right(st, a) - 1
            while k < len(extents) and extents[k].file == f and extents[k].start < a + n:
                e = extents[k]
                lo, hi = max(a, e.start), min(a + n, e.stop)
                if hi > lo:
                    out.append((k, lo - e.start, lo - a, hi - lo))
                k += 1
        pieces.append(out)
    return extents, pieces

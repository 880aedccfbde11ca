"""A ring of shared-memory buffers for scatter loads within one node.

The node's reader fills ring slots with extents of checkpoint files; every other
rank of the node copies its byte ranges straight out of the mapping into its
destination tensors. Which extent lands in which slot, and where each rank's
ranges lie in it, is decided up front (a schedule sent once through the process
group by :mod:`megashard.api`); per extent, the ranks synchronise only through
counters in the segment's header:

* ``produced`` (written by the reader): extents ``< produced`` are in their slots;
* ``done[c]`` (written by consumer ``c``): it no longer needs extents ``< done[c]``,
  so extent ``k`` may overwrite slot ``k % slots`` once every ``done[c] > k - slots``;
* ``reader_failed`` / ``failed[c]``: a peer gave up, stop waiting for it.

Every counter has exactly one writer (no atomics needed); each is one aligned
8-byte store. Nothing here blocks forever: every wait checks that the peer it waits
for is still alive (by pid, which is why the ranks must share a PID namespace) and
gives up after ``MEGASHARD_SHM_TIMEOUT_S`` seconds (default 300) without progress.

The segment is an anonymous memory file (``memfd_create``): it has no name in
``/dev/shm`` or anywhere else, so it exists exactly as long as some process holds
it (a descriptor or a mapping) and a crash of every rank at any instant, SIGKILL
included, leaves nothing behind. It is reserved with ``posix_fallocate`` (so memory
that cannot be had is an error here, not a SIGBUS later), except where the reader fills
the slots with ``pwrite`` (an object store's GETs: there a write that cannot get memory
is an error of that write). Once every consumer is through, the reader frees it on a
thread of its own (:meth:`Ring.close_when_consumed`). The other ranks open it
through the reader's ``/proc/<pid>/fd/<fd>`` (the same user's processes may; the
descriptor's device and inode, sent with the schedule, prove it is the ring), so it
needs no socket: a rank that cannot take passed descriptors still gets the ring.
This module never talks to ``torch.distributed``.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import threading
import time
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from . import procinfo
from .errors import MegashardError

log = logging.getLogger(__name__)

MEMFD_NAME = "megashard-ring"  # what /proc/<pid>/fd and /proc/<pid>/maps show: /memfd:megashard-ring (deleted)
RING_SLOTS = 4
MAGIC = 0x6D7368726E67  # "mshrng"
VERSION = 1
_HEAD = 8  # header words before the per-consumer records
_PER_CONSUMER = 4  # done, failed, pid, unused
_PAGE = mmap.PAGESIZE
_PR_GET_DUMPABLE = 3
_fence_lock = threading.Lock()
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_LIBC.fallocate.restype = ctypes.c_int


class ShmError(MegashardError):
    """Shared-memory transfer failed: segment unavailable, peer died, or no progress."""


def _fence() -> None:
    """A full memory barrier (a lock round trip): slot bytes before counters on weakly ordered CPUs."""
    with _fence_lock:
        pass


def stall_timeout() -> float:
    """Seconds a wait may see no progress from a live peer before giving up."""
    try:
        return float(os.environ.get("MEGASHARD_SHM_TIMEOUT_S", "300"))
    except ValueError:
        return 300.0


def host_identity() -> str:
    """This kernel's boot id, this process's PID namespace and user id ('' if unknown). Ranks with
    equal identities share a kernel (its memory), watch each other's pids and may open each other's
    /proc/PID/fd (see :func:`dumpable`); a node id that groups ranks of different machines shows up
    as different boot ids."""
    boot, ns = procinfo.boot_id(), procinfo.namespace("pid")
    return f"{boot}/{ns}/uid {os.geteuid()}" if boot and ns else ""


def dumpable() -> bool:
    """Whether the kernel lets this user's other processes open this one's descriptors through
    /proc/PID/fd: only if it is dumpable (it did not change its user id without an exec, nor call
    ``prctl(PR_SET_DUMPABLE, 0)``). True when that cannot be told: opening the ring will say."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
    except (OSError, AttributeError):
        return True


pid_alive = procinfo.pid_alive


def available_bytes() -> int:
    """What a new segment may use: the kernel's estimate of available memory (``MemAvailable``),
    capped by ``MEGASHARD_SHM_MAX_BYTES``. A memory file is not limited by the size of
    ``/dev/shm`` (Docker's 64 MB default does not apply)."""
    free = 1 << 62  # /proc/meminfo unreadable: no estimate, posix_fallocate still decides
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    cap = os.environ.get("MEGASHARD_SHM_MAX_BYTES")
    if cap:
        try:
            free = min(free, int(cap))
        except ValueError:
            log.warning("ignoring MEGASHARD_SHM_MAX_BYTES=%r (not an integer)", cap)
    return free


def header_bytes(consumers: int) -> int:
    words = _HEAD + _PER_CONSUMER * consumers
    return -(-words * 8 // _PAGE) * _PAGE


def segment_bytes(consumers: int, slots: int, slot_bytes: int) -> int:
    return header_bytes(consumers) + slots * slot_bytes


class Ring:
    """One mapping of a ring segment (the reader's or a consumer's)."""

    def __init__(self, fd: int, consumers: int, slots: int, slot_bytes: int, keep_fd: bool,
                 populate: bool = True) -> None:
        """Map ``fd``; keep it open (the reader's: the others open the ring through it) or close it.
        ``populate``: map every page now (MAP_POPULATE), in one call, instead of one fault per page
        later. Without it the pages are mapped as the slots are first written and read: for an object
        store (:meth:`create`'s ``populate``) that spreads the work over the reads' own threads,
        while they wait on the network, instead of doing it all before the first GET (256 MiB:
        60-110 ms for the reader here, 20-80 ms for each consumer, measured under load)."""
        self.consumers, self.slots, self.slot_bytes = consumers, slots, slot_bytes
        self.fd: Optional[int] = fd if keep_fd else None
        size = segment_bytes(consumers, slots, slot_bytes)
        try:
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
        self._head = np.frombuffer(self._mm, dtype=np.int64, count=header_bytes(consumers) // 8)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header_bytes(consumers),
                                      count=slots * slot_bytes) if slots * slot_bytes else torch.empty(0, dtype=torch.uint8)
        self._peer_pids: List[int] = []

    # -- creation -----------------------------------------------------------------
    @classmethod
    def create(cls, consumers: int, slots: int, slot_bytes: int, populate: bool = True,
               reserve: bool = True) -> "Ring":
        """Create and reserve the segment (ShmError if the memory cannot be had; ``populate`` only says
        when its pages are mapped: see ``Ring``). ``reserve=False``: only sized, for a reader that fills
        the slots with ``pwrite`` on :attr:`fd` (never through its mapping): a write that cannot get
        memory is an error there, not a SIGBUS, and the memory is taken as the slots are first written,
        by the threads that wait on the network, instead of before the first read (``posix_fallocate``
        of 128 MiB: 37 ms alone, 130-240 ms under load here, all before the ring's first GET)."""
        size = segment_bytes(consumers, slots, slot_bytes)
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        except (OSError, AttributeError) as e:
            raise ShmError(f"cannot create an anonymous memory file (memfd_create): {e}") from None
        try:
            if reserve:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, header_bytes(consumers))  # the counters: written through the mapping
        except OSError as e:
            os.close(fd)
            raise ShmError(f"cannot reserve {size} bytes of shared memory for the ring ({e.strerror}); "
                           f"{available_bytes()} bytes available; lower scatter_chunk_bytes or pass "
                           "scatter_transport='group'") from None
        ring = cls(fd, consumers, slots, slot_bytes, keep_fd=True, populate=populate)
        ring._head[:_HEAD] = [MAGIC, VERSION, consumers, slots, slot_bytes, 0, 0, os.getpid()]
        return ring

    def handle(self) -> List[int]:
        """What another local rank needs to open this ring (:meth:`attach`): pid, descriptor, device, inode."""
        if self.fd is None:
            raise ShmError("only the ring's creator can hand it out")
        st = os.fstat(self.fd)
        return [os.getpid(), self.fd, st.st_dev, st.st_ino]

    @classmethod
    def attach(cls, handle: Sequence[int], consumers: int, slots: int, slot_bytes: int, index: int,
               populate: bool = True) -> "Ring":
        """Open the reader's segment (its :meth:`handle`) as consumer ``index`` and check its header."""
        if not (isinstance(handle, (list, tuple)) and len(handle) == 4 and all(type(x) is int for x in handle)):
            raise ShmError(f"the node's reader named no usable shared memory ring ({handle!r:.100})")
        pid, rfd, dev, ino = handle
        path = f"/proc/{pid}/fd/{rfd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ShmError(f"cannot open the node's shared memory ring through {path}: {e.strerror} (the "
                           "node's ranks must run as one user, able to read each other's /proc/PID/fd; "
                           "else pass scatter_transport='group')") from None
        size = segment_bytes(consumers, slots, slot_bytes)
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
            problem = "is not the ring the reader named (another file under that descriptor)"
        elif st.st_size != size:
            problem = f"has {st.st_size} bytes, expected {size}"
        if problem:
            os.close(fd)
            raise ShmError(f"shared memory ring {path} {problem}")
        ring = cls(fd, consumers, slots, slot_bytes, keep_fd=False, populate=populate)
        if list(ring._head[:5]) != [MAGIC, VERSION, consumers, slots, slot_bytes]:
            ring.close()
            raise ShmError(f"shared memory ring {path} has an unexpected header")
        ring._set(_HEAD + _PER_CONSUMER * index + 2, os.getpid())
        return ring

    def close(self) -> None:
        """Unmap (and close the creator's descriptor): the memory is freed once no rank holds it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._mm is None:
            return
        self._head = None  # type: ignore[assignment]
        self._data = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
            log.debug("shared memory ring still referenced at close")
        self._mm = None  # type: ignore[assignment]

    # -- header fields ------------------------------------------------------------
    def _get(self, i: int) -> int:
        return int(self._head[i])

    def _set(self, i: int, v: int) -> None:
        _fence()
        self._head[i] = v

    @property
    def reader_pid(self) -> int:
        return self._get(7)

    def consumer_pid(self, c: int) -> int:
        return self._get(_HEAD + _PER_CONSUMER * c + 2)

    @property
    def data(self) -> torch.Tensor:
        """Every slot, as one tensor (page-locked by ranks that copy to a GPU)."""
        return self._data

    def slot(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the slot that holds extent ``k``."""
        s = (k % self.slots) * self.slot_bytes
        return self._data[s:s + nbytes]

    def slot_offset(self, k: int) -> int:
        """Where the slot that holds extent ``k`` starts in the segment (the reader's :attr:`fd`)."""
        return header_bytes(self.consumers) + (k % self.slots) * self.slot_bytes

    def slot_memoryview(self, k: int, nbytes: int) -> memoryview:
        s = header_bytes(self.consumers) + (k % self.slots) * self.slot_bytes
        return memoryview(self._mm)[s:s + nbytes]

    # -- reader side ----------------------------------------------------------------
    def publish(self, k: int) -> None:
        """Extent ``k`` is in its slot."""
        self._set(5, k + 1)

    def fail_reader(self) -> None:
        if self._mm is not None:
            self._set(6, 1)

    def wait_slot_free(self, k: int, pids: Sequence[int], blocking: bool = True) -> bool:
        """Whether extent ``k`` may be written (every consumer is done with extent ``k - slots``).

        Consumers that failed count as done. Non-blocking when ``blocking`` is false."""
        need = k - self.slots + 1
        if need <= 0:
            return True

        def ready() -> bool:
            for c in range(self.consumers):
                base = _HEAD + _PER_CONSUMER * c
                if int(self._head[base]) < need and not int(self._head[base + 1]):
                    return False
            return True

        if not blocking:
            return ready()

        def watch() -> Optional[str]:
            for c in range(self.consumers):
                base = _HEAD + _PER_CONSUMER * c
                if int(self._head[base]) < need and not int(self._head[base + 1]) and not pid_alive(pids[c]):
                    return f"local rank consumer {c} (pid {pids[c]}) died while the reader waited for it"
            return None

        progress = lambda: tuple(int(self._head[_HEAD + _PER_CONSUMER * c]) for c in range(self.consumers))  # noqa: E731
        _wait(ready, watch, progress, f"a free slot for extent {k}")
        return True

    def close_in_background(self) -> None:
        """:meth:`close` on a thread of its own (a consumer after its last copy: unmapping 128 MiB of
        mapped ring takes it 20-50 ms here, which no load needs to wait for). The ring is the thread's."""
        threading.Thread(target=self.close, name="megashard-ring-close", daemon=True).start()

    def close_when_consumed(self, upto: int, pids: Sequence[int]) -> None:
        """The reader's :meth:`close`, on a thread of its own: once every consumer is done with extents
        ``< upto`` (or failed, or died), punch out every slot (the pages leave every rank's mapping and are
        freed by this thread) and close. Why: freeing a 128 MiB ring costs ~60 ms here, paid by whichever
        rank drops the last reference, after its last copy, on its load's path; this way no rank's load
        waits for it. The ring is the thread's from this call on."""
        def run() -> None:
            try:
                if upto > 0:
                    self.wait_slot_free(upto - 1 + self.slots, pids)
                if self.fd is not None and self.slots * self.slot_bytes:
                    if _LIBC.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                       header_bytes(self.consumers), self.slots * self.slot_bytes) != 0:
                        log.debug("ring memory not punched out: %s", os.strerror(ctypes.get_errno()))
            except Exception as e:  # noqa: BLE001 - a consumer failed or died: it reports that itself
                log.debug("ring released without waiting for its consumers: %s", e)
            finally:
                self.close()

        threading.Thread(target=run, name="megashard-ring-release", daemon=True).start()

    # -- consumer side --------------------------------------------------------------
    def wait_produced(self, k: int, reader_pid: int) -> None:
        """Wait until extent ``k`` is in its slot (ShmError if the reader failed or died)."""
        _fence()
        if int(self._head[5]) > k:
            return

        def ready() -> bool:
            if int(self._head[6]):
                raise ShmError("the node's reader failed while filling shared memory (its error follows from its rank)")
            return int(self._head[5]) > k

        def watch() -> Optional[str]:
            return None if pid_alive(reader_pid) else f"the node's reader (pid {reader_pid}) died"

        _wait(ready, watch, lambda: int(self._head[5]), f"extent {k} from the node's reader")
        _fence()

    def set_done(self, c: int, upto: int) -> None:
        """Consumer ``c`` no longer needs extents ``< upto``."""
        self._set(_HEAD + _PER_CONSUMER * c, upto)

    def fail_consumer(self, c: int) -> None:
        if self._mm is not None:
            self._set(_HEAD + _PER_CONSUMER * c + 1, 1)


def _wait(ready: Callable[[], bool], watch: Callable[[], Optional[str]], progress: Callable[[], object],
          what: str) -> None:
    """Poll ``ready`` with a short backoff; check ``watch`` (peer liveness) ~10x a second;
    give up after :func:`stall_timeout` seconds in which ``progress()`` did not change."""
    timeout = stall_timeout()
    delay = 2e-5
    last = progress()
    last_change = time.monotonic()
    next_check = last_change + 0.05
    while not ready():
        now = time.monotonic()
        if now >= next_check:
            problem = watch()
            if problem:
                raise ShmError(f"{problem} (waiting for {what})")
            cur = progress()
            if cur != last:
                last, last_change = cur, now
            elif now - last_change > timeout:
                raise ShmError(f"no progress for {timeout:.0f} s waiting for {what} (peer alive but stuck?); "
                               "MEGASHARD_SHM_TIMEOUT_S sets this limit")
            next_check = now + 0.1
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)

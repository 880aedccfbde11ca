"""A ring of POSIX shared-memory buffers for scatter loads within one node.

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

Segments live in ``/dev/shm`` under unique names, are reserved with
``posix_fallocate`` (so a full tmpfs is an error here, not a SIGBUS later) and
unlinked by every rank as soon as all of them have it open; after that a crash of
any rank cannot leave anything behind. Before that moment a crash of every rank of
the node would leave the segment, so its name says who created it:
``megashard-<pid>-<boot id>-<pid namespace>-<start time>-<token>``. Each new ring's
creator first removes (:func:`sweep_abandoned`) the segments of its own user, boot
and PID namespace whose creator is provably gone (no such pid, a zombie, or a pid
reused by a process with another start time): such a ring can no longer be used
by anyone. This module never talks to ``torch.distributed``.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import procinfo
from .errors import MegashardError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "megashard-"
RING_SLOTS = 4
MAGIC = 0x6D7368726E67  # "mshrng"
VERSION = 1
_HEAD = 8  # header words before the per-consumer records
_PER_CONSUMER = 4  # done, failed, pid, unused
_PAGE = mmap.PAGESIZE
_fence_lock = threading.Lock()


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
    """This kernel's boot id and this process's PID namespace ('' if unknown). Ranks with equal
    identities share a /dev/shm-capable kernel and can watch each other's pids; a node id that
    groups ranks of different machines shows up as different boot ids."""
    boot, ns = procinfo.boot_id(), procinfo.namespace("pid")
    return f"{boot}/{ns}" if boot and ns else ""


pid_alive = procinfo.pid_alive


def available_bytes() -> int:
    """What a new segment may use: free space in /dev/shm, capped by ``MEGASHARD_SHM_MAX_BYTES``.

    0 when /dev/shm does not exist or is not writable."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    if not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return 0
    free = st.f_bavail * st.f_frsize
    cap = os.environ.get("MEGASHARD_SHM_MAX_BYTES")
    if cap:
        try:
            free = min(free, int(cap))
        except ValueError:
            log.warning("ignoring MEGASHARD_SHM_MAX_BYTES=%r (not an integer)", cap)
    return free


_NAME = re.compile(r"megashard-([1-9][0-9]{0,9})-([0-9a-f]{8})-([0-9]{1,20})-([0-9]{1,20})-[0-9a-f]{16}\Z")


def _creator() -> Optional[Tuple[str, str, int]]:
    """This process's (boot id prefix, PID namespace inode, start time), or None if unknown."""
    boot = procinfo.boot_id().replace("-", "")[:8]
    ns = re.fullmatch(r"pid:\[([0-9]+)\]", procinfo.namespace("pid"))
    start = procinfo.start_time("self")
    if ns is None or start is None or start < 0 or not re.fullmatch(r"[0-9a-f]{8}", boot):
        return None
    return boot, ns.group(1), start


def new_name() -> str:
    """A fresh segment name that records its creator (see the module docstring); without
    /proc, a name no sweep will ever remove."""
    me = _creator()
    if me is None:
        return f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    boot, ns, start = me
    return f"{SEGMENT_PREFIX}{os.getpid()}-{boot}-{ns}-{start}-{secrets.token_hex(8)}"


def sweep_abandoned() -> List[str]:
    """Remove the segments whose creator is provably gone; returns their names.

    Only regular files owned by this user, named as :func:`new_name` names them, created
    in this boot and PID namespace (where their creator's pid can be checked), by a
    process that no longer exists. Anything else in /dev/shm is left alone."""
    me = _creator()
    if me is None:
        return []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for n in names:
        m = _NAME.match(n)
        if m is None or (m.group(2), m.group(3)) != me[:2]:
            continue
        start = procinfo.start_time(m.group(1))
        if start is None or start == int(m.group(4)):  # alive, or we cannot tell
            continue
        path = os.path.join(SHM_DIR, n)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(n)
        log.info("removed shared memory segment %s: its creator (pid %s) died before the ring was unlinked",
                 path, m.group(1))
    return removed


def unlink(name: str) -> None:
    """Remove a segment name (no error if some other rank already did)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove shared memory segment %s: %s", os.path.join(SHM_DIR, name), e)


def header_bytes(consumers: int) -> int:
    words = _HEAD + _PER_CONSUMER * consumers
    return -(-words * 8 // _PAGE) * _PAGE


def segment_bytes(consumers: int, slots: int, slot_bytes: int) -> int:
    return header_bytes(consumers) + slots * slot_bytes


class Ring:
    """One mapping of a ring segment (the reader's or a consumer's)."""

    def __init__(self, name: str, fd: int, consumers: int, slots: int, slot_bytes: int) -> None:
        self.name, self.consumers, self.slots, self.slot_bytes = name, consumers, slots, slot_bytes
        size = segment_bytes(consumers, slots, slot_bytes)
        try:
            # MAP_POPULATE: map every page now, in one call, instead of one fault per page later
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._head = np.frombuffer(self._mm, dtype=np.int64, count=header_bytes(consumers) // 8)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header_bytes(consumers),
                                      count=slots * slot_bytes) if slots * slot_bytes else torch.empty(0, dtype=torch.uint8)
        self._peer_pids: List[int] = []

    # -- creation -----------------------------------------------------------------
    @classmethod
    def create(cls, name: str, consumers: int, slots: int, slot_bytes: int) -> "Ring":
        """Create and reserve the segment (ShmError if /dev/shm cannot hold it), after
        removing those of crashed jobs (:func:`sweep_abandoned`)."""
        sweep_abandoned()
        path = os.path.join(SHM_DIR, name)
        size = segment_bytes(consumers, slots, slot_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise ShmError(f"cannot create shared memory segment {path}: {e.strerror}") from None
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            unlink(name)
            raise ShmError(f"cannot reserve {size} bytes in {SHM_DIR} for {path} ({e.strerror}); "
                           f"{SHM_DIR} has {available_bytes()} bytes free; lower scatter_chunk_bytes, enlarge "
                           "/dev/shm (docker --shm-size) or pass scatter_transport='group'") from None
        ring = cls(name, fd, consumers, slots, slot_bytes)
        ring._head[:_HEAD] = [MAGIC, VERSION, consumers, slots, slot_bytes, 0, 0, os.getpid()]
        return ring

    @classmethod
    def attach(cls, name: str, consumers: int, slots: int, slot_bytes: int, index: int) -> "Ring":
        """Open the reader's segment as consumer ``index`` and check its header."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise ShmError(f"cannot open shared memory segment {path}: {e.strerror}") from None
        size = segment_bytes(consumers, slots, slot_bytes)
        have = os.fstat(fd).st_size
        if have != size:
            os.close(fd)
            raise ShmError(f"shared memory segment {path} has {have} bytes, expected {size}")
        ring = cls(name, fd, consumers, slots, slot_bytes)
        if list(ring._head[:5]) != [MAGIC, VERSION, consumers, slots, slot_bytes]:
            ring.close()
            raise ShmError(f"shared memory segment {path} has an unexpected header")
        ring._set(_HEAD + _PER_CONSUMER * index + 2, os.getpid())
        return ring

    def close(self) -> None:
        """Unmap (the segment itself disappears once unlinked and unmapped everywhere)."""
        if self._mm is None:
            return
        self._head = None  # type: ignore[assignment]
        self._data = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
            log.debug("shared memory mapping %s still referenced at close", self.name)
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

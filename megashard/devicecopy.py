"""Bytes from files and shared memory into accelerator (GPU) memory.

``preadv`` writes host memory only. A byte range whose destination lives on a GPU is
read into one of a few page-locked ("pinned") host buffers and copied from there
asynchronously on a side stream while the next buffer fills, so a rank's host memory
stays at ``buffers × buffer_bytes`` however large its GPU shards are (the alternative,
a full host copy of every GPU tensor, doubles a rank's footprint for the load).

A shared-memory ring (:mod:`megashard.shm`) is page-locked in place instead
(:meth:`DeviceCopier.register`): each rank of a node copies its pieces from the mapping
to its own GPU by DMA, over its own link, with no bounce through another buffer.

Without CUDA the same code copies synchronously into CPU tensors: that is how the
bounce logic is exercised on machines without a GPU.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .format.fastio import tensor_memoryview

log = logging.getLogger(__name__)

BOUNCE_BYTES = 32 << 20  # per pinned buffer
BOUNCE_BUFFERS = 3  # one filling, one or two copying


def on_host(t: torch.Tensor) -> bool:
    """Whether ``preadv``/``memcpy`` can write ``t``'s memory directly."""
    return t.device.type == "cpu"


def device_targets(tensors: Iterable[Optional[torch.Tensor]]) -> List[torch.device]:
    """The distinct non-host devices among ``tensors`` (``None`` entries ignored)."""
    out: List[torch.device] = []
    for t in tensors:
        if t is not None and not on_host(t) and t.device not in out:
            out.append(t.device)
    return out


def split_targets(requests: Iterable[Tuple[int, torch.Tensor]]
                  ) -> Tuple[List[Tuple[int, memoryview]], List[Tuple[int, torch.Tensor]]]:
    """``(file offset, contiguous destination)`` requests split by where the memory is: host
    ones as memoryviews for ``preadv``, the others for :meth:`DeviceCopier.read`."""
    host: List[Tuple[int, memoryview]] = []
    device: List[Tuple[int, torch.Tensor]] = []
    for off, t in requests:
        if on_host(t):
            host.append((off, tensor_memoryview(t)))
        else:
            device.append((off, t))
    return host, device


class DeviceCopier:
    """Host bytes to device tensors for one load; ``close()`` waits for every copy.

    Create it on the thread that owns the destinations (its current CUDA stream is the
    one the side streams wait for, so pending writes to the destinations, such as a
    zero fill, land first). ``copy`` may be called from several threads; ``read`` from
    one thread at a time.
    """

    def __init__(self, devices: Sequence[torch.device], buffer_bytes: int = BOUNCE_BYTES,
                 buffers: int = BOUNCE_BUFFERS) -> None:
        self.buffer_bytes, self.nbuf = max(1, int(buffer_bytes)), max(1, int(buffers))
        self.cuda = [d for d in devices if d.type == "cuda"]
        self._streams: Dict[torch.device, Any] = {}
        for d in self.cuda:
            s = torch.cuda.Stream(device=d)
            s.wait_stream(torch.cuda.current_stream(d))
            self._streams[d] = s
        self._bufs: List[torch.Tensor] = []
        self._events: List[List[Any]] = []  # per buffer: events of the copies still reading it
        self._next = 0
        self._registered: List[int] = []
        self._lock = threading.Lock()
        self.bounced = 0  # bytes that went through the pinned buffers

    # -- copies from host memory the caller owns ------------------------------------
    def register(self, t: torch.Tensor) -> bool:
        """Page-lock ``t``'s host memory in place so copies from it are DMA; False (and one
        log line) where the driver refuses, after which copies still work, staged by the driver."""
        if not self.cuda or t.numel() == 0:
            return False
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        except Exception as e:  # noqa: BLE001 - slower, still correct
            log.warning("cannot page-lock %d MiB of shared memory for GPU copies (%s); copying without it",
                        t.numel() * t.element_size() >> 20, e)
            return False
        self._registered.append(t.data_ptr())
        return True

    def unregister_all(self) -> None:
        """Undo :meth:`register` (after :meth:`sync`); call before the memory is unmapped."""
        self.sync()
        for ptr in self._registered:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
            except Exception as e:  # noqa: BLE001 - the mapping is unmapped next anyway
                log.debug("cudaHostUnregister failed: %s", e)
        self._registered.clear()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[:] = src`` (both contiguous uint8); asynchronous for a GPU ``dst``: ``src`` must
        stay unchanged until :meth:`sync`."""
        s = self._streams.get(dst.device)
        if s is None:
            dst.copy_(src)
        else:
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)

    def sync(self) -> None:
        """Every copy issued so far has completed."""
        for s in self._streams.values():
            s.synchronize()

    # -- reads from files ----------------------------------------------------------
    def read(self, read_into: Callable[[List[Tuple[int, memoryview]]], Any],
             requests: Sequence[Tuple[int, torch.Tensor]]) -> int:
        """Fill contiguous uint8 device tensors from file offsets (validated by the caller)
        through the pinned buffers; returns the bytes read. ``read_into(reqs)`` fills host
        ``(file offset, view)`` requests from the one file (a files object's ``read_into``
        bound to a member, or ``read_requests`` on a descriptor). Copies may still be in
        flight when it returns (:meth:`sync`)."""
        batch: List[Tuple[int, int, torch.Tensor, int]] = []  # file offset, bytes, destination, offset in buffer
        filled = total = 0
        for off, dst in sorted(requests, key=lambda r: r[0]):
            n = dst.numel()
            pos = 0
            while pos < n:
                take = min(n - pos, self.buffer_bytes - filled)
                batch.append((off + pos, take, dst[pos:pos + take], filled))
                pos += take
                filled += take
                if filled == self.buffer_bytes:
                    self._flush(read_into, batch)
                    batch, filled = [], 0
            total += n
        if batch:
            self._flush(read_into, batch)
        return total

    def _flush(self, read_into: Callable[[List[Tuple[int, memoryview]]], Any],
               batch: List[Tuple[int, int, torch.Tensor, int]]) -> None:
        buf, i = self._acquire()
        read_into([(off, tensor_memoryview(buf[b:b + n])) for off, n, _, b in batch])
        used = set()
        for _, n, dst, b in batch:
            self.copy(dst, buf[b:b + n])
            used.add(dst.device)
        self.bounced += sum(n for _, n, _, _ in batch)
        events = []
        for d in used:
            s = self._streams.get(d)
            if s is not None:
                ev = torch.cuda.Event()
                ev.record(s)
                events.append(ev)
        self._events[i] = events

    def _acquire(self) -> Tuple[torch.Tensor, int]:
        """The next pinned buffer, once the copies still reading it are done."""
        with self._lock:
            if len(self._bufs) < self.nbuf:
                self._bufs.append(torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=bool(self.cuda)))
                self._events.append([])
                i = len(self._bufs) - 1
            else:
                i = self._next
                self._next = (i + 1) % self.nbuf
            for ev in self._events[i]:
                ev.synchronize()
            self._events[i] = []
            return self._bufs[i], i

    def close(self) -> None:
        """Wait for every copy, release the pinned buffers and page-locked registrations."""
        try:
            self.unregister_all()
        finally:
            self._bufs.clear()
            self._events.clear()

    def __enter__(self) -> "DeviceCopier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

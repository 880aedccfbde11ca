"""Asynchronous saves: training waits for a snapshot, not for the disk.

``megashard.save(..., async_save=True)`` runs the planning collective, copies every
tensor this rank writes into *staging* buffers (:class:`Staging`), agrees that every
rank holds its snapshot, and returns an :class:`AsyncSaveHandle`. A persistent
background thread then hashes, writes and fsyncs the files into the save's temporary
directory. :meth:`AsyncSaveHandle.result` (collective) agrees on the outcome, writes
the manifest and renames the directory into place — the same commit as a synchronous
save, so a checkpoint only ever appears complete.

Why a thread and not a process: the writer spends its time in SHA-256, CRC32 and
``pwrite``/``fsync``, all of which release the GIL, so a thread slows a training step
less than a forked process does (``scripts/bench_async.py`` measures both), while a
process would need the staging memory shared with it and its results sent back. The
writer runs at a raised niceness (``MEGASHARD_ASYNC_NICE``, default 10), so on busy
CPUs the kernel runs training first and the write takes the idle time.

The writer and the threads it starts use their own I/O thread pools
(:func:`megashard.format.fastio.take_io_role`): the training path's reads and writes
never run on a niced writer thread, and the background write never on a training one.

At most one save is in flight per process: a new save (sync or async) first calls
``result()`` on the previous one. A process that exits with a save still in flight
**abandons** it: an ``atexit`` hook waits for this rank's background write to stop (also
one whose ``result()`` failed or timed out) and then for the writer thread to end (so no
thread writes during interpreter teardown), at most ``MEGASHARD_ASYNC_EXIT_WAIT``
seconds (default 120; then it exits anyway, naming the temporary directory left behind),
and commits nothing; the save's ``.<name>.tmp-<token>`` directory is never a checkpoint.
The previous checkpoint and the tracker are untouched, exactly as after a SIGKILL.

``fork``: a child process has none of this: not the writer thread, not the staging
arenas (left out of children, see :class:`Staging`), not the parent's save in flight.
A fork handler gives the child an empty state, so a child exits at once, saves on its
own (its own snapshot, staging and writer) and never waits for, or finishes, the
parent's save; a parent's :class:`AsyncSaveHandle` used in a child raises.

Staging: one arena per memory kind (``empty_buffer``'s huge-page-backed, pre-touched
host memory for CPU tensors; pinned host memory for CUDA tensors, copied on a side
stream), sized to the rank's checkpoint bytes and reused by every later save that
fits. The copies run in parallel chunks.
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import exiting
from .errors import CheckpointError, MegashardError
from .format.fastio import default_threads, empty_buffer, prefault, run_parallel, take_io_role, tensor_memoryview
from .transport import Comm

log = logging.getLogger(__name__)

ALIGN = 4096  # staged tensors start on page boundaries (aligned pwrite sources, dtype views)
COPY_CHUNK = 32 << 20  # bytes per parallel copy task
DEFAULT_WRITER_NICE = 10
DEFAULT_EXIT_WAIT = 120.0  # seconds the exit hook waits for a background write

__all__ = ["AsyncSaveHandle", "Staging", "staging", "in_flight", "finalize", "all_done"]


# --------------------------------------------------------------------------- staging


class Staging:
    """Host buffers a snapshot is copied into, kept from one save to the next.

    ``allocations`` counts arena allocations: after the first save of a given size
    later saves allocate nothing (tests check it and the arenas' addresses).
    """

    def __init__(self) -> None:
        self.arenas: Dict[str, torch.Tensor] = {}
        self.allocations = 0
        self._streams: Dict[int, Any] = {}

    def _arena(self, kind: str, nbytes: int) -> torch.Tensor:
        have = self.arenas.get(kind)
        if have is not None and have.numel() >= nbytes:
            return have
        self.arenas.pop(kind, None)  # free the smaller one before allocating the larger
        if kind == "pinned":
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            buf = empty_buffer(nbytes, fork_private=True)  # see empty_buffer: forks must not slow snapshots
            if nbytes:
                prefault(tensor_memoryview(buf))  # touched now, not page by page inside the copy
        self.allocations += 1
        self.arenas[kind] = buf
        log.debug("staging: allocated %d bytes of %s memory", nbytes, kind)
        return buf

    def nbytes(self) -> int:
        return sum(a.numel() for a in self.arenas.values())

    def snapshot(self, tensors: List[torch.Tensor], threads: Optional[int] = None) -> List[torch.Tensor]:
        """Copies of ``tensors`` (contiguous, CPU, in staging memory), in order.

        Valid until the next call; the caller may change or free the originals as
        soon as this returns."""
        kinds = ["pinned" if t.device.type == "cuda" else "cpu" for t in tensors]
        offsets: List[int] = []
        need: Dict[str, int] = {}
        for t, kind in zip(tensors, kinds):
            pos = need.get(kind, 0)
            offsets.append(pos)
            need[kind] = pos + _round_up(t.numel() * t.element_size(), ALIGN)
        arenas = {kind: self._arena(kind, n) for kind, n in need.items()}
        out: List[torch.Tensor] = []
        cpu_tasks: List[Callable[[], None]] = []
        gpu: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for t, kind, off in zip(tensors, kinds, offsets):
            nb = t.numel() * t.element_size()
            dst = arenas[kind][off:off + nb].view(t.dtype).view(t.shape)
            out.append(dst)
            if kind == "pinned":
                gpu.append((t, dst))
            else:
                cpu_tasks += _copy_tasks(t.detach(), dst)
        if gpu:
            self._copy_from_gpu(gpu)
        run_parallel(cpu_tasks, threads or default_threads())
        return out

    def _copy_from_gpu(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Device-to-host copies on a side stream per device, ordered after the work
        already queued on the current stream; returns when they are complete."""
        by_dev: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        for src, dst in pairs:
            by_dev.setdefault(src.device.index or 0, []).append((src, dst))
        streams = []
        for dev, items in by_dev.items():
            stream = self._streams.get(dev)
            if stream is None:
                stream = self._streams[dev] = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for src, dst in items:
                    dst.copy_(src.detach(), non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _copy_tasks(src: torch.Tensor, dst: torch.Tensor) -> List[Callable[[], None]]:
    """Chunks of one host copy (torch's copy releases the GIL, so chunks run in parallel)."""
    nb = src.numel() * src.element_size()
    if nb <= COPY_CHUNK or not src.is_contiguous() or src.device.type != "cpu":
        return [lambda: dst.copy_(src)]
    s, d = src.reshape(-1), dst.reshape(-1)
    step = max(1, COPY_CHUNK // src.element_size())
    return [lambda lo=lo: d[lo:lo + step].copy_(s[lo:lo + step]) for lo in range(0, s.numel(), step)]


_STAGING = Staging()


def staging() -> Staging:
    """This process's staging buffers (shared by every async save)."""
    return _STAGING


# --------------------------------------------------------------------------- the writer thread


class _Job:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[str] = None
        self.what = ""  # the checkpoint it writes, for messages
        self.temp = ""  # where it writes (the save's temporary directory or prefix)
        self._lock = threading.Lock()
        self._then: List[Callable[[], None]] = []

    def finish(self, result: Any, error: Optional[str]) -> None:
        self.result, self.error = result, error
        with self._lock:
            self.done.set()
            then, self._then = self._then, []
        for fn in then:
            _run_callback(fn)

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (on the writer thread) when the job ends; now if it already has."""
        with self._lock:
            if not self.done.is_set():
                self._then.append(fn)
                return
        _run_callback(fn)


def _run_callback(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a notification must not kill the writer thread
        log.warning("async save: a completion callback failed", exc_info=True)


class _Writer:
    """One persistent daemon thread that runs background writes, one at a time."""

    def __init__(self) -> None:
        self.q: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self.thread: Optional[threading.Thread] = None

    def submit(self, job: _Job) -> None:
        if self.thread is None or not self.thread.is_alive():  # a forked child gets a new _Writer
            self.thread = threading.Thread(target=self._loop, name="megashard-async-save", daemon=True)
            self.thread.start()
        self.q.put(job)

    def stop(self, timeout: float) -> bool:
        """Let the thread leave its loop once its job (if any) has ended, and wait for it
        (bounded); True when no writer thread runs any more."""
        t = self.thread
        if t is None or not t.is_alive():
            return True
        self.q.put(None)
        t.join(timeout)
        return not t.is_alive()

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            if job is None:  # stop(): the process exits
                return
            take_io_role("async", writer_nice())  # its own pools, niced (re-read: the variable may change)
            job.finish(*_capture(job.fn))


def writer_nice() -> int:
    """Niceness of the writer thread (and of the threads it starts, which inherit it):
    ``MEGASHARD_ASYNC_NICE``, default 10, so that the kernel runs training first when
    the CPUs are busy. 0 keeps the trainer's priority. Only ever raised: lowering it
    again would need privileges."""
    return _env_number("MEGASHARD_ASYNC_NICE", DEFAULT_WRITER_NICE, lambda v: max(0, min(19, int(v))))


def exit_wait() -> float:
    """Seconds the exit hook waits for an abandoned background write:
    ``MEGASHARD_ASYNC_EXIT_WAIT``, default 120."""
    return _env_number("MEGASHARD_ASYNC_EXIT_WAIT", DEFAULT_EXIT_WAIT, lambda v: max(0.0, min(float(v), 86400.0)))


def _env_number(name: str, default: Any, parse: Callable[[str], Any]) -> Any:
    v = os.environ.get(name, "")
    try:
        return parse(v) if v else default
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, v, default)
        return default


def _capture(fn: Callable[[], Any]) -> Tuple[Any, Optional[str]]:
    """Like :meth:`Comm.run`, off the training thread (no collective here)."""
    import traceback

    try:
        return fn(), None
    except MegashardError as e:
        return None, f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - reaches every rank at result()
        return None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"


_WRITER = _Writer()


# --------------------------------------------------------------------------- the handle


@dataclass
class _Commit:
    """What :meth:`AsyncSaveHandle.result` needs to finish the save."""

    comm: Comm
    final_dir: str
    temp_dir: str
    finish: Callable[[Comm, Optional[str], Any], None]  # agree on the write, commit, agree (api)


class AsyncSaveHandle:
    """An async save in flight. ``done()`` is local; ``result()`` is collective."""

    def __init__(self, commit: _Commit, job: _Job) -> None:
        self._commit = commit
        self._job = job
        self.pid = os.getpid()  # the process whose writer thread runs this save
        self._finalized = False
        self._error: Optional[BaseException] = None
        self._committed: List[Callable[[], None]] = []
        self.checkpoint_dir = commit.final_dir
        self.started = time.time()
        self.timings: Dict[str, float] = {}  # where the blocking time went (plan, copy, agree), seconds

    @property
    def temp_dir(self) -> str:
        return self._commit.temp_dir

    def _check_process(self) -> None:
        """A forked child has the handle object but neither the write nor its thread:
        waiting there would never end."""
        if os.getpid() != self.pid:
            raise CheckpointError(
                f"the async save of {self.checkpoint_dir} was started by another process (pid {self.pid}); "
                f"this process (pid {os.getpid()}, a fork of it) has neither its background write nor its "
                "staging and cannot wait for or commit it: finish it in the process that started it, "
                "or save again here")

    def done(self) -> bool:
        """True once this rank's background write has ended (success or failure). Local, non-blocking."""
        self._check_process()
        return self._job.done.is_set()

    def when_written(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from the writer thread, or now) once this rank's write has ended."""
        self._job.then(fn)

    def add_commit_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on every rank right after a successful commit, inside ``result()``
        (whoever calls it: the caller, the next save, or :func:`finalize`); it may be
        collective — e.g. Megatron's tracker file is written this way."""
        self._committed.append(fn)

    def wait_local(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's background write ends (no collective); False on timeout."""
        self._check_process()
        return self._job.done.wait(timeout)

    @property
    def finalized(self) -> bool:
        return self._finalized

    def result(self, timeout: Optional[float] = None) -> str:
        """Wait for every rank's write, commit, and return the checkpoint directory. Collective.

        Raises :class:`DistributedError` on every rank if any rank's write failed (or
        did not finish within ``timeout`` seconds); the checkpoint is then not
        committed. Calling it again returns (or re-raises) the same outcome.
        """
        if self._finalized:
            if self._error is not None:
                raise self._error
            return self.checkpoint_dir
        self._check_process()
        comm = self._commit.comm
        error = None
        if not self._job.done.wait(timeout):
            error = (f"the background write of {self.checkpoint_dir} did not finish within {timeout} s "
                     "(the save is abandoned; the previous checkpoint is untouched)")
        elif self._job.error is not None:
            error = self._job.error
        global _IN_FLIGHT
        try:
            self._commit.finish(comm, error, None if error else self._job.result)
            for fn in self._committed:
                fn()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._finalized = True
            if _IN_FLIGHT is self:
                _IN_FLIGHT = None
        return self.checkpoint_dir


_IN_FLIGHT: Optional[AsyncSaveHandle] = None
_LAST_JOB: Optional[_Job] = None


def in_flight() -> Optional[AsyncSaveHandle]:
    """The async save not yet finalized by ``result()``, if any (this process)."""
    return _IN_FLIGHT


def start(commit: _Commit, write: Callable[[], Any]) -> AsyncSaveHandle:
    """Hand ``write`` to the background thread; the returned handle is in flight."""
    global _IN_FLIGHT, _LAST_JOB
    job = _LAST_JOB = _Job(write)
    job.what = commit.final_dir
    job.temp = commit.temp_dir
    handle = AsyncSaveHandle(commit, job)
    _IN_FLIGHT = handle
    _WRITER.submit(job)
    return handle


def wait_idle(timeout: Optional[float] = None) -> None:
    """Wait until no background write runs (before staging memory is reused): a save
    whose ``result()`` timed out may still be writing from it. Bounded by ``timeout``
    (the save's): a write stuck in storage must not hang this rank forever."""
    job = _LAST_JOB
    if job is not None and not job.done.wait(timeout):
        raise CheckpointError(
            f"an earlier async save to {job.what} is still writing after {timeout:g} s (its result() timed "
            "out); its staging memory cannot be reused yet: check that storage, or save later")


def all_done(comm: Optional[Comm] = None) -> bool:
    """True on every rank iff every rank's background write has ended. Collective.

    The non-blocking check of a training loop: call it every iteration (all ranks),
    and finalize with ``result()`` when it says True."""
    h = _IN_FLIGHT
    comm = comm or (h._commit.comm if h is not None else Comm())
    busy = 0 if h is None or h.done() else 1
    return comm.all_reduce_max(busy) == 0


def finalize(blocking: bool, comm: Optional[Comm] = None) -> Optional[str]:
    """Finalize the save in flight like megatron-core's ``maybe_finalize_async_calls``.

    Collective (every rank calls it with the same ``blocking``). Non-blocking: commit
    only when every rank's write has ended, else return None at once. Blocking: wait,
    then commit. Returns the committed directory, or None when nothing was committed.
    """
    h = _IN_FLIGHT
    if h is None:
        return None
    if not blocking and not all_done(comm):
        return None
    return h.result()


def _abandon_at_exit() -> None:
    """Wait, bounded, for this process's background write (a forked child has none), even one
    whose ``result()`` already failed or timed out, then stop the writer thread. No megashard
    thread may run during interpreter teardown: a daemon thread still inside a torch call when
    Python ends it aborts the whole process (``terminate called without an active exception``,
    SIGABRT) after the caller's own error was printed."""
    h = _IN_FLIGHT
    if h is not None and not h.finalized and h.pid == os.getpid():
        log.warning("process exiting with an async save to %s not finalized: it is abandoned (never committed; "
                    "the previous checkpoint and tracker are untouched; its files stay in %s). Call "
                    "handle.result() before exit to keep it.", h.checkpoint_dir, h.temp_dir)
    limit = exit_wait()
    job = _LAST_JOB
    if (job is not None and not job.done.wait(limit)) or not _WRITER.stop(limit):
        log.warning("the background write of %s did not end within %g s (MEGASHARD_ASYNC_EXIT_WAIT): exiting while "
                    "it runs; its temporary directory %s is left behind (never a checkpoint, safe to delete)",
                    job.what if job else "?", limit, job.temp if job else "?")


def _keep_forever(obj: Any) -> None:
    """Never free ``obj`` in this process, not even at interpreter exit."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _after_fork_in_child() -> None:
    """The child starts with no save in flight, no writer thread and no staging.

    The parent's staging is not mapped here (``MADV_DONTFORK``): it is kept alive, never
    used and never freed, since freeing it would unmap whatever the child maps at those
    addresses later (its pinned memory and CUDA streams must not be released here either)."""
    global _STAGING, _WRITER, _IN_FLIGHT, _LAST_JOB
    if _STAGING.arenas or _STAGING._streams:
        _keep_forever(_STAGING)
    _STAGING, _WRITER, _IN_FLIGHT, _LAST_JOB = Staging(), _Writer(), None, None


exiting.at_exit(exiting.WRITES, _abandon_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)

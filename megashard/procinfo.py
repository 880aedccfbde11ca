"""Which process is which, across pid reuse: boot id, PID namespace, start time, liveness.

One place for what a save's owner record (:mod:`megashard.storage`) records about its
creator, and for the checks that later prove that creator gone (and, for :mod:`megashard.shm`,
whether the node's ranks share a kernel and PID namespace and are alive). Linux ``/proc`` only; every function answers "unknown"
rather than guess when ``/proc`` does not say.
"""
from __future__ import annotations

import os
from typing import Optional, Union

#: :func:`start_time` of a process that does not exist, or is a zombie (it holds nothing any more).
GONE = -1


def _read_proc(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16)
    except FileNotFoundError:
        return None


def boot_id() -> str:
    """This kernel boot's id ('' if unknown): pids are only comparable within one boot."""
    try:
        return (_read_proc("/proc/sys/kernel/random/boot_id") or b"").decode("ascii", "replace").strip()
    except OSError:
        return ""


def namespace(kind: str) -> str:
    """This process's namespace of ``kind`` (``pid``, ``mnt``), e.g. ``pid:[4026531836]``; '' if unknown."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def start_time(pid: Union[int, str]) -> Optional[int]:
    """A process's start time in clock ticks after boot (with the pid it names one process for
    the whole boot, whatever pids are reused); :data:`GONE`; or None when /proc does not say."""
    try:
        data = _read_proc(f"/proc/{pid}/stat")
        if data is None:  # no such process, or one /proc hides from us (hidepid): ask the kernel
            return GONE if str(pid).isdigit() and not _exists(int(pid)) else None
        fields = data.rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[:1] and fields[0] in (b"Z", b"X", b"x"):
        return GONE
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live (not zombie) process in this PID namespace; a process /proc
    hides from us (another user, ``hidepid``) counts as alive."""
    started = start_time(pid)
    return started != GONE if started is not None else _exists(pid)

"""Who owns a save's leftovers, and when a clean-up may remove them: the rule every store applies.

A file-system save's temp dir (and a deletion's ``.del-*`` directory) holds an owner record: host,
boot id, pid namespace, pid and process start time (:func:`write_owner`), so a clean-up on the same
machine knows at once whether its process is gone (:func:`owner_alive`). A leftover without such a
record (another machine's, or any object-store save prefix) goes only once it holds nothing but
megashard's names and nothing in it changed for ``older_than_s`` (:data:`DEFAULT_STALE_AGE_S`):
:func:`why_kept`.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import time
from typing import Any, Callable, Dict, Optional

from .. import procinfo

#: The owner record inside a save's temp dir (removed right after the commit renames it).
OWNER_NAME = ".megashard-owner.json"
#: How long a leftover that cannot be proven abandoned must sit unchanged before removal.
DEFAULT_STALE_AGE_S = 24 * 3600.0


def read_small(name: str, limit: int = 4096, dir_fd: Optional[int] = None) -> Optional[str]:
    """A small regular file's text (no link followed), or None when it is not one."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace") if len(data) <= limit else None


def host_identity() -> Dict[str, str]:
    """What makes pids comparable: the same kernel boot, hostname and pid namespace."""
    return {"host": socket.gethostname(), "boot_id": procinfo.boot_id(),
            "pidns": procinfo.namespace("pid"), "mntns": procinfo.namespace("mnt")}


def owner_record() -> Dict[str, Any]:
    ident = host_identity()
    return {"host": ident["host"], "boot_id": ident["boot_id"], "pidns": ident["pidns"], "pid": os.getpid(),
            "start": procinfo.start_time(os.getpid()), "created": time.time()}


def write_owner(dfd: int, record: Optional[Dict[str, Any]] = None) -> None:
    """Create the owner record in the directory open as ``dfd`` (fails if there is one). The
    record is composed before the file exists (it reads /proc): a process killed between
    creating and writing the file leaves an empty record, which no clean-up can attribute."""
    data = json.dumps(owner_record() if record is None else record, sort_keys=True).encode()
    fd = os.open(OWNER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644,
                 dir_fd=dfd)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def owner_alive(dfd: int) -> Optional[bool]:
    """Whether the process that owns the directory open as ``dfd`` (a save's temp dir, a
    deletion's ``.del-*``) may still run: True, False (its process on this machine is gone),
    or None (no readable record, or another machine's)."""
    text = read_small(OWNER_NAME, dir_fd=dfd)
    try:
        rec = json.loads(text) if text is not None else None
    except ValueError:
        rec = None
    if not isinstance(rec, dict):
        return None
    me = host_identity()
    if not me["boot_id"] or any(rec.get(k) != me[k] for k in ("host", "boot_id", "pidns")):
        return None
    pid, start = rec.get("pid"), rec.get("start")
    if type(pid) is not int or pid <= 0 or not (start is None or type(start) is int):
        return None
    now = procinfo.start_time(pid)
    if now == procinfo.GONE:
        return False
    return now is None or start is None or now == start  # hidden from us (hidepid): assume it runs


def why_kept(alive: Optional[bool], only_ours: Callable[[], bool], newest: Callable[[], float],
             older_than_s: float, now: float) -> Optional[str]:
    """Why a dead save's leftover stays; None when a clean-up may remove it. ``alive``: what its owner
    record says (:func:`owner_alive`; None: no record of this machine, as always on an object store);
    ``only_ours()``: it holds nothing but what megashard writes; ``newest()``: when anything in it last
    changed (each asked only when the rule needs it)."""
    if alive:
        return "its owner still runs"
    if alive is None:
        if not only_ours():
            return "it has no owner record of this machine and holds names megashard does not write"
        if now - newest() < older_than_s:
            return f"it has no owner record of this machine and changed within {older_than_s:.0f} s"
    return None

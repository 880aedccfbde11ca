"""One exception family for everything megashard raises on purpose.

Callers catch :class:`MegashardError`; the subclasses say which layer found the
problem. Messages name the file, tensor key and rank where known, and what to do.
"""
from __future__ import annotations

import errno
import os
from typing import Dict, List, Mapping, Optional


class MegashardError(Exception):
    """Base class of every error megashard raises deliberately."""


class FormatError(MegashardError):
    """A `.tensors` file is malformed, truncated, or uses an unsupported feature."""


class ChecksumError(FormatError):
    """A tensor's stored CRC32/SHA-256 does not match its bytes."""


class UnsupportedFormatError(FormatError):
    """A valid tensorizer file uses a feature megashard does not read (e.g. encryption)."""


class CheckpointError(MegashardError):
    """A checkpoint directory or manifest is missing, incomplete or inconsistent."""


class NoSpaceError(CheckpointError, OSError):
    """A save ran out of space: still an ``OSError`` with ``errno == ENOSPC`` (and ``filename``)
    for code that catches those; the message names the path, the bytes needed and free."""

    def __init__(self, message: str, filename: Optional[str] = None) -> None:
        super().__init__(message)
        self.errno, self.strerror, self.filename = errno.ENOSPC, os.strerror(errno.ENOSPC), filename

    def __str__(self) -> str:  # OSError's would print "[Errno 28] ..." without the message
        return str(self.args[0]) if self.args else os.strerror(errno.ENOSPC)


def no_space_error(path: str, needed: int) -> NoSpaceError:
    """The error for a write of ``needed`` bytes to ``path`` that found its file system full."""
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "free space unknown"
    return NoSpaceError(f"No space left on device writing {path}: this rank's files need about {needed} bytes, "
                        f"{free} on that file system; free space there or save elsewhere", path)


class CommitConflictError(CheckpointError):
    """A conditional write lost: another writer created or replaced the object first (S3 412/409)."""


class CommitOutcomeUnknownError(CheckpointError):
    """A commit's conditional write failed without an answer (5xx, a dropped connection, retries exhausted)
    and whether it was applied could not be read back: the save's objects are all kept."""


class ObjectChangedError(CheckpointError):
    """An object was replaced after its ETag was recorded, so its bytes no longer match the checkpoint."""


class StateDictError(MegashardError):
    """The state dict given to save/load cannot be saved, or does not match the checkpoint."""


class DistributedError(MegashardError):
    """One or more ranks failed; carries every failing rank's message.

    Raised on *every* rank so that no rank is left waiting in a later collective.
    """

    def __init__(self, failures: Mapping[int, str], what: str = "operation") -> None:
        self.failures = dict(sorted(failures.items()))
        # each distinct message once, with the ranks that sent it; a line (e.g. one tensor's
        # mismatch, seen by every rank that holds a shard of it) once, from the first rank
        groups: Dict[str, List[int]] = {}
        for rank, msg in self.failures.items():
            groups.setdefault(msg.rstrip(), []).append(rank)
        head = f"megashard {what} failed on rank(s) {ranks_text(list(self.failures))}:"
        lines, seen = [head], set()
        for msg, ranks in groups.items():
            first, *rest = msg.splitlines()
            new = [ln for ln in rest if ln.strip() not in seen]
            seen.update(ln.strip() for ln in rest)
            who = f"[rank {ranks[0]}]" if len(ranks) == 1 else f"[ranks {ranks_text(ranks)}]"
            if rest and not new and first.strip() in seen:
                lines.append(f"  {who} the same problems as above")
                continue
            seen.add(first.strip())
            lines.append(f"  {who} {first}" + "".join(f"\n    {ln}" for ln in new))
        super().__init__("\n".join(lines))


def ranks_text(ranks: List[int]) -> str:
    """``0-7, 9``: sorted ranks with runs of three or more as ranges."""
    out: List[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(f"{ranks[i]}-{ranks[j]}" if j - i >= 2 else ", ".join(str(r) for r in ranks[i:j + 1]))
        i = j + 1
    return ", ".join(out)


_COMBINED: dict = {}


def distributed_error(failures: Mapping[int, str], what: str = "operation") -> DistributedError:
    """A DistributedError that is also the failing ranks' own error class when they agree.

    So ``except StateDictError`` works the same in one process and in a job of many ranks.
    """
    names = {msg.split(":", 1)[0].strip() for msg in failures.values()}
    cls: type = DistributedError
    if len(names) == 1:
        base = {c.__name__: c for c in (FormatError, ChecksumError, UnsupportedFormatError, CheckpointError,
                                         CommitConflictError, CommitOutcomeUnknownError, ObjectChangedError,
                                         StateDictError, NoSpaceError)}.get(names.pop())
        if base is not None:
            cls = _COMBINED.get(base)
            if cls is None:
                cls = _COMBINED[base] = type(f"Distributed{base.__name__}", (DistributedError, base), {})
    err = cls(failures, what)
    if isinstance(err, OSError):  # NoSpaceError on every failing rank: still errno ENOSPC everywhere
        err.errno, err.strerror = errno.ENOSPC, os.strerror(errno.ENOSPC)
    return err

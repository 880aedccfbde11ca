"""One exception family for everything megashard raises on purpose.

Callers catch :class:`MegashardError`; the subclasses say which layer found the
problem. Messages name the file, tensor key and rank where known, and what to do.
"""
from __future__ import annotations

from typing import Mapping


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
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [f"megashard {what} failed on rank(s) {ranks}:"]
        for rank, msg in self.failures.items():
            indented = "\n    ".join(msg.rstrip().splitlines())
            lines.append(f"  [rank {rank}] {indented}")
        super().__init__("\n".join(lines))


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
                                         StateDictError)}.get(names.pop())
        if base is not None:
            cls = _COMBINED.get(base)
            if cls is None:
                cls = _COMBINED[base] = type(f"Distributed{base.__name__}", (DistributedError, base), {})
    return cls(failures, what)

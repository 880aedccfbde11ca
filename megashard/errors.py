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

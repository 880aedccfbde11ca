"""Megatron's save-root layout: the tracker file and the ``iter_N`` / ``release`` directory names.

A save root (what ``--save``/``--load`` take) holds ``iter_0000100/`` ... checkpoints and
``latest_checkpointed_iteration.txt``, the tracker, naming the latest. Pure naming and parsing (no
I/O): every store reads and writes the tracker with these rules (:mod:`megashard.storage`), and the
Megatron adapter names its checkpoints with them. Beside the adapter rather than inside
``megashard/megatron/``, whose import loads megatron-core.
"""
from __future__ import annotations

import re
from typing import Optional, Union

from .errors import CheckpointError

#: Megatron's tracker file name, kept so Megatron tooling finds the latest iteration.
TRACKER_NAME = "latest_checkpointed_iteration.txt"

#: The largest tracker file read (a larger one is garbage, refused).
TRACKER_MAX = 4096
_ITER_RE = re.compile(r"iter_(\d{7,})\Z")


def check_iteration(iteration: Union[int, str]) -> Union[int, str]:
    """``iteration`` when it is an int >= 0 or ``"release"``; a CheckpointError otherwise."""
    if iteration == "release":
        return "release"
    if type(iteration) is int and iteration >= 0:
        return iteration
    raise CheckpointError(f"bad iteration {iteration!r}: use an int >= 0 or 'release'")


def iteration_dir_name(iteration: Union[int, str]) -> str:
    """Megatron's directory name: ``iter_0000100`` (7+ digits) or ``release``."""
    it = check_iteration(iteration)
    return "release" if it == "release" else f"iter_{it:07d}"


def parse_iteration_dir_name(name: str) -> Optional[Union[int, str]]:
    """Inverse of :func:`iteration_dir_name`; None for any other name."""
    if name == "release":
        return "release"
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def parse_tracker(raw: bytes, path: str) -> Union[int, str]:
    """The iteration (or ``"release"``) tracker bytes ``raw`` name; garbage raises a CheckpointError
    naming ``path``: guessing would load the wrong checkpoint."""
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    if text == "release":
        return "release"
    if text is not None and len(raw) <= TRACKER_MAX and text.isdigit():
        return int(text)
    shown = raw[:60].decode("ascii", "backslashreplace")
    raise CheckpointError(
        f"tracker file {path} holds {shown!r}, not an iteration number or 'release'; "
        "fix or delete it, or load an explicit checkpoint directory"
    )


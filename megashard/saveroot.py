"""Megatron's save-root layout: the tracker file and the ``iter_N`` / ``release`` directory names.

Pure naming (no I/O), beside the Megatron adapter (:mod:`megashard.megatron`) but outside that
package, whose import loads megatron-core: :mod:`megashard.storage` (clean-up of the tracker's
temporaries, save roots) and the adapter both use it.
"""
from __future__ import annotations

import re
from typing import Optional, Union

from .errors import CheckpointError

#: Megatron's tracker file name, kept so Megatron tooling finds the latest iteration.
TRACKER_NAME = "latest_checkpointed_iteration.txt"

_ITER_RE = re.compile(r"iter_(\d{7,})\Z")
_TRACKER_MAX = 4096


# --------------------------------------------------------------------------- tracker


def _check_iteration(iteration: Union[int, str]) -> Union[int, str]:
    if iteration == "release":
        return "release"
    if type(iteration) is int and iteration >= 0:
        return iteration
    raise CheckpointError(f"bad iteration {iteration!r}: use an int >= 0 or 'release'")


def iteration_dir_name(iteration: Union[int, str]) -> str:
    """Megatron's directory name: ``iter_0000100`` (7+ digits) or ``release``."""
    it = _check_iteration(iteration)
    return "release" if it == "release" else f"iter_{it:07d}"


def parse_iteration_dir_name(name: str) -> Optional[Union[int, str]]:
    """Inverse of :func:`iteration_dir_name`; None for any other name."""
    if name == "release":
        return "release"
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def _parse_tracker(raw: bytes, path: str) -> Union[int, str]:
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    if text == "release":
        return "release"
    if text is not None and len(raw) <= _TRACKER_MAX and text.isdigit():
        return int(text)
    shown = raw[:60].decode("ascii", "backslashreplace")
    raise CheckpointError(
        f"tracker file {path} holds {shown!r}, not an iteration number or 'release'; "
        "fix or delete it, or load an explicit checkpoint directory"
    )


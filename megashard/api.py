"""The public entry points, re-exported from the modules that implement them.

``save`` (:mod:`megashard.saving`), ``load`` / ``load_common`` (:mod:`megashard.loading`),
and ``read_manifest`` and the checkpoint-directory checks of :mod:`megashard.storage`.
"""
from __future__ import annotations

import os

from . import storage
from .loading import DEFAULT_SCATTER_CHUNK, LoadStats, load, load_common
from .saving import save
from .storage import checkpoint_location, read_manifest

__all__ = ["save", "load", "load_common", "read_manifest", "checkpoint_location", "is_checkpoint", "LoadStats",
           "DEFAULT_SCATTER_CHUNK"]


def is_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    """True iff ``checkpoint_dir`` holds a committed, readable checkpoint."""
    return storage.is_checkpoint(os.fspath(checkpoint_dir))

"""megashard: parallel, reshardable checkpoints in tensorizer's `.tensors` format."""
from __future__ import annotations

from typing import Any

from .errors import (
    ChecksumError,
    CheckpointError,
    DistributedError,
    FormatError,
    MegashardError,
    NoSpaceError,
    StateDictError,
    UnsupportedFormatError,
)

__version__ = "0.1.0"

__all__ = [
    "save",
    "load",
    "load_common",
    "load_consolidated",
    "is_checkpoint",
    "read_manifest",
    "ShardedTensor",
    "sharded_state_dict",
    "MegashardError",
    "FormatError",
    "ChecksumError",
    "UnsupportedFormatError",
    "CheckpointError",
    "StateDictError",
    "DistributedError",
    "NoSpaceError",
]


def __getattr__(name: str) -> Any:
    # Lazy so that `import megashard.format` stays light (no torch.distributed import).
    if name in ("save", "load", "load_common", "is_checkpoint", "read_manifest"):
        from . import api

        return getattr(api, name)
    if name == "load_consolidated":
        from .consolidated import load_consolidated

        return load_consolidated
    if name in ("ShardedTensor", "sharded_state_dict"):
        from . import sharded

        return getattr(sharded, name)
    raise AttributeError(name)

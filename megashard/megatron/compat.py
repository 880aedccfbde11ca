"""Where megatron-core releases differ, in one place (0.16.1 on Python 3.11 … 0.19.x on 3.12).

Everything else in :mod:`megashard.megatron` uses only what every supported release has.
Each entry names the releases it is for, so a later release that changes it again is a
one-line edit here.
"""
from __future__ import annotations

import importlib.metadata
import re
from typing import FrozenSet, Tuple

#: Megatron functions known to merge a ``ShardedTensorFactory``'s parts with ``torch.cat`` along
#: dim 0 (SwiGLU's fc1 halves), as (``__module__``, ``__qualname__``):
#: 0.16 uses a closure in ``apply_swiglu_sharded_factory``; 0.19 a module function that falls back
#: to a CPU ``cat`` on OOM (same result).
CAT0_MERGES: FrozenSet[Tuple[str, str]] = frozenset({
    ("megatron.core.transformer.mlp", "apply_swiglu_sharded_factory.<locals>.sh_ten_merge_fn"),  # 0.16
    ("megatron.core.transformer.utils", "cat_with_oom_fallback"),  # 0.17+
})


def megatron_core_version() -> Tuple[int, int, int]:
    """The installed megatron-core release as (major, minor, patch); (0, 0, 0) when not installed.

    Read from the package metadata: importing ``megatron.core`` only to ask would print its
    import-time warnings."""
    try:
        text = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0, 0)
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (0, 0, 0)

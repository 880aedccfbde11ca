"""Where megatron-core releases differ, in one place (0.16.1 on Python 3.11 … 0.19.x on 3.12).

Everything else in :mod:`megashard.megatron` uses only what every supported release has.
Each entry names the releases it is for, so a later release that changes it again is a
one-line edit here. Differences on Megatron-LM's side (``pretrain()``'s signature, where the
arguments are parsed) are the user's script's business: see :func:`megashard.megatron.with_arguments`.
Differences that only matter without CUDA live in :mod:`megashard.megatron.cpu_compat`.
"""
from __future__ import annotations

from typing import FrozenSet, Tuple

#: Megatron functions known to merge a ``ShardedTensorFactory``'s parts with ``torch.cat`` along
#: dim 0 (SwiGLU's fc1 halves), as (``__module__``, ``__qualname__``):
#: 0.16 uses a closure in ``apply_swiglu_sharded_factory``; 0.19 a module function that falls back
#: to a CPU ``cat`` on OOM (same result).
CAT0_MERGES: FrozenSet[Tuple[str, str]] = frozenset({
    ("megatron.core.transformer.mlp", "apply_swiglu_sharded_factory.<locals>.sh_ten_merge_fn"),  # 0.16
    ("megatron.core.transformer.utils", "cat_with_oom_fallback"),  # 0.19 (releases between: untested)
})


"""Stand-ins for Megatron-LM's optional imports that are not installed in the test venv.

Megatron-LM's ``megatron/training`` (core_v0.16.1) imports, at module level, a few
packages that have nothing to do with checkpointing and are not dependencies of
megatron-core: ``regex`` (GPT-2 tokenizer), ``yaml`` (YAML configs), ``triton`` (via
``batch_invariant_kernels``) and ``pydantic`` (via ``megatron.rl``). Each stub below is
installed only when the real module cannot be imported, and fails loudly if the
feature is actually used.
"""
from __future__ import annotations

import importlib.util
import re
import sys
import types
from typing import Any, List


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _unavailable(what: str) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{what} is not available in this test environment")

    return fn


class _LaxModule(types.ModuleType):
    """Every attribute is a no-op function (used only for import-time registrations)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


def install() -> List[str]:
    """Install the stubs that are needed; return their names."""
    done = []
    if _missing("regex"):
        sys.modules["regex"] = re  # GPT2 tokenizer's patterns also compile with `re`
        done.append("regex")
    if _missing("yaml"):
        sys.modules["yaml"] = _LaxModule("yaml")
        done.append("yaml")
    if _missing("triton"):
        name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
        m = types.ModuleType(name)
        for fn in ("set_batch_invariant_mode", "disable_batch_invariant_mode", "enable_batch_invariant_mode"):
            setattr(m, fn, _unavailable("batch-invariant kernels (triton)"))
        m.is_batch_invariant_mode_enabled = lambda: False
        sys.modules[name] = m
        done.append("triton (batch_invariant_kernels)")
    if _missing("pydantic"):
        rl = types.ModuleType("megatron.rl")
        rl.__path__ = []  # type: ignore[attr-defined]
        pu = types.ModuleType("megatron.rl.parallel_utils")
        pu.build_inference_pg_collection = _unavailable("megatron.rl (pydantic)")
        rl.parallel_utils = pu  # type: ignore[attr-defined]
        sys.modules["megatron.rl"] = rl
        sys.modules["megatron.rl.parallel_utils"] = pu
        done.append("pydantic (megatron.rl)")
    return done

"""megashard for Megatron: save/load Megatron training state as megashard checkpoints.

Two ways to use it:

* Megatron-LM's ``pretrain_gpt.py``::

      import megashard.megatron as msm
      msm.install()                                   # routes save/load (see hooks.py)
      # core_v0.16: pretrain(..., extra_args_provider=msm.add_arguments)
      # core_v0.19: parse_and_validate_args(extra_args_provider=msm.with_arguments(<its provider>), ...)
      # then run with --save-format tensors

* your own training loop (megatron-core only): :func:`save_checkpoint` and
  :func:`load_checkpoint` with ``args=...`` (see ``examples/pretrain_gpt.py``).

On a machine without CUDA, :func:`megashard.megatron.cpu_compat.apply` makes
megatron-core run on CPU (gloo); it is never applied when CUDA is available.
"""
from __future__ import annotations

import warnings

#: What megatron-core warns at import when Transformer Engine / Apex are missing (it falls back to
#: torch): said to every user of the adapter, who did not ask; silenced for this import only.
_TE_APEX_WARNING = r"Transformer Engine and Apex are not installed"

with warnings.catch_warnings():  # restores the process's filters on exit
    warnings.filterwarnings("ignore", message=_TE_APEX_WARNING, category=UserWarning)
    from .args import add_arguments, with_arguments
    from .checkpointing import (
        TRACKER_FILENAME,
        async_request,
        check_save_writable,
        checkpoint_dir,
        finalize_async_save,
        find_checkpoint,
        is_megashard_checkpoint,
        load_checkpoint,
        read_tracker,
        save_checkpoint,
    )
    from .hooks import install, uninstall


def register_megatron_enums() -> None:
    """Let checkpoints hold the enums Megatron's ``args`` carry (AttnBackend, CudaGraphScope,
    ModelType, Fp8Recipe, ...): megashard decodes only registered enums, never imports."""
    import enum

    from megashard import jsonstate

    try:
        from megatron.core import enums as core_enums
        from megatron.core.transformer import enums as transformer_enums
    except ImportError:
        return
    for mod in (core_enums, transformer_enums):
        for v in vars(mod).values():
            if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == mod.__name__:
                jsonstate.register_enum(v)


with warnings.catch_warnings():  # its first import of megatron.core is what warns
    warnings.filterwarnings("ignore", message=_TE_APEX_WARNING, category=UserWarning)
    register_megatron_enums()

__all__ = [
    "add_arguments",
    "with_arguments",
    "register_megatron_enums",
    "install",
    "uninstall",
    "save_checkpoint",
    "finalize_async_save",
    "async_request",
    "load_checkpoint",
    "find_checkpoint",
    "is_megashard_checkpoint",
    "checkpoint_dir",
    "check_save_writable",
    "read_tracker",
    "TRACKER_FILENAME",
]

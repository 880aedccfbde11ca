"""``install()``: route Megatron-LM's checkpoint save/load through megashard.

Megatron-LM's training loop calls ``save_checkpoint`` / ``load_checkpoint`` which
``megatron/training/training.py`` imports *by name* from
``megatron/training/checkpointing.py``; patching only the checkpointing module would
miss those call sites, so both modules' names are replaced. The wrappers send

* saves with ``--save-format tensors`` to :func:`megashard.megatron.save_checkpoint`
  (with ``--async-save``: the snapshot is taken there and a megatron-core
  ``AsyncRequest`` is handed to Megatron's ``schedule_async_save``, so Megatron's
  ``maybe_finalize_async_save`` commits it and writes the tracker), every other save to Megatron's original (with ``--save-format torch|torch_dist``
  mapped onto ``--ckpt-format``);
* non-persistent saves with ``--non-persistent-ckpt-type local`` and ``--save-format tensors``
  (whose flags megashard takes before Megatron's ``validate_args``, which would require
  nvidia-resiliency-ext) to :func:`megashard.megatron.checkpointing.save_local_checkpoint`;
* loads, first, from the local tier when the whole job holds a newer iteration there
  (:func:`megashard.megatron.checkpointing.resolve_local`), falling back to ``--load`` on
  every rank when that load fails and ``--load`` holds a megashard checkpoint;
* loads whose ``--load`` (or ``--pretrained-checkpoint``) directory holds a megashard
  checkpoint (as any rank sees it, an interrupted re-save's ``.old-*`` copy included:
  the ranks decide together, see :func:`megashard.megatron.checkpointing.resolve_load`)
  to :func:`megashard.megatron.load_checkpoint`, every other load to the original — no
  flag needed.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Tuple

from megashard import storage
from megashard.errors import CheckpointError, MegashardError

from . import checkpointing as ms_ckpt
from .args import megatron_save_format, take_local_checkpointing, uses_megashard_save
from .state import get_logger

log = get_logger(__name__)

#: (module, attribute name, original) for uninstall()
_PATCHED: List[Tuple[Any, str, Any]] = []
_MODULES = ("megatron.training.checkpointing", "megatron.training.training")


def is_installed() -> bool:
    return bool(_PATCHED)


def _megatron_args() -> Any:
    from megatron.training.global_vars import get_args

    return get_args()


def make_save_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                        num_floating_point_operations_so_far: float, checkpointing_context: Any = None,
                        *args: Any, **kwargs: Any) -> Any:
        margs = _megatron_args()
        if kwargs.get("non_persistent_ckpt", False) and ms_ckpt.local_ckpt_dir(margs):
            ms_ckpt.save_local_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                          num_floating_point_operations_so_far, args=margs)
            return None
        if uses_megashard_save(margs) and not kwargs.get("non_persistent_ckpt", False):
            is_async = bool(getattr(margs, "async_save", False))
            ms_ckpt.save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                    num_floating_point_operations_so_far, checkpointing_context,
                                    args=margs, release=bool(kwargs.get("release", False)), async_save=is_async)
            if is_async:  # Megatron's own queue drives it: maybe_finalize_async_save commits + writes the tracker
                from megatron.training.async_utils import schedule_async_save

                schedule_async_save(ms_ckpt.async_request())
            return None
        fmt = megatron_save_format(margs)
        if fmt and getattr(margs, "ckpt_format", None) != fmt:
            margs.ckpt_format = fmt
            if hasattr(margs, "use_dist_ckpt"):
                margs.use_dist_ckpt = fmt != "torch"
        return original(iteration, model, optimizer, opt_param_scheduler,
                        num_floating_point_operations_so_far, checkpointing_context, *args, **kwargs)

    save_checkpoint.__megashard_wrapped__ = original  # type: ignore[attr-defined]
    return save_checkpoint


def make_load_wrapper(original: Callable, ckpt_module: Any = None) -> Callable:
    @functools.wraps(original)
    def load_checkpoint(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                        strict: bool = True, *args: Any, **kwargs: Any) -> Any:
        margs = _megatron_args()
        ms_ckpt.check_save_writable(margs)  # start-up: a read-only --save fails now, also for Megatron's loads
        if any(storage.is_url(u) and not str(u).startswith("s3://")
               for u in (getattr(margs, a, None) for a in (load_arg, "pretrained_checkpoint"))):
            # another URL (Megatron's msc:// for torch_dist) is Megatron's; megashard reads s3:// itself
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *args, **kwargs)
        # collective: every rank routes the same way, also ranks that cannot see the
        # directory (scatter mode) and when only an interrupted re-save's .old-* copy exists
        target = ms_ckpt.resolve_load_target(margs, load_arg)
        if target.foreign:  # no tracker: Megatron's loader would start from random init
            raise CheckpointError(ms_ckpt.foreign_load_error(target, load_arg))
        local = ms_ckpt.resolve_local(margs, ddp_model, target) if load_arg == "load" else None
        if local is not None:
            try:
                result = ms_ckpt.load_checkpoint(
                    ddp_model, optimizer, opt_param_scheduler, load_arg, strict,
                    skip_load_to_model_and_opt=bool(kwargs.get("skip_load_to_model_and_opt", False)), args=margs,
                    target=target, local=local)
            except MegashardError as e:  # agreed: every rank falls back together
                if target.checkpoint is None:  # nothing would overwrite what the failed load changed
                    raise
                log.warning("local checkpoint of iteration %d could not be loaded (%s); loading --load %s",
                            local[1], str(e)[:2000], target.root)
            else:
                _bookkeeping(ckpt_module, result)
                return result
        if target.checkpoint is None:
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *args, **kwargs)
        log.info("--%s %s holds a megashard checkpoint: loading with megashard",
                 "pretrained-checkpoint" if target.pretrained else load_arg.replace("_", "-"), target.root)
        result = ms_ckpt.load_checkpoint(
            ddp_model, optimizer, opt_param_scheduler, load_arg, strict,
            skip_load_to_model_and_opt=bool(kwargs.get("skip_load_to_model_and_opt", False)), args=margs,
            target=target)
        _bookkeeping(ckpt_module, result)
        return result

    load_checkpoint.__megashard_wrapped__ = original  # type: ignore[attr-defined]
    return load_checkpoint


def _bookkeeping(ckpt_module: Any, result: Tuple[int, float]) -> None:
    """Keep Megatron's own record of the loaded checkpoint consistent."""
    if ckpt_module is None:
        return
    if hasattr(ckpt_module, "set_loaded_iteration"):
        ckpt_module.set_loaded_iteration(result[0])
    if hasattr(ckpt_module, "set_checkpoint_version") and \
            getattr(ckpt_module, "get_checkpoint_version", lambda: None)() is None:
        ckpt_module.set_checkpoint_version(3.0)


def install() -> Dict[str, bool]:
    """Patch Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` (idempotent).

    Call it once before ``pretrain(...)``. Returns which modules were patched.
    """
    import importlib

    ckpt_module = importlib.import_module("megatron.training.checkpointing")
    original_save = getattr(ckpt_module.save_checkpoint, "__megashard_wrapped__", ckpt_module.save_checkpoint)
    original_load = getattr(ckpt_module.load_checkpoint, "__megashard_wrapped__", ckpt_module.load_checkpoint)
    save_w = make_save_wrapper(original_save)
    load_w = make_load_wrapper(original_load, ckpt_module)
    done: Dict[str, bool] = {}
    _wrap_setup()
    _wrap_validate_args()
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            log.warning("megashard.megatron.install: cannot import %s (%s)", name, e)
            done[name] = False
            continue
        for attr, wrapper in (("save_checkpoint", save_w), ("load_checkpoint", load_w)):
            if hasattr(mod, attr):
                current = getattr(mod, attr)
                if not hasattr(current, "__megashard_wrapped__"):
                    _PATCHED.append((mod, attr, current))
                setattr(mod, attr, wrapper)
        done[name] = True
    log.info("megashard installed into %s", ", ".join(k for k, v in done.items() if v))
    return done


def _wrap_setup() -> None:
    """Megatron-LM calls ``load_checkpoint`` at start-up only with ``--load``;
    ``setup_model_and_optimizer`` runs on every start: it checks a megashard ``--save`` first."""
    import importlib

    try:
        mod = importlib.import_module("megatron.training.training")
    except ImportError:
        return
    current = getattr(mod, "setup_model_and_optimizer", None)
    if current is None or hasattr(current, "__megashard_wrapped__"):
        return

    @functools.wraps(current)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        ms_ckpt.check_save_writable(_megatron_args())
        return current(*args, **kwargs)

    setup_model_and_optimizer.__megashard_wrapped__ = current  # type: ignore[attr-defined]
    _PATCHED.append((mod, "setup_model_and_optimizer", current))
    mod.setup_model_and_optimizer = setup_model_and_optimizer


def _wrap_validate_args() -> None:
    """Megatron's ``validate_args`` requires nvidia-resiliency-ext for ``--non-persistent-ckpt-type
    local``: with ``--save-format tensors`` megashard takes those flags first
    (:func:`megashard.megatron.args.take_local_checkpointing`). Patched where it is called from:
    ``arguments`` (0.19's ``parse_and_validate_args``) and ``initialize`` (0.16 imports it by name)."""
    import importlib

    for name in ("megatron.training.arguments", "megatron.training.initialize"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(mod, "validate_args", None)
        if current is None or hasattr(current, "__megashard_wrapped__"):
            continue

        def make(original: Callable) -> Callable:
            @functools.wraps(original)
            def validate_args(args: Any, *a: Any, **kw: Any) -> Any:
                if take_local_checkpointing(args):
                    log.info("megashard saves the non-persistent checkpoints (--non-persistent-ckpt-type local) "
                             "to its local tier in %s", args.megashard_local_ckpt_dir)
                return original(args, *a, **kw)

            validate_args.__megashard_wrapped__ = original  # type: ignore[attr-defined]
            return validate_args

        _PATCHED.append((mod, "validate_args", current))
        mod.validate_args = make(current)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    while _PATCHED:
        mod, attr, original = _PATCHED.pop()
        setattr(mod, attr, original)

"""``save_checkpoint`` / ``load_checkpoint`` with Megatron-LM's semantics, stored by megashard.

Layout (same as Megatron-LM's)::

    <save>/iter_0000010/                    one megashard checkpoint (manifest + .tensors files,
                                            one file per (TP, PP, VP[, EP]) model chunk per writer,
                                            plus one per rank for optimizer / RNG / the rest)
    <save>/latest_checkpointed_iteration.txt   written last, by rank 0, after the commit

Flags honoured with Megatron's meaning (read from ``args`` with ``getattr`` so that
both Megatron-LM's global args and a stand-alone script's args work): ``save``,
``load``, ``finetune``, ``no_load_optim``, ``no_load_rng``, ``no_save_optim``,
``no_save_rng``, ``ckpt_step``, ``exit_on_missing_checkpoint``,
``use_distributed_optimizer``, ``data_parallel_random_init``, ``pretrained_checkpoint``;
and megashard's own ``megashard_load_mode``, ``megashard_verify_on_load``,
``megashard_strict_load``, ``megashard_direct_io`` (see :mod:`megashard.megatron.args`).
"""
from __future__ import annotations

import inspect
import os
import sys
import time
import types
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from megashard import storage
from megashard.errors import CheckpointError, StateDictError

from . import state as st
from .state import get_logger

log = get_logger(__name__)

TRACKER_FILENAME = storage.TRACKER_NAME


# --------------------------------------------------------------------------------------
# paths and the tracker file
# --------------------------------------------------------------------------------------
def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_FILENAME)


def checkpoint_dir(root: str, iteration: int, release: bool = False) -> str:
    """``<root>/iter_{:07d}`` (or ``<root>/release``), as Megatron-LM names it."""
    return os.path.join(root, storage.iteration_dir_name("release" if release else int(iteration)))


def read_tracker(root: Optional[str]) -> Tuple[int, bool]:
    """(iteration, release) from the tracker file, or (-1, False) when there is none.

    Like Megatron, the maximum over ranks is used when torch.distributed is up.
    """
    from megashard.transport import Comm

    found = storage.read_tracker(root) if root else None
    release = found == "release"
    iteration = 0 if release else (-1 if found is None else int(found))
    comm = Comm()
    top = comm.all_reduce_max(iteration)
    if top != iteration:
        log.warning("tracker iteration %d differs from max over ranks %d; using the max", iteration, top)
        iteration = top
    return iteration, release


def write_tracker(root: str, iteration: int, release: bool = False) -> None:
    """Atomically (write + fsync + rename) record the latest complete checkpoint."""
    storage.write_tracker(root, "release" if release else int(iteration))


def _barrier() -> None:
    from megashard.transport import Comm

    Comm().barrier()


# --------------------------------------------------------------------------------------
# the storage backend (megashard.save / load / load_common / is_checkpoint)
# --------------------------------------------------------------------------------------
def _api() -> Any:
    from megashard import api

    return api


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with only the keyword arguments it accepts (API options are optional)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def load_common(ckpt: str, keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Rank 0's top-level non-tensor values (``args``, ``iteration``, …); collective."""
    return _call(_api().load_common, ckpt, keys)


def is_megashard_checkpoint(path: Optional[str]) -> bool:
    """True if ``path`` is a megashard checkpoint directory."""
    if not path or not os.path.isdir(path):
        return False
    return bool(_api().is_checkpoint(path))


def find_checkpoint(root: Optional[str], ckpt_step: Optional[int] = None) -> Optional[str]:
    """The megashard checkpoint directory ``--load`` points to, or None.

    ``root`` may be a Megatron save root (tracker + ``iter_*``) or a checkpoint
    directory itself. Used by :func:`megashard.megatron.install` to route loads.
    """
    if not root:
        return None
    if is_megashard_checkpoint(root):
        return root
    iteration, release = -1, False
    path = tracker_path(root)
    if os.path.isfile(path):
        text = open(path).read().strip()
        release = text == "release"
        iteration = 0 if release else int(text) if text.isdigit() else -1
    if ckpt_step:
        iteration, release = int(ckpt_step), False
    if iteration < 0 and not release:
        return None
    d = checkpoint_dir(root, iteration, release)
    return d if is_megashard_checkpoint(d) else None


# --------------------------------------------------------------------------------------
# parallel layout helpers
# --------------------------------------------------------------------------------------
def _layout() -> Dict[str, int]:
    from megatron.core import parallel_state as mpu

    return {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "dp": mpu.get_data_parallel_world_size(with_context_parallel=True),
        "dp_rank": mpu.get_data_parallel_rank(with_context_parallel=True),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "ep_rank": mpu.get_expert_model_parallel_rank(),
    }


def file_stems(model: Sequence[Any], layout: Dict[str, int]) -> Dict[str, str]:
    """One ``.tensors`` file per (TP, PP, VP[, EP]) model chunk, plus one for the rest.

    megashard appends the writing rank (``-r00003``), so DP replicas never collide.
    """
    ep = f"_ep{layout['ep_rank']:03d}" if layout["ep"] > 1 else ""
    stems = {}
    chunks = [st.unwrap_model(m) for m in model]
    for i, (key, chunk) in enumerate(zip(st.model_keys(chunks), chunks)):
        vp = getattr(chunk, "vp_stage", None)
        vp = i if vp is None else int(vp)
        stems[key] = f"model_tp{layout['tp_rank']:02d}_pp{layout['pp_rank']:03d}_vp{vp}{ep}"
    stems["__rest__"] = f"state_tp{layout['tp_rank']:02d}_pp{layout['pp_rank']:03d}{ep}"
    return stems


def _get_args(args: Any) -> Any:
    if args is not None:
        return args
    try:
        from megatron.training.global_vars import get_args
    except ImportError as e:  # pragma: no cover - only without Megatron-LM
        raise StateDictError("pass args=... (Megatron-LM's megatron.training is not importable)") from e
    return get_args()


def _flag(args: Any, name: str, default: Any = False) -> Any:
    v = getattr(args, name, default)
    return default if v is None else v


# --------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------
def save_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float = 0,
    checkpointing_context: Optional[dict] = None,
    *,
    args: Any = None,
    save_dir: Optional[str] = None,
    release: bool = False,
    async_save: Optional[bool] = None,
    **_ignored: Any,
) -> str:
    """Save Megatron's full training state to ``<save>/iter_{iteration:07d}`` with megashard.

    Collective over the world. Signature-compatible with Megatron-LM's
    ``save_checkpoint`` (extra keyword arguments are accepted and ignored).
    Returns the checkpoint directory.

    With ``--async-save`` (or ``async_save=True``) it returns once every rank holds a
    snapshot; the files are written in the background and the checkpoint is
    committed, and the tracker written, when the save is finalized
    (:func:`finalize_async_save`, the next save, or Megatron-LM's
    ``maybe_finalize_async_save`` through :func:`async_request`).
    """
    args = _get_args(args)
    root = save_dir or args.save
    if not root:
        raise StateDictError("save_checkpoint: no save directory (--save)")
    t0 = time.perf_counter()
    chunks = [st.unwrap_model(m) for m in st.as_chunk_list(model)]
    layout = _layout()
    ckpt = checkpoint_dir(root, iteration, release)
    log.info("saving checkpoint at iteration %d to %s in megashard (.tensors) format",
             iteration, ckpt)

    request = st.StateRequest(
        optimizer=not _flag(args, "no_save_optim"),
        scheduler=not _flag(args, "no_save_optim"),
        rng=not _flag(args, "no_save_rng"),
        data_parallel_random_init=_flag(args, "data_parallel_random_init"),
        metadata=st.sharded_sd_metadata(_flag(args, "use_distributed_optimizer")),
    )
    sd = st.build_state_dict(
        args, chunks, optimizer, opt_param_scheduler, request,
        iteration=iteration,
        num_floating_point_operations_so_far=num_floating_point_operations_so_far,
    )
    sd = st.prepare_for_save(sd)
    stems = file_stems(chunks, layout)
    save_layout = {k: layout[k] for k in ("tp", "pp", "dp", "ep")} | {"vp": len(chunks)}
    direct_io = bool(_flag(args, "megashard_direct_io"))
    if bool(_flag(args, "async_save")) if async_save is None else async_save:
        handle = _call(_api().save, sd, ckpt, file_stems=stems, layout=save_layout, async_save=True,
                       direct_io=direct_io)
        handle.add_commit_callback(lambda: _commit_tracker(root, iteration, release))
        log.info("scheduled an async save of iteration %d to %s; training stalled %.2f s for the snapshot",
                 iteration, ckpt, time.perf_counter() - t0)
        return ckpt
    _call(_api().save, sd, ckpt, file_stems=stems, layout=save_layout, direct_io=direct_io)
    _barrier()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        write_tracker(root, iteration, release)
    _barrier()
    log.info("saved checkpoint at iteration %d to %s in %.2f s", iteration, ckpt,
             time.perf_counter() - t0)
    return ckpt


def _commit_tracker(root: str, iteration: int, release: bool) -> None:
    """After an async save's commit (every rank): rank 0 writes the tracker; all agree."""
    from megashard.transport import Comm

    comm = Comm()
    _, err = comm.run("save/tracker", lambda: write_tracker(root, iteration, release) if comm.rank == 0 else None)
    comm.agree(err, "save (tracker)")
    log.info("async checkpoint at iteration %d committed to %s", iteration, checkpoint_dir(root, iteration, release))


def finalize_async_save(blocking: bool = False) -> bool:
    """Finalize megashard's async save in flight, as Megatron's loop does: collective.

    ``blocking=False`` (every iteration): commit only if every rank's write has ended.
    ``blocking=True`` (before exit, before the next save): wait, then commit. True
    when a save was committed (its tracker written).
    """
    from megashard import async_save

    return async_save.finalize(blocking) is not None


def _wait_written(marker: str) -> None:
    """Megatron's async worker body: alive while this rank's background write runs.

    megatron-core's ``AsyncCallsQueue`` decides that a save is done when its worker
    process has exited on every rank; megashard writes in a thread of the trainer, so
    the worker waits for the marker file the writer thread deletes when it is done (or
    for the trainer to die). Module-level, with a string argument: megatron-core's
    persistent worker receives it through a spawn-context queue.
    """
    parent = os.getppid()
    while os.path.exists(marker) and os.getppid() == parent:
        time.sleep(0.01)


def async_request(handle: Any = None) -> Any:
    """A megatron-core ``AsyncRequest`` that tracks megashard's async save in flight.

    For Megatron-LM's ``schedule_async_save``: its worker lives while this rank
    writes; its finalize function commits (``handle.result()``, collective) and
    writes the tracker. Returns None when no save is in flight.
    """
    import tempfile

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megashard import async_save

    handle = handle or async_save.in_flight()
    if handle is None:
        return None
    fd, marker = tempfile.mkstemp(prefix=".megashard-writing-", dir=os.environ.get("MEGASHARD_MARKER_DIR"))
    os.close(fd)

    def written() -> None:
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass

    handle.when_written(written)
    return AsyncRequest(async_fn=_wait_written, async_fn_args=(marker,), finalize_fns=[handle.result])


# --------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------
def load_checkpoint(
    ddp_model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    checkpointing_context: Optional[dict] = None,
    skip_load_to_model_and_opt: bool = False,
    *,
    args: Any = None,
    **_ignored: Any,
) -> Tuple[int, float]:
    """Load a megashard checkpoint into model, optimizer, scheduler and RNG, like Megatron-LM.

    Returns ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when no
    checkpoint exists (or exits when ``--exit-on-missing-checkpoint``). ``--finetune``
    loads only the model (iteration 0); ``--no-load-optim`` / ``--no-load-rng`` skip
    those parts; ``--ckpt-step N`` loads ``iter_N`` whatever the tracker says. The RNG
    state is ignored with a warning when TP or PP differ from the checkpoint's.
    """
    args = _get_args(args)
    load_dir = getattr(args, load_arg, None)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained and not (load_dir and os.path.isfile(tracker_path(load_dir))):
        log.warning("no checkpoint in %s; fine-tuning from %s", load_dir, pretrained)
        load_dir = pretrained
        args.finetune = True

    iteration, release = read_tracker(load_dir)
    ckpt_step = getattr(args, "ckpt_step", None)
    if ckpt_step:
        iteration, release = int(ckpt_step), False
    if iteration < 0 and not release:
        log.warning("could not find the tracker file %s; starting from random init",
                    tracker_path(load_dir) if load_dir else "(no --load)")
        if _flag(args, "exit_on_missing_checkpoint"):
            log.error("'--exit-on-missing-checkpoint' set and no checkpoint under %s: exiting",
                      load_dir)
            _barrier()
            sys.exit(1)
        return 0, 0

    ckpt = checkpoint_dir(load_dir, iteration, release)
    if not is_megashard_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt} is not a megashard checkpoint (iteration {iteration} from "
                              f"{'--ckpt-step' if ckpt_step else tracker_path(load_dir)})")
    t0 = time.perf_counter()
    common = load_common(ckpt, ["args", "iteration", "num_floating_point_operations_so_far", "checkpoint_version", "content_metadata"])
    ckpt_args = common.get("args") or types.SimpleNamespace()
    content_md = common.get("content_metadata") or {}
    finetune = bool(_flag(args, "finetune")) or release

    layout = _layout()
    ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                  getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    run_tp_pp = (layout["tp"], layout["pp"])
    mismatch = f"(TP, PP) mismatch after resume ({run_tp_pp} vs {ckpt_tp_pp} from checkpoint)"

    load_rng = not finetune and not _flag(args, "no_load_rng") and not getattr(ckpt_args, "no_save_rng", False)
    if load_rng and ckpt_tp_pp != run_tp_pp:
        log.warning("%s: RNG state will be ignored", mismatch)
        load_rng = False
    rng_change = st.rng_layout_change(content_md, ckpt_args) if load_rng else None
    if rng_change:  # e.g. EP or DP changed: a layout change never fails on the RNG state
        log.warning("%s: RNG state will be ignored", rng_change)
        load_rng = False
    load_optim = (not finetune and not _flag(args, "no_load_optim")
                  and not getattr(ckpt_args, "no_save_optim", False) and optimizer is not None)

    use_dist_opt = bool(_flag(args, "use_distributed_optimizer"))
    metadata = st.sharded_sd_metadata(use_dist_opt)
    saved_type = content_md.get("distrib_optim_sharding_type")
    if load_optim and use_dist_opt and saved_type not in (None, st.DISTRIB_OPTIM_SHARDING_TYPE):
        raise CheckpointError(f"checkpoint stores DistributedOptimizer state as {saved_type!r}; "
                           f"megashard reads {st.DISTRIB_OPTIM_SHARDING_TYPE!r}")

    chunks = [st.unwrap_model(m) for m in st.as_chunk_list(ddp_model)]
    strict_load = bool(_flag(args, "megashard_strict_load", True))
    # a strict load overwrites every element of the optimizer state: no need to zero it first
    fresh = st.preallocate_optimizer_state(optimizer) if load_optim and strict_load else st.FreshOptimizerState()
    try:
        template = st.build_state_dict(
            args, chunks, optimizer if load_optim else None,
            opt_param_scheduler if load_optim else None,
            st.StateRequest(optimizer=load_optim, scheduler=load_optim, rng=load_rng, is_loading=True,
                            data_parallel_random_init=_flag(args, "data_parallel_random_init"),
                            metadata=metadata),
        )
        # the non-tensor values come from the checkpoint (load_common / load results)
        for key in ("args", "checkpoint_version", "content_metadata"):
            template.pop(key, None)
        prepared = st.prepare_for_load(template, skip_aliased_main_params=strict_load)
        # no_grad: template ShardedTensors wrap live nn.Parameters, which are filled in place
        with torch.no_grad():
            loaded = _call(_api().load, prepared.request, ckpt,
                           mode=_flag(args, "megashard_load_mode", "auto") or "auto",
                           strict=strict_load, verify=bool(_flag(args, "megashard_verify_on_load")))
        loaded = st.finish_load(loaded, prepared)
    except BaseException:
        fresh.zero()  # never leave uninitialised optimizer state behind a failed load
        raise

    if finetune:
        iteration = 0
    else:
        iteration = int(common.get("iteration", loaded.get("iteration", iteration)))
    num_flops = common.get("num_floating_point_operations_so_far",
                           loaded.get("num_floating_point_operations_so_far", 0)) or 0

    if not finetune and common.get("args") is not None:
        check_checkpoint_args(args, ckpt_args)
        _restore_counters(args, ckpt_args)

    if not skip_load_to_model_and_opt:
        st.load_model_state(st.as_chunk_list(ddp_model), loaded, strict=strict)
    if load_optim:
        if not skip_load_to_model_and_opt:
            st.load_optimizer_state(optimizer, loaded["optimizer"])
        if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
            opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        rng = loaded.get("rng_state")
        if not rng:
            raise CheckpointError(f"no rng_state in {ckpt}; use --no-load-rng or --finetune")
        dp_rank = layout["dp_rank"] if _flag(args, "data_parallel_random_init") else 0
        st.restore_rng_state(rng[dp_rank] if len(rng) > dp_rank else rng[0])

    _barrier()
    log.info("loaded checkpoint %s at iteration %d (optimizer %s, rng %s%s) in %.2f s",
             ckpt, iteration, "loaded" if load_optim else "not loaded",
             "loaded" if load_rng else "not loaded", ", finetune" if finetune else "",
             time.perf_counter() - t0)
    return iteration, num_flops


def check_checkpoint_args(args: Any, ckpt_args: Any) -> None:
    """Megatron's ``check_checkpoint_args``: the model architecture must match the checkpoint's."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if hasattr(args, name) and hasattr(ckpt_args, name) and getattr(args, name) != getattr(ckpt_args, name):
            raise CheckpointError(f"{name} value from checkpoint ({getattr(ckpt_args, name)}) is not equal to "
                             f"the input argument value ({getattr(args, name)})")


def _restore_counters(args: Any, ckpt_args: Any) -> None:
    """Megatron's post-load bookkeeping: consumed samples and the microbatch calculator."""
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        if hasattr(args, name) or hasattr(ckpt_args, name):
            setattr(args, name, getattr(ckpt_args, name, 0))
    try:
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        update_num_microbatches(consumed_samples=getattr(args, "consumed_train_samples", 0), verbose=True)
    except (ImportError, AssertionError, AttributeError, TypeError):
        pass  # calculator not initialised (stand-alone scripts)

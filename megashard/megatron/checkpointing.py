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
``megashard_strict_load``, ``megashard_direct_io``, ``megashard_sha256`` (see :mod:`megashard.megatron.args`).
"""
from __future__ import annotations

import inspect
import os
import sys
import time
import types
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megashard import saveroot, storage
from megashard.errors import CheckpointError, StateDictError
from megashard.sharded import looks_like_sharded_tensor

from . import state as st
from .state import get_logger

log = get_logger(__name__)

TRACKER_FILENAME = saveroot.TRACKER_NAME


# --------------------------------------------------------------------------------------
# paths and the tracker file
# --------------------------------------------------------------------------------------
def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_FILENAME)


def checkpoint_dir(root: str, iteration: int, release: bool = False) -> str:
    """``<root>/iter_{:07d}`` (or ``<root>/release``), as Megatron-LM names it."""
    return os.path.join(root, saveroot.iteration_dir_name("release" if release else int(iteration)))


def read_tracker(root: Optional[str]) -> Tuple[int, bool]:
    """(iteration, release) from the tracker file, or (-1, False) when there is none. Collective.

    Like Megatron, the maximum over the ranks that see a tracker is used; a rank that
    cannot read its tracker makes every rank raise (see :func:`resolve_load`).
    """
    target = resolve_load(root)
    return target.iteration, target.release


def write_tracker(root: str, iteration: int, release: bool = False) -> None:
    """Atomically (write + fsync + rename) record the latest complete checkpoint (this rank only)."""
    try:
        storage.write_tracker(root, "release" if release else int(iteration))
    except OSError as e:
        raise CheckpointError(f"cannot write tracker file {tracker_path(root)} ({type(e).__name__}: {e}); "
                              f"the checkpoint {checkpoint_dir(root, iteration, release)} is complete: "
                              "fix the directory and write the tracker, or load that directory with "
                              "--ckpt-step") from e


def commit_tracker(root: str, iteration: int, release: bool = False) -> None:
    """After a save's commit (every rank): rank 0 writes the tracker and every rank learns
    whether it did, so a failure raises one DistributedError everywhere instead of
    leaving the other ranks in a later collective."""
    from megashard.transport import Comm

    comm = Comm()
    _, err = comm.run("save/tracker", lambda: write_tracker(root, iteration, release) if comm.rank == 0 else None)
    comm.agree(err, "save (tracker)")


# --------------------------------------------------------------------------------------
# what --load names, agreed by every rank
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadTarget:
    """The checkpoint ``--load`` names, the same decision on every rank.

    ``checkpoint`` is this rank's path of it (``<root>/iter_N``, or ``root`` itself when
    that is a checkpoint directory) when at least one rank sees a megashard checkpoint
    there — possibly an interrupted re-save's ``.iter_N.old-*`` copy, which
    :func:`megashard.load` reads in place — else None. Ranks that cannot see it (scatter
    mode: only the node readers need to) get the same answer as those that can.
    """

    root: Optional[str]
    iteration: int = -1  # -1: no tracker and no --ckpt-step
    release: bool = False
    tracker: bool = False  # some rank read a tracker file under root
    checkpoint: Optional[str] = None
    direct: bool = False  # root itself is the checkpoint directory
    seen_by: int = 0  # how many ranks see the checkpoint
    why: str = ""  # why there is none (rank 0's view), for messages
    pretrained: bool = False  # root is --pretrained-checkpoint (no tracker under --load)
    foreign: Optional[str] = None  # "torch_dist" / "hf": root is such a directory (convert it), not a save root


def _look_tracker(root: Optional[str]) -> Dict[str, Any]:
    if not root:
        return {"tracker": None, "direct": False}
    root = storage.location(root)  # an s3:// URL, or an absolute path (a bad URL is refused, agreed)
    named = os.path.basename(root) not in ("", ".", "..") and root.count("/") > (2 if storage.is_url(root) else 0)
    tracker = storage.read_tracker(root)
    direct = named and storage.locate(root) is not None
    # a torch_dist or Hugging Face directory given as --load: say so, never start from random init
    foreign = (storage.foreign_format(root) if tracker is None and not direct and not storage.is_url(root)
               else None)  # a URL: no request spent on it (an empty --load bucket prefix is a first start)
    return {"tracker": tracker, "direct": direct, "foreign": foreign}


def _decide_iteration(looks: Sequence[Dict[str, Any]], ckpt_step: Optional[int]) -> Dict[str, Any]:
    """Rank 0: Megatron's choice (``--ckpt-step``, else the maximum tracker over ranks)."""
    trackers = [x["tracker"] for x in looks if x["tracker"] is not None]
    numbers = [t for t in trackers if t != "release"]
    if len(set(trackers)) > 1:
        log.warning("tracker files differ between ranks (%s); using the maximum", sorted(set(map(str, trackers))))
    direct = any(x["direct"] for x in looks)
    if ckpt_step:
        iteration, release = int(ckpt_step), False
    elif numbers:
        iteration, release = max(numbers), False
    else:
        iteration, release = (0, True) if trackers else (-1, False)
    foreign = next((x.get("foreign") for x in looks if x.get("foreign")), None)
    return {"iteration": iteration, "release": release, "tracker": bool(trackers), "direct": direct,
            "foreign": foreign}


def resolve_load(root: Optional[str], ckpt_step: Optional[int] = None, comm: Any = None) -> LoadTarget:
    """Which checkpoint ``root`` (``--load``) names, decided together by every rank. Collective.

    Each rank reads its tracker and looks for the checkpoint with :func:`storage.locate`
    (read-only; an interrupted re-save's ``.old-*`` copy counts); rank 0 combines what
    every rank saw and every rank gets the same answer. A rank that fails to read (a
    garbage tracker, an unreadable directory) makes every rank raise one
    DistributedError naming it. Two small gather/scatter rounds (one when there is no
    tracker and no ``ckpt_step``); every rank must call it, with or without a root.
    """
    from megashard.transport import Comm

    comm = comm or Comm()
    look, err = comm.run("load/tracker", lambda: _look_tracker(root))
    decided = comm.coordinate("load (checkpoint lookup)", err, look,
                              lambda looks: [_decide_iteration(looks, ckpt_step)] * comm.world_size)
    iteration, release, direct = decided["iteration"], decided["release"], decided["direct"]
    if not direct and iteration < 0 and not release:
        return LoadTarget(root, tracker=decided["tracker"], foreign=decided["foreign"],
                          why=f"no tracker file {tracker_path(root)}" if root else "no load directory")
    path = root if direct else checkpoint_dir(root, iteration, release) if root else None

    # the tracker this rank read names the checkpoint: it exists, though a mount that lags may not show
    # it yet right after another node's commit (wait for it, bounded). A rank that saw no tracker (it
    # does not see the root: scatter's blind ranks) or a --ckpt-step the user named: one look.
    named = not direct and not ckpt_step and look is not None and look.get("tracker") is not None

    def look_checkpoint() -> Dict[str, Any]:
        if not path:
            return {"sees": False, "why": "no load directory on this rank"}
        found = storage.locate_named(path) if named else storage.locate(path)
        return {"sees": found is not None, "why": "" if found else storage.why_not_checkpoint(path)}

    def combine(sees: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
        # a count, not a list of ranks: every rank receives the reply
        return [{"seen_by": sum(1 for x in sees if x["sees"]), "why": sees[0]["why"]}] * comm.world_size

    seen, err = comm.run("load/locate", look_checkpoint)
    found = comm.coordinate("load (checkpoint lookup)", err, seen, combine)
    return LoadTarget(root, iteration, release, decided["tracker"],
                      checkpoint=path if found["seen_by"] else None, direct=direct,
                      seen_by=found["seen_by"], why=found["why"])


def foreign_load_error(target: LoadTarget, load_arg: str = "load") -> str:
    """``--load`` names a torch_dist or Hugging Face directory (no tracker): what to run instead."""
    return f"--{load_arg.replace('_', '-')} {target.root}: {storage.foreign_hint(target.root, target.foreign)}"


def resolve_load_target(args: Any, load_arg: str = "load") -> LoadTarget:
    """:func:`resolve_load` for Megatron's args: ``--<load_arg>``, ``--ckpt-step``, and the
    ``--pretrained-checkpoint`` fall-back when no rank sees a tracker under ``--load``. Collective."""
    ckpt_step = getattr(args, "ckpt_step", None)
    target = resolve_load(getattr(args, load_arg, None), ckpt_step)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained and not target.tracker:
        target = dataclasses.replace(resolve_load(pretrained, ckpt_step), pretrained=True)
    return target


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
    """True if ``path`` is a megashard checkpoint directory (this rank's view, no collective)."""
    if not path or not (storage.is_url(path) or os.path.isdir(path)):
        return False
    return bool(_api().is_checkpoint(path))


def find_checkpoint(root: Optional[str], ckpt_step: Optional[int] = None) -> Optional[str]:
    """The megashard checkpoint ``--load`` points to (this rank's path of it), or None. Collective.

    ``root`` may be a Megatron save root (tracker + ``iter_*``) or a checkpoint directory
    itself. Every rank gets the same answer (see :func:`resolve_load`), including ranks
    that cannot see the directory and when only an interrupted re-save's ``.old-*`` copy
    exists (:func:`megashard.load` reads it in place).
    """
    return resolve_load(root, ckpt_step).checkpoint


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
    ckpt = checkpoint_dir(root, iteration, release)
    log.info("saving checkpoint at iteration %d to %s in megashard (.tensors) format",
             iteration, ckpt)
    sd, stems, save_layout = _saved_state(args, model, optimizer, opt_param_scheduler, iteration,
                                          num_floating_point_operations_so_far)
    direct_io = bool(_flag(args, "megashard_direct_io"))
    sha256 = _flag(args, "megashard_sha256", None)  # None: MEGASHARD_SHA256, else on
    if bool(_flag(args, "async_save")) if async_save is None else async_save:
        handle = _call(_api().save, sd, ckpt, file_stems=stems, layout=save_layout, async_save=True,
                       direct_io=direct_io, sha256=sha256)
        handle.add_commit_callback(lambda: _commit_tracker(root, iteration, release))
        log.info("scheduled an async save of iteration %d to %s; training stalled %.2f s for the snapshot",
                 iteration, ckpt, time.perf_counter() - t0)
        return ckpt
    _call(_api().save, sd, ckpt, file_stems=stems, layout=save_layout, direct_io=direct_io, sha256=sha256)
    commit_tracker(root, iteration, release)  # save() returned on every rank: committed
    log.info("saved checkpoint at iteration %d to %s in %.2f s", iteration, ckpt,
             time.perf_counter() - t0)
    return ckpt


def _saved_state(args: Any, model: Any, optimizer: Any, opt_param_scheduler: Any, iteration: int,
                 num_floating_point_operations_so_far: float) -> Tuple[Dict[str, Any], Dict[str, str], Dict[str, int]]:
    """(state dict ready for megashard.save, file stems, layout) of a save at ``iteration``."""
    chunks = [st.unwrap_model(m) for m in st.as_chunk_list(model)]
    layout = _layout()
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
    save_layout = {k: layout[k] for k in ("tp", "pp", "dp", "ep")} | {"vp": len(chunks)}
    return sd, file_stems(chunks, layout), save_layout


# --------------------------------------------------------------------------------------
# the local checkpoint tier (--non-persistent-ckpt-type local, see megashard.localtier)
# --------------------------------------------------------------------------------------
def local_ckpt_dir(args: Any) -> Optional[str]:
    """The local tier's directory when megashard handles ``--non-persistent-ckpt-type local``."""
    return getattr(args, "megashard_local_ckpt_dir", None) or None


def _own_bytes(tree: Any) -> Any:
    """``tree`` with every ShardedTensor replaced by this rank's tensor: a version of the local
    tier holds exactly the bytes its rank holds, saved and loaded back by that rank alone."""
    if looks_like_sharded_tensor(tree):
        return tree.data
    if isinstance(tree, dict):
        return {k: _own_bytes(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_own_bytes(v) for v in tree)
    return tree


def _local_layout_name(world: int, layout: Dict[str, int], n_chunks: int) -> str:
    from megashard import localtier

    return localtier.layout_name(world, {"tp": layout["tp"], "pp": layout["pp"], "ep": layout["ep"],
                                         "vp": n_chunks})


_REPLICATORS: Dict[Tuple[str, str], Any] = {}


def _replication(args: Any) -> Optional[Tuple[Optional[int], int]]:
    """(jump, factor) of ``--replication`` when megashard handles the local tier, else None."""
    rep = getattr(args, "megashard_replication", None)
    if not rep or int(rep[1] or 1) < 2:
        return None
    return (int(rep[0]) if rep[0] else None), int(rep[1])


def _replicator(args: Any, comm: Any, root: str, name: str) -> Any:
    """This job's :class:`megashard.replication.Replicator` (created and checked at the first local
    save: collective), or None without ``--replication``."""
    from megashard import replication

    rep = _replication(args)
    if rep is None:
        return None
    key = (os.path.abspath(root), name)
    if key not in _REPLICATORS:
        if not _REPLICATORS:  # the last version's replication finishes before the process exits
            from megashard import exiting

            exiting.at_exit(exiting.WRITES, wait_for_replication)
        _REPLICATORS[key] = replication.Replicator(root, name, rep[0], rep[1], comm)
    return _REPLICATORS[key]


def wait_for_replication() -> None:
    """Wait for the background replication in flight, if any (e.g. before the process exits)."""
    for r in _REPLICATORS.values():
        r.wait()


def save_local_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                          num_floating_point_operations_so_far: float = 0, *, args: Any = None) -> str:
    """A non-persistent save to the local tier: every rank writes its own bytes to its version
    directory under ``--non-persistent-local-ckpt-dir`` (no fsync: it outlives the processes,
    not the node), then every rank learns whether all succeeded. Collective (one agreement).
    With ``--replication``, the committed version is then sent to the replica group's ranks in
    the background (:mod:`megashard.replication`); the next local save first waits for it.
    Returns this rank's version directory."""
    from megashard import localtier
    from megashard.transport import SOLO, Comm

    args = _get_args(args)
    root = local_ckpt_dir(args)
    if not root:
        raise StateDictError("save_local_checkpoint: no local checkpoint directory "
                             "(--non-persistent-local-ckpt-dir)")
    t0 = time.perf_counter()
    comm = Comm()
    sd, stems, save_layout = _saved_state(args, model, optimizer, opt_param_scheduler, iteration,
                                          num_floating_point_operations_so_far)
    name = _local_layout_name(comm.world_size, save_layout, save_layout["vp"])
    path = localtier.version_dir(root, name, comm.rank, iteration)
    replicator = _replicator(args, comm, root, name)
    if replicator is not None:
        replicator.wait()  # the previous version's replication reads the tier: finish it first

    def write() -> None:
        localtier.prepare(root, name, comm.rank)
        _call(_api().save, _own_bytes(sd), path, process_group=SOLO, file_stems=stems,
              layout=save_layout | {"rank": comm.rank, "world": comm.world_size}, fsync=False)
        localtier.after_commit(root, name, comm.rank, iteration)

    _, err = comm.run("save/local", write)
    comm.agree(err, "save (local checkpoint)")
    if replicator is not None:
        replicator.start(iteration)
    log.info("saved local checkpoint at iteration %d to %s in %.3f s", iteration, path,
             time.perf_counter() - t0)
    return path


def resolve_local(args: Any, ddp_model: Any, persistent: LoadTarget) -> Optional[Tuple[str, int]]:
    """(this rank's version directory, iteration) of the local tier's checkpoint to resume from,
    or None. Collective (:func:`megashard.replication.resolve`): each rank lists its complete
    versions (and, with ``--replication``, the replicas it holds), rank 0 picks the newest
    complete for every rank and newer than ``persistent``, and a rank whose own copy is missing
    receives it from a peer's replica first. Not used with ``--ckpt-step``, ``--finetune`` or a
    ``--pretrained-checkpoint`` fall-back (a persistent checkpoint is asked for)."""
    from megashard import localtier, replication
    from megashard.transport import Comm

    root = local_ckpt_dir(args)
    if not root or getattr(args, "ckpt_step", None) or _flag(args, "finetune") or persistent.pretrained:
        return None
    comm = Comm()
    name = _local_layout_name(comm.world_size, _layout(), len(st.as_chunk_list(ddp_model)))
    before = persistent.iteration if persistent.checkpoint and not persistent.release else -1
    iteration, why = replication.resolve(comm, root, name, before, _replication(args))
    if iteration is None:
        if comm.rank == 0:  # the one line saying why
            at = "" if not persistent.checkpoint else " (release)" if persistent.release else \
                f" at iteration {persistent.iteration}"
            log.info("local checkpoint tier %s: %s; loading --load %s%s", os.path.join(root, localtier.PREFIX + name),
                     why, persistent.root, at)
        return None
    return localtier.version_dir(root, name, comm.rank, iteration), int(iteration)


def _commit_tracker(root: str, iteration: int, release: bool) -> None:
    """An async save's commit callback (every rank, inside ``result()``)."""
    commit_tracker(root, iteration, release)
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
    target: Optional[LoadTarget] = None,
    local: Optional[Tuple[str, int]] = None,
    **_ignored: Any,
) -> Tuple[int, float]:
    """Load a megashard checkpoint into model, optimizer, scheduler and RNG, like Megatron-LM.

    Returns ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when no
    checkpoint exists (or exits when ``--exit-on-missing-checkpoint``). ``--finetune``
    loads only the model (iteration 0); ``--no-load-optim`` / ``--no-load-rng`` skip
    those parts; ``--ckpt-step N`` loads ``iter_N`` whatever the tracker says. The RNG
    state is ignored with a warning when TP or PP differ from the checkpoint's. A given
    ``checkpointing_context`` dict gets ``"megashard_loaded"``: what was restored
    (``optimizer``/``rng`` booleans: false also when the checkpoint holds none).

    Collective, and every step is agreed: which checkpoint to load (``target``, from
    :func:`resolve_load_target` when not given), preparing the template, reading, and
    restoring args/model/optimizer/scheduler/RNG. A failure on any rank raises one
    DistributedError on every rank, so no rank is left waiting for the others.

    ``local``: (this rank's version directory, iteration) from :func:`resolve_local`: every rank
    reads its own version of the local tier alone (same layout as saved, no collective read).
    """
    from megashard.transport import SOLO, Comm

    args = _get_args(args)
    check_save_writable(args)  # a resume is at start-up: a read-only --save is reported now
    comm = Comm()
    target = target or (LoadTarget(None) if local else resolve_load_target(args, load_arg))
    if local is not None:
        target = LoadTarget(target.root or local[0], local[1], checkpoint=local[0], seen_by=comm.world_size)
    group = SOLO if local is not None else None
    if target.pretrained:
        log.warning("no checkpoint in %s; fine-tuning from %s", getattr(args, load_arg, None), target.root)
        args.finetune = True
    if target.foreign:
        raise CheckpointError(foreign_load_error(target, load_arg))
    if not target.root or (target.iteration < 0 and not target.release and not target.direct):
        log.warning("could not find the tracker file %s; starting from random init",
                    tracker_path(target.root) if target.root else "(no --load)")
        if _flag(args, "exit_on_missing_checkpoint"):
            log.error("'--exit-on-missing-checkpoint' set and no checkpoint under %s: exiting", target.root)
            sys.exit(1)  # every rank: the decision is agreed
        return 0, 0
    ckpt = target.checkpoint
    if ckpt is None:
        raise CheckpointError(
            f"no rank sees a megashard checkpoint at {checkpoint_dir(target.root, target.iteration, target.release)} "
            f"(iteration {target.iteration} from "
            f"{'--ckpt-step' if getattr(args, 'ckpt_step', None) else tracker_path(target.root)}): {target.why}")
    iteration, release = target.iteration, target.release
    t0 = time.perf_counter()
    common = _call(_api().load_common, ckpt, ["args", "iteration", "num_floating_point_operations_so_far",
                                              "checkpoint_version", "content_metadata"], process_group=group)
    ckpt_args = common.get("args") or types.SimpleNamespace()
    content_md = common.get("content_metadata") or {}
    finetune = bool(_flag(args, "finetune")) or release
    strict_load = bool(_flag(args, "megashard_strict_load", True))
    plan: Dict[str, Any] = {"fresh": st.FreshOptimizerState()}

    def prepare() -> Any:
        if not finetune and common.get("args") is not None:  # first: one line, before any tensor is compared
            check_checkpoint_args(args, ckpt_args)
        layout = plan["layout"] = _layout()
        ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                      getattr(ckpt_args, "pipeline_model_parallel_size", 1))
        run_tp_pp = (layout["tp"], layout["pp"])
        load_rng = (not finetune and not _flag(args, "no_load_rng")
                    and not getattr(ckpt_args, "no_save_rng", False))
        if load_rng and ckpt_tp_pp != run_tp_pp:
            log.warning("(TP, PP) mismatch after resume (%s vs %s from checkpoint): RNG state will be ignored",
                        run_tp_pp, ckpt_tp_pp)
            load_rng = False
        rng_change = st.rng_layout_change(content_md, ckpt_args) if load_rng else None
        if rng_change:  # e.g. EP or DP changed: a layout change never fails on the RNG state
            log.warning("%s: RNG state will be ignored", rng_change)
            load_rng = False
        load_optim = (not finetune and not _flag(args, "no_load_optim")
                      and not getattr(ckpt_args, "no_save_optim", False) and optimizer is not None)
        plan["rng"], plan["optim"] = load_rng, load_optim
        use_dist_opt = bool(_flag(args, "use_distributed_optimizer"))
        metadata = st.sharded_sd_metadata(use_dist_opt)
        if load_optim and use_dist_opt:  # the sharding the checkpoint holds (converted: Megatron's)
            metadata.update(st.check_distrib_optim_load(ckpt, content_md, ckpt_tp_pp, run_tp_pp))
        chunks = [st.unwrap_model(m) for m in st.as_chunk_list(ddp_model)]
        # a strict load overwrites every element of the optimizer state: no need to zero it first
        if load_optim and strict_load:
            plan["fresh"] = st.preallocate_optimizer_state(optimizer)
        template = st.build_state_dict(
            args, chunks, optimizer if load_optim else None,
            opt_param_scheduler if load_optim else None,
            st.StateRequest(optimizer=load_optim, scheduler=load_optim, rng=load_rng, is_loading=True,
                            data_parallel_random_init=_flag(args, "data_parallel_random_init"),
                            metadata=metadata,
                            legacy_swiglu_optim=(content_md.get("distrib_optim_sharding_type")
                                                 == st.DISTRIB_OPTIM_SHARDING_TYPE
                                                 and st.SWIGLU_OPTIM_KEY not in content_md)),
        )
        # the non-tensor values come from the checkpoint (load_common / load results)
        for key in ("args", "checkpoint_version", "content_metadata"):
            template.pop(key, None)
        return st.prepare_for_load(template, skip_aliased_main_params=strict_load)

    def restore(loaded: Dict[str, Any]) -> Tuple[int, float]:
        loaded = st.finish_load(loaded, prepared)
        it = 0 if finetune else int(common.get("iteration", loaded.get("iteration", iteration)))
        flops = common.get("num_floating_point_operations_so_far",
                           loaded.get("num_floating_point_operations_so_far", 0)) or 0
        if not finetune and common.get("args") is not None:
            _restore_counters(args, ckpt_args)
        if not skip_load_to_model_and_opt:
            st.load_model_state(st.as_chunk_list(ddp_model), loaded, strict=strict)
        if plan["optim"]:
            if not skip_load_to_model_and_opt:
                st.load_optimizer_state(optimizer, loaded["optimizer"])
            if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
                opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if plan["rng"]:
            rng = loaded.get("rng_state")
            if not rng:
                raise CheckpointError(f"no rng_state in {ckpt}; use --no-load-rng or --finetune")
            dp_rank = plan["layout"]["dp_rank"] if _flag(args, "data_parallel_random_init") else 0
            st.restore_rng_state(rng[dp_rank] if len(rng) > dp_rank else rng[0])
        return it, flops

    try:
        prepared, err = comm.run("load/prepare", prepare)
        comm.agree(err, "load (prepare)")
        # no_grad: template ShardedTensors wrap live nn.Parameters, which are filled in place
        request = prepared.request if local is None else _own_bytes(prepared.request)
        with torch.no_grad():
            loaded = _call(_api().load, request, ckpt,
                           mode="own" if local is not None else _flag(args, "megashard_load_mode", "auto") or "auto",
                           strict=strict_load, verify=bool(_flag(args, "megashard_verify_on_load")),
                           check_crc=bool(_flag(args, "megashard_crc_on_load", True)), process_group=group)
            if not strict_load:
                loaded = _keep_unloaded(loaded, request)
        out, err = comm.run("load/restore", lambda: restore(loaded))
        comm.agree(err, "load (restore)")
    except BaseException:
        plan["fresh"].zero()  # never leave uninitialised optimizer state behind a failed load
        raise
    iteration, num_flops = out
    if checkpointing_context is not None:  # what was restored, for a caller's own log (examples/pretrain_gpt.py)
        checkpointing_context["megashard_loaded"] = {"checkpoint": ckpt, "iteration": iteration,
                                                     "optimizer": plan["optim"], "rng": plan["rng"],
                                                     "finetune": finetune}
    log.info("loaded %scheckpoint %s at iteration %d (optimizer %s, rng %s%s) in %.2f s",
             "local " if local is not None else "", ckpt, iteration, "loaded" if plan["optim"] else "not loaded",
             "loaded" if plan["rng"] else "not loaded", ", finetune" if finetune else "",
             time.perf_counter() - t0)
    return iteration, num_flops


def check_save_writable(args: Any = None) -> None:
    """With ``--save-format tensors``: fail at start-up, on every rank and in one line, when
    ``--save`` (or, if it does not exist yet, the directory it would be created in) cannot be
    written, not after the first ``--save-interval`` of training. Collective; once per run.
    A probe file is created there and removed (nothing else is touched)."""
    import tempfile

    from megashard.transport import Comm

    from .args import uses_megashard_save

    args = _get_args(args)
    save = getattr(args, "save", None)
    if not save or not uses_megashard_save(args) or storage.is_url(str(save)) \
            or getattr(args, "_megashard_save_checked", False):
        return

    def check() -> None:
        probe = os.path.abspath(str(save))
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        try:
            fd, tmp = tempfile.mkstemp(dir=probe, prefix=".megashard-writable-")
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise CheckpointError(f"--save {save}: cannot write in {probe} ({e.strerror}); make it writable "
                                  "or pass another --save (checked at start-up, before training)") from None

    comm = Comm()
    _, err = comm.run("save/writable", check)
    comm.agree(err, "start-up check of --save")
    args._megashard_save_checked = True


def _keep_unloaded(loaded: Any, request: Any) -> Any:
    """--megashard-non-strict-load: a shard the checkpoint cannot fill (``None`` from
    :func:`megashard.load`) keeps its current value, the model's or optimizer's own tensor."""
    if loaded is None and looks_like_sharded_tensor(request):
        return request.data
    if isinstance(loaded, dict) and isinstance(request, dict):
        for k in loaded:
            if k in request:
                loaded[k] = _keep_unloaded(loaded[k], request[k])
    elif isinstance(loaded, list) and isinstance(request, (list, tuple)):
        for i in range(min(len(loaded), len(request))):
            loaded[i] = _keep_unloaded(loaded[i], request[i])
    return loaded


# the arguments that fix a model's tensor shapes (Megatron's check_checkpoint_args compares the
# first three; the parallel sizes may differ: megashard reshards)
ARCH_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
             "kv_channels", "num_experts", "moe_ffn_hidden_size")


def check_checkpoint_args(args: Any, ckpt_args: Any) -> None:
    """Megatron's ``check_checkpoint_args``, run before any tensor is compared: a resume with
    another model size fails in one line naming the argument and both values."""
    for name in ARCH_ARGS:
        if name == "num_query_groups" and not (getattr(args, "group_query_attention", False)
                                               and getattr(ckpt_args, "group_query_attention", False)):
            continue  # used only with GQA (Megatron-LM leaves its default 1, the example sets the heads)
        mine, saved = getattr(args, name, None), getattr(ckpt_args, name, None)
        if mine is not None and saved is not None and mine != saved:
            raise CheckpointError(f"{name} value from checkpoint ({saved}) is not equal to the input argument "
                                  f"value ({mine}): resume with the checkpoint's --{name.replace('_', '-')} "
                                  "(or start a new run with another --save)")


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

"""Build Megatron's full training state dict for megashard, and apply a loaded one.

The layout follows Megatron-LM's ``generate_state_dict`` (``training/checkpointing.py``)
so that a megashard checkpoint holds the same top-level keys as a ``torch_dist`` one:
``args``, ``checkpoint_version``, ``iteration``, ``model`` / ``model0``, ``model1``…,
``optimizer``, ``opt_param_scheduler``, ``rng_state`` and
``num_floating_point_operations_so_far``. Differences, all deliberate:

* model chunks are keyed by each chunk's ``vp_stage`` (``model{vp_stage}``), never by
  the deprecated global virtual-pipeline rank;
* the RNG state is stored as JSON-able data (base64 for generator states) inside
  Megatron's ``ShardedObject('rng_state', …, (pp, tp), (pp_rank, tp_rank))`` (with expert
  parallelism one per DP rank as well, as core_v0.16 does; core_v0.19 dropped that), so no
  pickle is ever needed to read it back; its layout is recorded in ``content_metadata``
  and a load in another layout ignores it with a warning (:func:`rng_layout_change`);
* ``args`` is reduced to JSON-representable values (anything else becomes its repr);
* the distributed optimizer uses the ``fully_sharded_model_space`` sharding (flattened
  ShardedTensors per model parameter), which megashard reshards across TP/PP/DP; a converted
  torch_dist checkpoint's ``dp_reshardable`` / ``fully_reshardable`` state is loaded in its
  own sharding (:data:`DISTRIB_OPTIM_LOADABLE`).

From megatron-core only the data model (``ShardedTensor``, ``ShardedObject``,
``ShardedTensorFactory``, ``LocalNonpersistentObject``, ``apply_factories``,
``apply_factory_merges``) and the models'/optimizers' own ``sharded_state_dict`` /
``load_state_dict`` are used -- never the ``dist_checkpointing`` strategies -- so this
works with megatron-core 0.16 and later. Five megatron-core quirks of the
DistributedOptimizer are handled here (see :func:`allow_flattened_range`,
:func:`flatten_swiglu_optimizer_factories`, :func:`ensure_distributed_optimizer_state`,
:func:`_load_fs_model_space`, :func:`_unshare_step_tensors`); they use DistributedOptimizer
methods present from 0.16 to the current main branch (``gbuf_ranges``,
``_get/_set_main_param_and_optimizer_states``).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import enum
import functools
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megashard.errors import CheckpointError, StateDictError

from .compat import CAT0_MERGES

CHECKPOINT_VERSION = 3.0
#: DistributedOptimizer sharding stored by megashard: reshardable over TP, PP and DP.
DISTRIB_OPTIM_SHARDING_TYPE = "fully_sharded_model_space"
#: DistributedOptimizer shardings megashard loads: its own, and the two megatron-core's
#: ``torch_dist`` saves write (``megashard convert`` keeps them as they are), loaded through
#: megatron-core's own ``load_parameter_state_from_*``. ``dp_reshardable`` (Megatron-LM's
#: default, 0.16 and 0.19) follows the optimizer's internal buckets: it loads only at the TP
#: and PP it was saved with (:func:`check_distrib_optim_load`).
DISTRIB_OPTIM_LOADABLE = (DISTRIB_OPTIM_SHARDING_TYPE, "fully_reshardable", "dp_reshardable")
#: ``content_metadata`` entries that shape a DistributedOptimizer's sharded state dict
_DISTRIB_OPTIM_METADATA = ("distrib_optim_sharding_type", "distrib_optim_fully_reshardable_mem_efficient")
RNG_FORMAT = "megashard-rng-v1"
#: ``content_metadata`` entry of checkpoints whose SwiGLU ``linear_fc1`` DistributedOptimizer state
#: is stored as flattened shards of the weight's two halves (:func:`flatten_swiglu_optimizer_factories`);
#: saves before it stored megatron-core's 1-D layout (read with ``legacy_swiglu_optim``)
SWIGLU_OPTIM_KEY = "megashard_swiglu_optim"
SWIGLU_OPTIM_FLAT = "flattened-halves"

Path = Tuple[Any, ...]


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------
def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class RankLogger(logging.LoggerAdapter):
    """Prefixes every message with ``[rank N]`` (the global rank, once distributed is up)."""

    def process(self, msg: Any, kwargs: Any) -> Tuple[Any, Any]:
        return f"[rank {_rank()}] {msg}", kwargs


def get_logger(name: str) -> RankLogger:
    return RankLogger(logging.getLogger(name), {})


def unwrap_model(model: Any) -> Any:
    """Strip DDP / Float16Module wrappers (anything exposing ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def as_chunk_list(model: Any) -> List[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_keys(model: Sequence[Any]) -> List[str]:
    """Top-level state-dict key of every chunk: ``model`` or ``model{vp_stage}``."""
    if len(model) == 1:
        return ["model"]
    keys = []
    for i, chunk in enumerate(model):
        vp_stage = getattr(chunk, "vp_stage", None)
        if vp_stage is None:
            vp_stage = getattr(unwrap_model(chunk), "vp_stage", None)
        keys.append(f"model{i if vp_stage is None else int(vp_stage)}")
    if len(set(keys)) != len(keys):
        raise StateDictError(f"model chunks have duplicate vp_stage keys: {keys}")
    return keys


# --------------------------------------------------------------------------------------
# nested-structure utilities (dicts and lists, like megatron's dict_utils)
# --------------------------------------------------------------------------------------
def _children(x: Any) -> List[Tuple[Any, Any]]:
    if isinstance(x, dict):
        return list(x.items())
    if isinstance(x, list):
        return list(enumerate(x))
    return []


def copy_structure(x: Any) -> Any:
    """Copy dicts and lists, share the leaves (tensors, ShardedTensors, …)."""
    if isinstance(x, dict):
        return {k: copy_structure(v) for k, v in x.items()}
    if isinstance(x, list):
        return [copy_structure(v) for v in x]
    return x


def iter_leaves(x: Any, path: Path = ()) -> List[Tuple[Path, Any]]:
    out: List[Tuple[Path, Any]] = []
    kids = _children(x)
    if not kids and not isinstance(x, (dict, list)):
        return [(path, x)]
    for k, v in kids:
        if isinstance(v, (dict, list)):
            out.extend(iter_leaves(v, path + (k,)))
        else:
            out.append((path + (k,), v))
    return out


def get_path(x: Any, path: Path) -> Any:
    for k in path:
        x = x[k]
    return x


def set_path(x: Any, path: Path, value: Any) -> None:
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = value


def _is_nonpersistent(x: Any) -> bool:
    return type(x).__name__ == "LocalNonpersistentObject" and hasattr(x, "unwrap")


def extract_nonpersistent(sd: Any) -> Dict[Path, Any]:
    """Remove ``LocalNonpersistentObject`` leaves in place; return ``{path: local value}``.

    They hold rank-local data (e.g. optimizer ``param_groups[i]['params']`` ids) that
    Megatron never saves and puts back from the live object after loading.
    """
    found: Dict[Path, Any] = {}

    def rec(x: Any, path: Path) -> None:
        for k, v in _children(x):
            if _is_nonpersistent(v):
                found[path + (k,)] = v.unwrap()
            elif isinstance(v, (dict, list)):
                rec(v, path + (k,))

    rec(sd, ())
    # delete deepest first so list indices stay valid
    for path in sorted(found, key=len, reverse=True):
        parent = get_path(sd, path[:-1])
        del parent[path[-1]]
    return found


def restore_nonpersistent(sd: Any, found: Dict[Path, Any]) -> None:
    for path in sorted(found, key=len):
        parent = get_path(sd, path[:-1])
        if isinstance(parent, list):
            parent.insert(path[-1], found[path])
        else:
            parent[path[-1]] = found[path]


def restore_scalar_tensors(loaded: Any, template: Any) -> None:
    """Where the template had a 0-dim tensor and the load gave a Python number, make it a tensor.

    Optimizer ``step`` counters are 0-dim tensors; a checkpoint layer may hand back
    plain numbers for them. Adam needs tensors, with the template's dtype.
    """
    for path, tmpl in iter_leaves(template):
        if isinstance(tmpl, torch.Tensor) and tmpl.dim() == 0:
            try:
                val = get_path(loaded, path)
            except (KeyError, IndexError, TypeError):
                continue
            if isinstance(val, (int, float, np.number)) and not isinstance(val, bool):
                set_path(loaded, path, torch.tensor(val, dtype=tmpl.dtype, device=tmpl.device))


# --------------------------------------------------------------------------------------
# args: JSON-representable copy
# --------------------------------------------------------------------------------------
_SIMPLE = (type(None), bool, int, float, str)


def _jsonable(v: Any, depth: int = 0) -> Tuple[bool, Any]:
    if isinstance(v, _SIMPLE) or isinstance(v, (torch.dtype, enum.Enum, np.generic)):
        return True, v
    if depth > 8:
        return False, None
    if isinstance(v, (list, tuple)):
        items = [_jsonable(x, depth + 1) for x in v]
        if all(ok for ok, _ in items):
            return True, type(v)(x for _, x in items) if isinstance(v, tuple) else [x for _, x in items]
        return False, None
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, (str, int)):
                return False, None
            ok, y = _jsonable(x, depth + 1)
            if not ok:
                return False, None
            out[k] = y
        return True, out
    return False, None


def jsonable_args(args: Any) -> Optional[argparse.Namespace]:
    """A Namespace with the JSON-representable attributes of ``args``; others become repr strings.

    Megatron's args hold a few runtime objects (process groups, callables) that a
    checkpoint must not need; Megatron only reads sizes and counters back.
    """
    if args is None:
        return None
    out = argparse.Namespace()
    lossy = []
    for name, value in sorted(vars(args).items()):
        ok, v = _jsonable(value)
        if not ok:
            lossy.append(name)
            v = f"<unrepresentable {type(value).__module__}.{type(value).__qualname__}: {value!r:.200}>"
        setattr(out, name, v)
    if lossy:
        get_logger(__name__).debug("args stored as repr strings: %s", ", ".join(lossy))
    return out


# --------------------------------------------------------------------------------------
# RNG state, without pickle
# --------------------------------------------------------------------------------------
def _b64_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().cpu().contiguous().numpy().tobytes()).decode("ascii")


def _tensor_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _tracker_states_as_tensors() -> Dict[str, torch.Tensor]:
    from megatron.core import tensor_parallel

    out = {}
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        if not isinstance(state, torch.Tensor):  # graph-safe tracker keeps Generators
            state = tensor_parallel.convert_cuda_rng_state(state, to_graphable=False)
        out[name] = state
    return out


def _device_rng_is_real() -> bool:
    from . import cpu_compat

    return torch.cuda.is_available() and not cpu_compat.is_applied()


def capture_rng_state() -> Dict[str, Any]:
    """This process's RNG states (python, numpy, torch, CUDA if present, TP tracker) as JSON data."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: Dict[str, Any] = {
        "format": RNG_FORMAT,
        "random_rng_state": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
        "np_rng_state": {
            "kind": str(np_kind),
            "keys": [int(k) for k in np_keys],
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_rng_state": _b64_tensor(torch.get_rng_state()),
        "cuda_rng_state": _b64_tensor(torch.cuda.get_rng_state()) if _device_rng_is_real() else None,
        "rng_tracker_states": {k: _b64_tensor(v) for k, v in _tracker_states_as_tensors().items()},
    }
    return state


def _from_megatron_rng_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron-LM's own ``get_rng_state()`` layout (tuples, numpy, tensors: what a torch_dist
    checkpoint converted by ``megashard convert`` holds) in :func:`capture_rng_state`'s form."""
    py_version, py_state, py_gauss = state["random_rng_state"]
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["np_rng_state"]
    cuda = state.get("cuda_rng_state")
    return {
        "format": RNG_FORMAT,
        "random_rng_state": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
        "np_rng_state": {"kind": str(np_kind), "keys": [int(k) for k in np_keys], "pos": int(np_pos),
                         "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch_rng_state": _b64_tensor(state["torch_rng_state"]),
        "cuda_rng_state": _b64_tensor(cuda) if isinstance(cuda, torch.Tensor) else None,
        "rng_tracker_states": {k: _b64_tensor(v) for k, v in (state.get("rng_tracker_states") or {}).items()},
    }


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    from megatron.core import tensor_parallel

    if state.get("format") is None and isinstance(state.get("torch_rng_state"), torch.Tensor):
        state = _from_megatron_rng_state(state)
    if state.get("format") != RNG_FORMAT:
        raise CheckpointError(f"unknown RNG state format {state.get('format')!r}")
    py = state["random_rng_state"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    n = state["np_rng_state"]
    np.random.set_state(
        (n["kind"], np.array(n["keys"], dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]),
         float(n["cached_gaussian"]))
    )
    torch.set_rng_state(_tensor_b64(state["torch_rng_state"]))
    if state.get("cuda_rng_state") is not None and _device_rng_is_real():
        torch.cuda.set_rng_state(_tensor_b64(state["cuda_rng_state"]))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    graph_safe = tensor_parallel.is_graph_safe_cuda_rng_tracker(tracker)
    if not state.get("rng_tracker_states"):
        raise CheckpointError("rng_tracker_states is empty in the checkpoint's RNG state; use --no-load-rng")
    states = {}
    for name, s in state["rng_tracker_states"].items():
        t = _tensor_b64(s)
        if not _device_rng_is_real():
            states[name] = t
        else:
            states[name] = tensor_parallel.convert_cuda_rng_state(t.cuda(), to_graphable=graph_safe)
    tracker.set_states(states)


#: ``content_metadata`` entry recording the shape of the saved ``rng_state`` ShardedObject
RNG_LAYOUT_KEY = "megashard_rng_layout"


def rng_layout() -> List[int]:
    """This run's ``rng_state`` layout: ``[pp, tp]``, or ``[pp, tp, dp]`` with expert parallelism
    (every DP rank keeps its own state then: the expert-parallel RNG differs between EP ranks)."""
    from megatron.core import parallel_state as mpu

    layout = [mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()]
    if mpu.get_expert_model_parallel_world_size() > 1:
        layout.append(mpu.get_data_parallel_world_size(with_context_parallel=True))
    return layout


def rng_layout_change(content_metadata: Dict[str, Any], ckpt_args: Any) -> Optional[str]:
    """Why the checkpoint's RNG state cannot be restored in this run's layout (None: it can).

    Megatron restores RNG states only into the layout that saved them and ignores them,
    with a warning, otherwise; so does megashard. Checkpoints that do not record their RNG
    layout (converted ones) are trusted only without expert parallelism on either side."""
    now = rng_layout()
    saved = content_metadata.get(RNG_LAYOUT_KEY)
    if saved is None:
        ep = int(getattr(ckpt_args, "expert_model_parallel_size", 1) or 1)
        if ep > 1 or len(now) > 2:
            return "the checkpoint does not record the layout of its RNG state (expert parallelism)"
        saved = [int(getattr(ckpt_args, "pipeline_model_parallel_size", 1) or 1),
                 int(getattr(ckpt_args, "tensor_model_parallel_size", 1) or 1)]
    if [int(x) for x in saved] != now:
        names = ("PP", "TP", "DP")
        fmt = lambda lay: "x".join(f"{n}{v}" for n, v in zip(names, lay)) + ("" if len(lay) > 2 else " (EP1)")
        return f"RNG state layout changed ({fmt(saved)} in the checkpoint, {fmt(now)} in this run)"
    return None


def rng_sharded_object(data_parallel_random_init: bool = False) -> Any:
    """Megatron's ``rng_state`` ShardedObject, shaped as :func:`rng_layout`."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng = capture_rng_state()
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
    if data_parallel_random_init and dp_size > 1:
        from megashard.transport import Comm  # JSON over the group: never pickled

        states = Comm(mpu.get_data_parallel_group(with_context_parallel=True)).all_gather_json(rng)
    else:
        states = [rng]
    layout = rng_layout()
    offset = [mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()]
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    if len(layout) > 2:
        return ShardedObject("rng_state", states, tuple(layout), (*offset, dp_rank), replica_id=0)
    return ShardedObject("rng_state", states, tuple(layout), tuple(offset), replica_id=dp_rank)


# --------------------------------------------------------------------------------------
# the full training state dict
# --------------------------------------------------------------------------------------
def sharded_sd_metadata(use_distributed_optimizer: bool) -> Dict[str, Any]:
    """``metadata`` passed to ``sharded_state_dict()`` (also stored, without process groups)."""
    from megatron.core import parallel_state as mpu

    md: Dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if use_distributed_optimizer:
        md["distrib_optim_sharding_type"] = DISTRIB_OPTIM_SHARDING_TYPE
    md["dp_cp_group"] = mpu.get_data_parallel_group(with_context_parallel=True)
    return md


def clean_metadata(md: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in md.items() if k != "dp_cp_group"}


def check_distrib_optim_load(ckpt: str, content_metadata: Dict[str, Any], saved_tp_pp: Tuple[int, int],
                             run_tp_pp: Tuple[int, int]) -> Dict[str, Any]:
    """The ``metadata`` entries to load the checkpoint's DistributedOptimizer state with (its own
    sharding type), or a CheckpointError that says what to do when this run cannot load it."""
    saved = content_metadata.get("distrib_optim_sharding_type")
    if saved is None:  # megashard's own checkpoints before content metadata, or no optimizer
        return {}
    what = f"{ckpt} stores DistributedOptimizer state as {saved!r}"
    if saved not in DISTRIB_OPTIM_LOADABLE:
        raise CheckpointError(
            f"{what}, which megashard cannot load (it loads {', '.join(map(repr, DISTRIB_OPTIM_LOADABLE))}): "
            "save the torch_dist checkpoint again with Megatron's --dist-ckpt-optim-fully-reshardable and "
            "convert that, or resume with --no-load-optim (a fresh optimizer)")
    if saved == "dp_reshardable" and tuple(saved_tp_pp) != tuple(run_tp_pp):
        fmt = lambda tp_pp: f"TP{tp_pp[0]}·PP{tp_pp[1]}"  # noqa: E731
        raise CheckpointError(
            f"{what} (Megatron-LM's default for torch_dist), which follows the optimizer's internal buckets "
            f"and loads only at the TP and PP it was saved with ({fmt(saved_tp_pp)}; this run: "
            f"{fmt(run_tp_pp)}): resume at {fmt(saved_tp_pp)} (megashard's next save reshards freely), or "
            "save the torch_dist checkpoint with Megatron's --dist-ckpt-optim-fully-reshardable and convert "
            "that, or resume with --no-load-optim (a fresh optimizer)")
    return {k: content_metadata[k] for k in _DISTRIB_OPTIM_METADATA if k in content_metadata}


@contextlib.contextmanager
def allow_flattened_range() -> Iterator[None]:
    """Let megatron-core build flattened-range ShardedTensors (DistributedOptimizer state).

    megatron-core >= 0.16 still *builds* the ``fully_sharded_model_space`` optimizer
    state (one flattened ShardedTensor per model parameter and DP rank: reshardable over
    TP, PP and DP) and still *loads* it, but ``ShardedTensor.validate_metadata_integrity``
    rejects ``flattened_range`` because torch_dist no longer writes it. megashard does
    write and reshard it, so while the optimizer's ``sharded_state_dict`` runs, that one
    check is replaced by the equivalent checks for flattened shards.
    """
    from megatron.core.dist_checkpointing import mapping
    from megatron.core.dist_checkpointing.core import CheckpointingException

    cls = mapping.ShardedTensor
    original = cls.validate_metadata_integrity

    def validate(self: Any) -> None:
        fr = self.flattened_range
        if fr is None:
            return original(self)
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(f"Data dtype should match `dtype` attribute for {self}")
            if self.data.dim() != 1 or self.data.numel() != fr.stop - fr.start:
                raise CheckpointingException(f"flattened data must be 1-D with {fr.stop - fr.start} elements: {self}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"Global offset and global shape ranks differ for {self}")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(f"local shape + prepend_axis_num != global rank for {self}")
        numel = 1
        for d in self.local_shape:
            numel *= int(d)
        if not (0 <= fr.start <= fr.stop <= numel):
            raise CheckpointingException(f"flattened_range {fr} outside the local shape for {self}")

    cls.validate_metadata_integrity = validate
    try:
        yield
    finally:
        cls.validate_metadata_integrity = original


def _merge_id(fn: Any) -> Tuple[Any, Any]:
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)


def flatten_swiglu_optimizer_factories(optimizer_sd: Any, model_sds: Sequence[Any], legacy: bool = False) -> int:
    """Make the DistributedOptimizer state of SwiGLU's ``linear_fc1`` flattened shards of its halves.

    ``sharded_param_state_fs_model_space`` copies the model's ShardedTensorFactory for fc1
    (``apply_swiglu_sharded_factory``) with this DP rank's flat piece of the state and its
    ``flattened_range``; the factory's build function (megatron-core 0.16.1 and 0.19.0 alike)
    ignores the range, halves the *flat piece* with ``torch.chunk`` and shards each half as a
    1-D tensor along the weight's row axis. Global shapes then follow the piece's length, so
    DP ranks holding pieces of different lengths disagree (the save is refused), and pieces of
    equal length claim the same elements. Each such factory (recognised by the model factory's
    build function, whose merge is ``torch.cat`` along dim 0: :data:`CAT0_MERGES`) is replaced
    by one that builds the model factory's parts for the whole local weight (on the meta device)
    and cuts this rank's range out of them: one flattened ShardedTensor per half it overlaps,
    with the half's global shape and offset, so the state reshards over TP, PP and DP.

    ``legacy``: a checkpoint saved before this (no :data:`SWIGLU_OPTIM_KEY` in its
    ``content_metadata``) holds megatron-core's layout, which only saved where each fc1 piece
    was a whole weight; that layout is the flattened global ``[w; v]`` (1-D, after the
    prepended axes), and the same elements are requested from it instead. Returns the number
    of factories replaced.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    by_build: Dict[int, Any] = {}
    for sub in model_sds:
        for _, leaf in iter_leaves(sub):
            if isinstance(leaf, ShardedTensorFactory) and _merge_id(leaf.merge_fn) in CAT0_MERGES:
                by_build[id(leaf.build_fn)] = leaf
    if not by_build:
        return 0
    replaced = 0
    for path, leaf in iter_leaves(optimizer_sd):
        if not (isinstance(leaf, ShardedTensorFactory) and leaf.flattened_range is not None
                and id(leaf.build_fn) in by_build and isinstance(leaf.data, torch.Tensor)):
            continue
        shape = tuple(by_build[id(leaf.build_fn)].data.shape)
        if _meta_parts(leaf.build_fn, shape, leaf.key, leaf.data.dtype, leaf.replica_id) is None:
            get_logger(__name__).debug("%s: factory parts do not tile the weight; left as megatron-core builds it",
                                       leaf.key)
            continue
        build = functools.partial(_build_flat_parts, leaf.build_fn, shape, legacy)
        set_path(optimizer_sd, path, ShardedTensorFactory(leaf.key, leaf.data, build, _cat_flat_parts,
                                                          leaf.replica_id, flattened_range=leaf.flattened_range))
        replaced += 1
    return replaced


def _meta_parts(build_fn: Any, shape: Tuple[int, ...], key: str, dtype: torch.dtype,
                replica_id: Any) -> Optional[List[Any]]:
    """The model factory's parts for a whole local weight of ``shape`` (meta device), if they are
    consecutive row blocks of it in order (what ``torch.cat`` along dim 0 undoes), else None."""
    whole = torch.empty(shape, dtype=dtype, device="meta")
    parts = build_fn(key, whole, replica_id, None)
    if not isinstance(parts, list) or not parts:
        return None
    pos = 0
    for p in parts:
        data = getattr(p, "data", None)
        if (type(p).__name__ != "ShardedTensor" or getattr(p, "flattened_range", None) is not None
                or not isinstance(data, torch.Tensor) or data.dim() != len(shape) or tuple(data.shape[1:]) != shape[1:]
                or not data.is_contiguous() or data.storage_offset() != pos
                or tuple(p.local_shape) != tuple(data.shape)):
            return None
        pos += data.numel()
    return parts if pos == whole.numel() else None


def _build_flat_parts(build_fn: Any, shape: Tuple[int, ...], legacy: bool, key: str, t: torch.Tensor,
                      replica_id: Any, flattened_range: Optional[slice]) -> List[Any]:
    """Build function of :func:`flatten_swiglu_optimizer_factories`' factories."""
    from dataclasses import replace

    parts = _meta_parts(build_fn, shape, key, t.dtype, replica_id)
    fr = flattened_range if flattened_range is not None else slice(0, t.numel())
    if parts is None or t.dim() != 1 or t.numel() != fr.stop - fr.start:
        raise StateDictError(f"{key}: SwiGLU optimizer state of {t.numel()} elements for range {fr} "
                             f"of a weight shaped {list(shape)}: cannot be split into its halves")
    out = []
    start = 0
    with allow_flattened_range():
        for p in parts:
            n = p.data.numel()
            lo, hi = max(fr.start, start), min(fr.stop, start + n)
            if hi > lo:
                data = t[lo - fr.start:hi - fr.start]
                if legacy:
                    out.append(_legacy_part(p, data, lo - start))
                else:
                    out.append(replace(p, data=data, dtype=t.dtype, flattened_range=slice(lo - start, hi - start)))
            start += n
    return out


def _legacy_part(p: Any, data: torch.Tensor, first: int) -> Any:
    """``data`` (flat elements ``first``… of part ``p``) as the 1-D ShardedTensor of the layout
    saved before :data:`SWIGLU_OPTIM_KEY`: the global ``[w; v]`` flattened after the prepended axes."""
    from dataclasses import replace

    pre = p.prepend_axis_num
    row = 1
    for d in p.local_shape[1:]:
        row *= int(d)
    if tuple(p.local_shape[1:]) != tuple(p.global_shape[pre + 1:]):
        raise StateDictError(f"{p.key}: checkpoint saved before {SWIGLU_OPTIM_KEY}: its 1-D SwiGLU optimizer "
                             "layout needs full rows; load with --no-load-optim")
    flat_numel = int(p.global_shape[pre]) * row
    return replace(p, data=data, dtype=data.dtype, local_shape=(data.numel(),),
                   global_shape=(*p.global_shape[:pre], flat_numel),
                   global_offset=(*p.global_offset[:pre], int(p.global_offset[pre]) * row + first),
                   axis_fragmentations=None, flattened_range=None)


def _cat_flat_parts(parts: Any) -> torch.Tensor:
    """Merge of :func:`flatten_swiglu_optimizer_factories`' factories: the flat piece again."""
    with torch.no_grad():
        return torch.cat(list(parts))


#: merges that are ``torch.cat`` along dim 0 (elided when the load filled the factory's tensor)
_CAT0 = CAT0_MERGES | {(__name__, _cat_flat_parts.__qualname__)}


def _inner_optimizers(optimizer: Any) -> List[Tuple[Any, Any]]:
    """(megatron optimizer, torch optimizer) for every optimizer of a (chained) Megatron optimizer."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is not None and hasattr(inner, "state") and hasattr(inner, "param_groups"):
            out.append((opt, inner))
    return out


@dataclass
class FreshOptimizerState:
    """Optimizer state allocated uninitialised for a load (see :func:`preallocate_optimizer_state`)."""

    tensors: List[torch.Tensor] = field(default_factory=list)

    def zero(self) -> None:
        """After a failed load: no uninitialised memory may reach training."""
        with torch.no_grad():
            for t in self.tensors:
                t.zero_()


def preallocate_optimizer_state(optimizer: Any) -> FreshOptimizerState:
    """Give a never-stepped torch Adam/AdamW (inside Megatron optimizers) its ``exp_avg`` /
    ``exp_avg_sq`` uninitialised, for a load that overwrites every element.

    Megatron's ``init_state_fn`` (run by ``sharded_state_dict(is_loading=True)``) fills
    them with ``zeros_like``: a memset of the whole optimizer state, plus its page faults,
    on the critical path. With the state already present it is skipped; the load's reads
    see that these pages are not in memory yet and pre-fault them piece by piece just
    before filling them (``format.fastio.read_requests``), so each page is touched once,
    while still in cache. Only for plain (non-AMSGrad, non precision-aware) Adam, whose
    ``init_state_fn`` creates exactly these two tensors. If the load does not complete,
    the caller must :meth:`~FreshOptimizerState.zero` them.
    """
    fresh = FreshOptimizerState()
    for opt, inner in _inner_optimizers(optimizer):
        config = getattr(opt, "config", None)
        if (not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(inner.state) > 0
                or getattr(opt, "init_state_fn", None) is None
                or getattr(config, "use_precision_aware_optimizer", False)
                or any(g.get("amsgrad") for g in inner.param_groups)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                s = inner.state[p]
                s["exp_avg"] = torch.empty_like(p.data, memory_format=torch.contiguous_format)
                s["exp_avg_sq"] = torch.empty_like(p.data, memory_format=torch.contiguous_format)
                fresh.tensors += [s["exp_avg"], s["exp_avg_sq"]]
    return fresh


def ensure_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped DistributedOptimizer (torch Adam) an initial state with ``step``.

    With torch's Adam (no Apex / Transformer Engine, e.g. on CPU) megatron-core's
    ``DistributedOptimizer.state_dict()`` reads ``state['step']`` of every parameter and
    fails on a fresh optimizer, so a load template could not be built before the first
    step. Apex/TE optimizers keep ``step`` in the param groups and are left alone.
    """
    try:
        from megatron.core.optimizer import distrib_optimizer as do
    except ImportError:  # pragma: no cover
        return
    for opt, inner in _inner_optimizers(optimizer):
        if not isinstance(opt, do.DistributedOptimizer):
            continue
        if getattr(do, "HAVE_APEX_OR_TE", True) and not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        if any("step" in s for s in inner.state.values()):
            continue
        if opt.init_state_fn is not None and len(inner.state) == 0:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


@dataclass
class StateRequest:
    """What goes into (or is requested from) a checkpoint."""

    model: bool = True
    optimizer: bool = True
    scheduler: bool = True
    rng: bool = True
    is_loading: bool = False
    data_parallel_random_init: bool = False
    metadata: Dict[str, Any] = field(default_factory=dict)
    #: request SwiGLU fc1 DistributedOptimizer state in the 1-D layout of checkpoints saved
    #: before :data:`SWIGLU_OPTIM_KEY` (see :func:`flatten_swiglu_optimizer_factories`)
    legacy_swiglu_optim: bool = False


def build_state_dict(
    args: Any,
    model: Sequence[Any],
    optimizer: Any,
    opt_param_scheduler: Any,
    request: StateRequest,
    *,
    iteration: Optional[int] = None,
    num_floating_point_operations_so_far: Optional[float] = None,
) -> Dict[str, Any]:
    """Megatron's training state as a ShardedStateDict (factories not yet applied).

    ``model`` is the list of *unwrapped* chunks (``sharded_state_dict`` of the DDP
    wrapper prefixes keys with ``module.``).
    """
    model = [unwrap_model(m) for m in as_chunk_list(model)]
    sd: Dict[str, Any] = {
        "args": jsonable_args(args),
        "checkpoint_version": CHECKPOINT_VERSION,
    }
    if iteration is not None:
        sd["iteration"] = int(iteration)
    if num_floating_point_operations_so_far is not None:
        sd["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    sd["content_metadata"] = clean_metadata(request.metadata)
    if request.rng and not request.is_loading:
        sd["content_metadata"][RNG_LAYOUT_KEY] = rng_layout()
    if not request.is_loading:
        sd["content_metadata"][SWIGLU_OPTIM_KEY] = SWIGLU_OPTIM_FLAT

    for key, chunk in zip(model_keys(model), model):
        sd[key] = chunk.sharded_state_dict(metadata=request.metadata)

    if request.optimizer and optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
        if request.is_loading:
            ensure_distributed_optimizer_state(optimizer)
        with allow_flattened_range():
            sd["optimizer"] = optimizer.sharded_state_dict(
                sd, is_loading=request.is_loading, metadata=request.metadata
            )
        flatten_swiglu_optimizer_factories(sd["optimizer"], [sd[k] for k in model_keys(model)],
                                           legacy=request.legacy_swiglu_optim)
    if request.scheduler and opt_param_scheduler is not None:
        sd["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if request.rng:
        sd["rng_state"] = rng_sharded_object(request.data_parallel_random_init)
    if not request.model:
        for key in model_keys(model):
            sd.pop(key, None)
    return sd


@dataclass
class PreparedLoad:
    """A load request ready for megashard.load plus what is needed to finish it."""

    request: Dict[str, Any]            # factories applied, non-persistent objects removed
    factory_template: Dict[str, Any]   # the original template (with factories) for merges
    nonpersistent: Dict[Path, Any]
    skipped: List[Path] = field(default_factory=list)  # left out of the request on purpose


def prepare_for_save(sd: Dict[str, Any]) -> Dict[str, Any]:
    """Apply ShardedTensorFactories and drop non-persistent objects (megashard.save needs neither)."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    out = copy_structure(sd)
    apply_factories(out)
    extract_nonpersistent(out)
    if "optimizer" in out:
        strip_fs_model_space_steps(out["optimizer"])
    return out


def prepare_for_load(template: Dict[str, Any], skip_aliased_main_params: bool = False) -> PreparedLoad:
    """``skip_aliased_main_params``: see :func:`drop_aliased_main_params` (only for strict
    loads, which fill every model tensor)."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    request = copy_structure(template)
    apply_factories(request)
    nonpersistent = extract_nonpersistent(request)
    skipped: List[Path] = []
    if "optimizer" in request:
        strip_fs_model_space_steps(request["optimizer"])
        if skip_aliased_main_params:
            skipped = drop_aliased_main_params(request, template)
    return PreparedLoad(request, template, nonpersistent, skipped)


def _memory(t: Any) -> Optional[Tuple[torch.dtype, int, int]]:
    """(dtype, first byte, end byte) of a contiguous CPU/GPU tensor's memory, else None."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.numel() == 0:
        return None
    start = t.data_ptr()
    return t.dtype, start, start + t.numel() * t.element_size()


def drop_aliased_main_params(request: Dict[str, Any], template: Dict[str, Any]) -> List[Path]:
    """Drop DistributedOptimizer ``fp32_param`` entries whose tensors are the model's own memory.

    With an fp32 model, the DistributedOptimizer's main params are views of the model
    parameters, which the same load fills from the model's shards (the saved bytes are
    the same memory, so equal). Requesting them again reads every main param twice,
    a quarter of the load's bytes; they are left out of the request (and of the
    template, for factory merges), and :func:`_load_fs_model_space` keeps the live
    tensors. Returns the paths left out (:func:`finish_load` drops what the load
    returns there: the saved tree's markers for them).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MShardedTensor

    runs: Dict[torch.dtype, List[List[int]]] = {}
    for key, sub in request.items():
        if not str(key).startswith("model"):
            continue
        for _, leaf in iter_leaves(sub):
            mem = _memory(leaf.data) if isinstance(leaf, MShardedTensor) else None
            if mem is not None:
                runs.setdefault(mem[0], []).append([mem[1], mem[2]])
    merged: Dict[torch.dtype, List[List[int]]] = {}
    for dtype, spans in runs.items():  # touching/overlapping spans become one (SwiGLU's w|v halves)
        out: List[List[int]] = []
        for lo, hi in sorted(spans):
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        merged[dtype] = out

    def inside(t: Any) -> bool:
        import bisect

        mem = _memory(t)
        if mem is None or mem[0] not in merged:
            return False
        spans = merged[mem[0]]
        i = bisect.bisect_right(spans, [mem[1], float("inf")]) - 1
        return i >= 0 and spans[i][0] <= mem[1] and mem[2] <= spans[i][1]

    skipped: List[Path] = []

    def walk(req: Any, tmpl: Any, path: Path) -> None:
        if not isinstance(req, dict):
            return
        if _is_fs_model_space(req) and isinstance(req.get("param_state"), dict):
            tstate = tmpl.get("param_state") if isinstance(tmpl, dict) else None
            for idx, entry in req["param_state"].items():
                if not isinstance(entry, dict) or "fp32_param" not in entry:
                    continue
                leaves = [v for _, v in iter_leaves(entry["fp32_param"])]
                if leaves and all(isinstance(v, MShardedTensor) and inside(v.data) for v in leaves):
                    del entry["fp32_param"]
                    if isinstance(tstate, dict) and isinstance(tstate.get(idx), dict):
                        tstate[idx].pop("fp32_param", None)
                    skipped.append(path + ("param_state", idx, "fp32_param"))
            return
        for k, v in req.items():
            walk(v, tmpl.get(k) if isinstance(tmpl, dict) else None, path + (k,))

    walk(request["optimizer"], template.get("optimizer"), ("optimizer",))
    return skipped


def finish_load(loaded: Dict[str, Any], prepared: PreparedLoad) -> Dict[str, Any]:
    """Put non-persistent objects back and merge factory outputs (Megatron's load epilogue)."""
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges

    restore_nonpersistent(loaded, prepared.nonpersistent)
    for path in prepared.skipped:
        try:
            del get_path(loaded, path[:-1])[path[-1]]
        except (KeyError, IndexError, TypeError):
            pass
    loaded = apply_factory_merges(loaded, _merges_to_run(prepared.factory_template, loaded))
    if "optimizer" in prepared.request and "optimizer" in loaded:
        restore_scalar_tensors(loaded["optimizer"], prepared.request["optimizer"])
    return loaded


def _merges_to_run(x: Any, loaded: Any) -> Any:
    """The sub-structure of ``x`` leading to the ShardedTensorFactory leaves whose merge must
    still run (lists become index-keyed dicts).

    A merge that is ``torch.cat`` along dim 0 (:data:`CAT0_MERGES`, e.g. SwiGLU's fc1 halves),
    whose loaded parts are, in order, consecutive views tiling the factory's own tensor, is
    already done: the load filled that tensor in place. ``loaded`` gets the tensor itself and
    the merge is left out; it would allocate and copy every such weight and optimizer state
    once more (measured: 0.10 s of a 0.49 s resume at 8 layers, TP=2, DistributedOptimizer)."""
    if isinstance(x, dict):
        items = list(x.items())
    elif isinstance(x, list):
        items = list(enumerate(x))
    else:
        return {}
    out = {}
    for k, v in items:
        sub = _child(loaded, k)
        if type(v).__name__ == "ShardedTensorFactory":
            fn = getattr(v, "merge_fn", None)
            if _merge_id(fn) in _CAT0 and _tiles_in_order(sub, getattr(v, "data", None)):
                loaded[k] = v.data
            else:
                out[k] = v
        elif isinstance(v, (dict, list)):
            nested = _merges_to_run(v, sub)
            if nested:
                out[k] = nested
    return out


def _child(x: Any, k: Any) -> Any:
    if isinstance(x, dict):
        return x.get(k)
    if isinstance(x, list) and isinstance(k, int) and 0 <= k < len(x):
        return x[k]
    return None


def _tiles_in_order(parts: Any, data: Any) -> bool:
    """Whether ``torch.cat(parts)`` (dim 0) equals ``data`` because the parts are, in order,
    consecutive contiguous views of its memory with its trailing shape."""
    if not (isinstance(parts, list) and parts and isinstance(data, torch.Tensor) and data.dim() >= 1
            and data.is_contiguous()):
        return False
    storage = data.untyped_storage().data_ptr()
    pos, rows = data.data_ptr(), 0
    for p in parts:
        if not (isinstance(p, torch.Tensor) and p.dtype == data.dtype and p.device == data.device
                and p.dim() == data.dim() and p.shape[1:] == data.shape[1:] and p.is_contiguous()
                and p.untyped_storage().data_ptr() == storage and p.data_ptr() == pos):
            return False
        pos += p.numel() * p.element_size()
        rows += p.shape[0]
    return rows == data.shape[0] and pos == data.data_ptr() + data.numel() * data.element_size()


# --------------------------------------------------------------------------------------
# applying a loaded state
# --------------------------------------------------------------------------------------
def load_model_state(ddp_model: Sequence[Any], loaded: Dict[str, Any], strict: bool = True) -> None:
    """``load_state_dict`` every chunk that has an entry (missing chunk = empty stage)."""
    chunks = as_chunk_list(ddp_model)
    for key, chunk in zip(model_keys([unwrap_model(c) for c in chunks]), chunks):
        if key not in loaded:
            continue
        chunk.load_state_dict(loaded[key], strict=strict)


def _is_fs_model_space(x: Any) -> bool:
    return isinstance(x, dict) and x.get("param_state_sharding_type") == DISTRIB_OPTIM_SHARDING_TYPE


def strip_fs_model_space_steps(optimizer_sd: Any) -> None:
    """Drop the per-parameter ``step`` tensors from DistributedOptimizer param-state entries.

    megatron-core leaves torch Adam's ``step`` as a plain rank-local tensor in every
    ``fully_sharded_model_space`` entry; it duplicates ``param_groups[i]['step']`` and,
    being indexed by this rank's parameter order, cannot be matched after a layout change.
    """
    if _is_fs_model_space(optimizer_sd):
        for entry in (optimizer_sd.get("param_state") or {}).values():
            if isinstance(entry, dict):
                entry.pop("step", None)
    elif isinstance(optimizer_sd, dict):
        for v in optimizer_sd.values():
            strip_fs_model_space_steps(v)


def _load_fs_model_space(opt: Any, param_state: Dict[int, Dict[str, torch.Tensor]]) -> None:
    """megatron-core's ``load_parameter_state_from_fs_model_space`` minus its torch-Adam bug.

    The original builds the source dict without ``step`` but copies every key of the live
    state (which, with torch's Adam, has ``step``): KeyError 'step'. Keys missing from the
    checkpoint entry (``step``, restored from ``param_groups``) keep their current value.
    """
    idx = 0  # same parameter order as sharded_param_state_fs_model_space
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_dtype in gbuf_range_maps.values():
            for gbuf_range_map in per_dtype:
                for model_param in gbuf_range_map["param_map"]:
                    _set_states(opt, model_param, param_state[idx])
                    idx += 1


def _load_fully_reshardable(opt: Any, param_state: Dict[int, Dict[str, torch.Tensor]]) -> None:
    """megatron-core's ``load_parameter_state_from_fully_reshardable`` minus the torch-Adam bug
    of :func:`_load_fs_model_space` (KeyError 'step'): every entry holds this parameter's whole
    (TP-local) state in its shape; this rank keeps its DP range of it."""
    from collections import ChainMap

    idx = -1  # the order of sharded_param_state_fully_reshardable: every buffer's param_index_map
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for per_dtype in gbuf_range_maps.values():
            ranges = ChainMap(*(m["param_map"] for m in per_dtype))
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                idx += 1
                if model_param not in ranges:
                    continue
                r = ranges[model_param]["param"]
                _set_states(opt, model_param, {k: v.flatten()[r.start:r.end] for k, v in param_state[idx].items()
                                               if isinstance(v, torch.Tensor) and k != "step"})


#: where a sub-optimizer's state keeps what is not a per-parameter tensor: param groups
#: (``FP32Optimizer``; ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer``)
#: and the step torch's Adam shares between parameters (``DistributedOptimizer`` keeps it
#: in every param group instead)
_PARAM_GROUPS_AT: Tuple[Path, ...] = (("param_groups",), ("optimizer", "param_groups"))
_COMMON_STEP_AT: Tuple[Path, ...] = (("state", "common_step"), ("optimizer", "state", "common_step"))


def _lookup(x: Any, path: Path) -> Tuple[bool, Any]:
    for k in path:
        if not isinstance(x, dict) or k not in x:
            return False, None
        x = x[k]
    return True, x


def _group_identity(group: Dict[str, Any], keys: Sequence[str]) -> Tuple[Any, ...]:
    """Megatron's identity of a param group (``pre_`` keys: NeMo's names, as megatron-core reads them)."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)


def _match_param_groups(current: List[Any], saved: List[Dict[str, Any]], where: str) -> List[Any]:
    """This run's param groups with the values of the checkpoint's matching groups.

    A group is matched by megatron-core's ``param_group_identifier_keys``; when expert
    parallelism appears or disappears, an expert group (``is_expert_parallel``, its own
    optimizer with EP>1) takes the values of the group that held the experts before
    (the same keys but ``is_expert_parallel``), and keeps its own flag and ``params``.
    """
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as keys

    loose = [k for k in keys if k != "is_expert_parallel"]
    out: List[Any] = []
    for group in current:
        if not isinstance(group, dict):
            raise StateDictError(f"{where}: param group {group!r:.100} of this run is not a dict")
        exact = [g for g in saved if _group_identity(g, keys) == _group_identity(group, keys)]
        near = exact or [g for g in saved if _group_identity(g, loose) == _group_identity(group, loose)]
        if not near:
            raise StateDictError(
                f"{where}: no param group of the checkpoint matches this run's group "
                f"{dict(zip(keys, _group_identity(group, keys)))} (checkpoint: "
                f"{[dict(zip(keys, _group_identity(g, keys))) for g in saved]}); load with --no-load-optim")
        merged = {k: v for k, v in near[0].items() if k != "params"}
        merged["is_expert_parallel"] = group.get("is_expert_parallel", merged.get("is_expert_parallel"))
        if "params" in group:
            merged["params"] = group["params"]
        out.append(merged)
    return out


def _fill_sub_state(current: Dict[str, Any], saved: List[Dict[str, Any]], where: str) -> None:
    """Give one sub-optimizer's state, built from this run, the checkpoint's param groups,
    step and grad scaler (its tensors were loaded by global key already)."""
    for path in _PARAM_GROUPS_AT:
        found, groups = _lookup(current, path)
        if found and isinstance(groups, list):
            pool = [g for s in saved for g in (_lookup(s, path)[1] or []) if isinstance(g, dict)]
            set_path(current, path, _match_param_groups(groups, pool, where))
    for path in _COMMON_STEP_AT:
        found, parent = _lookup(current, path[:-1])
        if not (found and isinstance(parent, dict)):
            continue
        steps = [v for ok, v in (_lookup(s, path) for s in saved) if ok]
        values = {float(v) for v in steps}
        if len(values) > 1:
            raise StateDictError(f"{where}: the checkpoint's optimizers are at different steps {sorted(values)}; "
                                 "megatron-core keeps one step for all of them")
        if steps:
            parent[path[-1]] = steps[0].clone() if isinstance(steps[0], torch.Tensor) else steps[0]
    if "grad_scaler" in current:
        scalers = [s["grad_scaler"] for s in saved if s.get("grad_scaler") is not None]
        if scalers:
            current["grad_scaler"] = scalers[0]


def regroup_optimizer_state(optimizer: Any, state: Any) -> Any:
    """The loaded optimizer state in this run's chain of optimizers, when the checkpoint's differs.

    megatron-core gives the expert-parallel parameters an optimizer of their own only
    when EP>1 (``ChainedOptimizer``): its state dict is the one optimizer's with EP=1,
    ``{0: dense, 1: experts}`` with EP>1. Every tensor of it is keyed by its parameter's
    global key and reshards as it is; what the load returns for this run's structure
    lacks the rest, which the checkpoint's structure holds (``megashard.load`` returns
    what this rank saved beside the template's keys): param groups (matched as
    megatron-core matches them, see :func:`_match_param_groups`), the step shared by the
    parameters and the grad scaler. Those are filled in here; with the same structure on
    both sides ``state`` is returned as it is.
    """
    n = len(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if not isinstance(state, dict):
        return state
    ints = sorted(k for k in state if isinstance(k, int))
    named = {k: v for k, v in state.items() if not isinstance(k, int)}
    if n == 1 and ints:
        current, saved, layout = [named], [state[k] for k in ints], f"{len(ints)} chained optimizers"
    elif n > 1 and named and ints == list(range(n)):
        current, saved, layout = [state[k] for k in ints], [named], "one optimizer"
    elif n > 1 and ints != list(range(n)):
        raise StateDictError(f"the checkpoint's optimizer state holds optimizers {ints}, this run chains {n}: "
                             "megashard reshards only between one optimizer and a chain; load with --no-load-optim")
    else:
        return state
    get_logger(__name__).info("optimizer state saved by %s, loaded into %s: param groups and step matched",
                              layout, f"{n} chained optimizers" if n > 1 else "one optimizer")
    for i, sub in enumerate(current):
        if not isinstance(sub, dict) or not all(isinstance(s, dict) for s in saved):
            raise StateDictError(f"optimizer state of optimizer {i}: not a dict in the checkpoint or this run")
        _fill_sub_state(sub, saved, f"optimizer {i} of {n}")
    return named if n == 1 else {k: state[k] for k in ints}


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict`` under no_grad; DistributedOptimizer param state loaded here.

    A checkpoint saved by another chain of optimizers (EP=1 <-> EP>1) is regrouped first
    (:func:`regroup_optimizer_state`). no_grad: the DistributedOptimizer's fp32 main params
    are views of the model params when the model is fp32, and copying into them outside
    no_grad fails ("a view of a leaf Variable that requires grad is being used in an
    in-place operation").
    """
    state = regroup_optimizer_state(optimizer, state)
    opts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if isinstance(state, dict) and "param_state_sharding_type" in state:
        pairs = [(opts[0], state)]
    elif isinstance(state, dict) and all(isinstance(k, int) for k in state) and len(state) == len(opts):
        pairs = [(o, state[k]) for o, k in zip(opts, sorted(state))]
    else:
        pairs = []
    deferred = []
    for opt, sub in pairs:
        if _is_fs_model_space(sub) and "param_state" in sub:
            deferred.append((opt, _load_fs_model_space, sub.pop("param_state")))
        elif isinstance(sub, dict) and sub.get("param_state_sharding_type") in _OTHER_LOADERS and "param_state" in sub:
            deferred.append((opt, _OTHER_LOADERS[sub["param_state_sharding_type"]], sub.pop("param_state")))
    with torch.no_grad():
        optimizer.load_state_dict(state)
        for opt, load, param_state in deferred:
            load(opt, param_state)
        _unshare_step_tensors(opts)


def _set_states(opt: Any, model_param: Any, entry: Dict[str, Any]) -> None:
    """Set one parameter's main param and optimizer states from a loaded entry. Keys the entry
    lacks (``step``: restored from the param groups) keep their current value: megatron-core's
    loaders copy every key of the live state (with torch's Adam: KeyError 'step', or on 0.16
    a copy from the rank-local ``step`` put back after the load)."""
    src = {("param" if k == "fp32_param" else k): v for k, v in entry.items()
           if k not in ("step", "padding") and isinstance(v, torch.Tensor)}
    current = opt._get_main_param_and_optimizer_states(model_param)
    opt._set_main_param_and_optimizer_states(model_param, {k: src.get(k, current[k]) for k in current})


def _load_dp_reshardable(opt: Any, param_state: Any) -> None:
    """megatron-core's ``load_parameter_state_from_dp_reshardable`` (a converted torch_dist
    checkpoint's default) with :func:`_set_states`. Its buckets must have this run's sizes (the
    same model, TP, PP and DDP bucketing): else a CheckpointError that says what to do."""
    if not isinstance(param_state, dict):
        raise StateDictError("dp_reshardable DistributedOptimizer state without its buckets (param_state)")
    saved = param_state.get("per_bucket_numel_unpadded")
    mine = getattr(opt, "per_bucket_numel_unpadded", None)
    if saved is not None and mine is not None and saved != mine:
        raise CheckpointError(
            f"the checkpoint's dp_reshardable DistributedOptimizer state has buckets of {saved} elements, "
            f"this run's optimizer {mine}: it loads only into the model, TP, PP and bucket sizes that saved "
            "it; save the torch_dist checkpoint with Megatron's --dist-ckpt-optim-fully-reshardable and "
            "convert that, or resume with --no-load-optim")
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for dtype, per_dtype in gbuf_range_maps.items():
            for bucket_idx, gbuf_range_map in enumerate(per_dtype):
                entries = [e for e in param_state[gbuf_idx][dtype][bucket_idx] if not e.get("padding")]
                if len(entries) != len(gbuf_range_map["param_map"]):
                    raise CheckpointError(
                        f"dp_reshardable bucket {gbuf_idx}/{bucket_idx}: {len(entries)} parameters in the "
                        f"checkpoint, {len(gbuf_range_map['param_map'])} in this run; resume with --no-load-optim")
                for entry, model_param in zip(entries, gbuf_range_map["param_map"]):
                    _set_states(opt, model_param, entry)


#: DistributedOptimizer param-state loaders of the torch_dist shardings (see DISTRIB_OPTIM_LOADABLE)
_OTHER_LOADERS = {"fully_reshardable": _load_fully_reshardable, "dp_reshardable": _load_dp_reshardable}


def _unshare_step_tensors(opts: Sequence[Any]) -> None:
    """Give every parameter its own torch-Adam ``step`` tensor again.

    ``DistributedOptimizer.load_state_dict`` (torch Adam, no Apex/TE) puts *one* step
    tensor into every parameter's state, and torch's ``Optimizer.load_state_dict`` keeps
    it shared; single-tensor Adam then does ``step += 1`` once per parameter, so the
    bias correction after a resume is wrong. Megatron's own torch_dist loads have the
    same problem on CPU; with Apex/TE (the GPU default) the step lives in param_groups.
    """
    for opt in opts:
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(inner, "state"):
            continue
        seen: set = set()
        for s in inner.state.values():
            step = s.get("step") if isinstance(s, dict) else None
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    s["step"] = step.clone()
                seen.add(id(s["step"]))

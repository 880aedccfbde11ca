"""megashard's own description of one shard of a global tensor.

Same meaning as megatron-core's ``ShardedTensor`` (``dist_checkpointing/mapping.py``) so
that Megatron state dicts can be consumed by duck typing, without importing
megatron-core. ``from_any`` converts a megatron-core object.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

ReplicaId = Union[int, Tuple[int, ...]]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica is ``0`` or an all-zero tuple (Megatron's rule)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedTensor:
    """A local piece of a global tensor.

    ``data`` has shape ``global_shape[prepend_axis_num:]``-ranked local shape; the
    shard covers ``global_offset[i] : global_offset[i] + chunk_shape[i]`` of the
    global tensor, where ``chunk_shape = (1,) * prepend_axis_num + data.shape``.
    With ``flattened_range`` set, ``data`` is 1-D and holds only elements
    ``[start, stop)`` of that chunk in C order (Megatron's distributed optimizer).
    """

    key: str
    data: Optional[torch.Tensor]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    local_shape: Optional[Tuple[int, ...]] = None
    dtype: Optional[torch.dtype] = None
    flattened_range: Optional[slice] = None
    allow_shape_mismatch: bool = False

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.local_shape is None:
            if self.data is None:
                raise ValueError(f"ShardedTensor {self.key!r}: need data or local_shape")
            if self.flattened_range is not None:
                raise ValueError(f"ShardedTensor {self.key!r}: flattened shards need local_shape")
            self.local_shape = tuple(self.data.shape)
        self.local_shape = tuple(int(s) for s in self.local_shape)
        if self.dtype is None:
            if self.data is None:
                raise ValueError(f"ShardedTensor {self.key!r}: need data or dtype")
            self.dtype = self.data.dtype
        if len(self.global_offset) != len(self.global_shape):
            raise ValueError(
                f"ShardedTensor {self.key!r}: global_offset {self.global_offset} and "
                f"global_shape {self.global_shape} differ in rank"
            )
        if self.prepend_axis_num + len(self.local_shape) != len(self.global_shape):
            raise ValueError(
                f"ShardedTensor {self.key!r}: prepend_axis_num={self.prepend_axis_num} + "
                f"local_shape {self.local_shape} does not match global_shape {self.global_shape}"
            )

    @property
    def chunk_shape(self) -> Tuple[int, ...]:
        """Shape of the rectangular region of the global tensor this shard lies in."""
        return (1,) * self.prepend_axis_num + tuple(self.local_shape)

    @property
    def flat_range(self) -> Optional[Tuple[int, int]]:
        if self.flattened_range is None:
            return None
        return (int(self.flattened_range.start), int(self.flattened_range.stop))

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
    ) -> "ShardedTensor":
        """Like Megatron's: each ``(axis, rank_on_axis, fragments)`` splits ``axis`` evenly."""
        ndim = prepend_axis_num + data.dim()
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        for axis, rank, frags in rank_offsets:
            if axis < prepend_axis_num:
                global_shape[axis] = frags
                global_offset[axis] = rank
            else:
                global_shape[axis] = data.shape[axis - prepend_axis_num] * frags
                global_offset[axis] = data.shape[axis - prepend_axis_num] * rank
        return cls(key, data, tuple(global_shape), tuple(global_offset), replica_id, prepend_axis_num)

    @classmethod
    def from_any(cls, obj: Any) -> "ShardedTensor":
        """Convert megatron-core's ShardedTensor (or anything with the same fields)."""
        if isinstance(obj, cls):
            return obj
        return cls(
            key=obj.key,
            data=obj.data,
            global_shape=tuple(obj.global_shape),
            global_offset=tuple(obj.global_offset),
            replica_id=obj.replica_id,
            prepend_axis_num=getattr(obj, "prepend_axis_num", 0),
            local_shape=tuple(getattr(obj, "local_shape", None) or obj.data.shape),
            dtype=getattr(obj, "dtype", None) or obj.data.dtype,
            flattened_range=getattr(obj, "flattened_range", None),
            allow_shape_mismatch=bool(getattr(obj, "allow_shape_mismatch", False)),
        )


def check_data(sh: ShardedTensor, path: str, what: str = "save") -> None:
    """Refuse a shard whose data is not what it declares: the dtype decides how many bytes
    an element has in the file and in the index, so a mismatch would write (or read) bytes
    of one dtype under the other's name. ``what``: ``"save"`` also checks the element count."""
    from .errors import StateDictError

    if sh.data is None:
        return
    if sh.data.dtype != sh.dtype:
        raise StateDictError(
            f"cannot {what} {path!r}: ShardedTensor {sh.key!r} declares dtype {sh.dtype} but its data is "
            f"{sh.data.dtype}; make the data match the declared dtype (or declare {sh.data.dtype})")
    if what == "save":
        fr = sh.flat_range
        n = (fr[1] - fr[0]) if fr is not None else math.prod(sh.local_shape)
        if sh.data.numel() != n:
            raise StateDictError(
                f"cannot save {path!r}: ShardedTensor {sh.key!r} declares {n} elements "
                f"({'flattened range ' + str(list(fr)) if fr is not None else 'local shape ' + str(sh.local_shape)}) "
                f"but its data has {sh.data.numel()}")


def looks_like_sharded_tensor(obj: Any) -> bool:
    """True for megashard's and megatron-core's ShardedTensor (duck typed)."""
    if isinstance(obj, ShardedTensor):
        return True
    return type(obj).__name__ == "ShardedTensor" and all(
        hasattr(obj, a) for a in ("key", "data", "global_shape", "global_offset", "replica_id")
    )


@dataclass
class ShardedObject:
    """A non-tensor value with a place in a global grid: megatron-core's ``ShardedObject``
    fields, without megatron-core (saved and loaded like megatron-core's own)."""

    key: str
    data: Any
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: Any = 0

    @property
    def unique_key(self) -> str:
        return _grid_key(self)


def looks_like_sharded_object(obj: Any) -> bool:
    """megatron-core's ShardedObject: a non-tensor value with a key, global shape/offset."""
    return type(obj).__name__ == "ShardedObject" and all(
        hasattr(obj, a) for a in ("key", "data", "global_shape", "global_offset", "replica_id")
    )


def object_unique_key(obj: Any) -> str:
    """The identity of a ShardedObject across ranks (megatron-core's ``unique_key``)."""
    uk = getattr(obj, "unique_key", None)
    return uk if isinstance(uk, str) else _grid_key(obj)


def _grid_key(obj: Any) -> str:
    return f"{obj.key}/shard_{'.'.join(map(str, obj.global_offset))}_{'.'.join(map(str, obj.global_shape))}"


def reject_unapplied(path: str, value: Any) -> None:
    """Factories and non-persistent objects must be resolved before save/load see them."""
    name = type(value).__name__
    if name in ("ShardedTensorFactory", "LocalNonpersistentObject"):
        from .errors import StateDictError

        raise StateDictError(
            f"{path!r}: {name} must be resolved before megashard.save/load "
            "(apply megatron-core's apply_factories / drop non-persistent objects; megashard.megatron does this)"
        )


def sharded_state_dict(obj: Any, split: Optional[Mapping[str, int]] = None, *, rank: int = 0, world: int = 1,
                       replica_id: ReplicaId = 0, prefix: str = "") -> Dict[str, Any]:
    """What :func:`megashard.save` takes and :func:`megashard.load` fills, built from a model
    (anything with ``state_dict()``, e.g. an ``nn.Module``) or a nested dict of tensors, so
    that nobody writes :class:`ShardedTensor` templates by hand (DCP's ``get_state_dict``).

    Every tensor becomes a ShardedTensor keyed by its dotted path (``prefix`` first) that
    shares the tensor's memory: a load fills the model in place. ``split`` maps a key without
    ``prefix`` (or an ``fnmatch`` pattern such as ``"*.fc1.weight"``) to the axis along which this rank holds
    part ``rank`` of ``world`` equal parts (tensor parallelism: the global shape is the local
    one times ``world`` on that axis); every other tensor is whole, the same on every rank
    that holds it, ``replica_id`` telling copies apart (``0`` on the one that saves it, e.g.
    the data-parallel rank). Other values (numbers, strings, ...) are kept as they are.
    Load at another layout by building the template with that layout's ``split``/``rank``/
    ``world``: ``examples/plain_api.py``.
    """
    from fnmatch import fnmatchcase

    split = dict(split or {})
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"sharded_state_dict: rank {rank} is not in 0..world-1 (world={world})")
    state = obj.state_dict() if hasattr(obj, "state_dict") and callable(obj.state_dict) else obj
    if not isinstance(state, Mapping):
        raise TypeError(f"sharded_state_dict: expected a model or a mapping, got {type(obj).__name__}")
    used: set = set()

    def axis_of(key: str) -> Optional[int]:
        for pat, ax in split.items():
            if pat == key or fnmatchcase(key, pat):
                used.add(pat)
                return ax
        return None

    def build(value: Any, rel: str) -> Any:
        if isinstance(value, Mapping):
            return {k: build(v, f"{rel}.{k}") for k, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        key = prefix + rel
        ax = axis_of(rel)
        if ax is None:
            return ShardedTensor(key, value, tuple(value.shape), (0,) * value.dim(), replica_id=replica_id)
        if not -value.dim() <= ax < value.dim():
            raise ValueError(f"sharded_state_dict: {key!r} has {value.dim()} dimensions; cannot split axis {ax}")
        return ShardedTensor.from_rank_offsets(key, value, (ax % value.dim(), rank, world), replica_id=replica_id)

    out = {k: build(v, str(k)) for k, v in state.items()}
    unused = sorted(set(split) - used)
    if unused:
        raise ValueError(f"sharded_state_dict: split names {unused} but no tensor has such a key "
                         f"(keys look like {sorted(out)[:3]})")
    return out

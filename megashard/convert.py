"""``megashard convert``: torch_dist <-> megashard, and megashard -> one file of global tensors.

One process, no torchrun. Directions:

* ``torch_dist`` (megatron-core ``dist_checkpointing``) -> ``megashard``: read with
  megatron-core's own loader in a world of one (gloo), in batches, into a
  memory-mapped scratch file, then saved by :func:`megashard.save`.
* ``megashard`` -> ``torch_dist``: every global tensor as one unsharded
  ``ShardedTensor`` (megatron-core reshards on load, so any layout loads it), backed
  by a private mapping of the source shard file (no copy) or, for tensors saved in
  several shards, assembled in a scratch mapping; written by megatron-core's
  ``dist_checkpointing.save``.
* ``megashard`` -> ``tensors`` / ``safetensors``: one file of full global tensors keyed
  by global key, streamed tensor by tensor (memory: two read batches, the next read
  while the current one is written).
* ``megashard`` -> ``hf`` (a Llama-family model): a Hugging Face directory, streamed
  layer by layer (:mod:`megashard.hf.export`); ``hf_tensors=True`` writes the same
  HF-named tensors as one ``model.tensors`` file. A Hugging Face directory -> ``megashard``
  imports it (:mod:`megashard.hf.importer`) as a Megatron save root (``release``).

Memory: anonymous memory stays at the largest tensor plus two read batches; the
torch_dist directions go through file mappings (page cache), never a second copy of
the model. A Megatron-LM save directory (``iter_XXXXXXX`` subdirectories plus
``latest_checkpointed_iteration.txt``) is accepted as SRC: the tracker's iteration
(or ``iteration=``) is converted and, for directory targets, DST gets Megatron's
layout and tracker too.

Object stores (``s3://``): SRC may be a megashard checkpoint or a Megatron save root (its
tracker object) at a URL, for every target; it is read through the read seam (ranged GETs,
pinned to the index's ETags), and shards that a local export would map are read into the
scratch file instead. DST may be a URL only for ``--to megashard`` (torch_dist, or a Hugging
Face import): :func:`megashard.save` writes it with the object store's commit protocol (the
tracker after the commit) and nothing is written beside it; scratch is a private local
temporary directory. A DST URL under which any object exists is refused. torch_dist and
Hugging Face sources, and file targets, are local only. DST is written new only
(``save(new_only=True)``, a rename that refuses to replace, a tracker PUT with
``If-None-Match``): what another writer creates there meanwhile is never replaced.

torch_dist checkpoints are pickle-based and megatron-core's loader unpickles them:
convert only torch_dist checkpoints you trust. Nothing megashard writes is pickled.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import logging
import mmap
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import saveroot, storage
from .errors import CheckpointError, CommitConflictError, MegashardError
from .consolidated import DEFAULT_BATCH_BYTES
from .manifest import Manifest, itemsize
from .plan import numel

log = logging.getLogger(__name__)

FORMATS = ("megashard", "torch_dist", "tensors", "safetensors", "hf")
SINGLE_FILE = ("tensors", "safetensors")
MODEL_ENTRY = "model"  # where converted model tensors go in a megashard state tree (file stem "model")
OPTIMIZER_ENTRY = "optimizer_tensors"
OBJECTS_ENTRY = "sharded_objects"
TORCH_DIST_ENTRY = "megashard_global_tensors"  # where global tensors go in a torch_dist state dict


class ConvertInputError(CheckpointError):
    """SRC is not a checkpoint, the format is unknown, or DST exists: nothing was written."""


@dataclass
class ConvertResult:
    src: str  # the checkpoint directory actually read
    dst: str  # what was written (file or directory)
    source_format: str
    target_format: str
    iteration: Optional[int | str]
    tensors: int = 0
    bytes: int = 0  # tensor bytes converted
    seconds: float = 0.0
    dropped: List[str] = field(default_factory=list)  # what the target cannot hold

    def summary(self) -> str:
        gbs = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        it = f", iteration {self.iteration}" if self.iteration is not None else ""
        line = (f"converted {self.src} ({self.source_format}) -> {self.dst} ({self.target_format}){it}: "
                f"{self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.2f} s ({gbs:.2f} GB/s)")
        if self.dropped:
            line += f"; not converted: {'; '.join(self.dropped)}"
        return line


# ---------------------------------------------------------------------------
# what is SRC


def detect_format(path: str) -> Optional[str]:
    """``"megashard"``, ``"torch_dist"`` or None for a checkpoint directory."""
    if storage.locate(path) is not None:  # also an interrupted re-save's complete copy
        return "megashard"
    return "torch_dist" if storage.foreign_format(path) == "torch_dist" else None


def resolve_source(src: str, iteration: Optional[int | str] = None) -> Tuple[str, str, Optional[int | str], bool]:
    """(checkpoint dir, format, iteration, is a Megatron save root) for SRC."""
    if storage.is_url(src):
        return _resolve_url_source(src, iteration)
    src = os.path.abspath(src)
    fmt = detect_format(src)
    if fmt is None and not os.path.isdir(src):
        raise ConvertInputError(f"{src} is not a checkpoint directory; SRC must be a megashard or torch_dist "
                                "checkpoint directory, or a Megatron save directory (iter_XXXXXXX subdirectories)")
    if fmt is not None:
        if iteration is not None:
            raise ConvertInputError(f"{src} is a single checkpoint; --iteration applies to a Megatron save directory")
        return src, fmt, saveroot.parse_iteration_dir_name(os.path.basename(src)), False
    tracked = storage.read_tracker(src)
    it = iteration if iteration is not None else tracked
    if it is None:
        iters = sorted(n for n in os.listdir(src) if saveroot.parse_iteration_dir_name(n) is not None)
        if iters:
            raise ConvertInputError(f"{src}: no {saveroot.TRACKER_NAME}; pass --iteration N (found {', '.join(iters[:5])})")
        raise ConvertInputError(f"{src} is not a checkpoint: no {storage.MANIFEST_NAME} (megashard), no "
                                f"metadata.json (torch_dist), no iter_XXXXXXX subdirectories")
    ckpt = os.path.join(src, saveroot.iteration_dir_name(it))
    fmt = detect_format(ckpt)
    if fmt is None:
        raise ConvertInputError(f"{ckpt}: iteration {it} is not a megashard or torch_dist checkpoint")
    return ckpt, fmt, it, True


def _resolve_url_source(src: str, iteration: Optional[int | str]) -> Tuple[str, str, Optional[int | str], bool]:
    """SRC at an object-store URL: a megashard checkpoint (its head), or a Megatron save root whose
    tracker (or ``iteration``) names one. Only megashard checkpoints are read from a URL."""
    src = storage.location(src)  # checked; no trailing slash
    if storage.locate(src) is not None:
        if iteration is not None:
            raise ConvertInputError(f"{src} is a single checkpoint; --iteration applies to a Megatron save directory")
        return src, "megashard", saveroot.parse_iteration_dir_name(src.rsplit("/", 1)[-1]), False
    it = iteration if iteration is not None else storage.read_tracker(src)
    if it is None:
        raise ConvertInputError(
            f"{src} is not a megashard checkpoint ({storage.why_not_checkpoint(src)}) and holds no "
            f"{saveroot.TRACKER_NAME}; for a Megatron save root pass --iteration N{_torch_dist_hint(src)}")
    ckpt = storage.child(src, saveroot.iteration_dir_name(it))
    if storage.locate(ckpt) is None:
        raise ConvertInputError(f"{ckpt}: iteration {it} is not a megashard checkpoint "
                                f"({storage.why_not_checkpoint(ckpt)}){_torch_dist_hint(ckpt)}")
    return ckpt, "megashard", it, True


def _torch_dist_hint(url: str) -> str:
    """What to do when ``url`` holds a torch_dist checkpoint (one HEAD, on the error path only)."""
    if storage.foreign_format(url) == "torch_dist":
        return ("; it looks like a torch_dist checkpoint, which convert reads from a local directory only "
                "(megatron-core's loader): copy it to a local path first")
    return ""


# ---------------------------------------------------------------------------
# helpers


def _progress(total: int, desc: str, enabled: Optional[bool]) -> Any:
    """A tqdm bar on a TTY (or when forced), else a no-op with the same interface."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if enabled:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False)

    class _Quiet:
        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    return _Quiet()


class _Scratch:
    """A sparse scratch file whose pages back tensors (file-backed, not anonymous memory)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "scratch.bin")
        self.size = 0
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        n = numel(shape) * itemsize(dtype)
        if n == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        off = self.size
        self.size += (n + 4095) // 4096 * 4096
        os.ftruncate(self.fd, self.size)
        arr = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=off, shape=(n,))
        return torch.from_numpy(arr).view(dtype).view(tuple(shape))

    def close(self) -> None:
        os.close(self.fd)


def _mapped_shard(files: "storage.CheckpointFiles", file: str, size: int, data_offset: int, nbytes: int,
                  dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A saved shard as a tensor over a private (copy-on-write) mapping of just its bytes: no copy.

    The tensor's storage is exactly the shard, so megatron-core's save writes it without
    cloning (it clones views of larger storages). The file is opened by the checkpoint's
    safe opener (inside the directory, no symlink, the manifest's size).
    """
    fd = files.open(file, size)
    start = data_offset - data_offset % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, data_offset + nbytes - start, flags=mmap.MAP_PRIVATE,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=data_offset - start)
    return t.view(dtype).view(tuple(shape))


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """A gloo process group of one for megatron-core (none is created if one exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConvertInputError("convert runs in one process; call it outside a multi-rank job")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="megashard-convert-") as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=30))
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def _megatron_core() -> Iterator[Any]:
    """megatron-core's dist_checkpointing, with the two CUDA calls its sync save makes stubbed on CPU."""
    try:
        from megatron.core import dist_checkpointing as dc
    except ImportError as e:
        raise ConvertInputError(f"torch_dist conversion needs megatron-core (pip install 'megashard[megatron]'): {e}")
    patched = {}
    if not torch.cuda.is_available():
        # filesystem_async.preload_tensors calls torch.cuda.synchronize(); state_dict_saver puts
        # its failure flag on torch.cuda.current_device(). Both only need to be harmless on CPU.
        patched = {"synchronize": torch.cuda.synchronize, "current_device": torch.cuda.current_device}
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        with _world_of_one():
            yield dc
    finally:
        for name, fn in patched.items():
            setattr(torch.cuda, name, fn)


class _Output:
    """Where DST goes: everything is written beside it, in a temp dir named and owned as a save's
    (``storage.make_temp_dir``), and renamed into place at the end.

    For a Megatron save root, DST becomes ``DST/iter_XXXXXXX`` plus the tracker.
    """

    def __init__(self, dst: str, megatron_root: bool, iteration: Optional[int | str], single_file: bool) -> None:
        self.final = os.path.abspath(dst)
        self.token = secrets.token_hex(6)
        # with a save's owner record, so a clean-up tells a killed conversion's leftovers from a running one's
        self.tmp = storage.make_temp_dir(self.final, self.token)
        self.single_file = single_file
        self.megatron_root = megatron_root and not single_file
        self.iteration = iteration

    @property
    def target(self) -> str:
        """Path of the checkpoint directory (or file) to write, inside the temporary directory."""
        if self.single_file:
            return os.path.join(self.tmp, os.path.basename(self.final))
        if self.megatron_root:
            return os.path.join(self.tmp, saveroot.iteration_dir_name(self.iteration))
        return os.path.join(self.tmp, "checkpoint")

    def scratch_dir(self) -> str:
        d = os.path.join(self.tmp, "scratch")
        os.makedirs(d, exist_ok=True)
        return d

    def commit(self) -> None:
        shutil.rmtree(os.path.join(self.tmp, "scratch"), ignore_errors=True)
        if self.megatron_root:
            storage.write_tracker(self.tmp, self.iteration)
            src = self.tmp
        else:
            src = self.target
        try:  # never replaces what another writer created meanwhile (not even an empty directory)
            storage.rename_new_only(src, self.final)
        except FileExistsError:
            raise ConvertInputError(f"{self.final} appeared while converting; left it untouched") from None
        if self.megatron_root:  # kept up to the rename, as a save's: a killed conversion's names its owner
            with contextlib.suppress(OSError):  # committed all the same
                os.unlink(os.path.join(self.final, storage.OWNER_NAME))
        storage.fsync_path(os.path.dirname(self.final))
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class _ObjectOutput:
    """DST at an object-store URL (``--to megashard`` only): :func:`megashard.save` writes and commits
    it (the object store's commit protocol), so nothing is written beside it; for a Megatron save root
    the tracker is written after the checkpoint's commit. Scratch (tensors read from torch_dist or
    Hugging Face) lives in a private local temporary directory, removed at the end."""

    def __init__(self, dst: str, megatron_root: bool, iteration: Optional[int | str]) -> None:
        self.final = dst
        self.megatron_root = megatron_root
        self.iteration = iteration
        self._scratch: Optional[str] = None

    @property
    def target(self) -> str:
        return storage.child(self.final, saveroot.iteration_dir_name(self.iteration)) if self.megatron_root else self.final

    def scratch_dir(self) -> str:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="megashard-convert-")
        return self._scratch

    def commit(self) -> None:
        self.cleanup()
        if self.megatron_root:  # only where no tracker is: never one another writer wrote meanwhile
            try:
                storage.write_tracker(self.final, self.iteration, new_only=True)
            except CommitConflictError:
                raise ConvertInputError(f"{self.final}: a tracker appeared there while converting (another "
                                        f"writer); left it untouched ({self.target} was written)") from None

    def cleanup(self) -> None:
        """A failed save already removed what it wrote (its own save prefix)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def _output(dst: str, megatron_root: bool, iteration: Optional[int | str], single_file: bool) -> Any:
    if storage.is_url(dst):
        return _ObjectOutput(dst, megatron_root and not single_file, iteration)
    return _Output(dst, megatron_root, iteration, single_file)


def _save_new(state: Dict[str, Any], out: Any, source: str) -> None:
    """:func:`megashard.save` into DST, never replacing a checkpoint another writer created there
    meanwhile (``new_only``)."""
    import megashard

    try:
        megashard.save(state, out.target, layout={"converted_from": source}, new_only=True)
    except CommitConflictError:
        raise ConvertInputError(f"{out.final} appeared while converting (another writer saved "
                                f"{out.target}); left it untouched") from None


def _match(keys: Sequence[str], patterns: Optional[Sequence[str]]) -> List[str]:
    """--keys: a pattern that matches nothing is a usage error (exit 2), not a damaged checkpoint."""
    from .consolidated import match_keys

    try:
        return match_keys(keys, patterns)
    except CheckpointError as e:
        raise ConvertInputError(str(e)) from None


# ---------------------------------------------------------------------------
# megashard -> one file


def _single_file_specs(m: Manifest, keys: Sequence[str], fmt: str) -> Tuple[List[str], List[str]]:
    """(keys to write, keys that the format cannot hold)."""
    from .format.dtypes import encode_dtype

    ok, skipped = [], []
    for k in keys:
        t = m.tensors[k]
        if fmt == "tensors" and numel(t.global_shape) == 0 and encode_dtype(t.dtype).opaque:
            skipped.append(k)  # tensorizer cannot read zero-element bf16/fp8 tensors
        else:
            ok.append(k)
    return ok, skipped


def _to_single_file(src: str, out: _Output, fmt: str, patterns: Optional[Sequence[str]], batch_bytes: int,
                    bar: Callable[[int], Any], res: ConvertResult) -> None:
    from .storage import read_manifest
    from .storage import checkpoint_location
    from .consolidated import iter_global_tensors
    from .format.stream import StreamWriter
    from .hf.safetensors import SafetensorsWriter

    src = checkpoint_location(src)
    m = read_manifest(src)
    keys, skipped = _single_file_specs(m, _match(list(m.tensors), patterns), fmt)
    if not keys:
        raise ConvertInputError(f"{src}: no global tensors to export")
    specs = [(k, m.tensors[k].dtype, tuple(m.tensors[k].global_shape)) for k in keys]
    total = sum(numel(s) * itemsize(d) for _, d, s in specs)
    if fmt == "tensors":
        writer: Any = StreamWriter(out.target, specs)
    else:
        it = res.iteration
        writer = SafetensorsWriter(out.target, specs, {"format": "pt", **({"iteration": str(it)} if it is not None else {})},
                                   error=ConvertInputError)
    pbar = bar(total)
    try:
        for k, t in iter_global_tensors(src, m, keys, batch_bytes=batch_bytes):
            writer.write(k, t)
            n = t.numel() * t.element_size()
            del t
            res.bytes += n
            res.tensors += 1
            pbar.update(n)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        pbar.close()
    res.dropped.append("args, iteration, RNG and non-tensor optimizer state (param groups, step), rank-local "
                       "tensors (single-file exports hold global tensors only)")
    if skipped:
        res.dropped.append(f"zero-element tensors tensorizer cannot read: {', '.join(skipped)}")


# ---------------------------------------------------------------------------
# megashard -> torch_dist


def _rank0_state(src: str, m: Manifest) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Rank 0's non-sharded state (args, iteration, its local tensors) and every sharded object's value."""
    from .loading import _decode_saved_tree, _finalize_tree, _LoadWork
    from .readers import read_own

    work = _LoadWork(base=src)
    tree = _decode_saved_tree(m.tree_for_rank(0), m, work)
    objects = {u: _decode_saved_tree(e.get("value"), m, work, u) for u, e in m.objects.items()}
    read_own(src, m, work.ops, work.view_ops, work.row_jobs, None)
    for f in work.finish:
        f()
    common = _finalize_tree(tree)
    if not isinstance(common, dict):
        raise CheckpointError(f"{src}: saved state is not a dict")
    return common, {u: _finalize_tree(v) for u, v in objects.items()}


def _without_sharded(tree: Any) -> Any:
    """Rank 0's saved tree without the markers where sharded entries were (their tensors and
    objects go in by global key), and without the dicts and lists that held only such markers.

    megatron-core merges a torch_dist checkpoint's common state with what it loads: a marker
    (or a list of the two halves of a SwiGLU weight's markers) where it loads a tensor is a
    conflict ("Duplicate non-dict and non-list values"), so Megatron-LM could not resume."""
    from .loading import _SHARDED

    def only_markers(v: Any) -> bool:
        if v is _SHARDED:
            return True
        kids = list(v.values()) if isinstance(v, dict) else v if isinstance(v, list) else None
        return bool(kids) and all(only_markers(x) for x in kids)

    if isinstance(tree, dict):
        return {k: _without_sharded(v) for k, v in tree.items() if not only_markers(v)}
    if isinstance(tree, list):
        return [_without_sharded(v) for v in tree]
    if isinstance(tree, argparse.Namespace):  # Megatron's args
        return argparse.Namespace(**{k: _without_sharded(v) for k, v in vars(tree).items()})
    return _picklable(tree)


def _picklable(value: Any) -> Any:
    """A placeholder of :mod:`megashard.jsonstate` as a value torch_dist's common state may hold.

    megatron-core 0.16 reads that state with ``torch.load(weights_only=True)``, which refuses
    megashard's placeholder classes (an unregistered enum in ``args`` or the rerun state):
    an enum member whose class is already imported becomes that member (nothing is imported
    for it), any other placeholder its stored text."""
    from . import jsonstate

    if isinstance(value, jsonstate.UnregisteredEnum):
        tag = value.tag
        cls = sys.modules.get(str(tag.get("module")))
        for part in str(tag.get("qualname", "")).split("."):
            cls = getattr(cls, part, None) if cls is not None else None
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and str(tag.get("name")) in cls.__members__:
            return cls[str(tag["name"])]
        return str(tag.get("name"))
    if isinstance(value, jsonstate.Unrepresentable):
        return value.repr
    return value


def _megashard_to_torch_dist(src: str, out: _Output, patterns: Optional[Sequence[str]],
                             bar: Callable[[int], Any], res: ConvertResult) -> None:
    from .storage import read_manifest
    from .storage import checkpoint_location
    from .consolidated import read_global_tensors

    src = checkpoint_location(src)
    m = read_manifest(src)
    keys = _match(list(m.tensors), patterns)
    common, objects = _rank0_state(src, m)
    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        scratch = _Scratch(out.scratch_dir())
        try:
            stack = contextlib.ExitStack()
            tensors: Dict[str, Any] = {}
            assemble: List[Tuple[str, torch.Tensor]] = []
            files = stack.enter_context(storage.checkpoint_files(src, m))
            mappable = isinstance(files, storage.CheckpointFiles)  # an object store's shards are read into scratch
            for k in keys:
                rec = m.tensors[k]
                shape = tuple(rec.global_shape)
                nbytes = numel(shape) * itemsize(rec.dtype)
                s = rec.shards[0] if len(rec.shards) == 1 else None
                if mappable and s is not None and s.flat is None and s.shape == shape and s.file and nbytes:
                    data = _mapped_shard(files, s.file, int(m.files[s.file].get("bytes", 0)), s.data_offset, nbytes,
                                         rec.dtype, shape)
                else:
                    data = scratch.tensor(rec.dtype, shape)
                    assemble.append((k, data))
                tensors[k] = ShardedTensor(k, data, rec.dtype, shape, shape, (0,) * len(shape),
                                           axis_fragmentations=(1,) * len(shape), replica_id=0)
                res.bytes += nbytes
            if assemble:  # several shards, or in an object store: planned and read like an own-mode load
                read_global_tensors(src, m, assemble)
            pbar = bar(res.bytes)
            state = _without_sharded(common)
            state[TORCH_DIST_ENTRY] = tensors
            if m.objects:
                state[OBJECTS_ENTRY] = {
                    u: ShardedObject(e["key"], objects[u], tuple(e["shape"]), tuple(e["offset"]), replica_id=0)
                    for u, e in m.objects.items()
                }
            os.makedirs(out.target)
            dc.save(state, out.target)
            pbar.update(res.bytes)
            pbar.close()
            res.tensors = len(tensors)
            del state, tensors, assemble
        finally:
            stack.close()
            scratch.close()
    if m.world_size > 1:
        res.dropped.append(f"rank-local state of ranks 1..{m.world_size - 1} (torch_dist keeps rank 0's)")
    res.dropped.extend(_megatron_cannot_load(common, m))


def _megatron_cannot_load(common: Dict[str, Any], m: Manifest) -> List[str]:
    """What Megatron-LM cannot resume from a megashard checkpoint converted to torch_dist, and how
    to resume without it (the tensors are written all the same)."""
    notes = []
    md = common.get("content_metadata")
    if isinstance(md, dict) and md.get("distrib_optim_sharding_type") == "fully_sharded_model_space":
        notes.append("for Megatron-LM: the DistributedOptimizer state, saved as 'fully_sharded_model_space', "
                     "which megatron-core 0.16 and later no longer load from torch_dist (resume with "
                     "--no-load-optim, or resume from the megashard checkpoint itself)")
    if any(e.get("key") == "rng_state" for e in m.objects.values()):
        notes.append("for Megatron-LM: the RNG state, stored in megashard's JSON form (resume with --no-load-rng)")
    for n in notes:
        log.warning("%s", n)
    return notes


# ---------------------------------------------------------------------------
# torch_dist -> megashard


def _torch_dist_to_megashard(src: str, out: _Output, patterns: Optional[Sequence[str]], batch_bytes: int,
                             bar: Callable[[int], Any], res: ConvertResult) -> None:
    from .sharded import ShardedTensor as MsTensor

    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        try:
            meta = serialization.load_sharded_metadata(src)
            common = serialization.load_common_state_dict(src)
        except MegashardError:
            raise
        except Exception as e:  # noqa: BLE001 - megatron-core's own errors, named for the user
            raise CheckpointError(f"{src}: megatron-core cannot read this torch_dist checkpoint: "
                                  f"{type(e).__name__}: {e}") from e
        ten_meta = {k: v for k, v in meta.items() if isinstance(v, ShardedTensor)}
        obj_meta = [v for v in meta.values() if isinstance(v, ShardedObject)]
        keys = _match(sorted(ten_meta), patterns)
        if not isinstance(common, dict):
            raise CheckpointError(f"{src}: common state is {type(common).__name__}, expected a dict")
        scratch = _Scratch(out.scratch_dir())
        try:
            loaded: Dict[str, torch.Tensor] = {k: scratch.tensor(ten_meta[k].dtype, ten_meta[k].global_shape)
                                               for k in keys}
            pbar = bar(sum(t.numel() * t.element_size() for t in loaded.values()))
            batch: Dict[str, Any] = {}
            size = 0

            def flush() -> None:
                nonlocal size
                if batch:
                    dc.load(batch, src)  # fills the scratch-backed tensors in place
                    pbar.update(size)
                    batch.clear()
                    size = 0

            for k in keys:
                t = loaded[k]
                n = t.numel() * t.element_size()
                if n == 0:
                    continue
                if batch and size + n > batch_bytes:
                    flush()
                shape = tuple(t.shape)
                batch[k] = ShardedTensor(k, t, t.dtype, shape, shape, (0,) * len(shape),
                                         axis_fragmentations=(1,) * len(shape), replica_id=0)
                size += n
                res.bytes += n
            flush()
            objs = {}
            if obj_meta:
                req = {o.unique_key: ShardedObject(o.key, None, o.global_shape, o.global_offset, replica_id=0)
                       for o in obj_meta}
                got = dc.load(req, src)
                objs = {u: ShardedObject(req[u].key, got[u], req[u].global_shape, req[u].global_offset, replica_id=0)
                        for u in req}
            pbar.close()
            state = dict(common)
            model = {k: MsTensor(k, loaded[k], tuple(loaded[k].shape), (0,) * loaded[k].dim())
                     for k in keys if not k.startswith("optimizer.")}
            opt = {k: MsTensor(k, loaded[k], tuple(loaded[k].shape), (0,) * loaded[k].dim())
                   for k in keys if k.startswith("optimizer.")}
            for name, part in ((MODEL_ENTRY, model), (OPTIMIZER_ENTRY, opt), (OBJECTS_ENTRY, objs)):
                if not part:
                    continue
                if name in state and not (isinstance(state[name], dict) and not state[name]):
                    name = f"megashard_{name}"
                state[name] = part
            res.tensors = len(keys)
            _save_new(state, out, "torch_dist")
            del state, model, opt, loaded
        finally:
            scratch.close()


# ---------------------------------------------------------------------------
# Hugging Face directory -> megashard


def _hf_import(src: str, dst: str, patterns: Optional[Sequence[str]], progress: Optional[bool],
               t0: float) -> ConvertResult:
    """An HF Llama directory as a Megatron save root: ``DST/release`` plus the tracker (``release``),
    which Megatron loads as a fine-tuning start (``--load DST``) at any layout (DST may be a URL)."""
    from .hf.importer import import_state, plan_import

    if patterns is not None:
        raise ConvertInputError("--keys does not apply to an import from Hugging Face")
    try:
        plan = plan_import(src)
    except CheckpointError as e:  # a malformed or hostile directory (a link, a bad header): wrong input
        raise ConvertInputError(str(e)) from None
    res = ConvertResult(plan.src, dst, "hf", "megashard", "release")
    try:
        out = _output(dst, True, "release", False)
        try:
            scratch = _Scratch(out.scratch_dir())
            try:
                state = import_state(plan, scratch.tensor)
                res.tensors = len(plan.where)
                res.bytes = plan.nbytes
                pbar = _progress(res.bytes, "hf -> megashard", progress)
                _save_new(state, out, "hf")
                pbar.update(res.bytes)
                pbar.close()
                del state
            finally:
                scratch.close()
            out.commit()
        except BaseException:
            out.cleanup()
            raise
    finally:
        plan.close()
    res.seconds = time.perf_counter() - t0
    log.info("%s", res.summary())
    return res


# ---------------------------------------------------------------------------
# entry point


def _refuse_inside(dst: str, src: str, ckpt: str) -> None:
    """DST inside SRC (or the checkpoint read), symbolic links resolved: convert would write
    into what it reads (and a later save would find foreign files there)."""
    if storage.is_url(dst) or storage.is_url(src):
        return  # nothing reads and writes the same object store: a URL DST only takes a local SRC
    real_dst = os.path.join(os.path.realpath(os.path.dirname(dst)), os.path.basename(dst))
    for s in dict.fromkeys((src, ckpt)):
        real_src = os.path.realpath(s)
        if os.path.commonpath([real_dst, real_src]) == real_src:
            raise ConvertInputError(f"{dst} is inside the source {s}: convert would write into the checkpoint "
                                    "it reads; choose a DST outside it")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str = "megashard",
    keys: Optional[Sequence[str]] = None,
    iteration: Optional[int] = None,
    progress: Optional[bool] = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    vocab_size: Optional[int] = None,
    tokenizer: Optional[str] = None,
    hf_tensors: bool = False,
    shard_bytes: Optional[int] = None,
) -> ConvertResult:
    """Convert SRC into a new DST (see the module docstring); DST must not exist.

    Raises :class:`ConvertInputError` (nothing written) for wrong inputs, another
    :class:`MegashardError` if the conversion itself fails (DST is then left absent).
    """
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise ConvertInputError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    src_s, dst_s = storage.location(src), storage.location(dst)  # a URL is checked, a path made absolute
    if storage.is_url(dst_s):
        if to != "megashard":
            raise ConvertInputError(
                f"{dst_s}: --to {to} writes local files only; convert to a local path and upload that (e.g. "
                "`aws s3 cp --recursive`), or write a megashard checkpoint at the URL (--to megashard)")
        try:
            storage.save_target(dst_s).validate()  # the URL takes a checkpoint (a key prefix in the bucket): no request
        except CheckpointError as e:
            raise ConvertInputError(f"DST {e}") from None
        if storage.occupied(dst_s):
            raise ConvertInputError(f"{dst_s} exists (objects are stored under it); choose a new DST "
                                    "(convert never overwrites)")
    else:
        if os.path.lexists(dst_s):
            raise ConvertInputError(f"{dst_s} exists; choose a new DST (convert never overwrites)")
        if not os.path.isdir(os.path.dirname(dst_s)):
            raise ConvertInputError(f"{os.path.dirname(dst_s)}: parent directory of DST does not exist")
    from .hf import HFMappingError

    if to == "megashard" and iteration is None and not storage.is_url(src_s):
        from .hf.importer import is_hf_dir

        if is_hf_dir(src_s):
            _refuse_inside(dst_s, src_s, src_s)
            try:
                return _hf_import(src_s, dst_s, keys, progress, t0)
            except HFMappingError as e:
                raise ConvertInputError(str(e)) from None
    if to != "hf" and (vocab_size is not None or tokenizer is not None or hf_tensors):
        raise ConvertInputError("--vocab-size, --tokenizer and --tensors apply to --to hf")
    ckpt, fmt, it, root = resolve_source(src_s, iteration)
    _refuse_inside(dst_s, src_s, ckpt)
    if to == "hf" and fmt == "megashard":
        if keys is not None:
            raise ConvertInputError("--keys does not apply to --to hf (the export writes the whole model)")
        from .hf.export import plan_export

        try:
            plan = plan_export(ckpt, vocab_size, tokenizer)
        except HFMappingError as e:
            raise ConvertInputError(str(e)) from None
    if fmt == to == "megashard":
        raise ConvertInputError(f"{ckpt} is a megashard checkpoint already; to copy it (between a file system and "
                                f"an object store, or anywhere else) run `megashard copy {src_s} {dst_s}`")
    if (fmt, to) not in (("torch_dist", "megashard"), ("megashard", "torch_dist"), ("megashard", "tensors"),
                         ("megashard", "safetensors"), ("megashard", "hf")):
        hint = " (convert to megashard first)" if fmt == "torch_dist" else ""
        raise ConvertInputError(f"cannot convert {fmt} to {to}{hint}; supported: torch_dist -> megashard, "
                                "megashard -> torch_dist | tensors | safetensors | hf, Hugging Face directory -> "
                                "megashard")
    res = ConvertResult(ckpt, dst_s, fmt, to, it)
    out = _output(dst_s, root and to != "hf", it, to in SINGLE_FILE)

    def bar(total: int) -> Any:
        return _progress(total, f"{fmt} -> {to}", progress)

    try:
        if to in SINGLE_FILE:
            _to_single_file(ckpt, out, to, keys, batch_bytes, bar, res)
        elif to == "hf":
            from .hf.export import DEFAULT_SHARD_BYTES, write_export

            pbar = bar(plan.nbytes)
            try:
                res.tensors, res.bytes = write_export(plan, out.target, tensors_file=hf_tensors,
                                                      shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                                                      progress=pbar.update)
            finally:
                pbar.close()
            res.target_format = "hf (tensorizer)" if hf_tensors else "hf"
            res.dropped.append("optimizer state, RNG, iteration (a Hugging Face directory holds the model)")
        elif to == "torch_dist":
            _megashard_to_torch_dist(ckpt, out, keys, bar, res)
        else:
            _torch_dist_to_megashard(ckpt, out, keys, batch_bytes, bar, res)
        out.commit()
    except BaseException:
        out.cleanup()
        raise
    res.dst = dst_s
    res.seconds = time.perf_counter() - t0
    log.info("%s", res.summary())
    return res

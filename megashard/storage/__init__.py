"""Where checkpoints live: one interface, one module per store.

* :mod:`.base`: what every store shares (names inside a checkpoint, the manifest limit, URL or
  path) and :class:`~.base.Store`, the functions each store's module provides;
* :mod:`.posix`: directories on a file system (commit by ``rename``, the protocol in its docstring);
* :mod:`.s3`: ``s3://`` and ``msc://`` object stores (commit by a conditional PUT,
  :mod:`.s3.checkpoint`; the client in :mod:`.s3.client`);
* :mod:`.ownership`: owner records of a save's temporaries and when leftovers count as abandoned.

Saving, loading, readers, scatter, ``copy`` and ``convert`` call the functions here (never a store's
module: ``tests/test_import_layers.py``), which pick the store by location
(:func:`store`): a path is the file system's, a URL the store of its scheme (:data:`STORES`, imported
on first use). Adding a store (GCS, Azure Blob, ...) is one module implementing :class:`~.base.Store`
and one line in :data:`STORES`. Built on the interface: Megatron save roots (a tracker and
``iter_N`` checkpoints, :mod:`megashard.saveroot`) in any store, and opening a checkpoint's index.

The file system's own operations that the local tier, replication and ``convert`` use (temp dirs,
commit, fsync, retention, ...) are re-exported from :mod:`.posix` by name.
"""
from __future__ import annotations

import importlib
import os
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..errors import CheckpointError
from ..saveroot import TRACKER_NAME, check_iteration, iteration_dir_name, parse_iteration_dir_name
from . import posix
from .base import (MANIFEST_DIGEST_NAME, MANIFEST_NAME, PathLike, Recovery, Store, check_member_name, is_url,
                   local_path, manifest_digest, max_manifest_bytes)
from .ownership import DEFAULT_STALE_AGE_S, OWNER_NAME
from .posix import (CheckpointFiles, DirectorySave, apply_retention, check_reported_files, check_save_target,
                    cleanup_stale_temps, commit_dir, dir_identity, foreign_hint, fsync_file, fsync_path,
                    head_problem, join_temp_dir, leftover_kind, make_temp_dir, remove_checkpoint, rename_new_only,
                    replace_problem, replace_problem_at, temp_dir_name, write_file_atomic)

__all__ = [
    "STORES", "Store", "store",
    # the interface, by location
    "location", "locate", "locate_named", "is_checkpoint", "checkpoint_location", "why_not_checkpoint", "recover", "Recovery",
    "save_target", "checkpoint_files", "child", "occupied", "foreign_format",
    # Megatron save roots in any store
    "write_tracker", "read_tracker", "save_root", "save_root_iterations", "root_checkpoint", "read_location",
    "recover_path",
    # a checkpoint's index, read through its store
    "open_index", "check_file_size", "read_index_bytes", "read_manifest",
    # Megatron's names (megashard.saveroot), for callers of the old names
    "TRACKER_NAME", "iteration_dir_name", "parse_iteration_dir_name",
    # shared names and rules
    "MANIFEST_NAME", "MANIFEST_DIGEST_NAME", "OWNER_NAME", "DEFAULT_STALE_AGE_S", "check_member_name", "is_url",
    "local_path", "manifest_digest", "max_manifest_bytes",
    # the file system's own operations (megashard.storage.posix)
    "CheckpointFiles", "DirectorySave", "apply_retention", "check_reported_files", "check_save_target",
    "cleanup_stale_temps", "commit_dir", "dir_identity", "foreign_hint", "fsync_file", "fsync_path",
    "head_problem", "join_temp_dir", "leftover_kind", "make_temp_dir", "remove_checkpoint", "rename_new_only",
    "replace_problem", "replace_problem_at", "temp_dir_name", "write_file_atomic",
]

#: URL scheme -> the module of that store (a :class:`~.base.Store`), imported when such a URL is first used.
#: A URL of another scheme goes to the S3 store, whose URL check refuses it, naming the schemes it takes.
STORES: Dict[str, str] = {
    "s3": "megashard.storage.s3.checkpoint",
    "msc": "megashard.storage.s3.checkpoint",
}


def store(path: PathLike) -> Store:
    """The store of ``path``: :mod:`.posix` for a path, the module :data:`STORES` names for a URL."""
    p = os.fspath(path)
    if not is_url(p):
        return posix  # type: ignore[return-value]
    name = STORES.get(p.partition("://")[0].lower(), STORES["s3"])
    return importlib.import_module(name)  # type: ignore[return-value]


# --------------------------------------------------------------------------- the interface, by location


def location(path: PathLike) -> str:
    """A checkpoint's location: a URL (checked, without a trailing slash) or an absolute local
    path. A URL is never taken for a relative path."""
    return store(path).location(path)


def locate(path: PathLike) -> Optional[str]:
    """Where the complete checkpoint called ``path`` is, without changing anything (:func:`.posix.locate`:
    also an interrupted re-save's complete copy), or None."""
    return store(path).locate(path)


def locate_named(path: PathLike) -> Optional[str]:
    """:func:`locate` for a checkpoint that a committed tracker names: on a file system, one not
    visible yet is looked for again up to ``MEGASHARD_FS_WAIT_S`` (:func:`.posix.locate_named`: a
    load right after another node's commit, on a lagging shared mount). An object store shows a
    committed object at once: one look."""
    if is_url(os.fspath(path)):
        return locate(path)
    return posix.locate_named(path)


def is_checkpoint(path: PathLike) -> bool:
    """``path`` holds a committed megashard checkpoint (its head parses as megashard's)."""
    return store(path).is_checkpoint(path)


def checkpoint_location(checkpoint_dir: PathLike) -> str:
    """Where the complete checkpoint ``checkpoint_dir`` is (read-only), or a CheckpointError saying why
    it is not one."""
    return store(checkpoint_dir).checkpoint_location(checkpoint_dir)


def why_not_checkpoint(path: PathLike) -> str:
    """A one-line reason why ``path`` is not a readable checkpoint (for error messages)."""
    return store(path).why_not_checkpoint(path)


def recover(final_dir: PathLike, older_than_s: Optional[float] = None,
            into: Optional[Recovery] = None) -> Optional[str]:
    """Repair checkpoint ``final_dir`` after a crash (``megashard recover``; the rule:
    :func:`.posix.recover`, :func:`.s3.checkpoint.recover`) and remove its dead saves' leftovers
    (``older_than_s``: :data:`DEFAULT_STALE_AGE_S` unless given); return where the complete checkpoint
    is, or None. ``into`` records what it restored and removed."""
    into = into if into is not None else Recovery()
    age = DEFAULT_STALE_AGE_S if older_than_s is None else older_than_s
    return store(final_dir).recover(final_dir, age, into)


def save_target(checkpoint_dir: PathLike, new_only: bool = False) -> Any:
    """The save seam for ``checkpoint_dir`` (:class:`.posix.DirectorySave`, :class:`.s3.checkpoint.ObjectSave`).
    ``new_only``: the commit creates it or fails (CommitConflictError), never replacing what is there.
    Checks nothing yet: ``validate`` does, on every rank."""
    return store(checkpoint_dir).save_target(checkpoint_dir, new_only)


def checkpoint_files(base: PathLike, index: Any = None) -> Any:
    """The files object a load reads members through (``read_into``; ``descriptor`` where
    ``passes_descriptors``): :class:`CheckpointFiles` of a directory, or its object-store equivalent
    (``index``: the checkpoint's index, whose ETags pin every read)."""
    return store(base).checkpoint_files(base, index)


def child(root: str, name: str) -> str:
    """The location of ``name`` directly under ``root`` (a save root's ``iter_N``; a file of a save's
    temporary directory or prefix): a path joined, or a URL's key extended (checked there)."""
    return store(root).child(root, name)


def occupied(path: PathLike) -> bool:
    """Anything at (or, on an object store, under) ``path``: where something new must not be written
    (``megashard convert`` never overwrites). An object store: one HEAD and one LIST."""
    return store(path).occupied(path)


def foreign_format(path: PathLike) -> Optional[str]:
    """``"torch_dist"`` or ``"hf"`` when ``path`` holds a checkpoint in a format ``megashard convert``
    reads (:func:`.posix.foreign_format`), else None. An object store answers by name only (one HEAD of
    ``metadata.json``: ``"torch_dist"``), for the hint of an error message."""
    return store(path).foreign_format(path)


# --------------------------------------------------------------------------- Megatron save roots


def write_tracker(save_root: PathLike, iteration: Union[int, str], new_only: bool = False) -> None:
    """Write Megatron's ``latest_checkpointed_iteration.txt`` (the last save step; readers see the old
    or the new). ``new_only``: only where there is none yet (CommitConflictError otherwise), never
    replacing one another writer wrote meanwhile (``megashard convert``)."""
    it = check_iteration(iteration)
    store(save_root).write_tracker(save_root, str(it), new_only)


def read_tracker(load_root: PathLike) -> Optional[Union[int, str]]:
    """The iteration named by the tracker file, ``"release"``, or None if there is none.

    Garbage content raises CheckpointError naming the file: guessing would load the
    wrong checkpoint.
    """
    return store(load_root).read_tracker(load_root)


def save_root_iterations(root: PathLike) -> List[Union[int, str]]:
    """The iterations a Megatron save root holds as megashard checkpoints (``iter_N``, or
    ``release``; locally also one that only an interrupted re-save's complete copy holds,
    as :func:`locate` finds it), ascending, ``release`` last. Read-only."""
    loc = location(root)
    st = store(loc)
    its = [parse_iteration_dir_name(n) for n in st.iteration_names(loc) if st.locate(child(loc, n)) is not None]
    return sorted(its, key=lambda it: (it == "release", it if isinstance(it, int) else 0))  # type: ignore[arg-type]


def save_root(path: PathLike) -> Optional[Dict[str, Any]]:
    """``{"path", "tracker", "iterations"}`` when ``path`` is a Megatron save root (what
    ``--save``/``--load`` take: not itself a checkpoint, holding a tracker or ``iter_N``
    checkpoints); None otherwise. ``tracker`` is the iteration the tracker names, or None."""
    loc = location(path)
    if locate(loc) is not None:
        return None
    tracker = read_tracker(loc)
    iterations = save_root_iterations(loc)
    if tracker is None and not iterations:
        return None
    return {"path": loc, "tracker": tracker, "iterations": iterations}


def root_checkpoint(root: Mapping[str, Any]) -> str:
    """The checkpoint a save root's tracker names (waited for when not visible yet: :func:`locate_named`);
    a root without a tracker is a CheckpointError that names its checkpoints (guessing would read the
    wrong one)."""
    if root["tracker"] is None:
        shown = ", ".join(child(root["path"], iteration_dir_name(i)) for i in root["iterations"])
        raise CheckpointError(f"{root['path']} is a Megatron save root without {TRACKER_NAME}; "
                              f"name one of its checkpoints: {shown}")
    named = child(root["path"], iteration_dir_name(root["tracker"]))
    locate_named(named)  # committed before the tracker named it, it may show late on a lagging mount: waited for
    return named


def read_location(path: PathLike) -> str:
    """:func:`checkpoint_location`, following a Megatron save root's tracker to the checkpoint it
    names (``load_consolidated``, ``megashard inspect|verify``). Read-only."""
    root = save_root(path)
    return checkpoint_location(path if root is None else root_checkpoint(root))


def recover_path(path: PathLike, older_than_s: Optional[float] = None) -> Recovery:
    """``megashard recover PATH``: a checkpoint (:func:`recover`), or a Megatron save root (a
    directory or URL holding a tracker or ``iter_N`` checkpoints): every iteration of it
    recovered, the leftovers of dead saves in it removed by the same rule (locally also those
    beside the iterations: :func:`cleanup_stale_temps`). A local directory that is not a checkpoint
    is handled as a root."""
    rec = Recovery()
    loc = location(path)
    root = save_root(loc)
    if root is None and not (not is_url(loc) and os.path.isdir(loc) and not os.path.islink(loc)
                             and not posix.has_manifest(loc)):
        rec.found = recover(loc, older_than_s, rec)
        return rec
    age = DEFAULT_STALE_AGE_S if older_than_s is None else older_than_s
    st = store(loc)
    for name in st.iteration_names(loc, kinds=("old", "tmp", "del")):
        recover(child(loc, name), age, rec)
    if not is_url(loc):
        rec.removed.extend(cleanup_stale_temps(loc, older_than_s=age))  # e.g. the tracker's temporaries
    rec.root = save_root(loc)
    return rec


# --------------------------------------------------------------------------- a checkpoint's index


def open_index(base: str) -> Any:
    """The index (:data:`megashard.index.Index`) of the committed checkpoint in ``base`` (validated;
    read-only). Its ``check_file`` checks a member's real size against the index's claim."""
    from ..index import index_from_files  # imported late: storage stays torch-free

    files = checkpoint_files(base)
    try:
        head = files.read_manifest_bytes()
        if not is_url(base) and b'"data_prefix"' in head:
            posix.refuse_object_layout(head, base)
    except BaseException:
        files.close()
        raise
    index = index_from_files(files, head, os.path.join(base, MANIFEST_NAME))
    index.check_file = partial(check_file_size, base, index=index)
    index.reads_check_files = is_url(base)  # every ranged GET checks size and ETag (see _FileSizes)
    return index


def check_file_size(base: str, name: str, size: int, index: Any = None) -> None:
    """Member ``name`` of ``base`` is a regular file (no link) of exactly ``size`` bytes
    (on an object store: the object of that size and of the index's ETag)."""
    with checkpoint_files(base, index) as cf:
        cf.open(name, size)


def read_index_bytes(base: str) -> Tuple[bytes, bytes]:
    """``manifest.json`` and the whole ``manifest.index`` (empty for version 1), checked
    against each other: what a node's reader sends ranks that cannot see the directory."""
    from ..manifest import INDEX_NAME, parse_head  # imported late: storage stays torch-free

    with checkpoint_files(base) as cf:
        head = cf.read_manifest_bytes()
        doc = parse_head(head, cf.path(MANIFEST_NAME))
        if doc.get("version") == 1:
            return head, b""
        idx = doc.get("index") if isinstance(doc.get("index"), dict) else {}
        sections = cf.read_bytes(INDEX_NAME, max_manifest_bytes())
        if len(sections) != idx.get("bytes"):
            raise CheckpointError(f"{cf.path(INDEX_NAME)}: size differs from the manifest's")
    return head, sections


def read_manifest(checkpoint_dir: PathLike) -> Any:
    """The whole index (:class:`megashard.manifest.Manifest`) of a committed checkpoint, validated;
    changes nothing on disk."""
    from ..manifest import Manifest  # imported late: storage stays torch-free

    index = open_index(checkpoint_location(checkpoint_dir))
    if isinstance(index, Manifest):
        return index
    try:
        m = index.full()
    finally:
        index.close()
    m.check_file = index.check_file
    return m

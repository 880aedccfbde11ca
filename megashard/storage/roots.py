"""Megatron save roots in any store: the tracker, the iterations a root holds, recovering a whole
root (``megashard recover``), retention."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import CheckpointError
from ..saveroot import TRACKER_NAME, _TRACKER_MAX, _check_iteration, _parse_tracker, iteration_dir_name, parse_iteration_dir_name
from .base import PathLike, is_url, location
from .ownership import DEFAULT_STALE_AGE_S
from .posix import (_AUX_RE, Recovery, _aux_dirs, _has_manifest, _remove_superseded, cleanup_stale_temps, fsync_path,
                    is_checkpoint, locate, checkpoint_location, recover, remove_checkpoint, replace_problem,
                    replace_problem_at, write_file_atomic)

logger = logging.getLogger(__name__)


def recover_path(path: PathLike, older_than_s: Optional[float] = None) -> Recovery:
    """``megashard recover PATH``: a checkpoint (:func:`recover`), or a Megatron save root (a
    directory or URL holding a tracker or ``iter_N`` checkpoints): every iteration of it
    recovered, the leftovers of dead saves in it removed by the same rule
    (:func:`cleanup_stale_temps`; at a URL, :func:`megashard.storage.s3.checkpoint.cleanup` of each
    iteration). A local directory that is not a checkpoint is handled as a root."""
    rec = Recovery()
    loc = location(path)
    root = save_root(loc)
    if root is None and not (not is_url(loc) and os.path.isdir(loc) and not os.path.islink(loc)
                             and not _has_manifest(loc)):
        rec.found = recover(loc, older_than_s, rec)
        return rec
    age = DEFAULT_STALE_AGE_S if older_than_s is None else older_than_s
    if is_url(loc):
        from .s3 import checkpoint as objck

        for name in objck.child_names(loc):
            if parse_iteration_dir_name(name) is not None:
                recover(_child(loc, name), age, rec)
    else:
        for name in sorted(_iteration_names(loc, kinds=("old", "tmp", "del"))):
            recover(os.path.join(loc, name), age, rec)
        rec.removed.extend(cleanup_stale_temps(loc, older_than_s=age))  # e.g. the tracker's temporaries
    rec.root = save_root(loc)
    return rec


def leftover_kind(path: str) -> str:
    """What a path :func:`recover_path` removed was, in words (for its report)."""
    m = _AUX_RE.match(os.path.basename(path.rstrip("/")))
    kind = m.group("kind") if m else None
    if kind == "old":
        return "a copy an interrupted re-save left, superseded by the checkpoint"
    if kind == "del":
        return "an interrupted deletion"
    if kind == "tmp" and not os.path.basename(path).startswith(f".{TRACKER_NAME}."):
        return "a save that is no longer running left it"
    return "left by a save that did not finish"


def write_tracker(save_root: PathLike, iteration: Union[int, str]) -> None:
    """Write Megatron's ``latest_checkpointed_iteration.txt`` atomically (the last save step)."""
    it = _check_iteration(iteration)
    if is_url(save_root):
        from .s3 import checkpoint as objck

        objck.write_tracker(location(save_root), str(it))
        return
    os.makedirs(save_root, exist_ok=True)
    write_file_atomic(os.path.join(os.fspath(save_root), TRACKER_NAME), str(it))


def read_tracker(load_root: PathLike) -> Optional[Union[int, str]]:
    """The iteration named by the tracker file, ``"release"``, or None if there is none.

    Garbage content raises CheckpointError naming the file: guessing would load the
    wrong checkpoint.
    """
    if is_url(load_root):
        from .s3 import checkpoint as objck

        raw = objck.read_tracker_bytes(location(load_root))
        if raw is None:
            return None
        return _parse_tracker(raw, f"{location(load_root)}/{TRACKER_NAME}")
    path = os.path.join(os.fspath(load_root), TRACKER_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(_TRACKER_MAX + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read tracker file {path}: {e}") from e
    return _parse_tracker(raw, path)



def _child(root: str, name: str) -> str:
    if is_url(root):
        from .s3.url import child

        return child(root, name)
    return os.path.join(root, name)


def _iteration_names(root: str, kinds: Sequence[str] = ("old",)) -> set[str]:
    """``iter_N`` / ``release`` names in local directory ``root``, also those only present as
    ``.<name>.<kind>-*`` entries of the given kinds."""
    try:
        entries = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    names = set()
    for e in entries:
        m = _AUX_RE.match(e)
        n = m.group("name") if m and m.group("kind") in kinds else e
        if parse_iteration_dir_name(n) is not None:
            names.add(n)
    return names


def save_root_iterations(root: PathLike) -> List[Union[int, str]]:
    """The iterations a Megatron save root holds as megashard checkpoints (``iter_N``, or
    ``release``; locally also one that only an interrupted re-save's complete copy holds,
    as :func:`locate` finds it), ascending, ``release`` last. Read-only."""
    loc = location(root)
    if is_url(loc):
        from .s3 import checkpoint as objck

        names = [n for n in objck.child_names(loc) if parse_iteration_dir_name(n) is not None]
    else:
        names = sorted(_iteration_names(loc))
    its = [parse_iteration_dir_name(n) for n in names if locate(_child(loc, n)) is not None]
    return sorted(its, key=lambda it: (it == "release", it if isinstance(it, int) else 0))


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
    """The checkpoint a save root's tracker names; a root without a tracker is a CheckpointError
    that names its checkpoints (guessing would read the wrong one)."""
    if root["tracker"] is None:
        shown = ", ".join(_child(root["path"], iteration_dir_name(i)) for i in root["iterations"])
        raise CheckpointError(f"{root['path']} is a Megatron save root without {TRACKER_NAME}; "
                              f"name one of its checkpoints: {shown}")
    return _child(root["path"], iteration_dir_name(root["tracker"]))


def read_location(path: PathLike) -> str:
    """:func:`checkpoint_location`, following a Megatron save root's tracker to the checkpoint it
    names (``load_consolidated``, ``megashard inspect|verify``). Read-only."""
    root = save_root(path)
    return checkpoint_location(path if root is None else root_checkpoint(root))


# --------------------------------------------------------------------------- retention


def apply_retention(
    save_root: PathLike, keep_last: int, protect: Iterable[str] = ()
) -> List[str]:
    """Delete the oldest ``iter_*`` checkpoints beyond the newest ``keep_last``.

    Never deletes the checkpoint the tracker names, nor any in ``protect`` (directory
    names or paths), nor directories that are not checkpoints or hold files megashard
    did not write (not ours to judge).
    A garbage tracker raises CheckpointError rather than risk deleting the latest.
    Returns the deleted paths, oldest first.
    """
    if type(keep_last) is not int or keep_last < 0:
        raise CheckpointError(f"keep_last must be an int >= 0, got {keep_last!r}")
    root = os.path.abspath(os.fspath(save_root))
    protected = set()
    for p in protect:
        p = os.fspath(p)
        protected.add(os.path.basename(os.path.normpath(p)))
    tracked = read_tracker(root)
    if tracked is not None:
        protected.add(iteration_dir_name(tracked))

    found: List[Tuple[int, str]] = []
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    for e in entries:
        it = parse_iteration_dir_name(e)
        if isinstance(it, int) and is_checkpoint(os.path.join(root, e)):
            why = replace_problem(os.path.join(root, e))
            if why is not None:
                logger.warning("retention: keeping %s: %s", os.path.join(root, e), why)
                continue
            found.append((it, e))
    found.sort()
    doomed = found[: max(0, len(found) - keep_last)]
    deleted: List[str] = []
    for _, e in doomed:
        if e in protected:
            continue
        p = os.path.join(root, e)
        olds = _aux_dirs(root, e, "old")
        why = remove_checkpoint(p, check=replace_problem_at)
        if why is not None:
            logger.warning("retention: keeping %s: %s", p, why)
            continue
        _remove_superseded(olds)
        logger.info("retention: deleted %s", p)
        deleted.append(p)
    if deleted:
        fsync_path(root)
    return deleted


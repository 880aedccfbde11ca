"""The local checkpoint tier: each rank's own checkpoint versions on its node (``/dev/shm``, local NVMe).

Pure filesystem code beside :mod:`megashard.storage` (no torch, no torch.distributed): where a
rank's versions live, which are complete, what one save leaves, and the rule that picks the
iteration a restarted job resumes from. Saving and loading stay store-agnostic: a version is an
ordinary megashard checkpoint (``.tensors`` files with CRC32s, JSON manifest, never a pickle),
written and committed by :func:`megashard.save` in a world of one (:data:`megashard.transport.SOLO`).

Layout under the directory the user names (``--non-persistent-local-ckpt-dir DIR``)::

    DIR/megashard-<layout>/rank00003/iter_0000120/   rank 3's complete version of iteration 120
    DIR/megashard-<layout>/replicas/rank00011/iter_0000120/   a replica of rank 11's version, kept on
                                                     this node for rank 11's node (--replication)

``<layout>`` names the world size and parallel layout that saved it (``w16-tp2-pp2-ep1-vp1``): a
job restarted with another layout finds no version of its own and falls back to the persistent
checkpoint instead of reading bytes laid out for other ranks (the line saying why names the change:
:func:`layout_changed`). A rank's directory is created ``0700`` and its files are made ``0600``; at
most :data:`KEEP` versions are kept per rank, the oldest removed by the save that commits a newer one
(:func:`after_commit`). A version is
complete iff it is a committed megashard checkpoint (:func:`megashard.storage.is_checkpoint`):
a save killed mid-write leaves only a ``.iter_N.tmp-*`` directory, never a version.
"""
from __future__ import annotations

import logging
import os
import stat
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from . import storage
from .errors import CheckpointError

logger = logging.getLogger(__name__)

#: versions kept per rank: the newest and the one before (a save killed mid-commit leaves the older)
KEEP = 2
PREFIX = "megashard-"
#: the directory, beside the ranks', holding the replicas this node keeps of other nodes' ranks
REPLICAS = "replicas"


def layout_name(world: int, layout: Mapping[str, int]) -> str:
    """``w<world>-tp<>-pp<>-ep<>-vp<>``: the directory of one world size and parallel layout."""
    parts = [f"w{int(world)}"] + [f"{k}{int(layout.get(k, 1))}" for k in ("tp", "pp", "ep", "vp")]
    return "-".join(parts)


def rank_dir(root: str, layout: str, rank: int) -> str:
    return os.path.join(os.path.abspath(root), PREFIX + layout, f"rank{int(rank):05d}")


def version_dir(root: str, layout: str, rank: int, iteration: int) -> str:
    return os.path.join(rank_dir(root, layout, rank), storage.iteration_dir_name(int(iteration)))


def prepare(root: str, layout: str, rank: int) -> str:
    """Create this rank's directory (``0700``; parents as needed) and remove what dead saves left
    in it; return it. A symbolic link or a file there is refused (CheckpointError naming it)."""
    d = rank_dir(root, layout, rank)
    for p in (os.path.dirname(d), d):
        try:
            os.makedirs(p, mode=0o700, exist_ok=True)
        except FileExistsError:
            pass
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"local checkpoint directory {p} is not a directory (a file or a symbolic "
                                  f"link); remove it or pass another --non-persistent-local-ckpt-dir")
    os.chmod(d, 0o700)
    storage.cleanup_stale_temps(d)
    return d


def replica_dir(root: str, layout: str, source: int) -> str:
    """Where a node keeps the replicas of rank ``source``'s versions (:mod:`megashard.replication`)."""
    return os.path.join(os.path.abspath(root), PREFIX + layout, REPLICAS, f"rank{int(source):05d}")


def replica_version_dir(root: str, layout: str, source: int, iteration: int) -> str:
    return os.path.join(replica_dir(root, layout, source), storage.iteration_dir_name(int(iteration)))


def complete_iterations(root: Optional[str], layout: str, rank: int) -> List[int]:
    """The iterations this rank holds a complete version of, ascending (read-only)."""
    if not root:
        return []
    return complete_in(rank_dir(root, layout, rank))


def complete_replica_iterations(root: Optional[str], layout: str, source: int) -> List[int]:
    """The iterations of rank ``source`` this node holds a complete replica of, ascending."""
    if not root:
        return []
    return complete_in(replica_dir(root, layout, source))


def _listdir(d: str) -> List[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []


def complete_in(d: str) -> List[int]:
    """The iterations with a committed megashard checkpoint ``iter_N`` in directory ``d``."""
    names = _listdir(d)
    its = [storage.parse_iteration_dir_name(n) for n in names]
    return sorted(it for it, n in zip(its, names)
                  if isinstance(it, int) and storage.is_checkpoint(os.path.join(d, n)))


def other_layouts(root: Optional[str], layout: str) -> Dict[str, int]:
    """{layout name: newest iteration} of the complete versions (own or replicas) this node holds under
    layouts other than ``layout``: what a job whose world size or parallel layout changed cannot
    use, named in the line saying why it falls back (read-only)."""
    if not root:
        return {}
    base = os.path.abspath(root)
    out: Dict[str, int] = {}
    for name in sorted(_listdir(base)):
        if not name.startswith(PREFIX) or name == PREFIX + layout:
            continue
        d, held = os.path.join(base, name), os.path.join(base, name, REPLICAS)
        subs = [os.path.join(d, n) for n in _listdir(d) if n != REPLICAS]
        subs += [os.path.join(held, n) for n in _listdir(held)]
        its = [it for sub in subs for it in complete_in(sub)]
        if its:
            out[name[len(PREFIX):]] = max(its)
    return out


def layout_changed(others: Sequence[Mapping[str, int]], layout: str, persistent: int) -> Optional[str]:
    """Why a job finds no usable version in its own ``layout`` while the ranks' nodes hold newer
    ones than ``persistent`` under another (``others``: each rank's :func:`other_layouts`), or None.
    Versions are one rank's bytes in the layout that saved them: they are not resharded."""
    newest: Dict[str, int] = {}
    for o in others:
        for name, it in o.items():
            newest[name] = max(newest.get(name, -1), int(it))
    newer = {n: it for n, it in newest.items() if it > persistent}
    if not newer:
        return None
    old = max(newer, key=lambda n: (newer[n], n))
    return (f"layout changed from {old} (local iteration {newer[old]}) to {layout}: local versions are "
            f"not resharded")


def after_commit(root: str, layout: str, rank: int, iteration: int) -> List[str]:
    """After this rank committed ``iteration``: its files ``0600``, versions beyond the newest
    :data:`KEEP` removed (only megashard checkpoints holding only megashard's names). Returns
    the removed paths."""
    v = version_dir(root, layout, rank, iteration)
    os.chmod(v, 0o700)
    for name in os.listdir(v):
        p = os.path.join(v, name)
        if stat.S_ISREG(os.lstat(p).st_mode):
            os.chmod(p, 0o600)
    return storage.apply_retention(rank_dir(root, layout, rank), KEEP)


def choose(held: Sequence[Sequence[int]], persistent: int) -> Tuple[Optional[int], str]:
    """The iteration every rank resumes from the local tier, or (None, why not).

    ``held``: each rank's complete iterations; ``persistent``: the iteration the persistent
    checkpoint holds (-1: none). The newest iteration that *every* rank holds completely, if it
    is newer than ``persistent``: never one rank's newer version with another's older one, never
    a set with a rank missing."""
    if not held:
        return None, "no ranks"
    common = set(held[0]).intersection(*map(set, held[1:]))
    if not common:
        missing = [r for r, h in enumerate(held) if not h]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            return None, (f"no complete local checkpoint on rank{'s' if len(missing) > 1 else ''} {shown}"
                          if len(missing) < len(held) else "no complete local checkpoint on any rank")
        newest: Dict[int, int] = {r: max(h) for r, h in enumerate(held)}
        return None, ("no iteration complete on every rank (newest per rank: "
                      + ", ".join(f"rank {r}: {it}" for r, it in list(newest.items())[:8]) + ")")
    best = max(common)
    if best <= persistent:
        return None, f"the newest local checkpoint complete on every rank (iteration {best}) is not newer " \
                     f"than the persistent one (iteration {persistent})"
    return best, ""

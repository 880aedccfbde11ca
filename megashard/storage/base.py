"""What every store shares: the names inside a checkpoint, the manifest size limit, URLs vs paths,
and the interface each store's module implements (:class:`Store`).

No store's code here (no file system, no object-store client): :mod:`megashard.storage.posix` and
:mod:`megashard.storage.s3` both build on it.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from ..errors import CheckpointError

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------- names inside a checkpoint

#: The head of a checkpoint's index (``manifest.index`` holds the sections it points to).
MANIFEST_NAME = "manifest.json"
#: Written beside the manifest: the SHA-256 (hex) of ``manifest.json``'s bytes.
MANIFEST_DIGEST_NAME = "manifest.sha256"
DEFAULT_MAX_MANIFEST_BYTES = 1 << 30


def max_manifest_bytes() -> int:
    """Largest ``manifest.json`` a load accepts: ``MEGASHARD_MAX_MANIFEST_BYTES`` or 1 GiB."""
    v = os.environ.get("MEGASHARD_MAX_MANIFEST_BYTES")
    try:
        return int(v) if v else DEFAULT_MAX_MANIFEST_BYTES
    except ValueError:
        raise CheckpointError(f"MEGASHARD_MAX_MANIFEST_BYTES={v!r} is not an integer") from None


def check_member_name(name: object, where: str) -> str:
    """A file name inside a checkpoint: one plain path component, never ``.``/``..``."""
    from ..manifest import is_plain_file_name  # one definition; imported late (storage stays torch-free)

    if not is_plain_file_name(name):
        raise CheckpointError(f"{where}: file name {str(name)[:100]!r} is not a plain file name inside the "
                              "checkpoint directory; the manifest is damaged or hostile")
    return name  # type: ignore[return-value]


def manifest_digest(text: Union[str, bytes]) -> str:
    """What ``manifest.sha256`` holds for a head: its SHA-256 in hex and a newline."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest() + "\n"


# --------------------------------------------------------------------------- a URL or a path

_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    """``scheme://...``: an object-store or other URL, never a local path."""
    return isinstance(path, str) and _URL_RE.match(path) is not None


def local_path(path: PathLike) -> str:
    """``path`` made absolute, refusing a URL where only a local path will do (file-system
    code): ``os.path.abspath("s3://b/x")`` is the local directory ``./s3:/b/x``, where a write
    would land silently."""
    p = os.fspath(path)
    if is_url(p):
        raise CheckpointError(f"{p}: a URL, not a local path; this step reads and writes local directories "
                              "only: use a local path (or a mounted bucket)")
    return os.path.abspath(p)



# --------------------------------------------------------------------------- the interface of a store


@dataclass
class Recovery:
    """What :func:`megashard.storage.recover` / :func:`megashard.storage.recover_path` did: checkpoints put
    back from an interrupted re-save's copy (``(checkpoint, copy)``) and leftovers removed (paths or URLs)."""

    restored: List[Tuple[str, str]] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    found: Optional[str] = None  # the complete checkpoint (for a checkpoint path)
    root: Optional[Dict[str, Any]] = None  # the Megatron save root (save_root()), re-read after recovery


class Store(Protocol):
    """What one store's module provides (:mod:`megashard.storage.posix` for paths,
    :mod:`megashard.storage.s3.checkpoint` for ``s3://`` and ``msc://``): :mod:`megashard.storage`
    picks the module by location and calls only these. Every function takes a location as the
    user gave it (a path, or a URL of this store) and normalises it itself."""

    def location(self, path: PathLike) -> str:
        """The location normalised: an absolute path, or the URL checked, without a trailing slash."""

    def locate(self, path: PathLike) -> Optional[str]:
        """Where the complete checkpoint called ``path`` is (read-only), or None."""

    def is_checkpoint(self, path: PathLike) -> bool:
        """``path`` holds a committed megashard checkpoint."""

    def checkpoint_location(self, path: PathLike) -> str:
        """:meth:`locate`, or a CheckpointError that says why ``path`` is not a checkpoint."""

    def why_not_checkpoint(self, path: PathLike) -> str:
        """One line: why ``path`` is not a readable checkpoint (for error messages)."""

    def recover(self, path: PathLike, older_than_s: float, into: Recovery) -> Optional[str]:
        """Repair checkpoint ``path`` after a crash and remove dead saves' leftovers older than
        ``older_than_s`` (recorded in ``into``); return where the checkpoint is, or None."""

    def save_target(self, path: PathLike, new_only: bool = False) -> Any:
        """The save seam of :mod:`megashard.saving` (``validate``, ``check``, ``create``,
        ``temp_location``, ``writer``, ``write_file``, ``commit``, ``after_commit``, ``discard``;
        ``write_stream``: a member streamed in, for ``megashard copy``)."""

    def checkpoint_files(self, path: PathLike, index: Any = None) -> Any:
        """The read seam: ``read_manifest_bytes``, ``open``, ``size``, ``read_into``, ``read_files``,
        ``read_bytes``, ``tensor_reader``, ``path``, ``close``, ``read_threads`` (a bulk read's parallelism
        here); ``descriptor`` where ``passes_descriptors``."""

    def occupied(self, path: PathLike) -> bool:
        """Anything at (an object store: or under) ``path``."""

    def foreign_format(self, path: PathLike) -> Optional[str]:
        """``"torch_dist"`` / ``"hf"``: ``path`` holds a checkpoint of a format ``megashard convert`` reads."""

    def child(self, root: str, name: str) -> str:
        """The location of ``name`` directly under ``root`` (a save root's ``iter_N``)."""

    def iteration_names(self, root: str, kinds: Sequence[str] = ("old",)) -> List[str]:
        """The ``iter_N`` / ``release`` names under save root ``root``, sorted (``kinds``: which
        leftovers of a file system's interrupted saves also count)."""

    def write_tracker(self, root: PathLike, text: str, new_only: bool = False) -> None:
        """Write Megatron's tracker file of save root ``root`` (readers see the old or the new);
        ``new_only``: only where there is none yet, else CommitConflictError."""

    def read_tracker(self, root: PathLike) -> Optional[Union[int, str]]:
        """The iteration save root ``root``'s tracker names (:func:`megashard.saveroot.parse_tracker`),
        or None when there is none."""

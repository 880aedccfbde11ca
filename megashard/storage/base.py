"""What every store shares: the names inside a checkpoint, the manifest size limit, URLs vs paths.

No store's code here (no file system, no object store client): :mod:`megashard.storage.posix` and
:mod:`megashard.storage.s3` both build on it.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Union

from ..errors import CheckpointError

MANIFEST_NAME = "manifest.json"

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------- reading safely

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
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest() + "\n"


# --------------------------------------------------------------------------- naming

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




def location(path: PathLike) -> str:
    """A checkpoint's location: an object-store URL (checked, without a trailing slash) or
    an absolute local path. A URL is never taken for a relative path."""
    p = os.fspath(path)
    if is_url(p):
        from .s3.url import parse_url

        parse_url(p)
        return p.rstrip("/")
    return os.path.abspath(p)


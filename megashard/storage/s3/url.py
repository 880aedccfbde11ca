"""Object-store URLs: ``s3://bucket/key`` and ``msc://profile/key``, parsed strictly.

A checkpoint URL names a key prefix, and every object megashard writes is that prefix plus plain names
(``child``). Keys that S3 would accept but that mean something else on a filesystem or to a person
(``..``, ``.``, empty segments, backslashes, control characters) are refused here, so a checkpoint can
never be written to, or read from, a key other than the one the user typed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ...errors import CheckpointError

SCHEMES = ("s3", "msc")
# S3 allows 1024 bytes; keep room for the names megashard appends under a checkpoint prefix.
MAX_KEY_BYTES = 900
# S3 bucket names (3-63 characters; underscores only in legacy us-east-1 buckets).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
# An msc profile name: what multi-storage-client accepts in its config, conservatively.
_PROFILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\?#]")


@dataclass(frozen=True)
class ObjectURL:
    """A parsed object-store URL. ``bucket`` is "" for ``msc://`` until its profile is resolved."""

    scheme: str
    bucket: str
    key: str
    profile: Optional[str] = None

    def __str__(self) -> str:
        host = self.profile if self.scheme == "msc" else self.bucket
        return f"{self.scheme}://{host}/{self.key}" if self.key else f"{self.scheme}://{host}"


def is_object_url(path: object) -> bool:
    """True for a string that starts with one of the object-store schemes (then it must parse)."""
    return isinstance(path, str) and any(path.lower().startswith(f"{s}://") for s in SCHEMES)


def _key_problem(key: str) -> Optional[str]:
    """Why ``key`` is not a usable megashard key prefix, or None."""
    if _BAD_CHARS.search(key):
        return "it contains a backslash, '?', '#' or a control character"
    if key:
        for seg in key.split("/"):
            if seg in ("", ".", ".."):
                return "it has an empty, '.' or '..' path segment"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"its key is longer than {MAX_KEY_BYTES} bytes"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "its key is not valid UTF-8"
    return None


def parse_url(url: str) -> ObjectURL:
    """Parse ``s3://bucket/a/b`` (key "a/b") or ``msc://profile/a/b``; a trailing slash is ignored.

    Anything else raises :class:`CheckpointError` naming the URL and the rule it breaks.
    """
    if not isinstance(url, str):
        raise CheckpointError(f"object-store URL must be a string, got {type(url).__name__}")
    shown = repr(url) if len(url) <= 200 else repr(url[:200]) + "..."
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise CheckpointError(f"{shown} is not an object-store URL: use s3://bucket/prefix or msc://profile/prefix")
    host, _, raw_key = rest.partition("/")
    key = raw_key[:-1] if raw_key.endswith("/") else raw_key
    if raw_key and not key:
        raise CheckpointError(f"{shown} is not a usable checkpoint URL: it has an empty path segment")
    if scheme == "s3":
        if not _BUCKET.match(host) or ".." in host:
            raise CheckpointError(f"{shown}: {host!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                                  f"'.', '-'); write s3://bucket/prefix")
    elif not _PROFILE.match(host):
        raise CheckpointError(f"{shown}: {host!r} is not a valid multi-storage-client profile name; "
                              f"write msc://profile/prefix")
    problem = _key_problem(key)
    if problem:
        raise CheckpointError(f"{shown} is not a usable checkpoint URL: {problem}")
    if scheme == "s3":
        return ObjectURL("s3", host, key)
    return ObjectURL("msc", "", key, profile=host)


def check_object_name(name: str, where: str) -> str:
    """Return ``name`` if it is one plain object name (no "/", not "." or ".."), else raise naming ``where``."""
    if (not isinstance(name, str) or not name or "/" in name or name in (".", "..") or _BAD_CHARS.search(name)
            or len(name.encode("utf-8", "surrogatepass")) > 255):
        raise CheckpointError(f"{where}: {name!r} is not a plain object name (no '/', '\\', '..', control "
                              f"characters; at most 255 bytes)")
    return name


def join_key(prefix: str, name: str) -> str:
    """``prefix/name`` (just ``name`` at the bucket root); ``name`` must already be checked."""
    return f"{prefix}/{name}" if prefix else name


def child(url: str, name: str) -> str:
    """The URL of plain object ``name`` directly under ``url``."""
    parsed = parse_url(url)
    check_object_name(name, str(parsed))
    joined = str(ObjectURL(parsed.scheme, parsed.bucket, join_key(parsed.key, name), parsed.profile))
    parse_url(joined)  # length limit
    return joined

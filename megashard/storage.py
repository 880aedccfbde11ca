"""Checkpoint directories on disk: temp names, fsync, atomic commit, tracker, retention.

Pure filesystem code (no torch, no torch.distributed); the save orchestration calls it.

Save protocol
-------------
For a checkpoint whose final directory is ``<parent>/<name>/``:

1. rank 0 picks a ``token`` (``[A-Za-z0-9_-]+``) and broadcasts it; it calls
   :func:`make_temp_dir`, creating ``<parent>/.<name>.tmp-<token>/``. Other ranks
   compute the same path with :func:`temp_dir_name`.
2. every rank writes its ``.tensors`` files into the temp dir and fsyncs them.
3. after a barrier (all ranks durable), rank 0 writes ``manifest.json`` with
   :func:`write_file_atomic` and calls :func:`commit_dir`, which fsyncs the temp dir
   and renames it to ``<parent>/<name>/``, then fsyncs ``<parent>``.
   If ``<name>`` already exists (re-saving an iteration), it is first renamed to
   ``<parent>/.<name>.old-<token>/``, the new dir is renamed into place, and the
   old one is deleted.
4. rank 0 writes the tracker ``latest_checkpointed_iteration.txt`` last
   (:func:`write_tracker`).

Invariants: a directory is a checkpoint iff it holds a readable, parseable
``manifest.json`` (:func:`is_checkpoint`); ``manifest.json`` is only ever created by
an atomic rename after its bytes and every shard are durable; ``.<name>.tmp-*``
directories are never checkpoints, whatever they contain.

Recovery rule (:func:`recover`; :func:`locate` finds the same checkpoint read-only)
------------------------------------------------------------------------------------
* ``<name>`` is a checkpoint: use it; any ``.<name>.old-*`` leftovers are deleted.
* ``<name>`` is absent but a ``.<name>.old-*`` directory is a checkpoint (a crash
  between moving the old checkpoint aside and renaming the new one in): rename the
  newest such directory back to ``<name>`` and use it.
* otherwise there is no checkpoint called ``<name>``.

A crash at any point of :func:`commit_dir` therefore leaves the old or the new
complete checkpoint discoverable. Deleting a checkpoint (old dirs, retention)
removes ``manifest.json`` first, so a half-deleted directory is never mistaken for
a checkpoint.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from typing import Iterable, List, Optional, Tuple, Union

from .errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST_NAME",
    "TRACKER_NAME",
    "fsync_path",
    "fsync_file",
    "write_file_atomic",
    "make_temp_dir",
    "temp_dir_name",
    "commit_dir",
    "is_checkpoint",
    "recover",
    "locate",
    "checkpoint_location",
    "why_not_checkpoint",
    "CheckpointFiles",
    "MANIFEST_DIGEST_NAME",
    "cleanup_stale_temps",
    "write_tracker",
    "read_tracker",
    "iteration_dir_name",
    "parse_iteration_dir_name",
    "apply_retention",
    "remove_checkpoint",
]

MANIFEST_NAME = "manifest.json"
#: Megatron's tracker file name, kept so Megatron tooling finds the latest iteration.
TRACKER_NAME = "latest_checkpointed_iteration.txt"

PathLike = Union[str, "os.PathLike[str]"]

_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]+\Z")
# .<name>.<kind>-<token>; tokens contain no '.', so the last '.' splits unambiguously.
_AUX_RE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<token>[A-Za-z0-9_-]+)\Z")
_ITER_RE = re.compile(r"iter_(\d{7,})\Z")
_TRACKER_MAX = 4096


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
    from .manifest import is_plain_file_name  # one definition; imported late (storage stays torch-free)

    if not is_plain_file_name(name):
        raise CheckpointError(f"{where}: file name {str(name)[:100]!r} is not a plain file name inside the "
                              "checkpoint directory; the manifest is damaged or hostile")
    return name  # type: ignore[return-value]


class CheckpointFiles:
    """Opens the files of one checkpoint directory, never leaving it.

    Every member is opened relative to the directory's file descriptor with
    ``O_NOFOLLOW`` and must be a regular file (of the size the manifest says, when
    given), so neither a symbolic link nor a hostile name can make a load read
    anything outside the directory. Descriptors are cached until :meth:`close`.
    """

    def __init__(self, base: PathLike) -> None:
        self.base = os.fspath(base)
        try:
            self.dir_fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointError(f"{self.base}: cannot open the checkpoint directory ({e.strerror})") from None
        self._fds: dict = {}

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def path(self, name: str) -> str:
        return os.path.join(self.base, name)

    def open(self, name: str, size: Optional[int] = None) -> int:
        """A read-only descriptor of member ``name`` (checked: plain name, regular file,
        no symlink, and exactly ``size`` bytes when given)."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        check_member_name(name, self.base)
        where = self.path(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.dir_fd)
        except OSError as e:
            why = "it is a symbolic link (refused)" if e.errno == errno.ELOOP else e.strerror
            raise CheckpointError(f"{where}: cannot open ({why})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{where}: not a regular file; refused")
            if size is not None and st.st_size != size:
                raise CheckpointError(f"{where}: size {st.st_size} differs from the manifest's {size} bytes; "
                                      "the file is damaged or was replaced")
        except BaseException:
            os.close(fd)
            raise
        self._fds[name] = fd
        return fd

    def size(self, name: str) -> int:
        return os.fstat(self.open(name)).st_size

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole member, refused (before reading) when larger than ``limit``."""
        fd = self.open(name)
        n = os.fstat(fd).st_size
        if n > limit:
            raise CheckpointError(f"{self.path(name)}: {n} bytes is over the limit of {limit} "
                                  "(MEGASHARD_MAX_MANIFEST_BYTES raises it)")
        buf = bytearray(n)
        view, pos = memoryview(buf), 0
        while pos < n:
            k = os.preadv(fd, [view[pos:]], pos)
            if k <= 0:
                raise CheckpointError(f"{self.path(name)}: truncated while reading")
            pos += k
        return bytes(buf)

    def read_manifest_bytes(self) -> bytes:
        """``manifest.json``, checked against ``manifest.sha256`` when that exists."""
        data = self.read_bytes(MANIFEST_NAME, max_manifest_bytes())
        try:
            self.open(MANIFEST_DIGEST_NAME)
        except CheckpointError:
            if os.path.lexists(self.path(MANIFEST_DIGEST_NAME)):
                raise
            return data  # written before digests existed
        raw = self.read_bytes(MANIFEST_DIGEST_NAME, 1024)
        if not _DIGEST_LINE.fullmatch(raw):  # strictly 64 lowercase hex digits and one newline
            raise CheckpointError(f"{self.path(MANIFEST_DIGEST_NAME)}: not one line of 64 lowercase hex digits "
                                  f"({raw[:80]!r}); the checkpoint is damaged")
        want = raw[:64].decode("ascii")
        got = hashlib.sha256(data).hexdigest()
        if want != got:
            raise CheckpointError(f"{self.path(MANIFEST_NAME)}: SHA-256 {got[:16]}... does not match "
                                  f"{MANIFEST_DIGEST_NAME} ({want[:16]}...); the manifest is damaged")
        return data


_DIGEST_LINE = re.compile(rb"[0-9a-f]{64}\n")


def manifest_digest(text: Union[str, bytes]) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest() + "\n"


# --------------------------------------------------------------------------- fsync


def fsync_file(f: Union[int, PathLike, "object"]) -> None:
    """Flush a file to stable storage: an fd, an open file object (flushed first) or a path."""
    if isinstance(f, int):
        os.fsync(f)
        return
    fileno = getattr(f, "fileno", None)
    if callable(fileno):
        flush = getattr(f, "flush", None)
        if callable(flush):
            flush()
        os.fsync(fileno())
        return
    fsync_path(f)  # type: ignore[arg-type]


def fsync_path(path: PathLike) -> None:
    """fsync a file or a directory by path.

    fsyncing a directory makes the names created/renamed in it durable, which a
    rename-based commit needs. Filesystems that cannot fsync directories
    (EINVAL/ENOTSUP) are tolerated: there is nothing more we could do there.
    """
    flags = os.O_RDONLY
    if os.path.isdir(path):
        flags |= getattr(os, "O_DIRECTORY", 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as e:
        unsupported = e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)
        if not (unsupported and stat.S_ISDIR(os.fstat(fd).st_mode)):
            raise
        logger.debug("directory fsync not supported for %s: %s", path, e)
    finally:
        os.close(fd)


def write_file_atomic(path: PathLike, data: Union[bytes, str]) -> None:
    """Write ``path`` so that readers see the old content or the new, never a mix.

    Writes ``.<name>.tmp-<random>`` in the same directory, fsyncs it, renames it over
    ``path`` and fsyncs the directory. ``str`` is written as UTF-8.
    """
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    d, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".{base}.tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(d)


# --------------------------------------------------------------------------- naming


def _split_final(final_dir: PathLike) -> Tuple[str, str]:
    final = os.path.abspath(os.fspath(final_dir))
    parent, name = os.path.split(final)
    if not name or name in (".", ".."):
        raise CheckpointError(f"checkpoint directory {os.fspath(final_dir)!r} has no usable name")
    return parent, name


def _check_token(token: str) -> None:
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        raise CheckpointError(f"bad checkpoint temp token {token!r}: use [A-Za-z0-9_-]+")


def temp_dir_name(final_dir: PathLike, token: str) -> str:
    """``<parent>/.<name>.tmp-<token>``: where all ranks write before the commit (pure)."""
    _check_token(token)
    parent, name = _split_final(final_dir)
    return os.path.join(parent, f".{name}.tmp-{token}")


def _old_dir_name(final_dir: PathLike, token: str) -> str:
    parent, name = _split_final(final_dir)
    return os.path.join(parent, f".{name}.old-{token}")


def _aux_dirs(parent: str, name: str, kind: str) -> List[str]:
    """Existing ``.<name>.<kind>-*`` entries in ``parent``."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = _AUX_RE.match(e)
        if m and m.group("name") == name and m.group("kind") == kind:
            out.append(os.path.join(parent, e))
    return out


def make_temp_dir(final_dir: PathLike, token: str) -> str:
    """Create (with parents) the temp dir of a save and return its path.

    Idempotent, so every node's writer may call it on node-local storage. The token
    must be the same on all ranks: rank 0 picks it, the caller broadcasts it.
    """
    tmp = temp_dir_name(final_dir, token)
    parent = os.path.dirname(tmp)
    os.makedirs(parent, exist_ok=True)
    os.makedirs(tmp, exist_ok=True)
    fsync_path(parent)
    return tmp


# --------------------------------------------------------------------------- checkpoints


def is_checkpoint(path: PathLike) -> bool:
    """True iff ``path`` is a directory holding a readable, parseable ``manifest.json``.

    Parsing (not just stat) guards against manifests damaged after the fact; the
    commit protocol itself never exposes a partial manifest.
    """
    if not os.path.isdir(path):
        return False
    try:
        with CheckpointFiles(path) as files:
            json.loads(files.read_bytes(MANIFEST_NAME, max_manifest_bytes()))
    except (OSError, ValueError, RecursionError, CheckpointError):
        return False
    return True


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint directory so that no crash leaves a half-deleted *checkpoint*.

    ``manifest.json`` goes first (made durable), then the directory is renamed to
    ``.<name>.del-<random>`` (so an interrupted deletion is recognisably garbage for
    :func:`cleanup_stale_temps`) and removed.
    """
    path = os.path.abspath(os.fspath(path))
    # FileNotFoundError anywhere means another process is deleting it too: fine.
    try:
        if not (os.path.isdir(path) and not os.path.islink(path)):
            os.unlink(path)
            return
        try:
            os.unlink(os.path.join(path, MANIFEST_NAME))
        except FileNotFoundError:
            pass
        fsync_path(path)
        parent, base = os.path.split(path)
        if not _AUX_RE.match(base):
            trash = os.path.join(parent, f".{base}.del-{uuid.uuid4().hex}")
            os.rename(path, trash)
            path = trash
    except FileNotFoundError:
        return
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        shutil.rmtree(path)  # retry without ignore_errors so a persistent failure is reported


def commit_dir(temp_dir: PathLike, final_dir: PathLike) -> None:
    """Atomically publish ``temp_dir`` as ``final_dir`` (see the module docstring).

    Requires ``manifest.json`` in ``temp_dir``: a directory without it is never a
    checkpoint, so publishing it would be a bug in the caller. Shard files must
    already be fsynced by their writers; this fsyncs the directories involved.
    If an existing ``final_dir`` cannot be replaced, it is restored and
    CheckpointError is raised.
    """
    temp_dir = os.path.abspath(os.fspath(temp_dir))
    parent, name = _split_final(final_dir)
    final = os.path.join(parent, name)
    if os.path.dirname(temp_dir) != parent:
        raise CheckpointError(
            f"temp dir {temp_dir} must be in the same directory as {final} for an atomic rename"
        )
    if not is_checkpoint(temp_dir):
        raise CheckpointError(
            f"refusing to commit {temp_dir}: it has no readable {MANIFEST_NAME} "
            "(write the manifest after all ranks' shards are durable)"
        )
    fsync_path(temp_dir)

    m = _AUX_RE.match(os.path.basename(temp_dir))
    token = m.group("token") if m else uuid.uuid4().hex
    old: Optional[str] = None
    if os.path.lexists(final):
        old = _old_dir_name(final, token)
        if os.path.lexists(old):
            old = _old_dir_name(final, uuid.uuid4().hex)
        os.rename(final, old)
        fsync_path(parent)
        logger.debug("moved existing %s aside to %s", final, old)
    try:
        os.rename(temp_dir, final)
    except OSError as e:
        if old is not None:
            try:
                os.rename(old, final)
            except OSError:
                logger.exception("could not move %s back to %s; recover() will", old, final)
        raise CheckpointError(f"could not rename {temp_dir} to {final}: {e}") from e
    fsync_path(parent)
    logger.info("committed checkpoint %s", final)
    # The new checkpoint is durable: older copies (this one's and any left by
    # earlier crashes) are now garbage.
    for stale in _aux_dirs(parent, name, "old"):
        remove_checkpoint(stale)


def _has_manifest(path: str) -> bool:
    """``path`` holds a regular ``manifest.json`` (opened safely; not parsed)."""
    if not os.path.isdir(path):
        return False
    try:
        with CheckpointFiles(path) as files:
            files.open(MANIFEST_NAME)
    except CheckpointError:
        return False
    return True


def locate(final_dir: PathLike) -> Optional[str]:
    """Where the complete checkpoint called ``final_dir`` is, without changing anything.

    ``final_dir`` itself when it holds a manifest (the caller parses it); the newest ``.<name>.old-*`` checkpoint
    when ``final_dir`` is absent (a re-save crashed mid-commit: :func:`recover`, the next
    save or ``megashard recover`` puts it back); else None. Read paths use this, so
    loading or inspecting never renames or deletes.
    """
    parent, name = _split_final(final_dir)
    final = os.path.join(parent, name)
    if _has_manifest(final):
        return final  # parsed (once) by the caller, which reports damage precisely
    if os.path.lexists(final):
        return None
    candidates = [o for o in _aux_dirs(parent, name, "old") if is_checkpoint(o)]
    if not candidates:
        return None
    candidates.sort(key=lambda p: os.stat(os.path.join(p, MANIFEST_NAME)).st_mtime, reverse=True)
    logger.warning("%s is missing; reading the complete copy %s left by an interrupted re-save "
                   "(run `megashard recover %s` to restore it)", final, candidates[0], final)
    return candidates[0]


def checkpoint_location(checkpoint_dir: PathLike) -> str:
    """The directory that holds the complete checkpoint ``checkpoint_dir`` (read-only: an
    interrupted re-save's ``.old-*`` copy is read in place, never renamed)."""
    path = os.path.abspath(os.fspath(checkpoint_dir))
    found = locate(path)
    if found is None:
        raise CheckpointError(
            f"{path} is not a megashard checkpoint ({why_not_checkpoint(path)}); check the path, or "
            "whether the save that should have produced it finished")
    return found


def why_not_checkpoint(path: PathLike) -> str:
    """A one-line reason why ``path`` is not a readable checkpoint (for error messages)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return f"{path} does not exist or is not a directory"
    try:
        with CheckpointFiles(path) as files:
            json.loads(files.read_bytes(MANIFEST_NAME, max_manifest_bytes()))
    except CheckpointError as e:
        return str(e)
    except (OSError, ValueError, RecursionError) as e:
        return f"{os.path.join(path, MANIFEST_NAME)}: unreadable ({type(e).__name__}: {str(e)[:200]})"
    return f"{path} is a checkpoint"


def recover(final_dir: PathLike) -> Optional[str]:
    """Apply the recovery rule; return the path of the complete checkpoint, or None.

    The one function that repairs a checkpoint's directory (``megashard recover DIR``);
    read paths use :func:`locate` and change nothing. It only renames an ``.old-*``
    back when ``<name>`` is missing, and only deletes ``.old-*`` copies once ``<name>``
    is a checkpoint. Concurrent calls are tolerated, but on a shared filesystem call it
    from one process.
    """
    parent, name = _split_final(final_dir)
    final = os.path.join(parent, name)
    olds = _aux_dirs(parent, name, "old")
    if is_checkpoint(final):
        for stale in olds:
            logger.info("removing superseded %s", stale)
            remove_checkpoint(stale)
        return final
    if os.path.lexists(final):
        if any(is_checkpoint(o) for o in olds):
            logger.warning(
                "%s exists but is not a checkpoint (no %s); leaving it and %s untouched",
                final, MANIFEST_NAME, olds,
            )
        return None
    candidates = [o for o in olds if is_checkpoint(o)]
    if not candidates:
        return None
    candidates.sort(key=lambda p: os.stat(os.path.join(p, MANIFEST_NAME)).st_mtime, reverse=True)
    best = candidates[0]
    try:
        os.rename(best, final)
    except FileNotFoundError:
        # Another process recovered it concurrently.
        return final if is_checkpoint(final) else None
    fsync_path(parent)
    logger.warning("restored %s from %s (a save crashed mid-commit)", final, best)
    for stale in olds:
        if stale != best:
            remove_checkpoint(stale)
    return final


def _newest_mtime(path: str) -> float:
    """mtime of ``path`` and, for a directory, of its direct entries: a save in progress
    keeps touching files inside even when the directory itself does not change."""
    newest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            pass
    return newest


def cleanup_stale_temps(
    parent: PathLike, name: Optional[str] = None, older_than_s: float = 3600.0
) -> List[str]:
    """Remove leftovers of crashed saves in ``parent``; return the removed paths.

    Removes ``.X.tmp-*`` (unfinished saves, also temp files of write_file_atomic) and
    ``.X.del-*`` (interrupted deletions) whose newest mtime (the entry's own or, for a
    directory, any direct child's) is at least ``older_than_s`` seconds old, and
    ``.X.old-*`` only when ``X`` itself is a checkpoint (otherwise the old copy is
    what :func:`recover` restores). ``name`` restricts this to one checkpoint name.
    The age check protects saves still running; pass 0 when none can be.
    """
    parent = os.fspath(parent)
    removed: List[str] = []
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return removed
    now = time.time()
    for e in entries:
        m = _AUX_RE.match(e)
        if not m or (name is not None and m.group("name") != name):
            continue
        p = os.path.join(parent, e)
        if m.group("kind") == "old":
            # Superseded as soon as <name> is a checkpoint (no age needed); otherwise
            # it may be the copy recover() restores, so it is never removed here.
            if not is_checkpoint(os.path.join(parent, m.group("name"))):
                continue
        else:
            try:
                if now - _newest_mtime(p) < older_than_s:
                    continue
            except FileNotFoundError:
                continue
        if os.path.isdir(p) and not os.path.islink(p):
            remove_checkpoint(p)
        else:
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue
        logger.info("removed stale %s", p)
        removed.append(p)
    return removed


# --------------------------------------------------------------------------- tracker


def _check_iteration(iteration: Union[int, str]) -> Union[int, str]:
    if iteration == "release":
        return "release"
    if type(iteration) is int and iteration >= 0:
        return iteration
    raise CheckpointError(f"bad iteration {iteration!r}: use an int >= 0 or 'release'")


def iteration_dir_name(iteration: Union[int, str]) -> str:
    """Megatron's directory name: ``iter_0000100`` (7+ digits) or ``release``."""
    it = _check_iteration(iteration)
    return "release" if it == "release" else f"iter_{it:07d}"


def parse_iteration_dir_name(name: str) -> Optional[Union[int, str]]:
    """Inverse of :func:`iteration_dir_name`; None for any other name."""
    if name == "release":
        return "release"
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def write_tracker(save_root: PathLike, iteration: Union[int, str]) -> None:
    """Write Megatron's ``latest_checkpointed_iteration.txt`` atomically (the last save step)."""
    it = _check_iteration(iteration)
    os.makedirs(save_root, exist_ok=True)
    write_file_atomic(os.path.join(os.fspath(save_root), TRACKER_NAME), str(it))


def read_tracker(load_root: PathLike) -> Optional[Union[int, str]]:
    """The iteration named by the tracker file, ``"release"``, or None if there is none.

    Garbage content raises CheckpointError naming the file: guessing would load the
    wrong checkpoint.
    """
    path = os.path.join(os.fspath(load_root), TRACKER_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(_TRACKER_MAX + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read tracker file {path}: {e}") from e
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    if text == "release":
        return "release"
    if text is not None and len(raw) <= _TRACKER_MAX and text.isdigit():
        return int(text)
    shown = raw[:60].decode("ascii", "backslashreplace")
    raise CheckpointError(
        f"tracker file {path} holds {shown!r}, not an iteration number or 'release'; "
        "fix or delete it, or load an explicit checkpoint directory"
    )


# --------------------------------------------------------------------------- retention


def apply_retention(
    save_root: PathLike, keep_last: int, protect: Iterable[str] = ()
) -> List[str]:
    """Delete the oldest ``iter_*`` checkpoints beyond the newest ``keep_last``.

    Never deletes the checkpoint the tracker names, nor any in ``protect`` (directory
    names or paths), nor directories that are not checkpoints (not ours to judge).
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
            found.append((it, e))
    found.sort()
    doomed = found[: max(0, len(found) - keep_last)]
    deleted: List[str] = []
    for _, e in doomed:
        if e in protected:
            continue
        p = os.path.join(root, e)
        remove_checkpoint(p)
        for stale in _aux_dirs(root, e, "old"):
            remove_checkpoint(stale)
        logger.info("retention: deleted %s", p)
        deleted.append(p)
    if deleted:
        fsync_path(root)
    return deleted

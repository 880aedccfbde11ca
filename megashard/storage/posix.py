"""The file-system store: checkpoint directories, temp names, fsync, atomic commit, recovery, retention.

Pure filesystem code (no torch, no torch.distributed); :mod:`megashard.storage` calls it for every
location that is not a URL (the :class:`~megashard.storage.base.Store` functions), and the local
tier, replication and ``convert`` use its directory operations directly.

What a save may replace
-----------------------
A save only ever replaces a *megashard checkpoint*: a directory whose ``manifest.json``
parses as megashard's head (format name, version, head schema: :func:`head_problem`, the
rule the object store applies too) and that holds nothing but the names megashard writes
there (``manifest.json``, ``manifest.sha256``, ``manifest.index`` and ``*.tensors``
files). An empty directory is a target too (it is replaced by the rename itself).
Anything else at the target — a Megatron save root, a torch_dist checkpoint, a
tensorizer model directory with the user's own ``manifest.json``, a file, a symbolic
link, or a checkpoint a user added files to — is refused with a :class:`CheckpointError`
naming it (:func:`check_save_target`), before any rank writes, and again at the commit
on what was actually moved aside. A replace deletes the whole old directory, so a
directory with files megashard did not write is never replaced: move them out first. The
same rule guards every deletion here (old copies, recovery, retention): megashard deletes
only directories it could have written.

Save protocol
-------------
For a checkpoint whose final directory is ``<parent>/<name>/``:

1. rank 0 checks the target, picks a ``token`` (``[A-Za-z0-9_-]+``) and creates
   ``<parent>/.<name>.tmp-<token>/`` with :func:`make_temp_dir`, which writes an owner
   record (:data:`OWNER_NAME`: host, boot id, pid namespace, pid and process start time;
   removed right after the commit's rename); then it sends every rank the token.
2. every other rank finds that directory with :func:`join_temp_dir` and never creates it:
   a rank that does not see it resolves the path to another directory (node-local disk,
   another mount, a relative path with another working directory) and the save fails on
   every rank before anything is committed. Every rank writes its ``.tensors`` files
   there, fsyncs them and reports their names and sizes and the directory's identity
   (:func:`dir_identity`).
3. rank 0 checks that every reported file is in the temp dir with its reported size
   (:func:`check_reported_files`), writes the index with :func:`write_file_atomic` and
   calls :func:`commit_dir` (below), then writes the tracker last (:func:`megashard.storage.write_tracker`).
   A save that fails removes its own temp dir.

Commit (:func:`commit_dir`, lock-free; needs only POSIX ``rename`` of directories, which
NFS and Lustre provide): while ``<name>`` is a
non-empty directory, the save renames it to its own ``.<name>.old-<token>[-n]`` (after
checking it may be replaced, and again on what it moved) and renames its temp dir to
``<name>``. A rename onto a non-empty directory fails, so when another save published in
between, this one moves that checkpoint aside too and commits after it (last commit
wins). Only then does it delete the ``.old-*`` names *it* created, nothing else. Two
saves of one name therefore both commit, one after the other; at every instant
``<name>`` or an ``.old-*`` copy holds the latest committed checkpoint.

Invariants: a directory is a checkpoint iff its ``manifest.json`` parses as megashard's
head (:func:`is_checkpoint`); ``manifest.json`` is only ever created by
an atomic rename after its bytes and every shard are durable; ``.<name>.tmp-*``
directories are never checkpoints, whatever they contain.

Recovery rule (:func:`recover`; :func:`locate` finds the same checkpoint read-only)
------------------------------------------------------------------------------------
* ``<name>`` is a checkpoint: use it; ``.<name>.old-*`` copies that were there before it
  was checked (and hold only megashard's names) are superseded and deleted.
* ``<name>`` is absent but a ``.<name>.old-*`` directory is a checkpoint (a crash
  between moving the old checkpoint aside and renaming the new one in): rename the
  newest such directory (by its manifest's mtime) back to ``<name>`` and use it.
* otherwise there is no checkpoint called ``<name>``.

:func:`recover` then removes the leftovers of dead saves of ``<name>`` (the rule below);
:func:`megashard.storage.recover_path` (``megashard recover``) applies both to every iteration of a Megatron save root.

Deleting a directory (:func:`remove_checkpoint`) works through descriptors: it opens the
directory (``O_NOFOLLOW``), checks that directory, adds the deleting process's owner record
(a temp dir keeps its save's), renames it to ``.<name>.del-<random>`` and, only if what it
renamed is the directory it opened, removes its manifest and then the rest through the
descriptor; a symbolic link swapped in meanwhile is put back, never followed.

Abandoned temporaries (:func:`cleanup_stale_temps`; every commit runs it on its parent,
for every name, and the Megatron adapter on its save root): a ``.<name>.tmp-*``
directory, and a ``.<name>.del-<hex>`` one (an interrupted deletion), is removed when
provably abandoned — its owner record names a process of this
machine (same boot id, hostname and pid namespace) that no longer runs (no such pid, or
one started at another time); or it has no such record or one from another machine, holds
only names megashard writes, and nothing in it changed for ``older_than_s`` (24 h by
default: another machine's save may still be running, or waiting for an async commit). An empty
``.<name>.del-<hex>`` (a deletion killed before its last ``rmdir``) is removed at once: nothing in it to lose,
and so is one this process's own deletion created that holds only megashard's files (``weed mount`` can
finish a directory rename after the directory was removed, bringing the name back; :data:`_OWN_DELETIONS`).
Without such a record, one holding anything else is never removed. A leftover that cannot be listed (another
node is renaming or removing it) is left for a later clean-up; the others are still looked at. ``.<name>.old-*``
megashard checkpoints holding only megashard's names go once ``<name>`` is a checkpoint,
the atomic writes' temporary files once old. Nothing else in the parent is touched.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from ..errors import CheckpointError, CommitConflictError
from ..saveroot import TRACKER_MAX, TRACKER_NAME, iteration_dir_name, parse_iteration_dir_name, parse_tracker
from .base import (MANIFEST_DIGEST_NAME, MANIFEST_NAME, PathLike, Recovery, check_member_name, is_url, local_path,
                   manifest_digest, max_manifest_bytes)
from .ownership import (DEFAULT_STALE_AGE_S, OWNER_NAME, host_identity, owner_alive, owner_record, read_small, why_kept,
                        write_owner)

logger = logging.getLogger(__name__)

_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]+\Z")
# .<name>.<kind>-<token>; tokens contain no '.', so the last '.' splits unambiguously.
_AUX_RE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<token>[A-Za-z0-9_-]+)\Z")


class CheckpointFiles:
    """Opens the files of one checkpoint directory, never leaving it.

    Every member is opened relative to the directory's file descriptor with
    ``O_NOFOLLOW`` and must be a regular file (of the size the manifest says, when
    given), so neither a symbolic link nor a hostile name can make a load read
    anything outside the directory. Descriptors are cached until :meth:`close`.

    Loads read through :meth:`read_into`; only scatter's descriptor passing takes
    :meth:`descriptor`, and only where :attr:`passes_descriptors`. Another storage's files
    object (an object store's) has the same methods, with ``passes_descriptors = False``.
    """

    #: :meth:`descriptor` gives a descriptor another process of the node can read through
    passes_descriptors = True

    def __init__(self, base: PathLike) -> None:
        self.base = os.fspath(base)
        try:
            self.dir_fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointError(f"{self.base}: cannot open the checkpoint directory ({e.strerror})") from None
        self._fds: dict = {}
        self._wait_until: Optional[float] = None  # see _wait_left

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

    @staticmethod
    def read_threads() -> int:
        """Threads one bulk read of a member uses here (``read_into``'s ``threads``): the file
        system's default (:func:`megashard.format.fastio.default_read_threads`)."""
        from ..format.fastio import default_read_threads  # imported late: storage stays torch-free

        return default_read_threads()

    def path(self, name: str) -> str:
        return os.path.join(self.base, name)

    def open(self, name: str, size: Optional[int] = None) -> int:
        """A read-only descriptor of member ``name`` (checked: plain name, regular file,
        no symlink, and exactly ``size`` bytes when given).

        A ``size`` comes from the committed index, which names the member: one that does not
        exist (yet) is waited for, up to :func:`fs_wait_s`, before it is reported missing (a
        load started on another node right after the commit, on a mount whose metadata cache
        lags). Without a size (the head, the digest, a probe) nothing is waited for."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        check_member_name(name, self.base)
        where = self.path(name)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(name, flags, dir_fd=self.dir_fd)
        except OSError as e:
            err: Optional[OSError] = e
            wait = self._wait_left() if e.errno == errno.ENOENT and size is not None else 0.0
            if wait:
                fd, err = self._wait_for(name, flags, wait)
            if err is not None:
                why = "it is a symbolic link (refused)" if err.errno == errno.ELOOP else err.strerror
                if wait and err.errno == errno.ENOENT:
                    raise CheckpointError(
                        f"{where}: cannot open ({why}), although the checkpoint's index names it ({size} bytes), "
                        f"after waiting {wait:g} s for a shared file system to show it (MEGASHARD_FS_WAIT_S); the "
                        f"checkpoint is incomplete: `megashard verify {self.base}` lists what is missing") from None
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

    def _wait_left(self) -> float:
        """What is left of this files object's one wait (:func:`fs_wait_s` from the first member
        waited for): a checkpoint missing many files fails after one wait, not one per file."""
        now = time.monotonic()
        if self._wait_until is None:
            self._wait_until = now + fs_wait_s()
        return max(0.0, self._wait_until - now)

    def _wait_for(self, name: str, flags: int, wait_s: float) -> Tuple[int, Optional[OSError]]:
        """Member ``name`` opened once it shows, polling up to ``wait_s``: (descriptor, None), or
        (-1, the last error: ENOENT when it never showed)."""
        got: List[int] = []
        last: List[OSError] = []
        t0 = time.monotonic()

        def there() -> bool:
            try:
                got.append(os.open(name, flags, dir_fd=self.dir_fd))
            except FileNotFoundError as e:
                last[:] = [e]
                return False
            except OSError as e:  # it showed, as something the open refuses: reported as such
                last[:] = [e]
                return True
            return True

        _poll(there, wait_s)
        if not got:
            return -1, last[0] if last else OSError(errno.ENOENT, os.strerror(errno.ENOENT))
        logger.warning("%s: showed %.1f s after the load first looked for it (a shared file system whose metadata "
                       "lags: MEGASHARD_FS_WAIT_S bounds the wait)", self.path(name), time.monotonic() - t0)
        return got[0], None

    def size(self, name: str) -> int:
        return os.fstat(self.open(name)).st_size

    def read_into(self, name: str, reqs: Sequence[Tuple[int, memoryview]], *, size: Optional[int],
                  threads: int) -> int:
        """Fill each ``(offset, view)`` of ``reqs`` from member ``name`` (opened and checked as by
        :meth:`open`; offsets validated by the caller) with parallel, coalesced ``preadv``
        (the row runs of a :class:`~megashard.format.fastio.Requests` one ``preadv`` per
        IOV_MAX rows); returns the bytes read. With no requests: only the checks."""
        from ..format.fastio import read_requests  # imported late: storage stays torch-free

        fd = self.open(name, size)
        if not reqs:
            return 0
        return read_requests(fd, reqs, self.path(name), threads)

    def read_files(self, jobs: Sequence[Tuple[str, Sequence[Tuple[int, memoryview]], Optional[int]]], *,
                   threads: int) -> int:
        """:meth:`read_into` of several members ``(name, reqs, size)``, one after another (each
        already spread over ``threads``); an object store's files object reads them at once."""
        return sum(self.read_into(name, reqs, size=size, threads=threads) for name, reqs, size in jobs)

    def descriptor(self, name: str, size: Optional[int]) -> int:
        """Member ``name``'s checked descriptor (cached; closed by :meth:`close`), for passing to
        another process of the node."""
        return self.open(name, size)

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

    def tensor_reader(self, name: str) -> Any:
        """A :class:`~megashard.format.TensorFileReader` of member ``name`` (no link followed)."""
        from ..format import TensorFileReader

        check_member_name(name, self.base)
        return TensorFileReader(name, dir_fd=self.dir_fd, nofollow=True, shown=self.path(name))

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



def _split_final(final_dir: PathLike) -> Tuple[str, str]:
    final = local_path(final_dir)
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
    """Create (with parents) the temp dir of a save, with its owner record; return its path.

    Called once per save, by the coordinator (rank 0): the directory must not exist (a
    save owns exactly the temp dir it created). Other ranks find it with
    :func:`join_temp_dir`.
    """
    tmp = temp_dir_name(final_dir, token)
    parent = os.path.dirname(tmp)
    os.makedirs(parent, exist_ok=True)
    record = owner_record()  # composed first (it reads /proc): the directory is never long without it
    try:
        os.mkdir(tmp)
    except FileExistsError:
        raise CheckpointError(f"{tmp} already exists: another save uses the token {token!r}") from None
    dfd = _open_dir(tmp)
    try:
        write_owner(dfd, record)
    finally:
        os.close(dfd)
    fsync_path(tmp)
    fsync_path(parent)
    return tmp


#: How long a rank waits, by default, for what another node wrote to show in its view of a shared
#: filesystem (a mount whose metadata cache lags: ``weed mount``, NFS attribute caches). Only a save
#: that is about to be refused waits this long.
FS_WAIT_S = 10.0


def fs_wait_s() -> float:
    """The wait for another node's writes to show (``MEGASHARD_FS_WAIT_S``, else :data:`FS_WAIT_S`)."""
    raw = os.environ.get("MEGASHARD_FS_WAIT_S", "")
    try:
        return max(0.0, float(raw)) if raw else FS_WAIT_S
    except ValueError:
        raise CheckpointError(f"MEGASHARD_FS_WAIT_S={raw!r} is not a number of seconds; unset it or give one, e.g. 10") from None


def _poll(ready: Callable[[], bool], wait_s: float) -> bool:
    """Call ``ready`` until it is true or ``wait_s`` has passed (polling 50 ms, backing off to 0.5 s)."""
    deadline = time.monotonic() + wait_s
    pause = 0.05
    while True:
        if ready():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)


def join_temp_dir(final_dir: PathLike, token: str, wait_s: Optional[float] = None) -> str:
    """The temp dir rank 0 created for this save, as this rank sees it (never created here).

    Not finding it within ``wait_s`` (default :func:`fs_wait_s`) means this rank's ``final_dir``
    is another directory than rank 0's: the save is refused (a commit would lack this rank's files).
    """
    tmp = temp_dir_name(final_dir, token)

    def there() -> bool:
        try:
            return stat.S_ISDIR(os.stat(tmp).st_mode)
        except FileNotFoundError:
            return False

    if _poll(there, fs_wait_s() if wait_s is None else wait_s):
        return tmp
    raise CheckpointError(
        f"{tmp}: the temporary directory rank 0 created for this save is not here; "
        f"{os.fspath(final_dir)} on this host ({socket.gethostname()}) is another directory than on rank 0 "
        "(node-local disk, a different mount, or a relative path with another working directory). "
        "Every rank must write into one directory: save to a shared filesystem every rank sees, "
        "with an absolute path")


def dir_identity(path: PathLike) -> List[Any]:
    """``[machine, st_dev, st_ino]`` of a directory: equal on two ranks of one machine (and
    mount namespace) iff they see the same directory."""
    st = os.stat(path)
    ident = host_identity()
    return [f"{ident['host']}/{ident['boot_id']}/{ident['mntns']}", st.st_dev, st.st_ino]


def check_reported_files(temp_dir: PathLike, files: Mapping[int, Mapping[str, int]],
                         where: Optional[Mapping[int, Sequence[Any]]] = None) -> None:
    """Coordinator, before the index is written: every file every rank reported
    (``{rank: {name: bytes}}``) is a regular file in ``temp_dir`` of that size, and ranks
    on one machine wrote into the same directory (``where``: :func:`dir_identity` by rank).
    A CheckpointError names the ranks and files otherwise: nothing is committed."""
    temp_dir = os.fspath(temp_dir)
    bad: Dict[int, List[str]] = {}
    if where:
        mine = where.get(0)
        for r, w in sorted(where.items()):
            if mine and w and w[0] == mine[0] and list(w[1:]) != list(mine[1:]):
                bad.setdefault(r, []).append("its temporary directory is another directory than rank 0's "
                                             f"on the same machine (device/inode {w[1]}/{w[2]}, rank 0: "
                                             f"{mine[1]}/{mine[2]})")
    wanted = [(r, check_member_name(name, temp_dir), size)
              for r, names in sorted(files.items()) for name, size in sorted(names.items())]
    dfd = os.open(temp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def problem(item: Tuple[int, str, int]) -> Optional[str]:
        _r, name, size = item
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return f"{name} (missing here, {size} bytes written)"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} (not a regular file here, {size} bytes written)"
        if st.st_size != size:
            return f"{name} ({st.st_size} bytes here, {size} bytes written)"
        return None

    def problems(items: List[Tuple[int, str, int]]) -> List[Tuple[Tuple[int, str, int], str]]:
        if len(items) > 256:  # one stat per rank's file: in parallel on a network filesystem
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(32) as pool:
                found = list(pool.map(problem, items))
        else:
            found = [problem(w) for w in items]
        return [(w, why) for w, why in zip(items, found) if why is not None]

    try:
        left = problems(wanted)
        if left and not bad:  # another node's files may show late on a shared mount: wait for them
            def settled() -> bool:
                left[:] = problems([w for w, _ in left])
                return not left

            _poll(settled, fs_wait_s())
    finally:
        os.close(dfd)
    for (r, _name, _size), why in left:
        bad.setdefault(r, []).append(why)
    if bad:
        order = sorted(bad)
        ranks = ", ".join(str(r) for r in order[:20]) + (f", ... ({len(order)} ranks)" if len(order) > 20 else "")
        shown = "; ".join(f"rank {r}: {', '.join(bad[r][:5])}{' ...' if len(bad[r]) > 5 else ''}"
                          for r in order[:16])
        raise CheckpointError(
            f"{temp_dir}: files reported by rank(s) {ranks} are not in the directory being committed "
            f"as written ({shown}); the ranks do not write into one shared directory (node-local disks, "
            "different mounts, or a relative path with per-rank working directories). Nothing was "
            "committed: save to a shared filesystem every rank sees, with an absolute path")



# --------------------------------------------------------------------------- checkpoints


def _open_dir(name: PathLike, dir_fd: Optional[int] = None, follow: bool = False) -> int:
    """A descriptor of directory ``name`` (relative to ``dir_fd``); a symbolic link is refused
    (ELOOP/ENOTDIR) unless ``follow``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    return os.open(name, flags, dir_fd=dir_fd)


def head_problem(dfd: int, where: str) -> Optional[str]:
    """Why the directory open as ``dfd`` is not a megashard checkpoint; None when it is: its
    ``manifest.json`` (a regular file of it, no link followed, at most
    :func:`max_manifest_bytes`) parses as megashard's head (:func:`megashard.manifest.parse_head`,
    the rule the object store applies too). Reads the head only, never the index or shards."""
    from ..manifest import parse_head  # one definition; imported late (storage stays torch-free)

    try:
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        return f"it has no {MANIFEST_NAME}"
    except OSError as e:
        return f"its {MANIFEST_NAME} " + ("is a symbolic link" if e.errno == errno.ELOOP
                                           else f"cannot be opened ({e.strerror})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"its {MANIFEST_NAME} is not a regular file"
        if st.st_size > max_manifest_bytes():
            return (f"its {MANIFEST_NAME} ({st.st_size} bytes) is over the limit of {max_manifest_bytes()} "
                    "(MEGASHARD_MAX_MANIFEST_BYTES raises it)")
        chunks, pos = [], 0
        while pos < st.st_size:
            data = os.pread(fd, st.st_size - pos, pos)
            if not data:
                break
            chunks.append(data)
            pos += len(data)
    except OSError as e:
        return f"its {MANIFEST_NAME} cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    try:
        parse_head(b"".join(chunks), os.path.join(where, MANIFEST_NAME))
    except CheckpointError as e:
        return f"its {MANIFEST_NAME} is not a megashard manifest ({str(e)[:400]})"
    return None


def is_checkpoint(path: PathLike) -> bool:
    """True iff ``path`` is a directory whose ``manifest.json`` parses as megashard's head
    (:func:`head_problem`).

    Parsing (not just stat) guards against manifests damaged after the fact and a user's own
    ``manifest.json``; the commit protocol itself never exposes a partial manifest.
    """
    try:
        dfd = _open_dir(path, follow=True)
    except OSError:
        return False
    try:
        return head_problem(dfd, os.fspath(path)) is None
    finally:
        os.close(dfd)


def _megashard_member(name: str) -> bool:
    """A name megashard writes into a checkpoint directory (the owner record only stays
    there when a save is killed right after its commit's rename)."""
    from ..manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)

    return name in (MANIFEST_NAME, MANIFEST_DIGEST_NAME, INDEX_NAME, OWNER_NAME) or (
        name.endswith(".tensors") and not name.startswith("."))


def replace_problem(path: PathLike) -> Optional[str]:
    """Why a save (or a clean-up) may not replace or delete ``path``; None when it may: it
    does not exist, is an empty directory, or is a megashard checkpoint holding only
    megashard's names (:func:`replace_problem_at`). Looks at one directory (by descriptor),
    whatever renames happen meanwhile."""
    path = os.fspath(path)
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return "it is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return "it is a file, not a directory"
        return f"it cannot be opened ({e.strerror})"
    try:
        return replace_problem_at(fd, path)
    finally:
        os.close(fd)


def replace_problem_at(dfd: int, where: str) -> Optional[str]:
    """:func:`replace_problem` of the directory open as ``dfd`` (``where`` names it)."""
    try:
        with os.scandir(dfd) as it:
            regular = {e.name: e.is_file(follow_symlinks=False) for e in it}
    except OSError as e:
        if e.errno in _VANISHING_ERRNOS:  # one message per errno: _settled looks again at these
            return f"it cannot be listed ({os.strerror(e.errno)})"
        return f"it cannot be listed ({e.strerror})"
    foreign = sorted(n for n, reg in regular.items() if not (reg and _megashard_member(n)))
    shown = ", ".join(foreign[:8]) + (f", ... ({len(foreign)} entries)" if len(foreign) > 8 else "")
    if not regular.get(MANIFEST_NAME):
        if not regular:
            return None
        return NO_MANIFEST + (f" and holds {shown}" if foreign else "")
    if foreign:
        return f"it holds files megashard did not write: {shown}"
    return head_problem(dfd, where)


#: :func:`replace_problem` of a directory holding only megashard's names but no manifest.
NO_MANIFEST = f"it has no {MANIFEST_NAME}"

#: Listing a directory just opened fails with these when it is gone meanwhile: on a shared mount
#: another node's rename moved or emptied it (``weed mount`` answers ENOENT; NFS ESTALE).
_VANISHING_ERRNOS = (errno.ENOENT, errno.ESTALE)

#: :func:`replace_problem` of a directory that could be opened but not listed (:data:`_VANISHING_ERRNOS`).
VANISHED = tuple(f"it cannot be listed ({os.strerror(n)})" for n in _VANISHING_ERRNOS)

#: What :func:`_settled` looks at again: a rename still arriving or another node's rename racing this look.
_UNSETTLED = (NO_MANIFEST,) + VANISHED


def _settled(problem: Callable[[], Optional[str]], where: str,
             unsettled: Tuple[str, ...] = _UNSETTLED) -> Optional[str]:
    """``problem()``, asked again while its answer is one of ``unsettled``, up to :func:`fs_wait_s`.

    A directory of megashard's files without a manifest may be a commit still arriving: a shared
    mount whose directory rename is not atomic (``weed mount`` shows the entries of a renamed
    directory one by one, to its own node too) shows it so for a moment. A directory that could be
    opened but not listed (:data:`VANISHED`) was moved or emptied by another node's rename of the
    same name meanwhile: looked at again (by path), it is gone, or shows what it holds."""
    why = problem()
    if why not in unsettled:
        return why
    t0, seen = time.monotonic(), [why]

    def settled() -> bool:
        seen[0] = problem()
        return seen[0] not in unsettled

    if _poll(settled, fs_wait_s()):
        logger.info("%s: %s at first, settled after %.2f s (a rename arriving or racing on a shared file "
                    "system; MEGASHARD_FS_WAIT_S bounds the wait)", where, why, time.monotonic() - t0)
    return seen[0]


def _settled_replace_problem_at(dfd: int, where: str) -> Optional[str]:
    """:func:`replace_problem_at`, waiting out a rename still arriving (:func:`_settled`). A descriptor
    that cannot be listed stays so: :func:`remove_checkpoint` opens the path again instead."""
    return _settled(lambda: replace_problem_at(dfd, where), where, (NO_MANIFEST,))


def _vanished_error(what: str, path: str, why: str, final: str) -> CheckpointError:
    """The error of a directory that stayed unlistable (:data:`VANISHED`) for all of :func:`fs_wait_s`."""
    return CheckpointError(
        f"{what}: {path} was opened but {why[3:]} for {fs_wait_s():g} s: another node keeps renaming or deleting "
        "it on a shared mount whose directory renames are not atomic (weed mount), or the mount lost it. Nothing "
        f"was deleted (`megashard recover {final}` restores a copy a save moved aside); retry the save, and raise "
        "MEGASHARD_FS_WAIT_S to look longer")


def _fragment_ok(dfd: int, where: str) -> Optional[str]:
    """:func:`replace_problem_at` of a copy this commit moved aside that held megashard's files
    without their manifest (:func:`commit_dir`): that is no reason to keep it, anything else is."""
    why = replace_problem_at(dfd, where)
    return None if why == NO_MANIFEST else why


def check_save_target(final_dir: PathLike) -> None:
    """Refuse (CheckpointError naming it) a save target that is not a megashard checkpoint
    with only megashard's files, an empty directory, or absent (see the module docstring).
    One without a manifest is looked at again for a while first (:func:`_settled`)."""
    final = os.path.abspath(os.fspath(final_dir))
    why = _settled(lambda: replace_problem(final), final)
    if why is None:
        return
    if why in VANISHED:
        raise _vanished_error(f"cannot save to {final} now", final, why, final)
    if why.startswith("it holds files"):
        raise CheckpointError(
            f"refusing to save to {final}: {why}. A save replaces the whole directory and would delete them; "
            "move them out of the checkpoint directory, or save elsewhere")
    raise CheckpointError(
        f"refusing to save to {final}: it is not a megashard checkpoint ({why}), and a save only ever replaces "
        "a megashard checkpoint. Save to a new directory (for a Megatron save root, its iter_XXXXXXX "
        "subdirectory), or move it away first")


#: What :func:`remove_checkpoint` asks of the directory it opened (descriptor, path) before
#: removing it: None, or why it must stay.
RemoveCheck = Callable[[int, str], Optional[str]]


def remove_checkpoint(path: PathLike, check: Optional[RemoveCheck] = None) -> Optional[str]:
    """Delete a checkpoint (or a save's temporary) directory so that no crash leaves a
    half-deleted *checkpoint*; return None when it is gone, or why it was left as it is.

    Everything happens relative to descriptors, so a symbolic link (or another directory)
    swapped in at ``path`` is never followed or emptied: the directory is opened
    (``O_NOFOLLOW``), ``check`` (the caller's rule, e.g. :func:`replace_problem_at`) looks at
    that directory, the deleting process's owner record is added (unless it has one), it is
    renamed to ``.<name>.del-<random>`` (recognisably garbage for :func:`cleanup_stale_temps`,
    which applies the owner rule of temporaries), and only if the renamed entry is still the
    directory opened are its manifest and then the rest removed through the descriptor.
    Anything but a directory at ``path`` is left.
    """
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    try:  # FileNotFoundError anywhere means another process is deleting it too: fine
        pfd = _open_dir(parent, follow=True)
    except FileNotFoundError:
        return None
    try:
        for look in range(MAX_RACED_RENAMES + 1):
            try:
                dfd = _open_dir(base, dir_fd=pfd)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                why = "it is a symbolic link or a file, not a directory"
                logger.warning("leaving %s: %s", path, why)
                return why
            try:
                why = _remove_dir(pfd, base, dfd, path, check)
            finally:
                os.close(dfd)
            if why not in VANISHED or look == MAX_RACED_RENAMES:
                return why
            # opened but not listable: another node's rename moved or emptied it; its path, opened
            # again, names what is there now (or nothing)
            logger.info("%s: %s; looking again", path, why)
            time.sleep(0.05 * (look + 1))
        return why
    finally:
        os.close(pfd)


#: The ``.<name>.del-*`` directories this process's :func:`remove_checkpoint` finished removing, by path,
#: oldest first, at most :data:`_OWN_DELETIONS_MAX`. ``weed mount`` can finish a directory rename after
#: the renaming process removed the renamed directory: the ``.del-*`` name shows up again holding the
#: copy's files (the owner record may be missing: no other process could attribute it for a day). This
#: process created that name and its deletion is over (one interrupted or still running is never listed
#: here: the owner rule keeps it), so its clean-up (:func:`cleanup_stale_temps`, run by every commit)
#: removes it, when it holds only files megashard writes (:func:`_own_deletion_check`).
_OWN_DELETIONS: Dict[str, None] = {}
_OWN_DELETIONS_MAX = 4096
_OWN_DELETIONS_LOCK = threading.Lock()  # saves of one process may run in threads (async saves)


def _own_deletion(path: str) -> bool:
    return os.path.abspath(path) in _OWN_DELETIONS


def _remember_deletion(path: str) -> None:
    with _OWN_DELETIONS_LOCK:
        _OWN_DELETIONS[os.path.abspath(path)] = None
        while len(_OWN_DELETIONS) > _OWN_DELETIONS_MAX:
            del _OWN_DELETIONS[next(iter(_OWN_DELETIONS))]


def _forget_deletion(path: str) -> None:
    with _OWN_DELETIONS_LOCK:
        _OWN_DELETIONS.pop(os.path.abspath(path), None)


def _own_deletion_check(dfd: int, where: str) -> Optional[str]:
    """A :data:`RemoveCheck` for a ``.del-*`` directory this process created (:data:`_OWN_DELETIONS`):
    removable when it holds nothing but files megashard writes."""
    return None if _members_only(dfd) else "it holds names megashard does not write"


def _remove_dir(pfd: int, base: str, dfd: int, path: str, check: Optional[RemoveCheck]) -> Optional[str]:
    """:func:`remove_checkpoint` of directory ``base`` of ``pfd``, open as ``dfd``."""
    opened = os.fstat(dfd)
    why = check(dfd, path) if check is not None else None
    if why is not None:  # the caller says what it makes of it
        return why
    m = _AUX_RE.match(base)
    if not (m and m.group("kind") == "del"):
        try:  # names who deletes it, so a clean-up leaves a deletion still running and ends a dead one's
            write_owner(dfd)
        except FileExistsError:
            pass  # a save's temp dir: its save owns it (the save discarding it, or a dead one)
        except OSError as e:  # a clean-up then goes by age
            logger.debug("no owner record in %s: %s", path, e)
        trash = f".{m.group('name') if m else base}.del-{uuid.uuid4().hex}"
        try:
            os.rename(base, trash, src_dir_fd=pfd, dst_dir_fd=pfd)
        except FileNotFoundError:
            return None
        base = trash
        try:
            moved = os.stat(trash, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            moved = None
        if moved is None or (moved.st_dev, moved.st_ino) != (opened.st_dev, opened.st_ino):
            # something else was swapped in after the directory was opened: put it back, untouched
            if moved is not None and not os.path.lexists(path):
                os.rename(trash, os.path.basename(path), src_dir_fd=pfd, dst_dir_fd=pfd)
            why = "it was replaced by something else while being removed"
            logger.warning("leaving %s: %s", path, why)
            return why
    try:
        os.unlink(MANIFEST_NAME, dir_fd=dfd)
    except FileNotFoundError:
        pass

    def emptied() -> bool:
        with os.scandir(dfd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        # the owner record last: a deleter killed in between leaves a directory that still names it
        entries.sort(key=lambda e: e[0] == OWNER_NAME)
        for name, is_dir in entries:
            try:
                if is_dir:
                    shutil.rmtree(name, dir_fd=dfd)  # descriptor-based: never follows a link
                else:
                    os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
        try:
            still = os.stat(base, dir_fd=pfd, follow_symlinks=False)
            if (still.st_dev, still.st_ino) == (opened.st_dev, opened.st_ino):
                os.rmdir(base, dir_fd=pfd)
        except FileNotFoundError:
            pass
        except OSError as e:  # a shared mount still showing entries of a rename just made
            if e.errno != errno.ENOTEMPTY:
                raise
            return False
        return True

    if not _poll(emptied, fs_wait_s()):
        raise OSError(errno.ENOTEMPTY, f"still not empty after {fs_wait_s():g} s (MEGASHARD_FS_WAIT_S)",
                      os.path.join(os.path.dirname(path), base))
    _remember_deletion(os.path.join(os.path.dirname(path), base))  # finished: should the name come back
    return None


#: Publishing gives up after this many rounds of other saves committing the same name in between.
MAX_COMMIT_ROUNDS = 32


#: A rename racing another node's rename of the same name on a shared mount may fail with these
#: (``weed mount`` answers EIO); the commit looks again, at most :data:`MAX_RACED_RENAMES` times.
_RACED_RENAME_ERRNOS = (errno.EIO, errno.ESTALE)
MAX_RACED_RENAMES = 5


def _raced(e: OSError, raced: List[OSError]) -> bool:
    """Whether ``e`` may be a shared mount's answer to two nodes renaming one name at once (and
    another look is still allowed); pauses a little before that look."""
    if e.errno not in _RACED_RENAME_ERRNOS or len(raced) >= MAX_RACED_RENAMES:
        return False
    logger.info("rename failed (%s); another node may be renaming the same name: looking again", e)
    time.sleep(0.05 * (len(raced) + 1))
    return True


def _fresh_old_name(final: str, token: str, n: int) -> str:
    old = _old_dir_name(final, token if n == 0 else f"{token}-{n}")
    while os.path.lexists(old):
        old = _old_dir_name(final, f"{token}-{uuid.uuid4().hex[:8]}")
    return old


def commit_dir(temp_dir: PathLike, final_dir: PathLike) -> None:
    """Atomically publish ``temp_dir`` as ``final_dir`` (see the module docstring).

    Requires ``manifest.json`` in ``temp_dir``: a directory without it is never a
    checkpoint, so publishing it would be a bug in the caller. Shard files must
    already be fsynced by their writers; this fsyncs the directories involved.
    An existing ``final_dir`` that is not a megashard checkpoint is refused; one that
    cannot be replaced is restored, and CheckpointError is raised. Deletes only the
    ``.old-*`` copies this commit created.
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
    olds: List[str] = []  # what this commit moved aside: the only names it deletes
    raced: List[OSError] = []  # renames a shared mount failed while another node's raced them
    fragments: Set[str] = set()  # of olds: parts of a checkpoint another node's raced rename split
    for _round in range(MAX_COMMIT_ROUNDS):
        if _occupied(final):
            check_save_target(final)
            old = _fresh_old_name(final, token, len(olds))
            try:
                os.rename(final, old)
            except FileNotFoundError:
                continue  # another save moved it aside just now
            except OSError as e:
                if not _raced(e, raced):
                    raise
                raced.append(e)
                if not os.path.lexists(old):
                    continue
            olds.append(old)
            fsync_path(parent)
            logger.debug("moved existing %s aside to %s", final, old)
            why = _settled(lambda: replace_problem(old), old)
            if why == NO_MANIFEST:
                # only megashard's files, its manifest elsewhere: another node moved the same checkpoint
                # aside at the same moment on a mount whose directory renames are not atomic (weed mount
                # splits the entries between the two names). It is superseded like any copy moved aside
                fragments.add(old)
                logger.warning("%s moved aside without its %s (another node's rename raced this one on a "
                               "mount whose renames are not atomic): committing after it", final, MANIFEST_NAME)
            elif why in VANISHED:  # another node's rename keeps it from this one: nothing to decide on
                olds.pop()
                _put_back(old, final)
                raise _vanished_error(f"could not commit {temp_dir} as {final}", old, why, final)
            elif why is not None:  # replaced by something else since it was checked: put it back
                olds.pop()
                _put_back(old, final)
                raise CheckpointError(f"refusing to replace {final}: it is no longer a megashard checkpoint "
                                      f"({why}); left it as it was")
        try:
            os.rename(temp_dir, final)
            break
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                continue  # another save published in between: commit after it
            if _raced(e, raced) and os.path.lexists(temp_dir):
                raced.append(e)
                continue
            if olds and not os.path.lexists(final):
                _put_back(olds.pop(), final)
            _drop_superseded(olds, final)
            if e.errno == errno.ENOTDIR:
                check_save_target(final)
            raise CheckpointError(f"could not rename {temp_dir} to {final}: {e}") from e
    else:
        _drop_superseded(olds, final)
        raise CheckpointError(f"could not commit {temp_dir} as {final}: other saves committed that name "
                              f"{MAX_COMMIT_ROUNDS} times in between; {temp_dir} is left for a retry")
    fsync_path(parent)
    logger.info("committed checkpoint %s", final)
    try:  # kept up to the rename, so a temp dir of a killed save always names its owner
        os.unlink(os.path.join(final, OWNER_NAME))
    except OSError:
        pass
    for old in olds:  # the new checkpoint is durable: the copies this save moved aside are garbage
        try:
            why = remove_checkpoint(old, check=_fragment_ok if old in fragments else _settled_replace_problem_at)
            if why is not None:
                logger.warning("committed %s, but left %s: %s", final, old, why)
        except OSError as e:  # committed all the same; recover() or a later clean-up removes it
            logger.warning("committed %s, but could not remove %s: %s", final, old, e)


@functools.lru_cache(maxsize=None)
def _renameat2() -> Any:
    """libc's ``renameat2`` (glibc 2.28+), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_new_only(src: PathLike, dst: PathLike) -> None:
    """Rename ``src`` to ``dst`` only if nothing is at ``dst``: FileExistsError otherwise, ``src``
    untouched. ``renameat2(RENAME_NOREPLACE)``; where the kernel or file system lacks it, an
    exclusive ``mkdir`` of ``dst`` (a file: ``link``) and a rename onto that empty directory of
    ours, which ``rename(2)`` never lets replace a non-empty one."""
    src, dst = os.fspath(src), os.fspath(dst)
    fn = _renameat2()
    if fn is not None:
        if fn(-100, os.fsencode(src), -100, os.fsencode(dst), 1) == 0:  # AT_FDCWD, RENAME_NOREPLACE
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), src, None, dst)
    if not stat.S_ISDIR(os.lstat(src).st_mode):
        os.link(src, dst)
        os.unlink(src)
        return
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # only ever an empty directory
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise FileExistsError(errno.EEXIST, "another writer filled it first", dst) from None
        raise


def _occupied(path: str) -> bool:
    """Something a rename of a directory cannot replace: anything but an empty directory."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return True
        with os.scandir(path) as it:
            return next(it, None) is not None
    except FileNotFoundError:
        return False


def _put_back(old: str, final: str) -> None:
    try:
        os.rename(old, final)
        fsync_path(os.path.dirname(final))
    except OSError:
        logger.exception("could not move %s back to %s; recover() will", old, final)


def _drop_superseded(olds: List[str], final: str) -> None:
    """After a failed commit: this save's moved-aside copies are garbage once ``final`` is a
    checkpoint again (another save's); otherwise they stay for :func:`recover`."""
    if olds and has_manifest(final):
        for old in olds:
            remove_checkpoint(old, check=_settled_replace_problem_at)


def has_manifest(path: str) -> bool:
    """``path`` holds a regular ``manifest.json`` (opened safely; not parsed)."""
    if not os.path.isdir(path):
        return False
    try:
        with CheckpointFiles(path) as files:
            files.open(MANIFEST_NAME)
    except CheckpointError:
        return False
    return True


def refuse_object_layout(head: bytes, base: str) -> None:
    """A head naming a save prefix in a directory: objects of an object store's checkpoint
    copied as plain files (its files are one directory down, its index unreadable here)."""
    from ..manifest import parse_head  # one definition; imported late (storage stays torch-free)

    prefix = parse_head(head, os.path.join(base, MANIFEST_NAME)).get("data_prefix")
    if prefix is not None:
        raise CheckpointError(
            f"{base}: its {MANIFEST_NAME} names the object-store save prefix {str(prefix)[:80]!r}: the objects "
            "of an s3:// checkpoint copied as plain files (e.g. `aws s3 cp --recursive`), which is not a checkpoint "
            "on a file system. Copy it with `megashard copy s3://BUCKET/PREFIX DIR` instead")


def locate(final_dir: PathLike) -> Optional[str]:
    """Where the complete checkpoint called ``final_dir`` is, without changing anything.

    ``final_dir`` itself when it holds a manifest (the caller parses it); the newest ``.<name>.old-*`` checkpoint
    when ``final_dir`` is absent (a re-save crashed mid-commit: :func:`recover`, the next
    save or ``megashard recover`` puts it back); else None. Read paths use this, so
    loading or inspecting never renames or deletes. A commit running meanwhile moves
    ``final_dir`` aside and back in: looking again then finds it.
    """
    parent, name = _split_final(final_dir)
    final = os.path.join(parent, name)
    # A commit running meanwhile renames <name> and its copies: a look may miss both (a
    # listing can skip an entry renamed during it), so only three looks that find nothing
    # mean there is nothing.
    for look in range(3):
        if has_manifest(final):
            return final  # parsed (once) by the caller, which reports damage precisely
        if not os.path.lexists(final):
            candidates = _newest_first([o for o in _aux_dirs(parent, name, "old") if is_checkpoint(o)])
            if candidates:
                logger.warning("%s is missing; reading the complete copy %s left by an interrupted re-save "
                               "(run `megashard recover %s` to restore it)", final, candidates[0], final)
                return candidates[0]
        time.sleep(0.001 * look)
    return None


def _newest_first(checkpoints: List[str]) -> List[str]:
    def mtime(p: str) -> float:
        try:
            return os.stat(os.path.join(p, MANIFEST_NAME)).st_mtime
        except FileNotFoundError:
            return float("-inf")

    return sorted(checkpoints, key=mtime, reverse=True)


def locate_named(final_dir: PathLike, wait_s: Optional[float] = None) -> Optional[str]:
    """:func:`locate` for a checkpoint that something committed names (a save root's tracker):
    when it is not there (yet), look again for up to ``wait_s`` (default :func:`fs_wait_s`)
    before answering None. Another node's commit may show late on a mount whose metadata
    cache lags (``weed mount``, NFS attribute caches): a load started right after it would
    otherwise find no checkpoint, or its head not yet."""
    found = locate(final_dir)
    if found is not None or foreign_format(final_dir) is not None:
        return found  # a torch_dist / Hugging Face directory there: no megashard checkpoint to wait for
    t0 = time.monotonic()
    seen: List[Optional[str]] = []
    _poll(lambda: bool(seen.append(locate(final_dir)) or seen[-1]), fs_wait_s() if wait_s is None else wait_s)
    if seen and seen[-1] is not None:
        logger.warning("%s: showed %.1f s after the load first looked for it (a shared file system whose metadata "
                       "lags: MEGASHARD_FS_WAIT_S bounds the wait)", final_dir, time.monotonic() - t0)
        return seen[-1]
    return None


def checkpoint_location(checkpoint_dir: PathLike) -> str:
    """The directory that holds the complete checkpoint ``checkpoint_dir`` (read-only: an
    interrupted re-save's ``.old-*`` copy is read in place, never renamed)."""
    path = local_path(checkpoint_dir)
    found = locate(path)
    if found is None:
        hint = foreign_hint(path) if not os.path.lexists(os.path.join(path, MANIFEST_NAME)) else None
        if hint:
            raise CheckpointError(f"{path} is not a megashard checkpoint: {hint}")
        raise CheckpointError(
            f"{path} is not a megashard checkpoint ({why_not_checkpoint(path)}); check the path, or "
            "whether the save that should have produced it finished")
    return found


_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def foreign_format(path: PathLike) -> Optional[str]:
    """``"torch_dist"`` or ``"hf"`` when the local directory ``path`` holds a checkpoint in a format that
    ``megashard convert`` reads (megatron-core's ``metadata.json`` naming the torch_dist backend; a Hugging
    Face ``config.json`` beside safetensors weights), else None. Only names and metadata.json are read."""
    if is_url(path):
        return None
    path = os.fspath(path)
    meta = read_small(os.path.join(path, "metadata.json"), 1 << 16)
    if meta is not None:
        try:
            doc = json.loads(meta)
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist":
            return "torch_dist"
    if os.path.isfile(os.path.join(path, "config.json")) and any(
            os.path.isfile(os.path.join(path, n)) for n in _HF_WEIGHTS):
        return "hf"
    return None


def foreign_hint(path: PathLike, fmt: Optional[str] = None) -> Optional[str]:
    """What to tell a user who points a megashard reader at a torch_dist or Hugging Face directory
    (``fmt``: :func:`foreign_format`'s answer when already known)."""
    fmt = fmt or foreign_format(path)
    if fmt == "torch_dist":
        return (f"it is a torch_dist checkpoint (megatron-core's dist_checkpointing), which megashard does not "
                f"read: convert it once with `megashard convert {path} NEW_DIR` and use NEW_DIR")
    if fmt == "hf":
        return (f"it is a Hugging Face model directory: import it once with `megashard convert {path} NEW_DIR` "
                "and use NEW_DIR (Megatron: --load NEW_DIR)")
    return None


def why_not_checkpoint(path: PathLike) -> str:
    """A one-line reason why ``path`` is not a readable checkpoint (for error messages)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return f"{path} does not exist or is not a directory"
    if not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        hint = foreign_hint(path)
        if hint:
            return hint
    try:
        with CheckpointFiles(path) as files:
            json.loads(files.read_bytes(MANIFEST_NAME, max_manifest_bytes()))
    except CheckpointError as e:
        return str(e)
    except (OSError, ValueError, RecursionError) as e:
        return f"{os.path.join(path, MANIFEST_NAME)}: unreadable ({type(e).__name__}: {str(e)[:200]})"
    return f"{path} is a checkpoint"


def recover(final_dir: PathLike, older_than_s: float, into: Recovery) -> Optional[str]:
    """Apply the recovery rule; return the path of the complete checkpoint, or None.

    The one function that repairs a checkpoint's directory (``megashard recover DIR``);
    read paths use :func:`locate` and change nothing. It only renames an ``.old-*``
    back when ``<name>`` is missing, and only deletes ``.old-*`` copies (holding only
    megashard's names) that existed before ``<name>`` was found to be a checkpoint, so
    a copy a concurrent save moves aside later is never touched. Then it removes the
    leftovers of dead saves of this name (:func:`cleanup_stale_temps`, the same rule a
    save's commit applies; ``older_than_s`` as there). ``into`` records what it restored
    and removed.
    """
    parent, name = _split_final(final_dir)
    found = _recover_local(parent, name, into)
    into.removed.extend(cleanup_stale_temps(parent, name, older_than_s=older_than_s))
    return found


def _recover_local(parent: str, name: str, into: Recovery) -> Optional[str]:
    final = os.path.join(parent, name)
    olds = _aux_dirs(parent, name, "old")  # listed before <name> is checked (see above)
    if is_checkpoint(final):
        into.removed.extend(_remove_superseded(olds))
        return final
    if os.path.lexists(final):
        if any(is_checkpoint(o) for o in olds):
            logger.warning(
                "%s exists but is not a checkpoint (no %s); leaving it and %s untouched",
                final, MANIFEST_NAME, olds,
            )
        return None
    candidates = _newest_first([o for o in olds if is_checkpoint(o)])
    if not candidates:
        return None
    best = candidates[0]
    try:
        os.rename(best, final)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
            raise
        # another process recovered it, or a save committed, meanwhile
        return final if is_checkpoint(final) else None
    fsync_path(parent)
    logger.warning("restored %s from %s (a save crashed mid-commit)", final, best)
    into.restored.append((final, best))
    into.removed.extend(_remove_superseded([o for o in olds if o != best]))
    return final


def _remove_superseded(olds: List[str]) -> List[str]:
    removed = []
    for stale in olds:
        why = remove_checkpoint(stale, check=replace_problem_at)
        if why is not None:
            logger.warning("leaving %s: not a copy megashard made (%s)", stale, why)
            continue
        logger.info("removed superseded %s", stale)
        removed.append(stale)
    return removed


def _newest_mtime(dfd: int) -> float:
    """mtime of the directory open as ``dfd`` and of its direct entries: a save in progress
    keeps touching files inside even when the directory itself does not change."""
    newest = os.fstat(dfd).st_mtime
    with os.scandir(dfd) as it:
        for e in it:
            try:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                pass
    return newest


_ATOMIC_TEMP_TOKEN = re.compile(r"[0-9a-f]{32}\Z")  # write_file_atomic's uuid4().hex


def _members_only(dfd: int) -> bool:
    """The directory open as ``dfd`` holds nothing but what a save writes there (files,
    owner record, write_file_atomic's temporaries of the index)."""
    with os.scandir(dfd) as it:
        for e in it:
            m = _AUX_RE.match(e.name)
            ours = (_megashard_member(e.name)
                    or (m is not None and m.group("kind") == "tmp" and _megashard_member(m.group("name"))))
            if not (ours and e.is_file(follow_symlinks=False)):
                return False
    return True


def _abandoned(older_than_s: float) -> RemoveCheck:
    """The owner rule (:func:`~megashard.storage.ownership.why_kept`) of a save's temp dir and of a
    deletion's ``.del-*`` directory, as a :data:`RemoveCheck`: removable when its owner record names a
    process of this machine that is gone, or (no record of this machine) when it holds only
    megashard's names and nothing in it changed for ``older_than_s``."""
    now = time.time()

    def check(dfd: int, where: str) -> Optional[str]:
        m = _AUX_RE.match(os.path.basename(where))
        if m and m.group("kind") == "del" and not os.listdir(dfd):
            return None  # a deletion killed before its rmdir: nothing left to lose
        return why_kept(owner_alive(dfd), functools.partial(_members_only, dfd),
                        functools.partial(_newest_mtime, dfd), older_than_s, now)

    return check


def cleanup_stale_temps(
    parent: PathLike, name: Optional[str] = None, older_than_s: float = DEFAULT_STALE_AGE_S
) -> List[str]:
    """Remove the leftovers of dead saves in ``parent``; return the removed paths.

    The rule (module docstring): ``.X.tmp-*`` and ``.X.del-<hex>`` directories whose owner
    record names a process of this machine that is gone; those without a record of this
    machine that hold only megashard's names and whose newest mtime (their own or any
    entry's) is ``older_than_s`` old; the tracker/index temporaries of
    :func:`write_file_atomic` once that old; ``.X.old-*`` megashard checkpoints holding only
    megashard's names once ``X`` is a checkpoint. Nothing else. ``name`` restricts this to
    one checkpoint name. For a Megatron save root: call it with the root.
    """
    parent = os.fspath(parent)
    removed: List[str] = []
    try:
        entries = sorted(os.listdir(parent))  # before any <name> is checked (see recover)
    except FileNotFoundError:
        return removed
    now = time.time()
    abandoned = _abandoned(older_than_s)

    for e in entries:
        m = _AUX_RE.match(e)
        if not m or (name is not None and m.group("name") != name):
            continue
        p = os.path.join(parent, e)
        kind = m.group("kind")
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if kind == "old":
                # superseded as soon as <name> is a checkpoint (no age needed); otherwise it
                # may be the copy recover() restores
                if not is_checkpoint(os.path.join(parent, m.group("name"))):
                    continue
                check = replace_problem_at
            elif kind == "del" and not _ATOMIC_TEMP_TOKEN.match(m.group("token")):
                continue  # not a name remove_checkpoint gives
            elif _own_deletion(p):
                check = _own_deletion_check
            else:
                check = abandoned
            try:
                if remove_checkpoint(p, check=check) is not None or os.path.lexists(p):
                    continue
            except OSError as e:  # another node's rename or deletion has it: not this clean-up's to finish
                if e.errno not in _VANISHING_ERRNOS:
                    raise
                logger.info("left %s for now: %s (another node renaming or removing it on a shared mount)", p, e)
                continue
            _forget_deletion(p)
        else:
            if not (kind == "tmp" and stat.S_ISREG(st.st_mode) and _ATOMIC_TEMP_TOKEN.match(m.group("token"))
                    and (m.group("name") == TRACKER_NAME or _megashard_member(m.group("name")))
                    and now - st.st_mtime >= older_than_s):
                continue
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue
        logger.info("removed stale %s", p)
        removed.append(p)
    return removed



# --------------------------------------------------------------------------- save roots, tracker, retention


def location(path: PathLike) -> str:
    """A local checkpoint's location: the path made absolute."""
    return os.path.abspath(os.fspath(path))


def occupied(path: PathLike) -> bool:
    """Anything at ``path`` (a file, a directory, a dangling link)."""
    return os.path.lexists(os.fspath(path))


def child(root: str, name: str) -> str:
    return os.path.join(root, name)


def iteration_names(root: str, kinds: Sequence[str] = ("old",)) -> List[str]:
    """``iter_N`` / ``release`` names in local directory ``root``, also those only present as
    ``.<name>.<kind>-*`` entries of the given kinds; sorted."""
    try:
        entries = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = set()
    for e in entries:
        m = _AUX_RE.match(e)
        n = m.group("name") if m and m.group("kind") in kinds else e
        if parse_iteration_dir_name(n) is not None:
            names.add(n)
    return sorted(names)


def leftover_kind(path: str) -> str:
    """What a path :func:`megashard.storage.recover_path` removed was, in words (for its report)."""
    m = _AUX_RE.match(os.path.basename(path.rstrip("/")))
    kind = m.group("kind") if m else None
    if kind == "old":
        return "a copy an interrupted re-save left, superseded by the checkpoint"
    if kind == "del":
        return "an interrupted deletion"
    if kind == "tmp" and not os.path.basename(path).startswith(f".{TRACKER_NAME}."):
        return "a save that is no longer running left it"
    return "left by a save that did not finish"


def write_tracker(save_root: PathLike, text: str, new_only: bool = False) -> None:
    """Megatron's tracker file in directory ``save_root`` (created), written atomically. ``new_only``:
    only where there is none yet (:func:`rename_new_only`), else CommitConflictError."""
    os.makedirs(save_root, exist_ok=True)
    path = os.path.join(os.fspath(save_root), TRACKER_NAME)
    if not new_only:
        write_file_atomic(path, text)
        return
    tmp = os.path.join(os.fspath(save_root), f".{TRACKER_NAME}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "xb") as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    try:
        rename_new_only(tmp, path)
    except FileExistsError:
        raise CommitConflictError(f"{path} exists (another writer wrote it); new_only: left it untouched") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_path(save_root)


def read_tracker(load_root: PathLike) -> Optional[Union[int, str]]:
    """The iteration the tracker file in directory ``load_root`` names (:func:`~megashard.saveroot.parse_tracker`),
    or None when there is none."""
    path = os.path.join(os.fspath(load_root), TRACKER_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(TRACKER_MAX + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read tracker file {path}: {e}") from e
    return parse_tracker(raw, path)


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


# --------------------------------------------------------------------------- the save seam


def write_index(directory: str, head: bytes, sections: bytes) -> int:
    """Write an index (see :class:`~megashard.manifest.IndexBuilder`) into ``directory``:
    sections first, then the digest, then the head (a checkpoint is one once its head
    exists). Returns the bytes written."""
    from ..manifest import INDEX_NAME  # one definition; imported late (storage stays torch-free)

    write_file_atomic(os.path.join(directory, INDEX_NAME), sections)
    write_file_atomic(os.path.join(directory, MANIFEST_DIGEST_NAME), manifest_digest(head))
    write_file_atomic(os.path.join(directory, MANIFEST_NAME), head)
    return len(head) + len(sections)


_WRITE_BYTES = 1 << 20  # one pwrite of DirectorySave.write_stream


class DirectorySave:
    """Where one save writes, on a file system (the protocol of the module docstring).

    ``saving`` talks only to this interface; :class:`megashard.storage.s3.checkpoint.ObjectSave`
    is the same for an object store. Rank 0 calls :meth:`check`, :meth:`create`,
    :meth:`commit` (and :meth:`discard` on failure); every rank calls :meth:`writer`.
    """

    #: How a file is written: None means into :meth:`writer`'s directory with ``format.write_file``.
    write_file = None

    def __init__(self, final_dir: PathLike, new_only: bool = False) -> None:
        self.given = final_dir
        self.final = os.path.abspath(os.fspath(final_dir))
        self.new_only = new_only  # commit only where nothing is (rename_new_only), never replace

    def validate(self) -> None:
        local_path(self.given)

    def check(self) -> None:
        if self.new_only and os.path.lexists(self.final):
            raise CommitConflictError(f"refusing to save to {self.final}: it exists (new_only: a save never replaces "
                                      "anything there)")
        check_save_target(self.final)

    def create(self, token: str) -> str:
        return make_temp_dir(self.final, token)

    def temp_location(self, token: str) -> str:
        return temp_dir_name(self.final, token)

    def writer(self, token: str) -> Tuple[str, List[Any]]:
        """The temp dir rank 0 created, as this rank sees it, and its identity."""
        tmp = join_temp_dir(self.final, token)
        return tmp, dir_identity(tmp)

    def commit(self, token: str, files: Mapping[int, Mapping[str, Mapping[str, Any]]],
               where: Mapping[int, Any], head: bytes, sections: bytes) -> None:
        tmp = temp_dir_name(self.final, token)
        check_reported_files(tmp, {r: {n: f["bytes"] for n, f in fs.items()} for r, fs in files.items()}, where)
        write_index(tmp, head, sections)
        if not self.new_only:
            commit_dir(tmp, self.final)
            return
        fsync_path(tmp)
        try:
            rename_new_only(tmp, self.final)
        except FileExistsError:
            raise CommitConflictError(f"{self.final} appeared while this save ran (another writer); new_only: left "
                                      "it untouched, this save is discarded") from None
        fsync_path(os.path.dirname(self.final))
        with contextlib.suppress(OSError):  # kept up to the rename, as commit_dir does
            os.unlink(os.path.join(self.final, OWNER_NAME))

    @staticmethod
    def write_stream(directory: str, name: str, size: int, chunk_bytes: int,
                     chunks: Callable[[int], Iterable[memoryview]]) -> Dict[str, Any]:
        """Write member ``name`` of ``size`` bytes into :meth:`writer`'s ``directory`` (created new,
        never replacing a file) from ``chunks(chunk_bytes)``, the bytes in order, and fsync it
        (``megashard copy``). Returns the file's extra record for the index: none here."""
        from ..format.fastio import pwrite_all  # imported late: storage stays torch-free

        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            off = 0
            for mv in chunks(chunk_bytes):
                for a in range(0, mv.nbytes, _WRITE_BYTES):  # on ext4 1 MiB writes beat 32 MiB ones (10 vs 14 s/GiB)
                    pwrite_all(fd, mv[a:a + _WRITE_BYTES], off + a)
                off += mv.nbytes
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def after_commit(self) -> None:
        """Leftovers of dead saves beside it, of any name (never a save in progress)."""
        cleanup_stale_temps(os.path.dirname(self.final))

    def discard(self, created: str) -> None:
        remove_checkpoint(created)


def save_target(checkpoint_dir: PathLike, new_only: bool = False) -> DirectorySave:
    """The save seam for directory ``checkpoint_dir``."""
    return DirectorySave(checkpoint_dir, new_only)


def checkpoint_files(base: PathLike, index: Any = None) -> CheckpointFiles:
    """The files object a load reads the checkpoint in directory ``base`` through (``index``: unused
    here; an object store pins its reads to the ETags it records)."""
    return CheckpointFiles(base)

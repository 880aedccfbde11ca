"""Handing open checkpoint files to the other ranks of a node (``SCM_RIGHTS``).

In a scatter load the node's reader opens and checks every file; a rank that needs
byte ranges nobody else on the node needs can then read them itself, in parallel
with the reader, through a copy of the reader's descriptor: the node still reads
each byte from storage once, and that rank never opens anything in the checkpoint
directory (it may not even see it).

The receiving rank listens on a socket with a random name in Linux's abstract
namespace (no file to leave behind; it disappears with its last descriptor) and
sends that name with its scatter request. The reader connects, checks with
``SO_PEERCRED`` that the listener is the requesting process (same pid, same uid)
and sends the descriptors. Abstract names are visible to every local user
(``/proc/net/unix``), so anyone may connect too: a thread accepts every connection
as it arrives (a stranger cannot fill the backlog), closes those of other users at
once, keeps the first of each other process of this user until the reader's pid is
known, and then keeps only the reader's. Every socket operation has a timeout. This
module never talks to ``torch.distributed``.
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import stat
import struct
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .errors import MegashardError

log = logging.getLogger(__name__)

NAME_PREFIX = "megashard-"
MAX_FDS_PER_MESSAGE = 250  # Linux's SCM_MAX_FD is 253
TIMEOUT_S = 30.0  # the reader sends before the receiver even learns to accept: a wait here means trouble
BACKLOG = 64
MAX_HELD = 16  # connections of this user's other processes kept until the reader's pid is known
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FdPassError(MegashardError):
    """Descriptors could not be handed over (socket trouble, wrong peer, short message)."""


def supported() -> bool:
    """Abstract-namespace Unix sockets and ``SCM_RIGHTS`` helpers (Linux, Python ≥ 3.9)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED")


def _address(name: str) -> str:
    return "\0" + name


def peer_credentials(sock: socket.socket) -> Tuple[int, int]:
    """The connected peer's (pid, uid), as the kernel recorded them."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _check_peer(sock: socket.socket, pid: int, who: str) -> None:
    got_pid, got_uid = peer_credentials(sock)
    if got_pid != pid or got_uid != os.getuid():
        raise FdPassError(f"the socket's peer is pid {got_pid} (uid {got_uid}), expected {who} pid {pid} "
                          f"(uid {os.getuid()}); refusing to exchange descriptors")


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Listener:
    """The receiving rank's end: a listening socket with a fresh random name, drained by a
    thread from the start (see the module docstring); :meth:`receive` takes the reader's
    connection, :meth:`close` ends the thread and closes everything."""

    def __init__(self) -> None:
        if not supported():
            raise FdPassError("passing descriptors needs Linux (abstract Unix sockets, SCM_RIGHTS)")
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            self.sock.bind(_address(self.name))
            self.sock.listen(BACKLOG)
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            self.sock.close()
            raise FdPassError(f"cannot listen on an abstract Unix socket: {e}") from None
        self._cond = threading.Condition()
        self._held: Dict[int, socket.socket] = {}  # peer pid -> its first connection
        self._expect: Optional[int] = None  # the reader's pid, once known
        self._dropped: Set[int] = set()  # pids of this user turned away while MAX_HELD were held
        self._failure: Optional[str] = None  # the accept thread stopped on this error
        self.strangers = 0  # connections closed: other users, other processes, repeats
        self._thread = threading.Thread(target=self._accept_loop, name="megashard-fdpass-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        poll = select.poll()
        poll.register(self.sock.fileno(), select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        try:
            while True:
                if any(fd == self._wake_r for fd, _ in poll.poll()):
                    return
                try:
                    conn, _ = self.sock.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                self._admit(conn)
        except OSError as e:  # the listening socket itself failed: the receiver learns it in receive()
            with self._cond:
                self._failure = f"accepting connections failed: {e}"
                self._cond.notify_all()

    def _admit(self, conn: socket.socket) -> None:
        """Keep ``conn`` if it may be the reader's (see the module docstring), else close it."""
        try:
            pid, uid = peer_credentials(conn)
        except OSError:
            pid, uid = -1, -1
        with self._cond:
            keep = uid == os.getuid() and pid > 0 and pid not in self._held and (
                pid == self._expect if self._expect is not None else len(self._held) < MAX_HELD)
            if keep:
                self._held[pid] = conn
                self._cond.notify_all()
                return
            if uid == os.getuid() and self._expect is None and pid not in self._held:
                self._dropped.add(pid)
            self.strangers += 1
        log.debug("descriptor socket %s: closed a connection from pid %d (uid %d)", self.name, pid, uid)
        conn.close()

    def receive(self, sender_pid: int, count: int, timeout: float = TIMEOUT_S) -> List[int]:
        """Wait for ``sender_pid``'s connection (closing every other) and take exactly ``count``
        descriptors from it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._expect = sender_pid
            for pid in [p for p in self._held if p != sender_pid]:
                self._held.pop(pid).close()
                self.strangers += 1
            while sender_pid not in self._held:
                left = deadline - time.monotonic()
                if sender_pid in self._dropped:
                    raise FdPassError(f"the node's reader (pid {sender_pid}) connected while {MAX_HELD} other "
                                      "processes' connections were held; its connection was closed")
                if self._failure or left <= 0:
                    raise FdPassError(f"no connection from the node's reader (pid {sender_pid}) within "
                                      f"{timeout:.0f} s ({self._failure or 'timed out'}; "
                                      f"{self.strangers} other connection(s) closed)")
                self._cond.wait(left)
            conn = self._held.pop(sender_pid)
        fds: List[int] = []
        try:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            _check_peer(conn, sender_pid, "the node's reader")
            while len(fds) < count:
                msg, got, flags, _ = socket.recv_fds(conn, 16, MAX_FDS_PER_MESSAGE)
                fds.extend(got)
                if flags & socket.MSG_CTRUNC:
                    raise FdPassError("descriptors were dropped in transit (MSG_CTRUNC; out of descriptors?)")
                if not msg:
                    raise FdPassError(f"the node's reader sent {len(fds)} of {count} descriptors, then closed")
            if len(fds) != count:
                raise FdPassError(f"expected {count} descriptors from the node's reader, got {len(fds)}")
        except BaseException as e:
            close_all(fds)
            if isinstance(e, OSError) and not isinstance(e, MegashardError):
                raise FdPassError(f"receiving descriptors from the node's reader: {e}") from None
            raise
        finally:
            conn.close()
        return fds

    def close(self) -> None:
        """Stop accepting, close the socket and every held connection (idempotent)."""
        if self._thread.is_alive():
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
            self._thread.join()
        if self.sock.fileno() >= 0:
            self.sock.close()
            close_all([self._wake_r, self._wake_w])
        with self._cond:
            held, self._held = list(self._held.values()), {}
        for conn in held:
            conn.close()


def send(name: str, receiver_pid: int, fds: Sequence[int], timeout: float = TIMEOUT_S) -> None:
    """Connect to a :class:`Listener`, check it belongs to ``receiver_pid``, send ``fds``.

    The descriptors wait in the socket until the receiver accepts; the receiver gets
    its own copies (closing ours later does not affect them)."""
    if not supported():
        raise FdPassError("passing descriptors needs Linux (abstract Unix sockets, SCM_RIGHTS)")
    if not isinstance(name, str) or not name.startswith(NAME_PREFIX) or "\0" in name or len(name) > 100:
        raise FdPassError(f"not a megashard socket name: {name!r}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            while True:  # a full backlog answers EAGAIN at once: the receiver drains it, retry
                try:
                    sock.connect(_address(name))
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.002)
            _check_peer(sock, receiver_pid, "the requesting rank")
            for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                socket.send_fds(sock, [b"F"], list(fds[i:i + MAX_FDS_PER_MESSAGE]))
        except OSError as e:
            raise FdPassError(f"cannot pass descriptors to pid {receiver_pid} over socket {name}: {e}") from None


def check_file(fd: int, size: int, what: str) -> None:
    """A received descriptor must be a regular file of the index's size, open for reading."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise FdPassError(f"{what}: the descriptor from the node's reader is not a regular file")
    if st.st_size != size:
        raise FdPassError(f"{what}: the descriptor from the node's reader has {st.st_size} bytes, "
                          f"the index says {size}")

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
and sends the descriptors; the receiver accepts only the reader's pid. Every
socket operation has a timeout. This module never talks to ``torch.distributed``.
"""
from __future__ import annotations

import os
import secrets
import socket
import stat
import struct
import sys
from typing import List, Sequence, Tuple

from .errors import MegashardError

NAME_PREFIX = "megashard-"
MAX_FDS_PER_MESSAGE = 250  # Linux's SCM_MAX_FD is 253
TIMEOUT_S = 30.0  # the reader sends before the receiver even learns to accept: a wait here means trouble
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
    """The receiving rank's end: a listening socket with a fresh random name."""

    def __init__(self) -> None:
        if not supported():
            raise FdPassError("passing descriptors needs Linux (abstract Unix sockets, SCM_RIGHTS)")
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(_address(self.name))
            self.sock.listen(1)
        except OSError as e:
            self.sock.close()
            raise FdPassError(f"cannot listen on an abstract Unix socket: {e}") from None

    def receive(self, sender_pid: int, count: int, timeout: float = TIMEOUT_S) -> List[int]:
        """Accept the sender's connection and take exactly ``count`` descriptors from it."""
        fds: List[int] = []
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except OSError as e:  # socket.timeout is an OSError
            raise FdPassError(f"no connection from the node's reader (pid {sender_pid}) within "
                              f"{timeout:.0f} s: {e}") from None
        try:
            conn.settimeout(timeout)
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
        self.sock.close()


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
        try:
            sock.connect(_address(name))
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

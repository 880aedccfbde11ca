"""The port a test's torchrun rendezvous listens on: picked free, yet another process on a shared
machine may take it before torchrun binds it. Launchers run again on another port when that (and
only that) happened: nothing of the script ran."""
from __future__ import annotations

import socket

#: Launches on a port another process took first, before giving up.
PORT_TRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether torchrun failed because its rendezvous port was taken (``EADDRINUSE``)."""
    return "server socket has failed to listen" in output and "EADDRINUSE" in output

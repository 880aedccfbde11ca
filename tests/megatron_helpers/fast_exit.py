"""``python -m megatron_helpers.fast_exit SCRIPT ARGS...`` (or ``... -m MODULE ARGS...``): run a program
as ``__main__`` and end its process the way Python would, minus the interpreter's teardown.

Why: a process that imported megatron-core spends about a second of CPU after its last line freeing
thousands of modules (torch._inductor, sympy, ...), and the Megatron tests start some eighty
launchers and twice as many ranks per release on two cores. Everything a program or its launcher
can observe still happens, in Python's order: non-daemon threads are joined, ``atexit`` handlers
run (multiprocessing's among them), Python's and C's stdio are flushed, and the exit status is
Python's (0; ``SystemExit``'s code; 1 after the uncaught exception is printed by ``sys.excepthook``).
``runner.torchrun`` wraps both the launcher and its ranks in it.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import runpy
import sys
import threading
from typing import List, NoReturn, Optional


def _status(code: object) -> int:
    """The exit status Python gives ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> NoReturn:
    target = list(sys.argv[1:] if argv is None else argv)
    if not target or target == ["-m"]:
        print("usage: python -m megatron_helpers.fast_exit (SCRIPT | -m MODULE) [ARGS...]", file=sys.stderr)
        os._exit(2)
    try:
        if target[0] == "-m":
            sys.argv = target[1:]  # run_module puts the module's file in argv[0], as ``python -m`` does
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = target
            sys.path[0] = os.path.dirname(os.path.abspath(target[0]))  # as ``python SCRIPT`` has it
            runpy.run_path(target[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = _status(e.code)
    except BaseException:  # noqa: B036 - what Python does with an uncaught exception, KeyboardInterrupt too
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # Python joins non-daemon threads before atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    ctypes.CDLL(None).fflush(None)  # C stdio buffers (libraries' printf): os._exit does not flush them
    os._exit(status)


if __name__ == "__main__":
    main()

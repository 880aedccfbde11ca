"""megashard's exit hooks, run in one fixed order whatever order its modules were imported in.

``atexit`` runs hooks in the reverse order of registration, and megashard's modules load lazily:
the S3 client (imported by the first S3 save) registered its thread stop after the async-save hook,
so it ran first, found no threads yet, and the background write the async hook then waited for
started two that outlived the interpreter. Here background writes end first, then thread pools stop.
"""
from __future__ import annotations

import atexit
import logging
from typing import Callable, List, Tuple

log = logging.getLogger(__name__)

WRITES = 0  # background writes end (each bounded by its own wait)
THREADS = 1  # then the worker threads those writes used stop

_HOOKS: List[Tuple[int, Callable[[], None]]] = []


def at_exit(stage: int, hook: Callable[[], None]) -> None:
    """Run ``hook`` when the interpreter exits, after every hook of an earlier ``stage``."""
    _HOOKS.append((stage, hook))


def _run() -> None:
    for _, hook in sorted(_HOOKS, key=lambda h: h[0]):  # stable: registration order within a stage
        try:
            hook()
        except Exception:  # noqa: BLE001 - one failing hook must not skip the others
            log.exception("megashard exit hook %s failed", getattr(hook, "__qualname__", hook))


atexit.register(_run)

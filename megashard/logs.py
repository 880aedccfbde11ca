"""Rank-prefixed log lines shared by save and load."""
from __future__ import annotations

import logging

from .transport import Comm

def rank_prefix(comm: Comm) -> str:
    return f"[rank {comm.rank}] "


def log_summary(log: logging.Logger, comm: Comm, verb: str, path: str, nbytes: int, seconds: float, what: str) -> None:
    """One INFO line per save/load, on rank 0, with figures aggregated over ranks."""
    msg = (f"{verb} checkpoint {path}: {nbytes / 1e9:.3f} GB over {comm.world_size} rank(s) in {seconds:.2f} s "
           f"({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s, {what})")
    if comm.rank == 0:
        log.info("%s%s", rank_prefix(comm), msg)
    else:
        log.debug("%s%s", rank_prefix(comm), msg)

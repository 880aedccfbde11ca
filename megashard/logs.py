"""Rank-prefixed log lines shared by save and load."""
from __future__ import annotations

import logging

from .transport import Comm

def rank_prefix(comm: Comm) -> str:
    return f"[rank {getattr(comm, 'label_rank', comm.rank)}] "


def human_size(nbytes: float) -> str:
    """Bytes in the largest decimal unit (B, kB, MB, GB, TB) that keeps the value >= 1, three digits:
    a toy checkpoint reads "262 kB", not "0.000 GB"."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            break
        value /= 1000
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}" if value >= 10 else f"{value:.2f} {unit}"


def human_rate(nbytes: float, seconds: float) -> str:
    """Throughput, e.g. "550 MB/s" (never "0.00 GB/s")."""
    return f"{human_size(nbytes / max(seconds, 1e-9))}/s"


def log_summary(log: logging.Logger, comm: Comm, verb: str, path: str, nbytes: int, seconds: float, what: str) -> None:
    """One INFO line per save/load, on rank 0, with figures aggregated over ranks."""
    msg = (f"{verb} checkpoint {path}: {human_size(nbytes)} over {comm.world_size} rank(s) in {seconds:.2f} s "
           f"({human_rate(nbytes, seconds)}, {what})")
    if comm.rank == 0:
        log.info("%s%s", rank_prefix(comm), msg)
    else:
        log.debug("%s%s", rank_prefix(comm), msg)

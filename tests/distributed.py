"""Spawn gloo ranks on CPU for multi-process tests (file-store rendezvous, no ports)."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Optional


def _entry(fn: Callable, rank: int, world: int, store: str, env: Dict[str, str], q: Any, args: tuple) -> None:
    os.environ.update(env.get(str(rank), {}) if isinstance(env.get(str(rank)), dict) else {})
    os.environ.update({k: v for k, v in env.items() if isinstance(v, str)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        # every rank's gloo mesh connected before any rank runs: a rank whose fn returns at once would
        # otherwise close its sockets while a slower peer is still connecting ("connectFullMesh failed")
        dist.barrier()
        out = fn(rank, world, *args)
        q.put((rank, True, out))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 180,
              env: Optional[Dict[str, Any]] = None) -> List[tuple]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks.

    Returns ``[(ok, value_or_traceback), ...]`` by rank; a rank that dies without
    reporting gives ``(False, "exit code N")``. Raises AssertionError on timeout
    (a hang is a bug).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="megashard-store-")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store, env or {}, q, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: Dict[int, tuple] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, ok, val = q.get(timeout=0.5)
            results[rank] = (ok, val)
        except _q.Empty:
            if all(not p.is_alive() for p in procs):
                # a rank may have put its result and exited between the get's last look and this check
                # (the parent descheduled there, on a loaded machine): what the ranks put is in the pipe
                while len(results) < world:
                    try:
                        rank, ok, val = q.get(timeout=0.5)
                    except _q.Empty:
                        break
                    results[rank] = (ok, val)
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    try:
        os.unlink(store)
    except OSError:
        pass
    assert not hung, f"ranks {hung} hung (timeout {timeout}s)"
    return [results.get(r, (False, f"exit code {procs[r].exitcode}")) for r in range(world)]


def all_ok(results: List[tuple]) -> List[Any]:
    bad = [f"rank {r}: {v}" for r, (ok, v) in enumerate(results) if not ok]
    assert not bad, "\n".join(bad)
    return [v for _, v in results]


def capture_logs() -> List[str]:
    """Every message megashard logs from now on in this process."""
    import logging

    records: List[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("megashard").addHandler(Grab())
    return records

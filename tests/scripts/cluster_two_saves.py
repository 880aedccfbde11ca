"""One rank of one of two jobs that save to the cluster's shared mount at the same time.

Launched twice at once by ``tests/test_cluster.py`` (two torchrun jobs, 2 nodes x 1 rank each)::

    ... tests/scripts/cluster_two_saves.py --job NAME --peer OTHER --shared-dir S --results O

Both jobs first wait for each other (``O/ready-<job>-rank<r>`` files), then save ``--rounds``
times, alternating: their own directory ``S/two/<job>/ckpt`` and the one both use,
``S/two/same/ckpt``. Every save's state has values of its own (seeded by job, round and rank), so a
load tells which save it got. Once both jobs have saved (``O/saved-<job>-rank<r>``), each loads its
own directory (must be its last round, bit for bit) and the common one (must be exactly one save
of either job, bit for bit: never a mixture). Writes ``O/<job>-rank<r>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]

import megashard  # noqa: E402
from megashard import ShardedTensor  # noqa: E402
from megashard.errors import MegashardError  # noqa: E402

ROWS, COLS = 512, 2048  # rows per rank; float32: 4 MiB per rank and tensor
TENSORS = 2


def _state(job: str, rnd: int, rank: int, world: int, empty: bool = False) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for i in range(TENSORS):
        if empty:
            data = torch.zeros(ROWS, COLS)
        else:
            g = torch.Generator().manual_seed(zlib.crc32(f"{job}/{rnd}/{rank}/{i}".encode()))
            data = torch.randn(ROWS, COLS, generator=g)
        out[f"w{i}"] = ShardedTensor(f"w{i}", data, (world * ROWS, COLS), (rank * ROWS, 0))
    out["meta"] = {"job": job, "round": rnd}
    return out


def _wait(paths: List[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {[p for p in paths if not os.path.exists(p)]}")
        time.sleep(0.05)


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(socket.gethostname())


def _save(state: Dict[str, Any], path: str) -> Dict[str, Any]:
    t0 = time.time()
    try:
        megashard.save(state, path)
        raised: Optional[Dict[str, Any]] = None
    except Exception as e:  # noqa: BLE001  (the test asserts on the type and message)
        raised = {"type": type(e).__name__, "megashard_error": isinstance(e, MegashardError), "message": str(e)}
    return {"path": path, "start": t0, "end": time.time(), "raised": raised}


def _which(path: str, rank: int, world: int, candidates: List[Tuple[str, int]]) -> Dict[str, Any]:
    """Load ``path`` and name the (job, round) whose state it equals bit for bit (None: none)."""
    template = _state("", 0, rank, world, empty=True)
    try:
        loaded = megashard.load(template, path)
    except Exception as e:  # noqa: BLE001
        return {"raised": f"{type(e).__name__}: {e}"}
    for job, rnd in candidates:
        want = _state(job, rnd, rank, world)
        if all(torch.equal(loaded[f"w{i}"].data.view(torch.int32), want[f"w{i}"].data.view(torch.int32))
               for i in range(TENSORS)):
            return {"raised": None, "equals": [job, rnd], "meta": loaded["meta"]}
    return {"raised": None, "equals": None, "meta": loaded["meta"]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--shared-dir", dest="shared", required=True)
    ap.add_argument("--results", dest="out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    res: Dict[str, Any] = {"job": a.job, "rank": rank, "host": socket.gethostname(), "saves": []}
    both = (a.job, a.peer)
    try:
        own, same = os.path.join(a.shared, "two", a.job, "ckpt"), os.path.join(a.shared, "two", "same", "ckpt")
        if rank == 0:
            os.makedirs(os.path.dirname(own), exist_ok=True)
            os.makedirs(os.path.dirname(same), exist_ok=True)
        dist.barrier()
        _touch(os.path.join(a.out, f"ready-{a.job}-rank{rank}"))
        _wait([os.path.join(a.out, f"ready-{j}-rank{r}") for j in both for r in range(world)])
        for rnd in range(a.rounds):
            res["saves"].append(_save(_state(a.job, rnd, rank, world), own))
            res["saves"].append(_save(_state(a.job, rnd, rank, world), same))
        _touch(os.path.join(a.out, f"saved-{a.job}-rank{rank}"))
        _wait([os.path.join(a.out, f"saved-{j}-rank{r}") for j in both for r in range(world)])
        candidates = [(j, r) for j in both for r in range(a.rounds)]
        res["own"] = _which(own, rank, world, candidates)
        res["same"] = _which(same, rank, world, candidates)
        dist.barrier()
        res["listing"] = {d: sorted(os.listdir(os.path.join(a.shared, "two", d))) for d in (a.job, "same")}
    except Exception as e:  # noqa: BLE001  (recorded for the test)
        res["failed"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(a.out, f"{a.job}-rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

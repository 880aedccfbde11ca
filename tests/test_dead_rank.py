"""A rank that dies, hangs or exits during a load never strands the others."""
from __future__ import annotations

import os
import signal
import time

import torch

import megashard
from distributed import run_ranks
from megashard.sharded import ShardedTensor

G = torch.arange(4096, dtype=torch.float32).reshape(64, 64)


def _save(rank, world, path):
    half = 64 // world
    megashard.save({"w": ShardedTensor("w", G[rank * half:(rank + 1) * half].clone(), (64, 64), (rank * half, 0))},
                   path)


def _load_with_failure(rank, world, path, how, timeout):
    """Rank 1 dies (SIGKILL), hangs, or raises SystemExit inside its planning; rank 0 must raise
    DistributedError within the timeout."""
    import megashard.loading as api

    if rank == 1:
        orig = api._merge_template

        def sabotaged(*a, **k):
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "hang":  # stuck far past the timeout, then gone
                time.sleep(40)
                os._exit(0)
            if how == "exit":
                raise SystemExit(3)
            return orig(*a, **k)

        api._merge_template = sabotaged
    t0 = time.monotonic()
    try:
        megashard.load({"w": ShardedTensor("w", torch.zeros(64, 64), (64, 64), (0, 0))}, path, timeout=timeout)
    except megashard.DistributedError as e:
        return {"raised": type(e).__name__, "failures": sorted(e.failures), "seconds": time.monotonic() - t0,
                "msg": str(e)[:300]}
    return {"raised": None, "seconds": time.monotonic() - t0}


def test_dead_or_hung_or_exiting_rank_during_load(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, path)
    for how in ("sigkill", "hang", "exit"):
        # a 15 s load timeout: in the "exit" case rank 1 reaches its planning seconds after rank 0 starts
        # waiting on a loaded machine, and must do so within the timeout for its SystemExit to be agreed on
        res = run_ranks(_load_with_failure, 2, path, how, 15.0, timeout=180)
        ok, out = res[0]
        assert ok, out
        assert out["raised"], f"{how}: rank 0 did not raise"
        print(f"{how}: rank 0 raised {out['raised']} after {out['seconds']:.2f} s (timeout 15 s)")
        assert out["seconds"] < 35, f"{how}: rank 0 took {out['seconds']:.1f} s"  # not the hang's 40 s
        if how == "exit":  # SystemExit reached the agreement: both ranks raised, naming rank 1
            assert res[1][0] and res[1][1]["raised"] and 1 in res[1][1]["failures"], res[1]
            assert "SystemExit" in out["msg"]
        else:
            assert res[1][0] is False  # killed, or hung and gone without reporting

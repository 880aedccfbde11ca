#!/usr/bin/env python
"""The local checkpoint tier in Megatron-LM's own ``pretrain_gpt.py``: restart from the local tier, from
a peer's replica and from storage, the training stall of a local save vs an async save, and the
background replication's time and bandwidth, in one run.

Usage::

    python scripts/bench_localtier.py [--layers 4 --hidden 512 --heads 8] [--repeats 3]
        [--storage DIR] [--local DIR] [--no-replication] [--json]

Each of the 2 ranks is its own node (``MEGASHARD_NODE_ID``) with its own local directory
(``--local``/rank<R>/local). One *save* run (``--train-iters 6 --save-interval 3 --async-save
--ckpt-format torch`` to ``--storage``, local saves every other step, ``--replication
--replication-jump 1 --replication-factor 2``, SIGKILLed in step 6 once the replication of 4 and the
async save of 3 are done): Megatron's
``save-checkpoint`` timer (the async save's stall) and ``save-checkpoint-non-persistent`` timer (the
local save's stall) per save, and each rank's "replicated iteration N (M MB) ... in S s" line. Then
``--repeats`` rounds of restarts, interleaved (local, peer, storage, storage, peer, local, ...): from
the local tier (iteration 4), with node 1's local directory emptied (rank 1's version restored from
node 0's replica, then both load locally), and with both emptied from storage (iteration 3); each
timed by Megatron's ``load-checkpoint`` timer (max over ranks), the peer transfer by its own log line.
Medians with min-max.

Both tiers are on this machine here (storage: a directory on its disk, page cache warm; local:
``/dev/shm``; the "nodes" exchange over loopback): the figures show the tiers' own costs, not a
remote store's or a network's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from megatron_helpers.mlm_tree import find_tree  # noqa: E402
from megatron_helpers.runner import torchrun  # noqa: E402

REPLICATED = re.compile(r"replicated iteration (\d+) \(([\d.]+) MB\) to rank\S* \S+ in ([\d.]+) s")
RESTORED = re.compile(r"restored rank \d+'s local checkpoint of iteration \d+ from rank \d+'s replica in ([\d.]+) s")
TIMER = re.compile(r"^\s*(save-checkpoint-non-persistent|save-checkpoint|load-checkpoint) \.*: "
                   r"\(([\d.]+), ([\d.]+)\)", re.M)


def timers(output: str) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {}
    for name, _lo, hi in TIMER.findall(output):
        out.setdefault(name, []).append(float(hi) / 1000.0)  # ms -> s, max over ranks
    return out


def stats(xs: List[float]) -> str:
    return f"{statistics.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f}, n={len(xs)})" if xs else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--storage", default=None, help="persistent --save/--load (default: a temporary dir)")
    p.add_argument("--local", default=None, help="--non-persistent-local-ckpt-dir (default: under /dev/shm)")
    p.add_argument("--no-replication", action="store_true", help="the local tier without peer replicas")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from test_async_megatron_lm import STRATEGY
    from test_megatron_lm_install import ARGS, RELEASE, SCRIPT

    work = Path(tempfile.mkdtemp(prefix="bench-localtier-"))
    storage = Path(a.storage or work / "storage")
    nodes = Path(a.local or tempfile.mkdtemp(prefix="bench-localtier-", dir="/dev/shm"))
    local = [nodes / "rank0" / "local", nodes / "rank1" / "local"]  # each rank's node's directory
    for d in local:
        d.mkdir(parents=True, exist_ok=True)
    tree = find_tree(RELEASE, Path(REPO), lambda: Path(tempfile.mkdtemp(dir=work)))
    args = [x for x in ARGS]
    for flag, v in (("--num-layers", a.layers), ("--hidden-size", a.hidden), ("--num-attention-heads", a.heads)):
        args[args.index(flag) + 1] = str(v)
    repl = [] if a.no_replication else ["--replication", "--replication-jump", "1", "--replication-factor", "2"]
    common = [*args, "--train-iters", "6", "--save-interval", "3", "--non-persistent-save-interval", "2",
              "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "local",
              "--save-format", "tensors", *repl]
    env = {"MEGATRON_LM_DIR": tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "MEGASHARD_TEST_RANK_CWD": str(nodes), "MEGASHARD_TEST_NODE_PER_RANK": "1"}
    try:
        # --ckpt-format torch: without it Megatron-LM switches --async-save off (tests/test_async_megatron_lm.py)
        saved = torchrun(SCRIPT, [*common, "--save", str(storage), "--async-save", "--ckpt-format", "torch", *STRATEGY],
                         env=env | {"MEGASHARD_TEST_KILL_AT": "5"}, timeout=900)
        t = timers(saved.output)
        if "saved local checkpoint at iteration 4" not in saved.output or "scheduled an async save" not in saved.output:
            raise SystemExit(saved.output[-4000:])
        replicated = [(int(it), float(mb), float(s)) for it, mb, s in REPLICATED.findall(saved.output)]
        keep = work / "local-copy"
        shutil.copytree(nodes, keep)
        kinds = ["local", "storage"] if a.no_replication else ["local", "peer", "storage"]
        order = (kinds + kinds[::-1]) * ((a.repeats + 1) // 2)
        restarts: Dict[str, List[float]] = {k: [] for k in kinds}
        peer_transfer: List[float] = []
        for kind in order[: len(kinds) * a.repeats]:
            shutil.rmtree(nodes)
            shutil.copytree(keep, nodes)
            for d in local[1:] if kind == "peer" else local if kind == "storage" else []:
                shutil.rmtree(d)
                d.mkdir()
            scratch = work / "scratch"
            shutil.rmtree(scratch, ignore_errors=True)
            run = torchrun(SCRIPT, [*common, "--load", str(storage), "--save", str(scratch)], env=env, timeout=900)
            want = {"local": "loaded local checkpoint", "peer": "from rank 0's replica",
                    "storage": "at iteration 3 (optimizer loaded"}[kind]
            if run.returncode != 0 or want not in run.output:
                raise SystemExit(run.output[-4000:])
            restarts[kind] += timers(run.output).get("load-checkpoint", [])
            peer_transfer += [float(x) for x in RESTORED.findall(run.output)]
        size = sum(f.stat().st_size for f in keep.glob("rank*/local/megashard-*/rank0000*/iter_0000004/*"))
        rank1 = sum(f.stat().st_size for f in keep.rglob("rank1/local/*/rank00001/iter_0000004/*"))
        result = {"local_save_stall_s": t.get("save-checkpoint-non-persistent", []),
                  "async_save_stall_s": t.get("save-checkpoint", []),
                  "replication": [{"iteration": it, "mb_per_rank": mb, "seconds": s} for it, mb, s in replicated],
                  "restart_local_s": restarts["local"], "restart_peer_s": restarts.get("peer", []),
                  "peer_transfer_s": peer_transfer, "peer_transfer_bytes": rank1,
                  "restart_storage_s": restarts["storage"],
                  "local_version_bytes": size, "layers": a.layers, "hidden": a.hidden,
                  "replication_flags": repl}
        if a.json:
            print(json.dumps(result))
        print(f"local version (all ranks): {size / 1e6:.1f} MB")
        print(f"stall per save   local (sync, /dev/shm): {stats(result['local_save_stall_s'])}"
              f" | async to storage: {stats(result['async_save_stall_s'])}")
        if replicated:
            rates = [mb / s for _, mb, s in replicated if s > 0]
            print(f"replication (background, per rank): {stats([s for *_, s in replicated])}, "
                  f"{statistics.median(rates):.0f} MB/s median")
        if peer_transfer:
            print(f"peer restore transfer ({rank1 / 1e6:.1f} MB): {stats(peer_transfer)}")
        print("load-checkpoint  " + " | ".join(f"from {k}: {stats(restarts[k])}" for k in kinds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.local:
            shutil.rmtree(nodes, ignore_errors=True)


if __name__ == "__main__":
    main()

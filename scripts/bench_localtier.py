#!/usr/bin/env python
"""The local checkpoint tier in Megatron-LM's own ``pretrain_gpt.py``: restart from the local tier vs
from storage, and the training stall of a local save vs an async save, in one run.

Usage::

    python scripts/bench_localtier.py [--layers 4 --hidden 512 --heads 8] [--repeats 3]
        [--storage DIR] [--local DIR] [--json]

One *save* run (``--train-iters 6 --save-interval 3 --async-save`` to ``--storage``, local saves
every other step to ``--local``, SIGKILLed in step 6): Megatron's ``save-checkpoint`` timer (the
async save's stall) and ``save-checkpoint-non-persistent`` timer (the local save's stall) per save.
Then ``--repeats`` pairs of restarts, interleaved (local, storage, storage, local, ...): from the
local tier (iteration 4) and, with the local directory emptied, from storage (iteration 3); each
timed by Megatron's ``load-checkpoint`` timer (max over ranks). Medians with min-max.

Both tiers are on this machine here (storage: a directory on its disk, page cache warm; local:
``/dev/shm``): the restart figures show the local tier's own cost, not a remote store's.
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
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from test_megatron_lm_install import ARGS, RELEASE, SCRIPT

    work = Path(tempfile.mkdtemp(prefix="bench-localtier-"))
    storage = Path(a.storage or work / "storage")
    local = Path(a.local or tempfile.mkdtemp(prefix="bench-localtier-", dir="/dev/shm"))
    tree = find_tree(RELEASE, Path(REPO), lambda: Path(tempfile.mkdtemp(dir=work)))
    args = [x for x in ARGS]
    for flag, v in (("--num-layers", a.layers), ("--hidden-size", a.hidden), ("--num-attention-heads", a.heads)):
        args[args.index(flag) + 1] = str(v)
    common = [*args, "--train-iters", "6", "--save-interval", "3", "--non-persistent-save-interval", "2",
              "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local),
              "--save-format", "tensors"]
    env = {"MEGATRON_LM_DIR": tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    try:
        saved = torchrun(SCRIPT, [*common, "--save", str(storage), "--async-save"],
                         env=env | {"MEGASHARD_TEST_KILL_AT": "5"}, timeout=900)
        t = timers(saved.output)
        if "saved local checkpoint at iteration 4" not in saved.output:
            raise SystemExit(saved.output[-4000:])
        keep = work / "local-copy"
        shutil.copytree(local, keep)
        restarts: Dict[str, List[float]] = {"local": [], "storage": []}
        order = ["local", "storage", "storage", "local"] * ((a.repeats + 1) // 2)
        for kind in order[: 2 * a.repeats]:
            shutil.rmtree(local)
            shutil.copytree(keep, local) if kind == "local" else local.mkdir()
            scratch = work / "scratch"
            shutil.rmtree(scratch, ignore_errors=True)
            run = torchrun(SCRIPT, [*common, "--load", str(storage), "--save", str(scratch)], env=env, timeout=900)
            want = "loaded local checkpoint" if kind == "local" else "at iteration 3 (optimizer loaded"
            if run.returncode != 0 or want not in run.output:
                raise SystemExit(run.output[-4000:])
            restarts[kind] += timers(run.output).get("load-checkpoint", [])
        size = sum(f.stat().st_size for f in keep.rglob("iter_0000004/*"))
        result = {"local_save_stall_s": t.get("save-checkpoint-non-persistent", []),
                  "async_save_stall_s": t.get("save-checkpoint", []),
                  "restart_local_s": restarts["local"], "restart_storage_s": restarts["storage"],
                  "local_version_bytes": size, "layers": a.layers, "hidden": a.hidden}
        if a.json:
            print(json.dumps(result))
        print(f"local version (all ranks): {size / 1e6:.1f} MB")
        print(f"stall per save   local (sync, /dev/shm): {stats(result['local_save_stall_s'])}"
              f" | async to storage: {stats(result['async_save_stall_s'])}")
        print(f"load-checkpoint  from local: {stats(restarts['local'])} | from storage: {stats(restarts['storage'])}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.local:
            shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()

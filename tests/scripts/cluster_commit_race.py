"""One node's side of two nodes committing one checkpoint name as fast as they can.

Run on both nodes of ``tests/test_cluster.py``'s cluster at once (no torchrun: each process is a
one-rank save)::

    python tests/scripts/cluster_commit_race.py --node N --dir S/race/ckpt --start T --saves K --out O

Waits until the wall-clock time ``T``, then saves ``K`` times to the one directory, each save
with values of its own (node, round). Writes ``O`` (JSON): the errors of its saves (none expected:
the commit waits out a shared mount's renames racing, ``megashard.storage.posix.commit_dir``).
With ``--verify`` it loads the directory instead and writes which node's last save it equals,
bit for bit (null: none), and the entries beside it (leftovers of the race: ``entries``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]

import megashard  # noqa: E402


def state(node: int, rnd: int) -> Dict[str, torch.Tensor]:
    """Values that tell which save a load got."""
    return {"w": torch.full((256, 256), float(node * 1000 + rnd)), "b": torch.arange(64.0) + node * 1000 + rnd}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--saves", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--verify", action="store_true")
    a = ap.parse_args()
    if a.verify:
        got = megashard.load({"w": torch.empty(256, 256), "b": torch.empty(64)}, a.dir)
        equals = [n for n in (0, 1) if all(torch.equal(got[k], v) for k, v in state(n, a.saves - 1).items())]
        with open(a.out, "w") as f:
            json.dump({"equals": equals, "entries": sorted(os.listdir(os.path.dirname(a.dir)))}, f)
        return
    time.sleep(max(0.0, a.start - time.time()))
    errors: List[str] = []
    for rnd in range(a.saves):
        try:
            megashard.save(state(a.node, rnd), a.dir)
        except Exception as e:  # the test reports every one
            errors.append(f"round {rnd}: {type(e).__name__}: {e}")
    with open(a.out, "w") as f:
        json.dump({"errors": errors, "end": time.time()}, f)


if __name__ == "__main__":
    main()

"""One rank of a two-"node" scatter-load check, launched by two torchrun agents.

Launched by ``tests/test_multinode.py`` as::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank N \
        --master-addr 127.0.0.1 --master-port P tests/scripts/multinode_scatter.py --ckpt D --out O

World size 4, gloo on CPU, toy model ``Layout(tp=2, dp=2)``: node 0 holds ranks 0-1
(DP replica 0), node 1 ranks 2-3 (DP replica 1), so every node needs the whole
model. torchrun sets ``GROUP_RANK`` to the node rank; megashard uses it as the node
id, which makes local rank 0 of each node its reader.

Cases (run one after the other on the same checkpoint):
  ``shared``        every rank sees the checkpoint; ``mode="scatter"`` (within a node each rank
                    reads its own bytes through the reader's passed descriptors; replicated
                    bytes go through the reader's shared-memory ring).
  ``readers_only``  local rank 1 gets a path that does not exist (the checkpoint is
                    visible only to the node readers); ``mode="auto"`` must pick scatter.
  ``shared_group``  as ``shared`` with ``scatter_transport="group"`` (gloo sends).

Each rank writes ``O/<case>-rank<R>.json`` with what it observed; the test asserts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megashard  # noqa: E402

from layouts import GLOBALS, Layout, check_state, model_state  # noqa: E402

LAYOUT = Layout(tp=2, dp=2)
CASES = ("shared", "readers_only", "shared_group")


def template_bytes(state: Dict[str, Any]) -> int:
    """Bytes of every ShardedTensor in a (model_state) template: what this rank needs."""
    return sum(sh.data.numel() * sh.data.element_size() for chunk in state.values() for sh in chunk.values())


def model_unique_bytes() -> int:
    """Bytes of every global tensor once: what one node (a full DP replica) needs."""
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt in GLOBALS.values())


def run_case(case: str, ckpt: str, rank: int, local_rank: int) -> Dict[str, Any]:
    template = model_state(LAYOUT, rank, empty=True)
    if case == "readers_only":
        path, mode = (ckpt if local_rank == 0 else ckpt + "-not-visible-here"), "auto"
    else:
        path, mode = ckpt, "scatter"
    _, stats = megashard.load(template, path, mode=mode, return_stats=True,
                              scatter_transport="group" if case == "shared_group" else "auto")
    return {
        "case": case, "rank": rank, "local_rank": local_rank,
        "node": os.environ.get("GROUP_RANK"), "path_exists": os.path.exists(path),
        "mode": stats.mode, "bytes_read": stats.bytes_read,
        "bytes_received": stats.bytes_received, "transport": stats.transport,
        "needed_bytes": template_bytes(template), "node_needed_bytes": model_unique_bytes(),
        "mismatches": check_state(template),
    }


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint directory to create")
    ap.add_argument("--out", required=True, help="directory for the per-rank JSON results")
    a = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    assert world == LAYOUT.world, f"expected world size {LAYOUT.world}, got {world}"
    megashard.save(model_state(LAYOUT, rank), a.ckpt)
    for case in CASES:
        res = run_case(case, a.ckpt, rank, local_rank)
        with open(os.path.join(a.out, f"{case}-rank{rank}.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of the namespace-cluster job: torchrun on 2 nodes x 2 ranks, c10d rendezvous, gloo.

Launched by ``tests/test_cluster.py`` in every node of ``tests/cluster.py``'s cluster::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d ... \
        tests/scripts/cluster_job.py --shared-dir S --node-local-dir L \
        --s3-url s3://BUCKET/PREFIX --results O

``S`` is the SeaweedFS FUSE mount (the same path on every node), ``L`` a node-local tmpfs (the
same path, another directory on each node), ``O`` a host directory for the per-rank results.
World size 4, toy model ``Layout(tp=2, dp=2)``: each node holds one DP replica, so every node
needs the whole model. Cases, one after the other:

  ``save_shared``  every rank saves its shards to ``S/ckpt`` (two nodes write one checkpoint).
  ``scatter``      ``mode="scatter"`` load of ``S/ckpt``: one reader per node.
  ``reshard``      ``mode="scatter"`` load of ``S/ckpt`` into ``Layout(tp=4)`` (other shards).
  ``local_save``   every rank saves to ``L/ckpt``: must be refused on every rank.
  ``local_copy``   each node's first rank copies ``S/ckpt`` to ``L/copy`` (its own disk); a
                   ``mode="scatter"`` load of ``L/copy`` on every rank.
  ``s3``           save to ``--s3`` (SeaweedFS's S3 gateway), then a ``mode="scatter"`` load
                   with each rank's object-store request counts.

Each rank writes ``O/<case>-rank<R>.json``; the test asserts on them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional
from urllib.parse import urlparse

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megashard  # noqa: E402
from megashard.errors import MegashardError  # noqa: E402

from layouts import Layout, check_state, model_state  # noqa: E402
from multinode_scatter import model_unique_bytes, template_bytes  # noqa: E402

SAVED = Layout(tp=2, dp=2)
RESHARDED = Layout(tp=4)


def _who(rank: int) -> Dict[str, Any]:
    return {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "host": socket.gethostname(),
            "group_rank": os.environ.get("GROUP_RANK")}


def _load(layout: Layout, rank: int, path: str) -> Dict[str, Any]:
    template = model_state(layout, rank, empty=True)
    _, stats = megashard.load(template, path, mode="scatter", return_stats=True)
    return {"mode": stats.mode, "transport": stats.transport, "bytes_read": stats.bytes_read,
            "bytes_received": stats.bytes_received, "needed_bytes": template_bytes(template),
            "node_needed_bytes": model_unique_bytes(), "mismatches": check_state(template)}


def _refused(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test asserts on the type)
        return {"raised": type(e).__name__, "megashard_error": isinstance(e, MegashardError), "message": str(e)}
    return {"raised": None}


def _make_bucket(url: str) -> None:
    """The S3 bucket, created through the gateway (AWS_* variables: the cluster's credentials)."""
    import boto3

    boto3.client("s3").create_bucket(Bucket=urlparse(url).netloc)


def _together(action: Optional[Callable[[], Any]]) -> None:
    """Run ``action`` on the ranks that have one, then raise on every rank if it failed on any (a
    failure must not leave the other ranks waiting in the next collective)."""
    err: Optional[BaseException] = None
    if action is not None:
        try:
            action()
        except Exception as e:  # noqa: BLE001  (re-raised below)
            err = e
    failed = torch.tensor([int(err is not None)])
    dist.all_reduce(failed)
    if err is not None:
        raise err
    if failed.item():
        raise RuntimeError(f"{failed.item()} other rank(s) failed: see their results")


def _s3(rank: int, url: str) -> Dict[str, Any]:
    from megashard.storage.s3.client import ObjectStore

    _together((lambda: _make_bucket(url)) if rank == 0 else None)
    megashard.save(model_state(SAVED, rank), url)
    dist.barrier()
    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    out = _load(SAVED, rank, url)
    out["requests"] = dict(store.stats)
    return out


def _local_copy(rank: int, src: str, dst: str) -> Dict[str, Any]:
    _together((lambda: shutil.copytree(src, dst)) if int(os.environ["LOCAL_RANK"]) == 0 else None)
    return _load(SAVED, rank, dst)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared-dir", dest="shared", required=True)
    ap.add_argument("--node-local-dir", dest="local", required=True)
    ap.add_argument("--s3-url", dest="s3", required=True)
    ap.add_argument("--results", dest="out", required=True)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    assert dist.get_world_size() == SAVED.world, dist.get_world_size()
    shared_ckpt, local_ckpt = os.path.join(a.shared, "ckpt"), os.path.join(a.local, "ckpt")
    cases: Dict[str, Callable[[], Dict[str, Any]]] = {
        "save_shared": lambda: {"error": _refused(lambda: megashard.save(model_state(SAVED, rank), shared_ckpt)),
                                "listing": sorted(os.listdir(a.shared))},
        "scatter": lambda: _load(SAVED, rank, shared_ckpt),
        "reshard": lambda: _load(RESHARDED, rank, shared_ckpt),
        "local_save": lambda: dict(_refused(lambda: megashard.save(model_state(SAVED, rank), local_ckpt)),
                                   listing=sorted(os.listdir(a.local))),
        "local_copy": lambda: _local_copy(rank, shared_ckpt, os.path.join(a.local, "copy")),
        "s3": lambda: _s3(rank, a.s3),
    }
    for case, fn in cases.items():
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001  (recorded: the next case still runs on every rank)
            res = {"failed": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        dist.barrier()  # every rank's listing after every rank's save
        if case in ("save_shared", "local_save"):
            res["listing"] = sorted(os.listdir(a.shared if case == "save_shared" else a.local))
        dist.barrier()  # and before the next case writes there (local_copy: L/copy)
        with open(os.path.join(a.out, f"{case}-rank{rank}.json"), "w") as f:
            json.dump(dict(_who(rank), case=case, seconds=round(time.monotonic() - t0, 3), **res), f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a save that loses a node: torchrun on the namespace cluster, 2 nodes x 2 ranks, gloo.

Launched by ``tests/test_cluster.py`` after ``tests/scripts/cluster_job.py`` committed ``S/ckpt``::

    ... tests/scripts/cluster_kill_save.py --shared-dir S --results O --timeout T

Every rank re-saves ``S/ckpt`` with other values (``Layout(tp=2, dp=2)``, every tensor + 1). On the
node that does not hold rank 0 the ranks write their files, then say so (``O/blocked-rank<R>``,
holding the host name) and stop mid-save, before the commit; the test kills every process of that
node. The other ranks write ``O/survivor-rank<R>.json``: what their ``save(timeout=T)`` raised,
after how long, and the mismatches of ``S/ckpt`` loaded then by the rank alone (``SOLO``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

import torch.distributed as dist  # noqa: E402

import megashard  # noqa: E402
import megashard.saving  # noqa: E402
from megashard.errors import MegashardError  # noqa: E402
from megashard.transport import SOLO  # noqa: E402

from layouts import Layout, check_state, model_state  # noqa: E402

SAVED = Layout(tp=2, dp=2)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared-dir", dest="shared", required=True)
    ap.add_argument("--results", dest="out", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    # torchrun numbers ranks node by node: rank 0 is on the agent of group rank 0
    victim = os.environ["GROUP_RANK"] != "0"
    state = model_state(SAVED, rank)
    for sh in state["model"].values():
        sh.data.add_(1)  # other values than the committed checkpoint's
    if victim:
        real = megashard.saving.write_file

        def write_then_stop(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            with open(os.path.join(a.out, f"blocked-rank{rank}"), "w") as f:
                f.write(socket.gethostname())
            time.sleep(600)  # killed here, with every process of this node
            return out

        megashard.saving.write_file = write_then_stop
    t0 = time.monotonic()
    res: Dict[str, Any] = {"raised": None}
    try:
        megashard.save(state, os.path.join(a.shared, "ckpt"), timeout=a.timeout)
    except Exception as e:  # noqa: BLE001  (the test asserts on it)
        res = {"raised": type(e).__name__, "megashard_error": isinstance(e, MegashardError), "message": str(e)}
    res.update(rank=rank, host=socket.gethostname(), seconds=round(time.monotonic() - t0, 3))
    # the checkpoint the interrupted save would have replaced, loaded by this rank alone (its group lost a node)
    try:
        template = model_state(SAVED, rank, empty=True)
        megashard.load(template, os.path.join(a.shared, "ckpt"), process_group=SOLO)
        res["previous"] = check_state(template)
    except Exception as e:  # noqa: BLE001  (the test asserts on it)
        res["previous"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(a.out, f".survivor-rank{rank}.json"), "w") as f:
        json.dump(res, f)
    os.rename(os.path.join(a.out, f".survivor-rank{rank}.json"), os.path.join(a.out, f"survivor-rank{rank}.json"))
    # no teardown of a process group that lost a node; exit 0: on a failure torchrun would SIGTERM the
    # other survivor before it has written its result
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

"""Scatter load across two torchrun "nodes" on one machine (2 agents x 2 ranks, gloo).

Both ``torch.distributed.run`` agents run here on 127.0.0.1 with the static
rendezvous (``--node-rank``/``--master-addr``/``--master-port``); torchrun sets
``GROUP_RANK`` (the node rank), which megashard uses as the node id. The rank
script is ``tests/scripts/multinode_scatter.py``; this test asserts on its JSON.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from torchrun_ports import PORT_TRIES, free_port, port_taken

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = HERE / "scripts" / "multinode_scatter.py"
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
LAUNCH_TIMEOUT_S = 150  # a hang is a bug: kill everything past this


def _launch(tmp: Path, first_port: Optional[int] = None) -> Tuple[Dict[str, List[dict]], int]:
    """Start both agents, wait (killing their process groups on timeout), collect results; a launch
    whose rendezvous port another process took first runs again on another port (nothing ran).
    Returns the results and the number of launches."""
    for attempt in range(PORT_TRIES):
        procs, hung = _start_agents(tmp, attempt, first_port if attempt == 0 and first_port else free_port())
        if not (procs[0].returncode != 0 and not hung and _port_taken(tmp)):
            break
    return _results(tmp, procs, hung), attempt + 1


def _port_taken(tmp: Path) -> bool:
    return port_taken((tmp / "agent0.log").read_text(errors="replace"))


def _start_agents(tmp: Path, attempt: int, port: int) -> Tuple[List[subprocess.Popen], List[int]]:
    ckpt, out = tmp / f"ckpt{attempt}", tmp / "out"
    shutil.rmtree(out, ignore_errors=True)  # this test's own directory: a retried launch starts empty
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    for var in ("MEGASHARD_NODE_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the node id must come from torchrun's GROUP_RANK
    procs, logs = [], []
    for node in range(NNODES):
        log = open(tmp / f"agent{node}.log", "wb")
        logs.append(log)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NNODES),
               "--nproc-per-node", str(NPROC), "--node-rank", str(node), "--rdzv-backend", "static",
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
               str(SCRIPT), "--ckpt", str(ckpt), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    hung: List[int] = []
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if procs[0].poll() not in (None, 0) and _port_taken(tmp):
                break  # node 0 could not host the rendezvous: the other agent waits on a stranger's port
            if time.monotonic() > deadline:
                hung = [p.pid for p in procs if p.poll() is None]
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the agent and its ranks (own session)
                p.wait()
        for log in logs:
            log.close()
    return procs, hung


def _results(tmp: Path, procs: List[subprocess.Popen], hung: List[int]) -> Dict[str, List[dict]]:
    out = tmp / "out"

    def agent_logs() -> str:
        return "\n".join(f"--- agent {n} ---\n" + (tmp / f"agent{n}.log").read_text(errors="replace")[-4000:]
                         for n in range(NNODES))

    assert not hung, f"torchrun agents {hung} hung (> {LAUNCH_TIMEOUT_S}s)\n{agent_logs()}"
    assert [p.returncode for p in procs] == [0] * NNODES, f"agents failed\n{agent_logs()}"
    results: Dict[str, List[dict]] = {}
    for case in ("shared", "readers_only", "shared_group"):
        files = [out / f"{case}-rank{r}.json" for r in range(WORLD)]
        missing = [f.name for f in files if not f.exists()]
        assert not missing, f"no result from {missing}\n{agent_logs()}"
        results[case] = [json.loads(f.read_text()) for f in files]
    return results


@pytest.fixture(scope="module")
def multinode_launch(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Dict[str, List[dict]], int]:
    """The job, launched first on a port another process listens on (as happens on a shared machine
    between picking a free port and torchrun binding it): the launch must run again elsewhere."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        return _launch(tmp_path_factory.mktemp("multinode"), first_port=taken.getsockname()[1])


@pytest.fixture(scope="module")
def multinode_results(multinode_launch: Tuple[Dict[str, List[dict]], int]) -> Dict[str, List[dict]]:
    return multinode_launch[0]


def test_multinode_launch_runs_again_when_its_port_was_taken(multinode_launch) -> None:
    assert multinode_launch[1] == 2


def _assert_one_reader_per_node(results: List[dict], transport: str = "shm") -> None:
    by_node: Dict[str, List[dict]] = {}
    for r in results:
        assert r["mismatches"] == [], f"rank {r['rank']}: loaded data differs: {r['mismatches']}"
        assert r["mode"] == "scatter", f"rank {r['rank']}: mode {r['mode']}"
        assert r["transport"] == transport, f"rank {r['rank']}: transport {r['transport']}"
        by_node.setdefault(r["node"], []).append(r)
    assert sorted(by_node) == ["0", "1"], f"node ids (GROUP_RANK) seen: {sorted(by_node)}"
    for node, ranks in by_node.items():
        assert sorted(r["local_rank"] for r in ranks) == list(range(NPROC))
        # the node reads every byte it needs exactly once, and nothing else
        assert sum(r["bytes_read"] for r in ranks) == ranks[0]["node_needed_bytes"], (node, ranks)
        for r in ranks:
            if r["local_rank"] == 0:
                assert r["bytes_received"] == 0, (node, r)
            elif transport == "shm":
                # bytes only this rank needs: read through the reader's descriptors (even where
                # the rank cannot see the directory); replicated ones come through the ring
                assert r["bytes_read"] > 0 and r["bytes_received"] > 0, (node, r)
                assert r["bytes_read"] + r["bytes_received"] == r["needed_bytes"], (node, r)
            else:
                assert r["bytes_read"] == 0, f"non-reader rank {r['rank']} read from storage: {r}"
                assert r["bytes_received"] == r["needed_bytes"], (node, r)


def test_multinode_scatter_one_reader_per_node(multinode_results: Dict[str, List[dict]]) -> None:
    results = multinode_results["shared"]
    assert all(r["path_exists"] for r in results)
    _assert_one_reader_per_node(results)


def test_multinode_auto_scatter_when_only_readers_see_checkpoint(multinode_results: Dict[str, List[dict]]) -> None:
    results = multinode_results["readers_only"]
    for r in results:
        assert r["path_exists"] == (r["local_rank"] == 0), r
    _assert_one_reader_per_node(results)


def test_multinode_scatter_over_the_process_group(multinode_results: Dict[str, List[dict]]) -> None:
    _assert_one_reader_per_node(multinode_results["shared_group"], transport="group")

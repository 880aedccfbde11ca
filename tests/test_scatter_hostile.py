"""Scatter loads among hostile or failing neighbours (issue 19, defects 7, 8, 15).

* a stranger process connects to every descriptor socket the ranks listen on: the loads still
  succeed, bit-exact, through the descriptors (strangers are closed, the reader's connection kept);
* a rank that fails to take the reader's descriptors gets its bytes through the ring instead;
* a receiving rank that fails mid-transfer reaches the reader in seconds, not at the process-group
  timeout, on both transports;
* ranks SIGKILLed all together while the ring is being set up leave nothing in /dev/shm (the ring is
  an anonymous memory file: it goes with its last process).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List

import pytest
import torch

from distributed import all_ok, capture_logs, run_ranks
from layouts import Layout, check_state, model_state

NODE_ENV = {"MEGASHARD_NODE_ID": "test-node", "MEGASHARD_HUGEPAGES": "0"}
SHM_DIR = "/dev/shm"

# A stranger: scans /proc/net/unix for the megashard sockets of the pids listed in <dir>/pid*,
# connects to each one 4 times (non-blocking, held open, as a hostile neighbour would), then
# leaves a marker <dir>/seen-<tag>-<socket name>. argv: dir, tag, uid to switch to (or -1).
STRANGER = r"""
import os, socket, sys, time
d, tag, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
if uid >= 0:
    os.setgid(uid)
    os.setuid(uid)
held, done = [], set()
while not os.path.exists(os.path.join(d, "stop")):
    pids = set()
    for n in os.listdir(d):
        if n.startswith("pid"):
            with open(os.path.join(d, n)) as f:
                pids.add(f.read().strip())
    prefixes = tuple(f"@megashard-{p}-" for p in pids if p)
    with open("/proc/net/unix") as f:
        names = [w[1:] for line in f for w in line.split()[7:8] if prefixes and w.startswith(prefixes)]
    for name in names:
        if name in done:
            continue
        done.add(name)
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect("\0" + name)
            except OSError:
                pass
            held.append(s)
        open(os.path.join(d, f"seen-{tag}-{name}"), "w").close()
    time.sleep(0.001)
"""


@contextlib.contextmanager
def _strangers(shared: str) -> Iterator[List[str]]:
    """Stranger processes (this uid, and another uid when running as root) watching ``shared``."""
    uids = [-1] + ([65534] if os.getuid() == 0 else [])
    procs = [subprocess.Popen([sys.executable, "-c", STRANGER, shared, f"s{i}", str(u)])
             for i, u in enumerate(uids)]
    try:
        yield [f"s{i}" for i in range(len(uids))]
    finally:
        open(os.path.join(shared, "stop"), "w").close()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]


def _load(layout: Layout, rank: int, path: str, **kw: Any) -> Dict[str, Any]:
    import megashard

    template = model_state(layout, rank, empty=True)
    _, stats = megashard.load(template, path, mode="scatter", return_stats=True, **kw)
    return {"bad": check_state(template), "transport": stats.transport, "read": stats.bytes_read,
            "received": stats.bytes_received,
            "needed": sum(sh.data.numel() * sh.data.element_size() for c in template.values() for sh in c.values())}


def _stranger_job(rank: int, world: int, tmp: str, shared: str, tags: List[str]) -> Dict[str, Any]:
    import megashard
    from megashard import fdpass

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    megashard.save(model_state(layout, rank), path)
    records = capture_logs()
    missed: List[str] = []
    if rank == 0:  # the reader hands over descriptors only once every stranger has connected first
        real = fdpass.send

        def after_strangers(name: str, pid: int, fds: Any, timeout: float = fdpass.TIMEOUT_S) -> None:
            deadline = time.monotonic() + 20
            want = [os.path.join(shared, f"seen-{t}-{name}") for t in tags]
            while not all(os.path.exists(w) for w in want) and time.monotonic() < deadline:
                time.sleep(0.005)
            missed.extend(w for w in want if not os.path.exists(w))
            real(name, pid, fds, timeout)

        fdpass.send = after_strangers
    with open(os.path.join(shared, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    out: Dict[str, Any] = {"loads": [], "pid": os.getpid()}
    for _ in range(5):
        try:
            out["loads"].append(_load(layout, rank, path, scatter_transport="shm", timeout=60))
        except megashard.DistributedError as e:
            out["loads"].append({"error": str(e)})
    out["missed"], out["logs"] = missed, records
    return out


def test_scatter_survives_strangers(tmp_path) -> None:
    """Strangers (this uid and another) connect to every descriptor socket before the reader does,
    in each of 5 loads: every load succeeds bit-exact, through the passed descriptors, silently."""
    shared = tempfile.mkdtemp(prefix="megashard-strangers-")
    os.chmod(shared, 0o777)
    try:
        with _strangers(shared) as tags:
            res = all_ok(run_ranks(_stranger_job, 2, str(tmp_path), shared, tags, env=NODE_ENV, timeout=240))
        seen = [n for n in os.listdir(shared) if n.startswith("seen-")]
    finally:
        for n in os.listdir(shared):
            os.unlink(os.path.join(shared, n))
        os.rmdir(shared)
    assert res[0]["missed"] == [], res[0]["missed"]
    assert len(seen) == 5 * len(tags), seen  # every load's socket, by every stranger
    for rank, r in enumerate(res):
        assert len(r["loads"]) == 5
        for n, load in enumerate(r["loads"]):
            assert "error" not in load, (rank, n, load)
            assert load["bad"] == [] and load["transport"] == "shm", (rank, n, load)
        assert [m for m in r["logs"] if "descriptor" in m] == [], r["logs"]  # no fall-back was needed
    for load in res[1]["loads"]:  # rank 1 read its own shards itself, through the reader's descriptors
        assert load["read"] > 0 and load["read"] + load["received"] == load["needed"], load


def _receiver_fails_job(rank: int, world: int, tmp: str, how: str) -> Dict[str, Any]:
    import megashard
    from megashard import fdpass

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    megashard.save(model_state(layout, rank), path)
    records = capture_logs()
    if rank == 1:
        if how == "receive":  # the socket fails on the receiving side
            def broken(self: Any, sender_pid: int, count: int, timeout: float = 0) -> List[int]:
                raise fdpass.FdPassError("receiving descriptors from the node's reader: [Errno 104] reset (injected)")

            fdpass.Listener.receive = broken
        else:  # the descriptors arrive but fail the check against the index
            def bad_check(fd: int, size: int, what: str) -> None:
                raise fdpass.FdPassError(f"{what}: the descriptor from the node's reader has 1 bytes (injected)")

            fdpass.check_file = bad_check
    out = {"load": _load(layout, rank, path, scatter_transport="shm"), "logs": list(records), "fds": _fds()}
    out["again"] = _load(layout, rank, path, scatter_transport="shm")
    out["fds_after"] = _fds()
    return out


def _fds() -> List[int]:
    """This process's open descriptors, after a collection (nothing merely unreferenced counts)."""
    import gc

    gc.collect()
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))


def test_scatter_receiver_side_failure_falls_back_to_ring(tmp_path) -> None:
    """A rank that cannot take the reader's descriptors gets every byte through the ring (bit-exact),
    with one warning from the reader naming the rank and the reason; no descriptor leaks."""
    for how, why in (("receive", "[Errno 104] reset (injected)"), ("check", "has 1 bytes (injected)")):
        res = all_ok(run_ranks(_receiver_fails_job, 2, str(tmp_path / how), how, env=NODE_ENV))
        for r in res:
            for case in ("load", "again"):
                assert r[case]["bad"] == [] and r[case]["transport"] == "shm", (how, r[case])
        r1 = res[1]["load"]
        assert (r1["read"], r1["received"]) == (0, r1["needed"]), (how, r1)  # everything through the ring
        lines = [m for m in res[0]["logs"] if "descriptor" in m]
        assert len(lines) == 1, (how, res[0]["logs"])
        assert "rank(s) [1]" in lines[0] and why in lines[0] and "shared-memory ring instead" in lines[0], lines[0]
        assert res[1]["logs"] == [], res[1]["logs"]
        # no descriptor kept by a failed hand-over: a second one leaves none the first did not (a count
        # can drop by one that some other part of the process held open at the first look, as seen once
        # on a loaded CI machine: 15 -> 14)
        assert not set(res[1]["fds_after"]) - set(res[1]["fds"]), (how, res[1]["fds"], res[1]["fds_after"])


def _consumer_fails_job(rank: int, world: int, tmp: str, transport: str) -> Dict[str, Any]:
    import megashard
    from megashard import loading

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    megashard.save(model_state(layout, rank), path)
    if rank == 1:  # the receiving rank fails part-way through the transfer (as when allocating fails)
        real = loading._Op.target
        calls = []

        def failing(self: Any) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("cannot allocate the destination (injected)")
            return real(self)

        loading._Op.target = failing
    t0 = time.monotonic()
    try:
        _load(layout, rank, path, scatter_transport=transport, scatter_chunk_bytes=700, timeout=120)
        return {"error": None, "seconds": time.monotonic() - t0}
    except megashard.DistributedError as e:
        return {"error": type(e).__name__, "failures": sorted(e.failures), "msg": str(e),
                "seconds": time.monotonic() - t0}


def test_scatter_receiver_failure_reaches_reader_quickly(tmp_path) -> None:
    """A receiving rank that fails mid-transfer: every rank raises DistributedError naming it within
    seconds (the load's timeout is 120 s: a reader stuck in its sends would take that long)."""
    for transport in ("group", "shm"):
        res = all_ok(run_ranks(_consumer_fails_job, 2, str(tmp_path / transport), transport, env=NODE_ENV,
                               timeout=240))
        for rank, r in enumerate(res):
            print(f"{transport}: rank {rank} raised after {r['seconds']:.2f} s")
            assert r["error"] == "DistributedError", (transport, rank, r)
            assert r["failures"] == [1] and "injected" in r["msg"], (transport, rank, r)
            assert r["seconds"] < 30, (transport, rank, r["seconds"])  # a hang bound, not a speed test


def _segments_of(pids: List[int]) -> List[str]:
    prefixes = tuple(f"megashard-{p}-" for p in pids)
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefixes))


def _memfds_of(pid: int) -> List[str]:
    """The anonymous memory files (memfd) process ``pid`` holds open, as /proc names them."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/memfd:"):
                out.append(target)
    return out


def _stopped_in_window_job(rank: int, world: int, tmp: str, window: str) -> None:
    """Both ranks stop (forever) on entering the scatter load's ``window`` agreement: "setup" (the
    reader has created the ring, nobody has opened it) or "open" (every rank has it open)."""
    import megashard
    from megashard import scatter

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    megashard.save(model_state(layout, rank), path)
    with open(os.path.join(tmp, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    real_agree = scatter.Comm.agree

    def stop_there(self: Any, err: Any, what: str) -> None:
        if what == f"scatter load ({window})":
            open(os.path.join(tmp, f"stopped{rank}"), "w").close()
            time.sleep(600)
        real_agree(self, err, what)

    scatter.Comm.agree = stop_there
    _load(layout, rank, path, scatter_transport="shm")


@pytest.mark.parametrize("window", ["setup", "open"])
def test_ranks_killed_in_ring_setup_leave_no_shared_memory(tmp_path, window: str) -> None:
    """Every rank of the node SIGKILLed while the ring is being set up (before anyone opened it,
    or once everyone has): nothing of the job's is left in /dev/shm, with no later load to sweep it.
    The job's names there would start with ``megashard-<pid>-`` (the creator's pid); the test only
    looks at those of its own ranks."""
    box: Dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.update(res=run_ranks(
        _stopped_in_window_job, 2, str(tmp_path), window, env=NODE_ENV, timeout=120)))
    runner.start()
    deadline = time.monotonic() + 100
    while not all((tmp_path / f"stopped{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all((tmp_path / f"stopped{r}").exists() for r in range(2)), "the ranks never reached the window"
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    named, anonymous = _segments_of(pids), [m for p in pids for m in _memfds_of(p) if "megashard" in m]
    try:
        assert named or anonymous, "no ring exists at the stop point: the test stops in the wrong place"
    finally:
        for p in pids:
            os.kill(p, signal.SIGKILL)
        runner.join()
    assert [ok for ok, _ in box["res"]] == [False, False], box["res"]
    left = _segments_of(pids)
    for n in left:  # the job's own leftovers only (named after its pids)
        os.unlink(os.path.join(SHM_DIR, n))
    assert left == [], f"shared memory outlived every rank of the job (ring then: {named} {anonymous})"

"""Scatter loads within one node: descriptors + shared-memory ring vs process group, failures, cleanup.

All ranks share one ``MEGASHARD_NODE_ID``, so rank 0 is the node's reader. With
``shm`` the reader passes its open files to the other ranks (bytes only they need,
they read themselves) and bytes several ranks need go through the ring; ``ring``
below is ``shm`` with descriptor passing made to fail (everything through the ring).
One spawned job runs many scenarios to keep the suite fast.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed import all_ok, capture_logs, run_ranks
from layouts import GLOBALS, Layout, check_state, model_state
from tamper import flip_data_byte

NODE_ENV = {"MEGASHARD_NODE_ID": "test-node", "MEGASHARD_HUGEPAGES": "0"}
SHM_DIR = "/dev/shm"


def _segments(pids: List[int]) -> List[str]:
    """megashard segments in /dev/shm created by these processes (names carry the creator's pid)."""
    prefixes = tuple(f"megashard-{p}-" for p in pids)
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefixes))


def _sockets(pids: List[int]) -> List[str]:
    """megashard's abstract Unix sockets still open (names carry the listener's pid)."""
    prefixes = tuple(f"@megashard-{p}-" for p in pids)
    with open("/proc/net/unix") as f:
        return sorted(w for line in f for w in line.split()[7:8] if w.startswith(prefixes))


@contextlib.contextmanager
def _fd_passing_fails() -> Iterator[None]:
    """On the reader: every attempt to pass descriptors fails (as with a foreign network namespace)."""
    from megashard import fdpass

    orig = fdpass.send

    def refuse(name: str, pid: int, fds: Any, timeout: float = 0) -> None:
        raise fdpass.FdPassError(f"cannot pass descriptors to pid {pid} over socket {name}: [Errno 111] refused")

    fdpass.send = refuse
    try:
        yield
    finally:
        fdpass.send = orig


def _boxes(layout: Layout, rank: int) -> Dict[Tuple[str, Tuple[int, ...]], int]:
    return {(sh.key, tuple(sh.global_offset)): sh.data.numel() * sh.data.element_size()
            for chunk in model_state(layout, rank).values() for sh in chunk.values()}


def _shared_bytes(layout: Layout, rank: int, world: int) -> int:
    """Bytes of ``rank``'s shards that another rank of the node loads too (same layout as saved)."""
    others = [_boxes(layout, q) for q in range(world) if q != rank]
    return sum(n for b, n in _boxes(layout, rank).items() if any(b in o for o in others))


def _save(layout: Layout, rank: int, path: str) -> None:
    import megashard

    megashard.save(model_state(layout, rank), path)


def _load(layout: Layout, rank: int, path: str, **kw: Any) -> Dict[str, Any]:
    import megashard

    template = model_state(layout, rank, empty=True)
    _, stats = megashard.load(template, path, mode="scatter", return_stats=True, **kw)
    return {"bad": check_state(template), "transport": stats.transport,
            "read": stats.bytes_read, "received": stats.bytes_received,
            "needed": sum(sh.data.numel() * sh.data.element_size() for c in template.values() for sh in c.values())}


# saved layout -> loaded layouts (same world size)
SCENARIOS = {
    2: [(Layout(tp=2), Layout(tp=2)), (Layout(pp=2), Layout(pp=2)), (Layout(tp=2), Layout(dp=2)),
        (Layout(pp=2, vp=2), Layout(tp=2))],
    4: [(Layout(tp=2, pp=2), Layout(tp=2, pp=2)), (Layout(tp=2, dp=2), Layout(tp=4)),
        (Layout(pp=2, vp=2, tp=2), Layout(dp=2, tp=2))],
}
CHUNKS = [64 << 20, 700]  # the default, and smaller than most tensors (extents split tensors)


def _layouts_job(rank: int, world: int, tmp: str) -> List[Dict[str, Any]]:
    import torch.distributed as dist

    out = []
    for n, (saved, loaded) in enumerate(SCENARIOS[world]):
        path = os.path.join(tmp, f"ckpt{n}")
        _save(saved, rank, path)
        for want in ("shm", "ring", "group"):
            for chunk in CHUNKS:
                with _fd_passing_fails() if want == "ring" and rank == 0 else contextlib.nullcontext():
                    r = _load(loaded, rank, path, scatter_transport="group" if want == "group" else "shm",
                              scatter_chunk_bytes=chunk)
                r.update(scenario=n, want=want, chunk=chunk, pid=os.getpid(), sockets=_sockets([os.getpid()]))
                out.append(r)
        dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_scatter_transports_bit_exact(tmp_path, world: int) -> None:
    results = all_ok(run_ranks(_layouts_job, world, str(tmp_path), env=NODE_ENV, timeout=240))
    model_bytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                      for shape, dt in GLOBALS.values())
    for rank, rows in enumerate(results):
        for r in rows:
            saved, loaded = SCENARIOS[world][r["scenario"]]
            where = f"rank {rank}, scenario {r['scenario']}, {r['want']}, chunk {r['chunk']}"
            assert r["bad"] == [], f"{where}: loaded data differs: {r['bad']}"
            assert r["transport"] == ("group" if r["want"] == "group" else "shm"), where
            assert r["sockets"] == [], where  # the descriptor socket is closed after every load
            if rank == 0:
                assert r["received"] == 0, where
            elif r["want"] != "shm":  # everything arrives from the reader
                assert r["read"] == 0, where
                # (a reshard receives whole covering spans of saved shards)
                assert r["received"] == r["needed"] if saved == loaded else r["received"] >= r["needed"], where
            elif saved == loaded:  # its own shards through the reader's descriptors, replicated ones from the ring
                shared = _shared_bytes(loaded, rank, world)
                assert (r["read"], r["received"]) == (r["needed"] - shared, shared), where
            else:
                assert r["read"] + r["received"] >= r["needed"], where
    # every scenario needs the whole model on the node: with shared memory the node read each
    # byte exactly once (group: chunks smaller than overlapping spans re-read the overlap)
    for i in range(len(results[0])):
        rows = [res[i] for res in results]
        node_read = sum(r["read"] for r in rows)
        assert node_read == model_bytes if rows[0]["want"] != "group" else node_read >= model_bytes, rows[0]
    assert _segments([r["pid"] for rows in results for r in rows]) == []


def _fallback_job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    import megashard

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    _save(layout, rank, path)
    records = capture_logs()
    os.environ["MEGASHARD_SHM_MAX_BYTES"] = "4096"  # "too little memory for the ring"
    auto = _load(layout, rank, path)  # default: scatter_transport="auto"
    try:
        _load(layout, rank, path, scatter_transport="shm")
        forced = "no error"
    except megashard.DistributedError as e:
        forced = f"{type(e).__name__}: {e}"
    del os.environ["MEGASHARD_SHM_MAX_BYTES"]
    import ctypes

    from megashard import shm

    libc = ctypes.CDLL(None)
    if rank == 0:  # the reader made itself non-dumpable: the others could not open its /proc/PID/fd
        assert libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    undumpable = _load(layout, rank, path)
    if rank == 0:
        assert libc.prctl(4, 1, 0, 0, 0) == 0

    if rank == 1:  # a node id that groups ranks of different machines (another boot id)
        shm.host_identity = lambda: "another-machine/pid:[1]"
    elsewhere = _load(layout, rank, path)
    try:
        _load(layout, rank, path, scatter_transport="bogus")
        bad_arg = "no error"
    except ValueError as e:
        bad_arg = str(e)
    return {"auto": auto, "forced": forced, "logs": records, "bad_arg": bad_arg, "pid": os.getpid(),
            "elsewhere": elsewhere, "undumpable": undumpable}


def test_scatter_falls_back_when_shm_too_small(tmp_path) -> None:
    res = all_ok(run_ranks(_fallback_job, 2, str(tmp_path), env=NODE_ENV))
    for r in res:
        assert r["auto"]["bad"] == [] and r["auto"]["transport"] == "group"
        assert r["elsewhere"]["bad"] == [] and r["elsewhere"]["transport"] == "group"
        assert r["undumpable"]["bad"] == [] and r["undumpable"]["transport"] == "group"
        assert r["forced"].startswith("DistributedError") and "0.0 MiB of memory available for shared memory" in r["forced"], r["forced"]
        assert "scatter_transport" in r["bad_arg"]
    lines = [m for m in res[0]["logs"] if "MiB of memory available" in m]
    assert len(lines) == 1, res[0]["logs"]  # one line: the size found and what to change
    assert "MEGASHARD_SHM_MAX_BYTES" in lines[0] and "scatter_chunk_bytes" in lines[0]
    assert [m for m in res[1]["logs"] if "MiB of memory available" in m] == []  # only the reader decides and says so
    assert len([m for m in res[0]["logs"] if "do not all share this rank's kernel" in m]) == 1
    assert len([m for m in res[0]["logs"] if "this process is not dumpable" in m]) == 1
    assert _segments([r["pid"] for r in res]) == []


def _corrupt_job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    import torch.distributed as dist

    import megashard

    layout = Layout(pp=2)
    path = os.path.join(tmp, "ckpt")
    _save(layout, rank, path)
    if rank == 0:  # flip a byte of a shard that only rank 1 (pipeline stage 1) loads
        m = megashard.read_manifest(path)
        rec = [s for s in m.tensors["decoder.layers.self_attention.linear_qkv.weight"].shards if s.offset[0] == 7][0]
        flip_data_byte(path, rec)
    dist.barrier()
    out: Dict[str, Any] = {}
    for transport in ("shm", "group"):
        try:
            _load(layout, rank, path, scatter_transport=transport, verify=True)
            out[transport] = "no error"
        except megashard.DistributedError as e:
            out[transport] = [type(e).__name__, isinstance(e, megashard.ChecksumError), sorted(e.failures)]
    try:  # the default load checks CRC32 where the bytes land: rank 1 names the damaged tensor
        _load(layout, rank, path, scatter_transport="shm")
        out["default"] = "no error"
    except megashard.DistributedError as e:
        out["default"] = [isinstance(e, megashard.ChecksumError), sorted(e.failures)]
    out["unverified"] = _load(layout, rank, path, scatter_transport="shm", check_crc=False)["bad"]
    return out


def test_scatter_verify_covers_every_rank(tmp_path) -> None:
    res = all_ok(run_ranks(_corrupt_job, 2, str(tmp_path), env=NODE_ENV))
    for rank, r in enumerate(res):
        for transport in ("shm", "group"):
            # the reader re-hashes the shards rank 1 received: every rank raises a ChecksumError
            assert r[transport] == ["DistributedChecksumError", True, [0]], (rank, transport, r[transport])
        assert r["default"] == [True, [1]], (rank, r["default"])
    assert res[0]["unverified"] == [] and len(res[1]["unverified"]) == 1  # with no check at all the flip goes through


def _kill_job(rank: int, world: int, tmp: str, victim: int, path_kind: str) -> Dict[str, Any]:
    import megashard
    from megashard import scatter, shm

    with open(os.path.join(tmp, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    layout = Layout(tp=2)
    path = os.path.join(tmp, "ckpt")
    _save(layout, rank, path)
    if rank == victim:  # die in the middle of the transfer, after the ring exists (and descriptors were passed)
        if path_kind == "fd" and rank == 1:  # while reading its own bytes through the reader's descriptors
            owner, hook, nth = scatter, "read_requests", 1
        else:  # while filling / emptying the ring
            owner, hook, nth = shm.Ring, "publish" if rank == 0 else "set_done", 1 if path_kind == "fd" else 3
        orig = getattr(owner, hook)
        calls = []

        def die(*a: Any, **kw: Any) -> Any:
            calls.append(1)
            if len(calls) == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(*a, **kw)

        setattr(owner, hook, die)
    t0 = time.monotonic()
    try:
        with _fd_passing_fails() if path_kind == "ring" and rank == 0 else contextlib.nullcontext():
            _load(layout, rank, path, scatter_transport="shm", scatter_chunk_bytes=512)
        return {"error": None}
    except megashard.DistributedError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0,
                "sockets": _sockets([os.getpid()])}


@pytest.mark.parametrize("path_kind", ["fd", "ring"])
@pytest.mark.parametrize("victim", [0, 1], ids=["reader", "non_reader"])
def test_scatter_sigkill_leaves_nothing(tmp_path, victim: int, path_kind: str) -> None:
    # the stall timeout is far beyond the harness timeout: only the pid watch (or the process
    # group noticing the dead peer) can end the survivor's wait
    res = run_ranks(_kill_job, 2, str(tmp_path), victim, path_kind, env=dict(NODE_ENV, MEGASHARD_SHM_TIMEOUT_S="3600"),
                    timeout=120)
    assert res[victim] == (False, f"exit code {-signal.SIGKILL}"), res[victim]
    ok, survivor = res[1 - victim]
    assert ok and survivor["error"], survivor  # the survivor raised DistributedError, did not hang
    print(f"survivor raised after {survivor['seconds']:.2f} s: {survivor['error']}")
    assert survivor["sockets"] == []  # no descriptor socket left open
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert _segments(pids) == [] and _sockets(pids) == []


def _fd_job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    from megashard import fdpass, scatter

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    _save(layout, rank, path)
    records = capture_logs()
    out: Dict[str, Any] = {"pid": os.getpid()}
    # the non-reader is given a path that does not exist: it opens nothing there
    out["blind"] = _load(layout, rank, path if rank == 0 else path + "-not-here", verify=True)
    out["blind_logs"], records[:] = list(records), []
    with _fd_passing_fails() if rank == 0 else contextlib.nullcontext():
        out["refused"] = _load(layout, rank, path)
    out["refused_logs"], records[:] = list(records), []
    if rank == 1:  # this rank cannot even listen on a socket
        def no_listener() -> None:
            raise fdpass.FdPassError("cannot listen on an abstract Unix socket: [Errno 97] not supported here")

        scatter.fdpass.Listener = no_listener  # type: ignore[assignment]
    out["no_socket"] = _load(layout, rank, path)
    out["no_socket_logs"] = list(records)
    out["sockets"] = _sockets([os.getpid()])
    return out


def test_scatter_fd_passing_and_fallback(tmp_path) -> None:
    res = all_ok(run_ranks(_fd_job, 2, str(tmp_path), env=NODE_ENV))
    layout = Layout(tp=2)
    model_bytes = sum(_boxes(layout, 0).values()) + sum(n for b, n in _boxes(layout, 1).items()
                                                        if b not in _boxes(layout, 0))
    shared = _shared_bytes(layout, 1, 2)
    assert shared > 0  # the layernorms are replicated over TP
    for case in ("blind", "refused", "no_socket"):
        r0, r1 = res[0][case], res[1][case]
        assert r0["bad"] == [] and r1["bad"] == [], (case, r0["bad"], r1["bad"])
        assert r0["transport"] == r1["transport"] == "shm", case
        assert r0["read"] + r1["read"] == model_bytes, case  # the node reads each byte once
        if case == "blind":  # its own bytes through the reader's descriptors, the replicated ones from the ring
            assert (r1["read"], r1["received"]) == (r1["needed"] - shared, shared)
        else:  # fallback: everything through the ring
            assert (r1["read"], r1["received"]) == (0, r1["needed"]), case
    assert res[0]["blind_logs"] == [] and res[1]["blind_logs"] == []
    for case, why in (("refused", "[Errno 111] refused"), ("no_socket", "[Errno 97] not supported here")):
        lines = [m for m in res[0][f"{case}_logs"] if "file descriptors" in m]
        assert len(lines) == 1, res[0][f"{case}_logs"]  # one line: who, why, what happens instead
        assert "rank(s) [1]" in lines[0] and why in lines[0] and "shared-memory ring instead" in lines[0], lines[0]
        assert res[1][f"{case}_logs"] == []
    assert res[0]["sockets"] == res[1]["sockets"] == []
    assert _segments([r["pid"] for r in res]) == []


def _direct_read_fails_job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    import megashard
    from megashard import scatter
    from megashard.format import fastio

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    _save(layout, rank, path)
    out: Dict[str, Any] = {"pid": os.getpid()}
    for victim in (1, 0):  # the non-reader's reads through passed descriptors, then the reader's own
        real = fastio.read_requests  # (the reader's go through its files object's read_into)

        def broken(fd: int, reqs: Any, where: str, threads: int, **kw: Any) -> Any:
            if threading.current_thread().name == "megashard-scatter-direct":
                raise OSError(5, "Input/output error (injected)")
            return real(fd, reqs, where, threads, **kw)

        if rank == victim:
            scatter.read_requests = fastio.read_requests = broken
        try:
            _load(layout, rank, path, scatter_transport="shm")
            out[f"victim{victim}"] = "no error"
        except megashard.DistributedError as e:
            out[f"victim{victim}"] = str(e)
        finally:
            scatter.read_requests = fastio.read_requests = real
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("megashard-scatter"))
    return out


def test_scatter_direct_read_failure_raises_everywhere(tmp_path) -> None:
    """A failed read through a passed descriptor (or the reader's own) ends the load on every rank,
    naming the failing rank; no reading thread, segment or socket is left behind."""
    res = all_ok(run_ranks(_direct_read_fails_job, 2, str(tmp_path), env=NODE_ENV))
    for r in res:
        assert "rank 1" in r["victim1"] and "injected" in r["victim1"], r["victim1"]
        assert "rank 0" in r["victim0"] and "injected" in r["victim0"], r["victim0"]
        assert r["threads"] == []
    assert _segments([r["pid"] for r in res]) == [] and _sockets([r["pid"] for r in res]) == []


def _ring_fails_job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    import megashard
    from megashard import shm

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    _save(layout, rank, path)
    out: Dict[str, Any] = {"pid": os.getpid()}
    real = shm.Ring.create

    def refuse(consumers: int, slots: int, slot_bytes: int, **kw: Any) -> Any:
        raise shm.ShmError("cannot reserve shared memory for the ring (injected)")

    if rank == 0:  # the reader: its own bytes are already being read when the ring cannot be made
        shm.Ring.create = refuse
    try:
        with _fd_passing_fails() if rank == 0 else contextlib.nullcontext():
            _load(layout, rank, path, scatter_transport="shm")
        out["error"] = "no error"
    except megashard.DistributedError as e:
        out["error"] = str(e)
    finally:
        shm.Ring.create = real
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("megashard-scatter"))
    with _fd_passing_fails() if rank == 0 else contextlib.nullcontext():
        out["after"] = _load(layout, rank, path, scatter_transport="shm")
    return out


def test_scatter_ring_creation_failure_raises_everywhere(tmp_path) -> None:
    """The reader starts reading its own bytes before it creates the ring; when the ring cannot be made,
    those reads stop, the load fails on every rank naming the cause, no reading thread is left, and the
    next load is bit-exact."""
    res = all_ok(run_ranks(_ring_fails_job, 2, str(tmp_path), env=NODE_ENV))
    for r in res:
        assert "creating the node's shared memory ring" in r["error"] and "injected" in r["error"], r["error"]
        assert r["threads"] == []
        assert r["after"]["bad"] == [] and r["after"]["transport"] == "shm", r["after"]
    assert _segments([r["pid"] for r in res]) == [] and _sockets([r["pid"] for r in res]) == []


def _alone_job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    import megashard

    path = os.path.join(tmp, "ckpt")
    layout = Layout(tp=2)
    _save(layout, rank, path)
    os.environ["MEGASHARD_NODE_ID"] = f"node-{rank}"  # one rank per node: each is its node's reader
    out = {"alone": _load(layout, rank, path, verify=True)}
    os.environ["MEGASHARD_NODE_ID"] = "test-node"  # one node, but rank 1 asks for no bytes at all
    template = model_state(layout, rank, empty=True) if rank == 0 else {}
    _, stats = megashard.load(template, path, mode="scatter", strict=False, return_stats=True)
    out["idle_peer"] = {"bad": check_state(template), "transport": stats.transport, "read": stats.bytes_read,
                        "received": stats.bytes_received}
    return out


def test_scatter_reader_alone_reads_in_place(tmp_path) -> None:
    """A node whose other ranks need nothing (or that has no other ranks) moves nothing: its
    reader reads its own bytes straight into place, exactly its bytes, transport "none"."""
    res = all_ok(run_ranks(_alone_job, 2, str(tmp_path), env=NODE_ENV))
    for rank, r in enumerate(res):
        a = r["alone"]
        assert a["bad"] == [] and a["transport"] == "none", a
        assert (a["read"], a["received"]) == (a["needed"], 0), a
        i = r["idle_peer"]
        assert i["bad"] == [] and i["transport"] == "none" and i["received"] == 0, i
    assert res[0]["idle_peer"]["read"] == res[0]["alone"]["needed"] and res[1]["idle_peer"]["read"] == 0


def test_fdpass_checks_peer_and_counts(tmp_path) -> None:
    """The socket layer alone: descriptors arrive (in batches), the wrong peer is refused, nothing leaks."""
    from megashard import fdpass

    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    fd = os.open(f, os.O_RDONLY)
    before = sorted(os.listdir("/proc/self/fd"))
    me = os.getpid()
    try:
        lst = fdpass.Listener()
        fdpass.send(lst.name, me, [fd] * 300)  # > one message's worth
        got = lst.receive(me, 300)
        assert len(set(got)) == 300 and all(os.fstat(g).st_ino == os.fstat(fd).st_ino for g in got)
        fdpass.check_file(got[0], 100, "f")
        with pytest.raises(fdpass.FdPassError, match="has 100 bytes, the index says 99"):
            fdpass.check_file(got[0], 99, "f")
        fdpass.close_all(got)
        lst.close()
        lst = fdpass.Listener()
        with pytest.raises(fdpass.FdPassError, match="refusing"):  # not the requesting rank's pid
            fdpass.send(lst.name, me + 1, [fd])
        lst.close()
        lst = fdpass.Listener()
        fdpass.send(lst.name, me, [fd])  # not the reader's pid: closed, the wait goes on
        # the accept thread holds it first: slow on a loaded machine (10 s was not always enough); the wait
        # ends as soon as it does, and fails here, saying so, rather than in the match below
        deadline = time.monotonic() + 120
        while True:
            with lst._cond:
                if me in lst._held:
                    break
            assert time.monotonic() < deadline, "the listener's accept thread never took the connection"
            time.sleep(0.01)
        with pytest.raises(fdpass.FdPassError, match=r"no connection .* 1 other connection\(s\) closed"):
            lst.receive(me + 1, 1, timeout=0.3)
        lst.close()
        lst = fdpass.Listener()
        fdpass.send(lst.name, me, [fd])
        with pytest.raises(fdpass.FdPassError, match="sent 1 of 2 descriptors"):
            lst.receive(me, 2)
        with pytest.raises(fdpass.FdPassError, match="no connection"):
            lst.receive(me, 1, timeout=0.2)
        lst.close()
        with pytest.raises(fdpass.FdPassError, match="not a megashard socket name"):
            fdpass.send("/tmp/elsewhere", me, [fd])
        with pytest.raises(fdpass.FdPassError, match="cannot pass descriptors"):
            fdpass.send(lst.name, me, [fd])  # closed: nobody listens any more
        assert sorted(os.listdir("/proc/self/fd")) == before
        assert _sockets([me]) == []
    finally:
        os.close(fd)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 120)), max_size=25))
def test_split_shared_marks_bytes_of_several_ranges(ranges) -> None:
    from megashard.scatter import split_shared

    ranges = [(f"f{f}", a, n) for f, a, n in ranges]
    cover: Dict[Tuple[str, int], int] = {}
    for f, a, n in ranges:
        for b in range(a, a + n):
            cover[(f, b)] = cover.get((f, b), 0) + 1
    for (f, a, n), pieces in zip(ranges, split_shared(ranges)):
        pos = 0
        for p, m, shared in pieces:
            assert p == pos and m > 0  # in order, no gaps, nothing empty
            assert all((cover[(f, b)] > 1) == shared for b in range(a + p, a + p + m))
            pos += m
        assert pos == n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 120)), max_size=25),
       st.integers(1, 90))
def test_partition_reads_each_byte_once(ranges, chunk) -> None:
    from megashard.plan import partition

    ranges = [(f"f{f}", a, n) for f, a, n in ranges]
    extents, pieces = partition(ranges, chunk)
    seen = set()
    for e in extents:
        assert 0 < e.stop - e.start <= chunk
        span = {(e.file, b) for b in range(e.start, e.stop)}
        assert not span & seen  # disjoint
        seen |= span
    assert seen == {(f, b) for f, a, n in ranges for b in range(a, a + n)}  # exactly the union
    for (f, a, n), ps in zip(ranges, pieces):
        got = []
        for k, off, pos, m in ps:
            e = extents[k]
            assert e.file == f and 0 <= off and off + m <= e.stop - e.start
            got += list(range(e.start + off, e.start + off + m))
            assert e.start + off == a + pos
        assert got == list(range(a, a + n))


def test_shm_ring_protocol_single_process() -> None:
    """The ring's counters: a slot is reused only after every consumer moved past it."""
    from megashard import shm

    ring = shm.Ring.create(consumers=2, slots=2, slot_bytes=16)
    try:
        a = shm.Ring.attach(ring.handle(), 2, 2, 16, 0)
        b = shm.Ring.attach(ring.handle(), 2, 2, 16, 1)
        assert os.readlink(f"/proc/self/fd/{ring.fd}") == "/memfd:megashard-ring (deleted)"  # no name anywhere
        wrong = ring.handle()
        wrong[3] += 1  # another inode: not the ring the reader named
        with pytest.raises(shm.ShmError, match="is not the ring the reader named"):
            shm.Ring.attach(wrong, 2, 2, 16, 0)
        with pytest.raises(shm.ShmError, match=r"has \d+ bytes, expected"):
            shm.Ring.attach(ring.handle(), 2, 3, 16, 0)
        with pytest.raises(shm.ShmError, match="named no usable shared memory ring"):
            shm.Ring.attach(None, 2, 2, 16, 0)  # type: ignore[arg-type]
        me = os.getpid()
        assert ring.wait_slot_free(1, [me, me], blocking=False)
        ring.slot(0, 16).copy_(torch.arange(16, dtype=torch.uint8))
        ring.publish(0)
        a.wait_produced(0, me)
        assert torch.equal(a.slot(0, 16), torch.arange(16, dtype=torch.uint8))
        assert not ring.wait_slot_free(2, [me, me], blocking=False)  # nobody is done with extent 0
        a.set_done(0, 2)
        assert not ring.wait_slot_free(2, [me, me], blocking=False)  # consumer 1 still needs it
        b.fail_consumer(1)
        assert ring.wait_slot_free(2, [me, me], blocking=False)  # a failed consumer does not block
        ring.fail_reader()
        with pytest.raises(shm.ShmError, match="reader failed"):
            b.wait_produced(5, me)
        a.close()
        b.close()
    finally:
        ring.close()


@pytest.mark.parametrize("populate", [True, False])
def test_shm_ring_pages_mapped_up_front_or_on_first_touch_hold_the_same_bytes(populate: bool) -> None:
    """A ring mapped without MAP_POPULATE (an object store's: its pages are mapped as the GETs and
    the consumers first touch them) is still reserved whole at creation and carries the bytes alike."""
    from megashard import shm

    n = 3 * (1 << 20) + 5
    ring = shm.Ring.create(consumers=1, slots=2, slot_bytes=n, populate=populate)
    try:
        assert os.fstat(ring.fd).st_blocks * 512 >= shm.segment_bytes(1, 2, n)  # reserved, not sparse
        c = shm.Ring.attach(ring.handle(), 1, 2, n, 0, populate=populate)
        want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        ring.slot_memoryview(1, n)[:] = want.numpy().tobytes()
        ring.publish(1)
        c.wait_produced(1, os.getpid())
        assert torch.equal(c.slot(1, n), want) and torch.equal(ring.slot(1, n), want)
        c.close()
    finally:
        ring.close()

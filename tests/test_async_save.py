"""megashard.save(..., async_save=True): snapshot semantics, staging reuse, collective
finalization and failure agreement (2 gloo ranks), and SIGKILL at random moments of
an async save loop (the tracker always names a complete, loadable checkpoint)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import megashard
from megashard import DistributedError, storage

from distributed import all_ok, run_ranks
from layouts import Layout, check_state, extras, model_state

REPO = Path(__file__).resolve().parents[1]


def _tensors(tree):
    """Every tensor a state tree holds (ShardedTensor data included)."""
    out = []
    if isinstance(tree, dict):
        for v in tree.values():
            out += _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            out += _tensors(v)
    elif isinstance(tree, torch.Tensor):
        out.append(tree)
    elif hasattr(tree, "data") and isinstance(getattr(tree, "data"), torch.Tensor):
        out.append(tree.data)
    return out


def _load_check(layout, rank, ckpt):
    sd = model_state(layout, rank, empty=True)
    sd.update({"iteration": 0, "rng": torch.zeros(5056, dtype=torch.uint8)})
    out = megashard.load(sd, ckpt)
    ex = extras(rank)
    return {"bad": check_state(sd), "rng_ok": bool(torch.equal(out["rng"], ex["rng"])),
            "blob_ok": out["blob"] == ex["blob"], "iteration": out["iteration"]}


def _scenarios(rank, world, base):
    from megashard import async_save

    lay = Layout(tp=2)
    out = {}
    stg = async_save.staging()

    # 1. snapshot semantics: the caller clobbers every tensor right after save returns
    sd = model_state(lay, rank)
    sd.update(extras(rank))
    h = megashard.save(sd, os.path.join(base, "a"), async_save=True)
    for t in _tensors(sd):
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    assert async_save.in_flight() is h
    first_dir = h.result()
    out["result_dir"] = first_dir == os.path.join(base, "a")
    out["result_again"] = h.result() == first_dir and h.done() and async_save.in_flight() is None
    out["a"] = _load_check(lay, rank, first_dir)
    alloc1 = stg.allocations
    ptrs1 = {k: a.data_ptr() for k, a in stg.arenas.items()}

    # 2. staging reuse: same state again, then a new save while one is in flight
    sd = model_state(lay, rank)
    sd.update(extras(rank))
    h2 = megashard.save(sd, os.path.join(base, "b"), async_save=True)
    h3 = megashard.save(sd, os.path.join(base, "c"), async_save=True)  # finalizes b first
    out["b_finalized_by_next"] = h2.finalized and storage.is_checkpoint(os.path.join(base, "b"))
    while not async_save.all_done():  # Megatron-style non-blocking polling (collective)
        time.sleep(0.01)
    out["finalize"] = async_save.finalize(blocking=False) == os.path.join(base, "c") and h3.finalized
    out["allocs"] = [alloc1, stg.allocations]
    out["same_arena"] = {k: a.data_ptr() for k, a in stg.arenas.items()} == ptrs1
    out["staging_bytes"] = stg.nbytes()
    out["b"] = _load_check(lay, rank, os.path.join(base, "b"))
    out["c"] = _load_check(lay, rank, os.path.join(base, "c"))

    # 3. a sync save while an async one is in flight finalizes it first
    h4 = megashard.save(sd, os.path.join(base, "d"), async_save=True)
    megashard.save(sd, os.path.join(base, "e"))
    out["sync_after_async"] = h4.finalized and all(storage.is_checkpoint(os.path.join(base, n)) for n in "de")

    # 4. rank 1's background write fails: result() raises on every rank, nothing committed
    import megashard.saving as api

    real = api.write_file
    if rank == 1:
        def boom(*a, **k):
            raise OSError(28, "No space left on device")
        api.write_file = boom
    h5 = megashard.save(sd, os.path.join(base, "a"), async_save=True)  # re-save over a
    try:
        h5.result()
        out["fail"] = None
    except DistributedError as e:
        out["fail"] = {"failures": sorted(e.failures), "nospace": "No space left" in str(e)}
    api.write_file = real
    out["a_after_fail"] = _load_check(lay, rank, os.path.join(base, "a"))
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("async"))
    return base, all_ok(run_ranks(_scenarios, 2, base, timeout=300))


def _ok(check):
    assert check["bad"] == [] and check["rng_ok"] and check["blob_ok"], check


def test_snapshot_then_caller_clobbers_tensors(scenarios):
    _, res = scenarios
    for r in res:
        assert r["result_dir"] and r["result_again"]
        _ok(r["a"])


def test_staging_reused_without_allocating(scenarios):
    _, res = scenarios
    for r in res:
        assert r["allocs"][0] >= 1 and r["allocs"][1] == r["allocs"][0], r["allocs"]
        assert r["same_arena"]
        assert r["staging_bytes"] > 0


def test_new_save_finalizes_previous_and_nonblocking_finalize(scenarios):
    _, res = scenarios
    for r in res:
        assert r["b_finalized_by_next"] and r["finalize"] and r["sync_after_async"]
        _ok(r["b"])
        _ok(r["c"])


def test_failed_background_write_raises_everywhere_and_keeps_previous(scenarios):
    base, res = scenarios
    for r in res:
        assert r["fail"] == {"failures": [1], "nospace": True}, r["fail"]
        _ok(r["a_after_fail"])
    # the failed save removed its own temp dir (rank 0 created it)
    assert not [n for n in os.listdir(base) if n.startswith(".a.tmp-") or n.startswith(".a.del-")]


def test_process_exit_with_save_in_flight_abandons_it(tmp_path):
    """No result() before exit: the atexit hook waits for the writer, commits nothing."""
    script = textwrap.dedent("""
        import sys, torch, megashard
        h = megashard.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, sys.argv[1], async_save=True)
    """)
    final = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", script, str(final)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "abandoned" in p.stderr
    assert not final.exists()
    temps = [n for n in os.listdir(tmp_path) if n.startswith(".ckpt.tmp-")]
    assert len(temps) == 1 and not storage.is_checkpoint(tmp_path / temps[0])
    # the writer finished before exit: its file is whole, just never committed
    assert [f for f in os.listdir(tmp_path / temps[0]) if f.endswith(".tensors")]


# --------------------------------------------------------------------------- SIGKILL

LOOP = textwrap.dedent("""
    import os, sys, torch, megashard
    from megashard import storage
    root, ready = sys.argv[1], sys.argv[2]
    it = 0
    w = torch.zeros(6 << 20, dtype=torch.float32)  # 24 MiB: the write takes a while
    while True:
        it += 1
        w.fill_(float(it))
        h = megashard.save({"w": w, "iteration": it}, os.path.join(root, f"iter_{it:07d}"), async_save=True)
        w.fill_(-1.0)  # the snapshot must not see this
        if it == 1:
            open(ready, "w").close()
        h.result()
        storage.write_tracker(root, it)
""")


def _named_shared_memory(pid: int) -> list:
    """Files under /dev/shm that process ``pid`` maps or holds open."""
    with open(f"/proc/{pid}/maps") as f:
        found = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return sorted(n for n in found if n.startswith("/dev/shm/"))


def test_sigkill_at_random_moments_of_async_saves(tmp_path):
    """Kill a loop of async saves (snapshot, write, commit, tracker) at random times;
    each time the tracker names a complete checkpoint that loads bit-exactly, and the process held
    nothing in /dev/shm (nothing of it can outlive the kill)."""
    rnd = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outcomes = []
    for trial in range(6):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        ready = tmp_path / f"ready{trial}"
        proc = subprocess.Popen([sys.executable, "-c", LOOP, str(root), str(ready)], env=env)
        try:
            deadline = time.monotonic() + 180  # Python + torch + a first save; ends at "ready": no cost
            while not ready.exists():
                assert proc.poll() is None, "saver died early"
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(rnd.uniform(0.0, 1.5))
            # staging is the process's own memory: nothing it holds has a name in /dev/shm to outlive it
            assert _named_shared_memory(proc.pid) == []
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        tracker = storage.read_tracker(str(root))
        complete = sorted(n for n in os.listdir(root) if n.startswith("iter_") and storage.is_checkpoint(root / n))
        if tracker is None:  # killed before the first commit: nothing claims to be a checkpoint
            assert complete in ([], ["iter_0000001"])
            outcomes.append("no tracker")
            continue
        it = int(tracker)
        ckpt = root / f"iter_{it:07d}"
        w = torch.empty(6 << 20, dtype=torch.float32)
        out = megashard.load({"w": w, "iteration": 0}, str(ckpt), verify=True)
        assert out["iteration"] == it and torch.equal(w, torch.full_like(w, float(it)))
        for n in complete:  # every directory that looks complete is complete
            k = int(n[5:])
            v = torch.empty_like(w)
            megashard.load({"w": v, "iteration": 0}, str(root / n), verify=True)
            assert torch.equal(v, torch.full_like(v, float(k))), n
        assert complete[-1] in (f"iter_{it:07d}", f"iter_{it + 1:07d}")  # at most one commit past the tracker
        outcomes.append(f"tracker {it}, newest complete {complete[-1]}")
    print("kill outcomes:", outcomes)


def _killed_during_background_write(rank, world, ckpt):
    import megashard.saving as api

    sd = {"w": torch.full((1 << 16,), float(rank)), "iteration": 1}
    megashard.save(sd, ckpt)  # the previous checkpoint
    if rank == 1:
        real = api.write_file

        def die(tensors, path, **k):  # on the writer thread, after part of a file is written
            real(dict(list(tensors.items())[:1]), path, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        api.write_file = die
    sd = {"w": torch.full((1 << 16,), 10.0 + rank), "iteration": 2}
    h = megashard.save(sd, ckpt, async_save=True, timeout=20)
    t0 = time.monotonic()
    try:
        h.result()
    except DistributedError as e:
        return {"raised": sorted(e.failures), "after_s": time.monotonic() - t0}
    return {"raised": None}


def test_rank_sigkilled_during_background_write(tmp_path):
    """The survivor's result() raises within the timeout; the previous checkpoint stays."""
    ckpt = str(tmp_path / "ckpt")
    res = run_ranks(_killed_during_background_write, 2, ckpt, timeout=120)
    assert res[1][0] is False  # killed
    assert res[0][0] is True and res[0][1]["raised"], res[0]
    assert res[0][1]["after_s"] < 60
    w = torch.empty(1 << 16)
    out = megashard.load({"w": w, "iteration": 0}, ckpt, verify=True)
    assert out["iteration"] == 1 and torch.equal(w, torch.zeros(1 << 16))


def test_writer_thread_runs_niced_and_writes_bit_exact(tmp_path, monkeypatch):
    """In one process: the writer thread runs at MEGASHARD_ASYNC_NICE (training first),
    and what it wrote loads back bit for bit."""
    from megashard import async_save

    monkeypatch.setenv("MEGASHARD_ASYNC_NICE", "7")
    w = torch.randn(1 << 18)
    h = megashard.save({"w": w.clone()}, str(tmp_path / "c"), async_save=True)
    h.result()
    tid = async_save._WRITER.thread.native_id
    assert os.getpriority(os.PRIO_PROCESS, tid) >= 7
    v = torch.empty_like(w)
    megashard.load({"w": v}, str(tmp_path / "c"), verify=True)
    assert torch.equal(v, w)


POOLS = textwrap.dedent("""
    import json, os, sys, threading, torch, megashard
    torch.set_num_threads(1)
    base = sys.argv[1]
    records, phase = [], [None]
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def note():
        if phase[0] is not None:
            t = threading.current_thread()
            records.append((phase[0], t.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    def pwrite(*a):
        note()
        return real_pwrite(*a)

    def preadv(*a):
        note()
        return real_preadv(*a)

    os.pwrite, os.preadv = pwrite, preadv
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(300, 1000, generator=g)}

    def sync_save(name):
        phase[0] = name
        megashard.save(sd, os.path.join(base, name), direct_io=True)
        phase[0] = None

    def async_save(name):
        phase[0] = name
        h = megashard.save(sd, os.path.join(base, name), async_save=True, direct_io=True)
        h.wait_local()  # only the background write is recorded, not the commit on this thread
        phase[0] = None
        h.result()

    def load(name):
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        phase[0] = "load-" + name
        megashard.load(out, os.path.join(base, name), threads=int(sys.argv[2]))
        phase[0] = None
        assert all(torch.equal(out[k], v) for k, v in sd.items())

    # training-path saves first (pools created at the trainer's niceness), then the writer,
    # then the training path again (pools the writer has used)
    sync_save("s1")
    async_save("a1")
    sync_save("s2")
    load("s2")
    async_save("a2")
    load("a2")
    print("RESULT " + json.dumps({"main": os.getpriority(os.PRIO_PROCESS, 0), "records": records}))
""")


@pytest.mark.parametrize("load_threads", [2, 9])
def test_writer_niceness_stays_off_training_path_threads(tmp_path, load_threads):
    """Issue 19 defect 16: the background writer runs niced (MEGASHARD_ASYNC_NICE) on its
    own I/O threads. Every pwrite/preadv of a synchronous save or a load runs at the
    trainer's niceness, every one of the background writer's runs at the writer's, whichever
    used a thread pool first (direct-I/O writes go through pooled threads on both paths;
    9 load threads ask for a pool of the direct writers' size)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MEGASHARD_ASYNC_NICE="7")
    p = subprocess.run([sys.executable, "-c", POOLS, str(tmp_path), str(load_threads)], env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    main = res["main"]
    assert main < 7
    by_phase: dict = {}
    for ph, name, nice in res["records"]:
        by_phase.setdefault(ph, []).append((name, nice))
    assert set(by_phase) == {"s1", "a1", "s2", "load-s2", "a2", "load-a2"}, set(by_phase)
    for ph, recs in by_phase.items():
        want = 7 if ph.startswith("a") else main
        wrong = sorted({(n, v) for n, v in recs if v != want})
        assert not wrong, f"{ph}: I/O on threads at the wrong niceness (want {want}): {wrong}"
    for ph in ("s1", "a1", "s2", "a2"):  # the direct writes really went through pooled threads
        assert any(n.startswith("megashard-io") for n, _ in by_phase[ph]), (ph, by_phase[ph])


def test_next_save_waits_for_a_stuck_write_only_until_its_timeout(tmp_path, monkeypatch):
    """A save whose result() timed out may still be writing from the staging memory; the next
    async save waits for it (it reuses that memory), but only up to its own ``timeout``: then it
    raises, naming the stuck write, instead of hanging this rank forever."""
    import threading

    from megashard import MegashardError, saving

    release = threading.Event()
    real = saving._write_into

    def stuck(*a, **k):
        release.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(saving, "_write_into", stuck)
    w = torch.randn(1 << 12)
    h = megashard.save({"w": w}, str(tmp_path / "a"), async_save=True)
    with pytest.raises(DistributedError, match="did not finish within"):
        h.result(timeout=0.2)
    outcome: dict = {}

    def second() -> None:
        t0 = time.monotonic()
        try:
            megashard.save({"w": w}, str(tmp_path / "b"), async_save=True, timeout=1.0)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions below
            outcome["error"] = e
        outcome["s"] = time.monotonic() - t0

    t = threading.Thread(target=second, daemon=True)
    t.start()
    t.join(20)
    try:
        assert not t.is_alive(), "the next save hung on the stuck background write"
        assert isinstance(outcome.get("error"), MegashardError), outcome
        assert "still writing" in str(outcome["error"]) and str(tmp_path / "a") in str(outcome["error"])
        assert outcome["s"] < 15
    finally:
        release.set()
        t.join(30)
    assert not (tmp_path / "b").exists()

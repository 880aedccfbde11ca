"""megashard.save(..., async_save=True): snapshot semantics, staging reuse, collective
finalization and failure agreement (2 gloo ranks), and SIGKILL at random moments of
an async save loop (the tracker always names a complete, loadable checkpoint)."""
from __future__ import annotations

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


def test_sigkill_at_random_moments_of_async_saves(tmp_path):
    """Kill a loop of async saves (snapshot, write, commit, tracker) at random times;
    each time the tracker names a complete checkpoint that loads bit-exactly."""
    rnd = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outcomes = []
    for trial in range(6):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        ready = tmp_path / f"ready{trial}"
        proc = subprocess.Popen([sys.executable, "-c", LOOP, str(root), str(ready)], env=env)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert proc.poll() is None, "saver died early"
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(rnd.uniform(0.0, 1.5))
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

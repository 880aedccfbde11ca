"""A save never destroys what it did not create, and a commit is complete or does not happen.

Issue 19, defects 1-4 and 17: a save over something that is not a megashard checkpoint is
refused before any rank writes; ranks that do not share the checkpoint directory are refused
and the previous checkpoint stays; concurrent saves of one name (plus a SIGKILL) always leave
a complete checkpoint; temporaries of dead saves are removed, those of live ones kept;
``convert`` refuses a destination inside its source.
"""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import megashard
from megashard import saveroot, storage
from megashard.convert import ConvertInputError, convert
from megashard.errors import CheckpointError, DistributedError, MegashardError
from megashard.sharded import ShardedTensor

from distributed import run_ranks

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


# --------------------------------------------------------------------------- helpers


def tree(root: Path) -> dict:
    """Every entry under ``root`` with its kind and (for files) bytes: 'nothing changed' is equality."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", None)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def state(v: float) -> dict:
    """A one-rank state: a global tensor (so convert has something to export) and a value."""
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32) + v), "v": v}


def loaded_w(path) -> torch.Tensor:
    out = megashard.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64))}, path)
    return out["w"].data


def aux_entries(parent: Path) -> list:
    return sorted(n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n or ".del-" in n)


def megatron_root(root: Path) -> None:
    """A Megatron save root as a user has it: two iterations, the tracker, notes."""
    megashard.save(state(100), root / "iter_0000100")
    megashard.save(state(200), root / "iter_0000200")
    storage.write_tracker(root, 200)
    (root / "NOTES.md").write_text("lr sweep, do not delete\n")


# --------------------------------------------------------------------------- defect 1: only a checkpoint is replaced


def test_save_to_a_megatron_save_root_is_refused_and_deletes_nothing(tmp_path):
    root = tmp_path / "run1"
    megatron_root(root)
    before, parent_before = tree(root), sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError) as ei:
        megashard.save(state(1), root)
    msg = str(ei.value)
    assert str(root) in msg and "not a megashard checkpoint" in msg, msg
    assert tree(root) == before
    assert sorted(os.listdir(tmp_path)) == parent_before  # no temp dir: nothing was written
    assert torch.equal(loaded_w(root / "iter_0000200"), state(200)["w"].data)


def test_save_over_a_plain_file_or_a_symlink_is_refused(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match="model.bin"):
        megashard.save(state(1), f)
    assert f.read_bytes() == b"precious"
    real = tmp_path / "real"
    megashard.save(state(2), real)
    link = tmp_path / "link"
    link.symlink_to(real)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match="link"):
        megashard.save(state(3), link)
    assert tree(tmp_path) == before


def test_checkpoint_with_unrelated_files_is_not_replaced(tmp_path):
    ck = tmp_path / "ckpt"
    megashard.save(state(1), ck)
    (ck / "NOTES.md").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError) as ei:
        megashard.save(state(2), ck)
    assert "NOTES.md" in str(ei.value) and str(ck) in str(ei.value)
    assert tree(tmp_path) == before


def test_resave_replaces_atomically_and_an_empty_directory_is_a_target(tmp_path):
    ck = tmp_path / "ckpt"
    megashard.save(state(1), ck)
    megashard.save(state(2), ck)
    assert torch.equal(loaded_w(ck), state(2)["w"].data)
    assert aux_entries(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    megashard.save(state(3), empty)
    assert torch.equal(loaded_w(empty), state(3)["w"].data)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "empty"]


def _refused_body(rank, world, target):
    try:
        megashard.save(_split_rows(rank, world, 0.0), target)
    except CheckpointError as e:
        return ("CheckpointError", isinstance(e, DistributedError), str(e))
    return ("saved", False, "")


def test_refusal_reaches_every_rank_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "1")  # refusals wait this long for a lagging mount
    root = tmp_path / "run1"
    megatron_root(root)
    before, parent_before = tree(root), sorted(os.listdir(tmp_path))
    res = run_ranks(_refused_body, 2, str(root), timeout=120)
    for ok, (kind, dist, msg) in res:
        assert ok and kind == "CheckpointError" and dist, (kind, msg)
        assert str(root) in msg and "not a megashard checkpoint" in msg, msg
    assert tree(root) == before and sorted(os.listdir(tmp_path)) == parent_before


def test_recover_and_cleanup_never_delete_a_non_checkpoint_old_copy(tmp_path):
    ck = tmp_path / "ckpt"
    megashard.save(state(1), ck)
    junk = tmp_path / ".ckpt.old-user1"  # someone's directory that happens to use our pattern
    junk.mkdir()
    (junk / "data.txt").write_text("mine")
    mixed = tmp_path / ".ckpt.old-user2"  # a checkpoint a user added notes to
    megashard.save(state(0), tmp_path / "x")
    os.rename(tmp_path / "x", mixed)
    (mixed / "NOTES.md").write_text("notes")
    before = tree(tmp_path)
    assert storage.recover(ck) == str(ck)
    storage.cleanup_stale_temps(tmp_path, older_than_s=0)
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- defect 2: complete commits only


def _split_rows(rank, world, v):
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8) + v
    rows = 8 // world
    return {"w": ShardedTensor.from_rank_offsets("w", full[rank * rows:(rank + 1) * rows].clone(), (0, rank, world)),
            "v": v}


def _different_dirs_body(rank, world, dirs):
    os.chdir(dirs[rank])  # the same relative path names a different directory on each rank
    out = []
    for async_save in (False, True):
        try:
            h = megashard.save(_split_rows(rank, world, 2.0), "ckpt", async_save=async_save)
            if h is not None:
                h.result()
            out.append(("saved", False, ""))
        except MegashardError as e:
            out.append((type(e).__name__, isinstance(e, DistributedError), str(e)))
    return out


def test_ranks_that_do_not_share_the_directory_are_refused(tmp_path, monkeypatch):
    """Sync and async saves; the previous checkpoint stays bit-exact, nothing is left behind."""
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "1")  # refusals wait this long for a lagging mount
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    megashard.save(_split_rows(0, 1, 1.0), a / "ckpt")  # the previous checkpoint
    before_a, before_b = tree(a), tree(b)
    res = run_ranks(_different_dirs_body, 2, [str(a), str(b)], timeout=180)
    for ok, attempts in res:
        assert ok, attempts
        for kind, dist, msg in attempts:
            assert kind != "saved" and dist, (kind, msg)
            assert "rank(s) 1" in msg and "shared filesystem" in msg and str(b) in msg, msg
    assert tree(a) == before_a and tree(b) == before_b  # nothing committed, nothing left behind
    out = megashard.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}, a / "ckpt")
    assert torch.equal(out["w"].data, torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1.0)


def test_commit_checks_every_reported_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "1")  # refusals wait this long for a lagging mount
    tmp = Path(storage.make_temp_dir(tmp_path / "ckpt", "tok"))
    (tmp / "m-r00000.tensors").write_bytes(b"x" * 10)
    (tmp / "m-r00001.tensors").write_bytes(b"x" * 7)
    storage.check_reported_files(tmp, {0: {"m-r00000.tensors": 10}})
    with pytest.raises(CheckpointError) as ei:
        storage.check_reported_files(tmp, {0: {"m-r00000.tensors": 10}, 1: {"m-r00001.tensors": 8},
                                           3: {"m-r00003.tensors": 5}})
    msg = str(ei.value)
    assert "rank(s) 1, 3" in msg and "m-r00003.tensors" in msg and "8 bytes written" in msg and "shared" in msg, msg
    # two ranks of one machine in different directories (device/inode differ)
    with pytest.raises(CheckpointError, match=r"rank\(s\) 2 .*another directory than rank 0's"):
        storage.check_reported_files(tmp, {0: {}, 2: {}}, {0: ["m", 5, 7], 1: ["other", 5, 8], 2: ["m", 5, 8]})
    # many files: checked in parallel, same verdict
    many = {r: {f"m-r{r:05d}.tensors": 3} for r in range(300)}
    for r in range(300):
        (tmp / f"m-r{r:05d}.tensors").write_bytes(b"abc")
    storage.check_reported_files(tmp, many)
    os.unlink(tmp / "m-r00299.tensors")
    with pytest.raises(CheckpointError, match=r"rank\(s\) 299 .*m-r00299.tensors \(missing here"):
        storage.check_reported_files(tmp, many)


# --------------------------------------------------------------------------- defect 3: concurrent saves


def _mk(path: Path, v: float) -> Path:
    """A complete checkpoint at ``path`` (a temp dir of a save, or a final directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    megashard.save(state(v), path.parent / "_build")
    os.rename(path.parent / "_build", path)
    return path


def test_a_commit_deletes_only_its_own_old_copy(tmp_path, monkeypatch):
    """A publishes, B moves A's checkpoint aside and is SIGKILLed before publishing: A's
    clean-up must not delete B's copy, the only complete one."""
    final = tmp_path / "ckpt"
    _mk(final, 1)
    tmp_a = _mk(Path(storage.temp_dir_name(final, "aaaa")), 2)
    real = os.rename
    done = []

    def rename(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if Path(src) == tmp_a and not done:  # A just published: B moves it aside, then dies
            done.append(1)
            real(final, tmp_path / ".ckpt.old-bbbb")

    monkeypatch.setattr(os, "rename", rename)
    storage.commit_dir(tmp_a, final)
    monkeypatch.undo()
    assert done
    found = storage.locate(final)
    assert found is not None, os.listdir(tmp_path)
    assert torch.equal(loaded_w(found), state(2)["w"].data)
    assert storage.recover(final) == str(final) and torch.equal(loaded_w(final), state(2)["w"].data)


def test_a_save_that_loses_the_race_commits_after_the_winner(tmp_path, monkeypatch):
    """A moves the old checkpoint aside; B publishes in between; A then commits after B."""
    final = tmp_path / "ckpt"
    _mk(final, 1)
    tmp_a = _mk(Path(storage.temp_dir_name(final, "aaaa")), 2)
    tmp_b = _mk(Path(storage.temp_dir_name(final, "bbbb")), 3)
    real = os.rename
    done = []

    def rename(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if Path(src) == final and ".old-aaaa" in str(dst) and not done:
            done.append(1)
            monkeypatch.setattr(os, "rename", real)
            storage.commit_dir(tmp_b, final)  # B, all of it
            monkeypatch.setattr(os, "rename", rename)

    monkeypatch.setattr(os, "rename", rename)
    storage.commit_dir(tmp_a, final)
    monkeypatch.undo()
    assert done
    assert torch.equal(loaded_w(final), state(2)["w"].data)
    assert aux_entries(tmp_path) == []


SAVER = textwrap.dedent("""
    import os, sys, torch, megashard
    from megashard.sharded import ShardedTensor
    path, tag, ready, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    i = 0
    while True:
        last = os.path.exists(stop)
        v = float(tag * 1000 + (999 if last else i % 900))
        megashard.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32) + v),
                        "v": v}, path)
        if last:
            break
        i += 1
        if i == 2:
            open(ready, "w").close()
""")


def _start_saver(path: Path, tag: int, ready: Path, stop: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(tag), str(ready), str(stop)], env=ENV,
                            stderr=subprocess.PIPE, text=True)


def _check_complete(path: Path, tags=(1, 2)) -> float:
    found = storage.locate(path)
    assert found is not None, os.listdir(path.parent)
    v = megashard.load_common(found, ["v"])["v"]
    assert int(v) // 1000 in tags
    assert torch.equal(loaded_w(found), torch.arange(64, dtype=torch.float32) + v)
    return v


def test_two_concurrent_savers_and_a_sigkill_leave_a_complete_checkpoint(tmp_path):
    """Two processes re-save one name as fast as they can; A is SIGKILLed at a random
    moment (between its commits or inside one). A complete checkpoint is always found
    (B frozen anywhere too), B never fails, and B's last save is what remains."""
    path = tmp_path / "ckpt"
    megashard.save(state(0), path)
    ra, rb, stop = tmp_path / "ready-a", tmp_path / "ready-b", tmp_path / "stop"
    a, b = _start_saver(path, 1, ra, tmp_path / "never"), _start_saver(path, 2, rb, stop)
    misses = 0
    try:
        deadline = time.monotonic() + 180  # two Pythons importing torch, two saves each; ends at "ready": no cost
        while not (ra.exists() and rb.exists()):
            assert a.poll() is None, a.stderr.read()
            assert b.poll() is None, b.stderr.read()
            assert time.monotonic() < deadline, "savers never got going"
            misses += storage.locate(path) is None
            time.sleep(0.005)
        end = time.monotonic() + random.uniform(0.05, 0.5)
        while time.monotonic() < end:
            misses += storage.locate(path) is None
        a.send_signal(signal.SIGKILL)
        a.wait()
        b.send_signal(signal.SIGSTOP)  # B frozen wherever it is, as if it had died too
        _check_complete(path)
        b.send_signal(signal.SIGCONT)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            misses += storage.locate(path) is None
        stop.touch()
        assert b.wait(timeout=120) == 0, b.stderr.read()  # B never fails because of A or its remains
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert misses == 0
    assert _check_complete(path) == 2999.0  # B's last save is the last commit
    assert storage.recover(path) == str(path)
    storage.cleanup_stale_temps(tmp_path)  # A's remains: its owner is dead
    assert aux_entries(tmp_path) == []


# --------------------------------------------------------------------------- defect 4: abandoned temporaries


DEAD_SAVER = textwrap.dedent("""
    import os, sys
    from megashard import storage
    tmp = storage.make_temp_dir(sys.argv[1], "deadbeef")
    with open(os.path.join(tmp, "model-r00000.tensors"), "wb") as f:
        f.write(b"x" * 4096)
    os.kill(os.getpid(), 9)
""")


def test_a_save_removes_abandoned_temporaries_of_any_name_and_keeps_live_ones(tmp_path):
    root = tmp_path / "save"
    subprocess.run([sys.executable, "-c", DEAD_SAVER, str(root / "iter_0000100")], env=ENV, timeout=60)
    dead = root / ".iter_0000100.tmp-deadbeef"
    assert dead.is_dir() and (dead / "model-r00000.tensors").exists()
    live = Path(storage.make_temp_dir(root / "iter_0000300", "alive"))  # this process: alive
    foreign = Path(storage.make_temp_dir(root / "iter_0000400", "elsewhere"))
    owner = json.loads((foreign / storage.OWNER_NAME).read_text())
    owner.update(host="another-host-" + socket.gethostname(), boot_id="0" * 32)
    (foreign / storage.OWNER_NAME).write_text(json.dumps(owner))
    megashard.save(state(1), root / "iter_0000200")
    assert sorted(os.listdir(root)) == [".iter_0000300.tmp-alive", ".iter_0000400.tmp-elsewhere",
                                        "iter_0000200"]
    assert live.is_dir() and foreign.is_dir()
    # another host's save: only once nothing in it changed for longer than the limit
    old = time.time() - 3 * 86400
    for p in [foreign, *foreign.iterdir()]:
        os.utime(p, (old, old))
    assert storage.cleanup_stale_temps(root) == [str(foreign)]
    assert storage.cleanup_stale_temps(root, older_than_s=0) == []  # the live one stays
    assert live.is_dir()


def test_temporaries_that_are_not_provably_ours_stay(tmp_path):
    old = time.time() - 30 * 86400
    other = tmp_path / ".cache.tmp-1234"  # another program's temp dir: no owner record
    other.mkdir()
    (other / "blob").write_bytes(b"x")
    stray = tmp_path / ".notes.txt.tmp-abc"  # a file that is not one of our atomic writes
    stray.write_text("x")
    ours = tmp_path / f".{saveroot.TRACKER_NAME}.tmp-{'a' * 32}"  # an interrupted tracker write
    ours.write_text("5")
    for p in (other, other / "blob", stray, ours):
        os.utime(p, (old, old))
    assert storage.cleanup_stale_temps(tmp_path, older_than_s=0) == [str(ours)]
    assert other.is_dir() and stray.exists()


def test_pid_reuse_does_not_keep_a_dead_save_alive(tmp_path):
    tmp = Path(storage.make_temp_dir(tmp_path / "ckpt", "tok"))
    rec = json.loads((tmp / storage.OWNER_NAME).read_text())
    rec["start"] = int(rec["start"]) + 12345  # same pid (ours), another process's start time
    (tmp / storage.OWNER_NAME).write_text(json.dumps(rec))
    assert storage.cleanup_stale_temps(tmp_path) == [str(tmp)]


def test_a_failed_save_removes_its_own_temp_dir(tmp_path, monkeypatch):
    from megashard import saving

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving, "_write_tensors", fail)
    with pytest.raises(MegashardError, match="No space"):
        megashard.save(state(1), tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- defect 17: convert into its source


@pytest.mark.parametrize("where", ["inside", "inside-root", "via-symlink"])
def test_convert_refuses_a_destination_inside_the_source(tmp_path, where):
    root = tmp_path / "run1"
    megatron_root(root)
    src = root / "iter_0000200"
    (tmp_path / "alias").symlink_to(src)
    dst, source = {"inside": (src / "out.tensors", src), "inside-root": (root / "export", root),
                   "via-symlink": (tmp_path / "alias" / "out.tensors", src)}[where]
    before = tree(tmp_path)
    with pytest.raises(ConvertInputError) as ei:
        convert(source, dst, to="tensors")
    msg = str(ei.value)
    assert "inside" in msg and str(dst) in msg and str(source) in msg, msg
    assert tree(tmp_path) == before


def test_commit_waits_for_files_a_network_filesystem_shows_late(tmp_path, monkeypatch):
    """A shared mount whose metadata cache lags (``weed mount``, NFS attribute caches) shows rank 0 a
    file another node wrote only after a moment: the commit check waits for it (bounded by
    ``MEGASHARD_FS_WAIT_S``) instead of refusing a good save; a file that never appears still fails."""
    import threading

    tmp = Path(storage.make_temp_dir(tmp_path / "ckpt", "tok"))
    (tmp / "m-r00000.tensors").write_bytes(b"x" * 10)
    late = tmp / "m-r00001.tensors"

    def arrive() -> None:
        late.write_bytes(b"y" * 3)          # written short first: the size is not final yet either
        time.sleep(0.3)
        with open(late, "ab") as f:
            f.write(b"y" * 5)

    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "5")
    t = threading.Timer(0.3, arrive)
    t.start()
    try:
        storage.check_reported_files(tmp, {0: {"m-r00000.tensors": 10}, 1: {"m-r00001.tensors": 8}})
    finally:
        t.join()
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.5")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"rank\(s\) 2 .*m-r00002.tensors \(missing here"):
        storage.check_reported_files(tmp, {0: {"m-r00000.tensors": 10}, 2: {"m-r00002.tensors": 4}})
    assert 0.5 <= time.monotonic() - t0 < 5


def test_a_rank_waits_for_the_temp_dir_a_network_filesystem_shows_late(tmp_path, monkeypatch):
    """The temp dir rank 0 created appears late on another node's mount: the joining rank waits for
    it within ``MEGASHARD_FS_WAIT_S``."""
    import threading

    final = tmp_path / "ckpt"
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "5")
    t = threading.Timer(1.5, lambda: storage.make_temp_dir(final, "tok"))
    t.start()
    try:
        got = storage.join_temp_dir(final, "tok")
    finally:
        t.join()
    assert got == storage.temp_dir_name(final, "tok") and os.path.isdir(got)


# --------------------------------------------------------------------------- loads on a lagging mount

def _lagging(paths, delay: float):
    """Hide ``paths`` (rename each aside) and bring them back after ``delay`` seconds on a timer: what
    another node's fresh commit looks like on a mount whose metadata cache lags."""
    import threading

    for p in paths:
        os.rename(p, str(p) + ".hidden")
    t = threading.Timer(delay, lambda: [os.rename(str(p) + ".hidden", p) for p in paths])
    t.start()
    return t


def _lag_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"w": ShardedTensor("w", torch.randn(16, 8, generator=g), (16, 8), (0, 0)),
            "b": torch.randn(7, generator=g), "args": {"iteration": 3}}


def _lag_template() -> dict:
    return {"w": ShardedTensor("w", torch.zeros(16, 8), (16, 8), (0, 0)), "b": torch.zeros(7), "args": {}}


@pytest.mark.parametrize("hidden", ["tensors", "index", "both"])
def test_a_load_waits_for_files_its_index_names_that_a_lagging_mount_shows_late(tmp_path, monkeypatch, hidden):
    """The committed index names the index and data files: one not visible yet is waited for
    (bounded by ``MEGASHARD_FS_WAIT_S``) and the load is bit-exact; one that never shows fails
    after the wait, naming it and what to run."""
    ckpt = tmp_path / "iter_0000003"
    want = _lag_state()
    megashard.save(want, str(ckpt))
    names = {"tensors": [n for n in os.listdir(ckpt) if n.endswith(".tensors")],
             "index": ["manifest.index"]}
    names["both"] = names["tensors"] + names["index"]
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "10")
    t = _lagging([ckpt / n for n in names[hidden]], 0.4)
    try:
        got = megashard.load(_lag_template(), str(ckpt))
    finally:
        t.join()
    assert torch.equal(got["w"], want["w"].data) and torch.equal(got["b"], want["b"]) and got["args"] == {"iteration": 3}
    assert megashard.load_common(str(ckpt), ["args"]) == {"args": {"iteration": 3}}
    # never shows: a clear failure once the (here short) wait is over
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.3")
    gone = names[hidden][0]
    os.rename(ckpt / gone, tmp_path / gone)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        megashard.load(_lag_template(), str(ckpt))
    assert time.monotonic() - t0 >= 0.3
    msg = str(e.value)
    assert str(ckpt / gone) in msg and "MEGASHARD_FS_WAIT_S" in msg and f"megashard verify {ckpt}" in msg, msg
    problems = verify_checkpoint_problems(ckpt)
    assert any(gone in p for p in problems), problems


def verify_checkpoint_problems(path) -> list:
    from megashard.checkpoint_tools import verify_checkpoint

    return verify_checkpoint(str(path))


def test_files_not_named_by_an_index_are_never_waited_for(tmp_path, monkeypatch):
    """Only what a committed index or tracker names is waited for: a path that is no checkpoint,
    a checkpoint without its head, a save root without a tracker fail at once (the wait is long)."""
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "30")
    ckpt = tmp_path / "iter_0000003"
    megashard.save(_lag_state(), str(ckpt))
    os.rename(ckpt / "manifest.json", tmp_path / "manifest.json")
    t0 = time.monotonic()
    for bad in (ckpt, tmp_path / "nothing-here"):
        with pytest.raises(CheckpointError):
            megashard.load(_lag_template(), str(bad))
        with pytest.raises(MegashardError):
            storage.read_location(str(bad))
    assert storage.locate(str(ckpt)) is None
    td = tmp_path / "td"  # a torch_dist save root: the tracker names a directory, not a megashard checkpoint
    (td / "iter_0000003").mkdir(parents=True)
    (td / "iter_0000003" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    storage.write_tracker(str(td), 3)
    with pytest.raises(MegashardError, match="torch_dist"):
        storage.read_location(str(td))
    assert time.monotonic() - t0 < 10


def test_a_checkpoint_the_tracker_names_is_waited_for(tmp_path, monkeypatch):
    """A save root whose tracker names iter_N (another node just committed it) while this node's
    mount does not show iter_N (or its head) yet: the reader follows the tracker after the wait; a
    tracker naming a checkpoint that never shows fails after the wait, naming it."""
    root = tmp_path / "root"
    want = _lag_state()
    megashard.save(want, str(root / "iter_0000003"))
    storage.write_tracker(str(root), 3)
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "10")
    for hide in (root / "iter_0000003", root / "iter_0000003" / "manifest.json"):
        t = _lagging([hide], 0.4)
        try:
            found = storage.read_location(str(root))
        finally:
            t.join()
        assert found == str(root / "iter_0000003")
        assert torch.equal(megashard.load_consolidated(str(root))["w"], want["w"].data)
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.3")
    storage.write_tracker(str(root), 4)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="iter_0000004"):
        storage.read_location(str(root))
    assert time.monotonic() - t0 >= 0.3


def test_verify_and_inspect_of_a_save_root_wait_for_the_checkpoint_its_tracker_names(tmp_path, monkeypatch, capsys):
    from megashard.cli import main as cli_main

    root = tmp_path / "root"
    megashard.save(_lag_state(), str(root / "iter_0000003"))
    storage.write_tracker(str(root), 3)
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "10")
    for cmd in ("verify", "inspect"):
        t = _lagging([root / "iter_0000003" / "manifest.json"], 0.4)
        try:
            assert cli_main([cmd, str(root)]) == 0, capsys.readouterr()
        finally:
            t.join()
    capsys.readouterr()


def test_a_save_target_another_nodes_commit_is_still_filling_is_waited_for(tmp_path, monkeypatch):
    """A shared mount whose directory rename is not atomic to other nodes (``weed mount`` shows a
    renamed directory's entries arriving one by one) lets a save see the name another job is
    committing as a directory of megashard's files without its ``manifest.json`` yet. The target
    check waits for it (bounded by ``MEGASHARD_FS_WAIT_S``) instead of refusing; one that stays
    without a manifest is still refused, and files megashard did not write are refused at once."""
    import threading

    final = tmp_path / "same" / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, final)
    manifest = (final / "manifest.json").read_bytes()
    (final / "manifest.json").unlink()  # the commit's rename, as another node sees it mid-way

    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "5")
    t = threading.Timer(0.4, lambda: (final / "manifest.json").write_bytes(manifest))
    t.start()
    try:
        storage.check_save_target(final)
    finally:
        t.join()

    (final / "manifest.json").unlink()
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.5")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"it is not a megashard checkpoint \(it has no manifest.json\)"):
        storage.check_save_target(final)
    assert 0.5 <= time.monotonic() - t0 < 5

    (final / "notes.txt").write_text("mine")
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "30")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"notes.txt"):
        storage.check_save_target(final)
    assert time.monotonic() - t0 < 5


def test_a_commit_looks_again_when_a_shared_mount_fails_a_raced_rename(tmp_path, monkeypatch):
    """``weed mount`` answers EIO to a rename another node's rename of the same name raced: the
    commit looks again (a few times) and commits; an error that persists is raised, nothing lost;
    a deletion whose directory a mount still shows entries of retries its rmdir."""
    final = tmp_path / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, final)
    real_rename, real_rmdir = os.rename, os.rmdir
    fails = {"rename": 2, "rmdir": 1}

    def flaky_rename(src, dst, *a, **kw):
        if fails["rename"] > 0 and os.fspath(src) == str(final):
            fails["rename"] -= 1
            raise OSError(errno.EIO, "Input/output error", src)
        return real_rename(src, dst, *a, **kw)

    def flaky_rmdir(path, *a, **kw):
        if fails["rmdir"] > 0:
            fails["rmdir"] -= 1
            raise OSError(errno.ENOTEMPTY, "Directory not empty", path)
        return real_rmdir(path, *a, **kw)

    monkeypatch.setattr(os, "rename", flaky_rename)
    monkeypatch.setattr(os, "rmdir", flaky_rmdir)
    megashard.save({"w": torch.arange(5.0)}, final)
    assert fails == {"rename": 0, "rmdir": 0}
    assert torch.equal(megashard.load({"w": torch.empty(5)}, final)["w"], torch.arange(5.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    fails["rename"] = 100  # a mount that keeps failing: the save fails, the checkpoint stays
    with pytest.raises(MegashardError, match="Input/output error"):
        megashard.save({"w": torch.arange(6.0)}, final)
    assert torch.equal(megashard.load({"w": torch.empty(5)}, final)["w"], torch.arange(5.0))
    assert fails["rename"] == 100 - 1 - storage.posix.MAX_RACED_RENAMES


def test_a_commit_whose_moved_aside_copy_lost_its_manifest_to_a_raced_rename_commits(tmp_path, monkeypatch):
    """Two nodes moving one checkpoint aside at the same moment on ``weed mount`` split its entries
    between their two names: this save's copy holds megashard's files without the manifest. That
    copy is superseded like any other: the save commits and removes it; a copy holding files
    megashard did not write is still put back and the save refused."""
    final = tmp_path / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, final)
    real_rename = os.rename
    stray = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    stray.mkdir()
    intrude = {"file": None}

    def split_rename(src, dst, *a, **kw):
        real_rename(src, dst, *a, **kw)
        if os.fspath(src) == str(final) and ".old-" in os.fspath(dst):
            if intrude["file"]:
                Path(dst, intrude["file"]).write_text("mine")
            else:
                real_rename(Path(dst, "manifest.json"), stray / "manifest.json")  # the other node's half

    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.3")
    monkeypatch.setattr(os, "rename", split_rename)
    megashard.save({"w": torch.arange(5.0)}, final)
    assert torch.equal(megashard.load({"w": torch.empty(5)}, final)["w"], torch.arange(5.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    intrude["file"] = "notes.txt"
    with pytest.raises(MegashardError, match="no longer a megashard checkpoint"):
        megashard.save({"w": torch.arange(6.0)}, final)
    assert (final / "notes.txt").read_text() == "mine"


def _dir_path(fd) -> str:
    """The path of a directory descriptor (``/proc/self/fd``), or '' for a path argument."""
    return os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else os.fspath(fd)


def test_a_commit_looks_again_when_its_moved_aside_copy_cannot_be_listed(tmp_path, monkeypatch):
    """On ``weed mount`` a directory this commit just moved aside can be opened yet not listed
    (ENOENT: another node's rename of the same name moved or emptied it meanwhile). That is a raced
    rename like EIO: the commit looks again (bounded by ``MEGASHARD_FS_WAIT_S``) and commits, deleting
    only what it created; a listing that keeps failing fails the save with an error naming the copy,
    the checkpoint and what to do, and the previous checkpoint stays."""
    final = tmp_path / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, final)
    real_scandir, real_rename = os.scandir, os.rename
    fails = {"list": 2, "steal": False}
    other = tmp_path / ".ckpt.old-othernode"  # the name another node moved the checkpoint to

    def flaky_scandir(path=".", *a, **kw):
        where = _dir_path(path)
        if fails["list"] > 0 and ".ckpt.old-" in os.path.basename(where) and "othernode" not in where:
            fails["list"] -= 1
            if fails["steal"] and os.path.isdir(where):  # the other node's rename took it, entries and all
                real_rename(where, other)
            raise OSError(errno.ENOENT, "No such file or directory", path)
        return real_scandir(path, *a, **kw)

    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "2")
    monkeypatch.setattr(os, "scandir", flaky_scandir)
    megashard.save({"w": torch.arange(5.0)}, final)  # the listing shows again on a later look
    assert fails["list"] == 0
    assert torch.equal(megashard.load({"w": torch.empty(5)}, final)["w"], torch.arange(5.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    # the copy is gone: another node holds it under its own name. The commit (without the save's
    # clean-up of superseded copies afterwards) deletes only what it created
    fails.update(list=1, steal=True)
    monkeypatch.setattr(os, "scandir", real_scandir)
    tmp = _mk(Path(storage.temp_dir_name(final, "aaaa")), 6)
    monkeypatch.setattr(os, "scandir", flaky_scandir)
    storage.commit_dir(tmp, final)
    assert fails["list"] == 0
    assert torch.equal(loaded_w(final), state(6)["w"].data)
    assert sorted(os.listdir(tmp_path)) == [".ckpt.old-othernode", "ckpt"]
    assert torch.equal(megashard.load({"w": torch.empty(5)}, other)["w"], torch.arange(5.0))
    assert storage.remove_checkpoint(other) is None

    fails.update(list=10**6, steal=False)  # a listing that never comes back: refused, nothing lost
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.5")
    with pytest.raises(MegashardError) as ei:
        megashard.save({"w": torch.arange(7.0)}, final)
    msg = str(ei.value)
    assert "cannot be listed (No such file or directory)" in msg and str(final) in msg, msg
    assert "retry" in msg and "MEGASHARD_FS_WAIT_S" in msg, msg
    monkeypatch.setattr(os, "scandir", real_scandir)
    found = storage.locate(final)
    assert found is not None, os.listdir(tmp_path)
    assert torch.equal(loaded_w(found), state(6)["w"].data)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_save_target_that_cannot_be_listed_for_a_moment_is_looked_at_again(tmp_path, monkeypatch):
    """The target itself can be opened yet not listed while another node's rename moves it (weed
    mount): the check looks again instead of calling it 'not a megashard checkpoint'; when that
    persists, the error says what happened and what to do, and nothing changed."""
    final = tmp_path / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, final)
    real_scandir = os.scandir
    fails = {"list": 2}

    def flaky_scandir(path=".", *a, **kw):
        if fails["list"] > 0 and _dir_path(path) == str(final):
            fails["list"] -= 1
            raise OSError(errno.ENOENT, "No such file or directory", path)
        return real_scandir(path, *a, **kw)

    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "2")
    monkeypatch.setattr(os, "scandir", flaky_scandir)
    storage.check_save_target(final)
    assert fails["list"] == 0

    monkeypatch.setattr(os, "scandir", real_scandir)
    before = tree(tmp_path)
    monkeypatch.setattr(os, "scandir", flaky_scandir)
    fails["list"] = 10**6
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.3")
    with pytest.raises(CheckpointError) as ei:
        storage.check_save_target(final)
    msg = str(ei.value)
    assert f"cannot save to {final} now" in msg and "cannot be listed (No such file or directory)" in msg, msg
    assert "not a megashard checkpoint" not in msg and "retry" in msg, msg
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert tree(tmp_path) == before


def test_a_deletion_whose_directory_cannot_be_listed_looks_again(tmp_path, monkeypatch):
    """A copy being removed that was opened but cannot be listed (weed mount: another node's rename
    moved or emptied it meanwhile) is opened again by its path and removed, not left behind."""
    old = _mk(tmp_path / ".ckpt.old-aaaa", 1)
    real_scandir = os.scandir
    fails = {"list": 2}

    def flaky_scandir(path=".", *a, **kw):
        if fails["list"] > 0 and isinstance(path, int) and _dir_path(path) == str(old):
            fails["list"] -= 1
            raise OSError(errno.ENOENT, "No such file or directory", path)
        return real_scandir(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", flaky_scandir)
    assert storage.remove_checkpoint(old, check=storage.posix._settled_replace_problem_at) is None
    assert fails["list"] == 0 and os.listdir(tmp_path) == []


def test_a_clean_up_goes_on_past_a_leftover_another_node_is_removing(tmp_path, monkeypatch):
    """One leftover that cannot be listed (another node's deletion or rename has it) does not stop
    the clean-up of the others."""
    busy = tmp_path / f".ckpt.del-{'0' * 32}"
    busy.mkdir()
    (busy / "manifest.index").write_bytes(b"x")
    empty = tmp_path / f".ckpt.del-{'f' * 32}"
    empty.mkdir()
    real_listdir, real_scandir = os.listdir, os.scandir

    def gone(fn):
        def call(path=".", *a, **kw):
            if isinstance(path, int) and _dir_path(path) == str(busy):
                raise OSError(errno.ENOENT, "No such file or directory", path)
            return fn(path, *a, **kw)
        return call

    monkeypatch.setattr(os, "listdir", gone(real_listdir))
    monkeypatch.setattr(os, "scandir", gone(real_scandir))
    assert storage.cleanup_stale_temps(tmp_path) == [str(empty)]
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [busy.name]


def test_a_save_removes_its_own_deletion_directory_a_mount_brings_back(tmp_path, monkeypatch):
    """``weed mount`` can finish a directory rename after the renaming process removed the renamed
    directory: the deletion's ``.<name>.del-*`` directory shows up again, holding the copy's files (no
    owner record, so no other process can ever attribute it). The save that created it removes it
    in its clean-up; one it did not create stays."""
    final = tmp_path / "ckpt"
    megashard.save(state(1), final)
    files = {n: (final / n).read_bytes() for n in os.listdir(final)}
    theirs = tmp_path / f".ckpt.del-{'a' * 32}"  # another process's, as fresh as ours
    theirs.mkdir()
    for n, b in files.items():
        (theirs / n).write_bytes(b)
    real_rmdir = os.rmdir
    back = []

    def late_rename(path, *a, **kw):
        real_rmdir(path, *a, **kw)
        name = os.fspath(path)
        if name.startswith(".ckpt.del-") and not back:  # the rest of the rename arrives after the rmdir
            back.append(name)
            again = tmp_path / name
            again.mkdir()
            for n, b in files.items():
                (again / n).write_bytes(b)

    monkeypatch.setattr(os, "rmdir", late_rename)
    megashard.save(state(2), final)
    monkeypatch.undo()
    assert back
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", theirs.name])
    assert torch.equal(loaded_w(final), state(2)["w"].data)
    assert {n: (theirs / n).read_bytes() for n in os.listdir(theirs)} == files

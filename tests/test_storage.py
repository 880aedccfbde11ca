"""megashard.storage: atomic commit under crashes, recovery, tracker, retention."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megashard import storage
from megashard.errors import CheckpointError, MegashardError
from megashard.storage import (
    MANIFEST_NAME,
    TRACKER_NAME,
    apply_retention,
    cleanup_stale_temps,
    commit_dir,
    fsync_file,
    fsync_path,
    is_checkpoint,
    iteration_dir_name,
    make_temp_dir,
    parse_iteration_dir_name,
    read_tracker,
    recover,
    temp_dir_name,
    write_file_atomic,
    write_tracker,
)

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


def megashard_head(**extra) -> str:
    """A ``manifest.json`` that parses as megashard's head (format, version, head schema)."""
    return json.dumps({"format": "megashard", "version": 2, "world_size": 1, "layout": {}, "rank_trees": ["t"],
                       "extra": {}, "tensors": [], "objects": [], "files": [], "trees": [],
                       "index": {"file": "manifest.index", "bytes": 0}, **extra})


def make_ckpt(path: Path, version: str, shards: int = 2) -> None:
    """A complete checkpoint whose shard contents match its manifest's ``tag``."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        (path / f"shard_{i}.tensors").write_bytes(f"{version}-{i}".encode() * 100)
    write_file_atomic(path / MANIFEST_NAME, megashard_head(tag=version, shards=shards))


def ckpt_version(path) -> str:
    """Version of a complete, self-consistent checkpoint (asserts consistency)."""
    assert is_checkpoint(path), f"{path} is not a checkpoint"
    man = json.loads((Path(path) / MANIFEST_NAME).read_text())
    for i in range(man["shards"]):
        data = (Path(path) / f"shard_{i}.tensors").read_bytes()
        assert data == f"{man['tag']}-{i}".encode() * 100, f"{path}: shard {i} does not match manifest"
    return man["tag"]


class SimulatedCrash(BaseException):
    """BaseException so that `except Exception/OSError` cleanup in the code under test
    cannot swallow it: the process is dead."""


class CrashAt:
    """Make the k-th filesystem mutation/fsync raise, and every call after it too."""

    NAMES = ("rename", "replace", "fsync", "unlink", "rmdir", "mkdir")

    def __init__(self, monkeypatch, k: int) -> None:
        self.k = k
        self.calls: list = []
        self.dead = False
        self.mp = monkeypatch
        for name in self.NAMES:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def fn(*a, **kw):
            if self.dead or len(self.calls) == self.k:
                self.dead = True
                raise SimulatedCrash(f"crash at {name}{a}")
            self.calls.append((name, a))
            return real(*a, **kw)

        return fn

    def undo(self) -> None:
        self.mp.undo()


def _setup_resave(tmp_path: Path, with_old: bool):
    parent = tmp_path / "ckpts"
    final = parent / "iter_0000010"
    if with_old:
        make_ckpt(final, "old", shards=3)
    tmp = Path(make_temp_dir(final, "tok1"))
    make_ckpt(tmp, "new", shards=2)
    return parent, final, tmp


# --------------------------------------------------------------------------- fsync / atomic write


def test_fsync_helpers(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x")
    fsync_path(f)
    fsync_path(tmp_path)
    fsync_file(str(f))
    with open(f, "ab") as fh:
        fh.write(b"y")
        fsync_file(fh)
        fsync_file(fh.fileno())
    assert f.read_bytes() == b"xy"


def test_write_file_atomic_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "m.json"
    write_file_atomic(p, "héllo")
    assert p.read_text("utf-8") == "héllo"
    write_file_atomic(str(p), b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path)) == ["m.json"]


def test_write_file_atomic_failure_keeps_old_content(tmp_path, monkeypatch):
    p = tmp_path / "m.json"
    p.write_text("old")

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_file_atomic(p, "new")
    monkeypatch.undo()
    assert p.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["m.json"]


# --------------------------------------------------------------------------- temp dirs


def test_temp_dir_names(tmp_path):
    final = tmp_path / "a" / "b" / "iter_0000100"
    name = temp_dir_name(final, "abc_12-X")
    assert name == str(tmp_path / "a" / "b" / ".iter_0000100.tmp-abc_12-X")
    assert not os.path.exists(name) and not (tmp_path / "a").exists()  # pure
    assert make_temp_dir(str(final) + "/", "abc_12-X") == name
    assert os.path.isdir(name) and os.listdir(name) == [storage.OWNER_NAME]
    with pytest.raises(CheckpointError, match="already exists"):  # a save owns the temp dir it created
        make_temp_dir(final, "abc_12-X")
    assert storage.join_temp_dir(final, "abc_12-X") == name  # what the other ranks do
    with pytest.raises(CheckpointError, match="shared filesystem"):
        storage.join_temp_dir(final, "other", wait_s=0)
    assert not is_checkpoint(name)
    for bad in ["", "a.b", "a/b", "..", "x y", None]:
        with pytest.raises(CheckpointError, match="token"):
            temp_dir_name(final, bad)
    with pytest.raises(CheckpointError, match="name"):
        temp_dir_name("/", "tok")


def test_is_checkpoint(tmp_path):
    d = tmp_path / "c"
    assert not is_checkpoint(d)
    d.mkdir()
    assert not is_checkpoint(d)
    (d / MANIFEST_NAME).write_text('{"trunc')
    assert not is_checkpoint(d)
    (d / MANIFEST_NAME).write_text("{}")  # JSON, but not megashard's head
    assert not is_checkpoint(d)
    (d / MANIFEST_NAME).write_text(megashard_head())
    assert is_checkpoint(d)
    assert not is_checkpoint(d / MANIFEST_NAME)  # a file is never a checkpoint


# --------------------------------------------------------------------------- commit


@pytest.mark.parametrize("with_old", [True, False])
def test_commit_dir_happy_path(tmp_path, with_old):
    parent, final, tmp = _setup_resave(tmp_path, with_old)
    commit_dir(tmp, final)
    assert ckpt_version(final) == "new"
    assert not (final / "shard_2.tensors").exists()  # nothing of the old one survives in it
    assert sorted(os.listdir(parent)) == ["iter_0000010"]
    assert recover(final) == str(final)


def test_commit_dir_requires_manifest(tmp_path):
    final = tmp_path / "iter_0000001"
    tmp = Path(make_temp_dir(final, "t"))
    (tmp / "shard_0.tensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=MANIFEST_NAME):
        commit_dir(tmp, final)
    assert not final.exists() and tmp.exists()


def test_commit_dir_requires_same_parent(tmp_path):
    tmp = Path(make_temp_dir(tmp_path / "a" / "x", "t"))
    make_ckpt(tmp, "new")
    with pytest.raises(CheckpointError, match="same directory"):
        commit_dir(tmp, tmp_path / "b" / "x")


@pytest.mark.parametrize("with_old", [True, False])
def test_crash_at_every_step_of_commit_leaves_a_complete_checkpoint(tmp_path, monkeypatch, with_old):
    # Count the steps of an uninterrupted commit first.
    parent, final, tmp = _setup_resave(tmp_path / "dry", with_old)
    counter = CrashAt(monkeypatch, k=10**9)
    commit_dir(tmp, final)
    counter.undo()
    steps = counter.calls
    renames = [i for i, (n, a) in enumerate(steps) if n == "rename" and Path(a[0]) == tmp]
    assert len(renames) == 1
    publish_step = renames[0]
    assert len(steps) >= 3

    for k in range(len(steps) + 1):
        parent, final, tmp = _setup_resave(tmp_path / f"k{k}", with_old)
        crash = CrashAt(monkeypatch, k=k)
        try:
            commit_dir(tmp, final)
            crashed = False
        except SimulatedCrash:
            crashed = True
        crash.undo()
        assert crashed == (k < len(steps)), k

        # A fresh process starts and looks for the checkpoint.
        found = recover(final)
        if not with_old and k <= publish_step:
            assert found is None, k  # nothing was ever published; the new save is lost
            assert not is_checkpoint(final)
            continue
        assert found == str(final), (k, steps[k] if k < len(steps) else None)
        version = ckpt_version(final)
        if k > publish_step:
            assert version == "new", k
        else:
            assert version in ("old", "new"), k
        # recovery is idempotent and leaves no old copies around
        assert recover(final) == str(final) and ckpt_version(final) == version
        assert not [e for e in os.listdir(parent) if ".old-" in e], (k, os.listdir(parent))


def test_failed_publish_rename_rolls_back(tmp_path, monkeypatch):
    parent, final, tmp = _setup_resave(tmp_path, with_old=True)
    real = os.rename

    def flaky(src, dst, *a, **k):
        if Path(src) == tmp:
            raise OSError("EIO")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", flaky)
    with pytest.raises(CheckpointError, match="could not rename"):
        commit_dir(tmp, final)
    monkeypatch.undo()
    assert ckpt_version(final) == "old"
    assert is_checkpoint(tmp)  # the caller may retry
    commit_dir(tmp, final)
    assert ckpt_version(final) == "new"


def test_recover_rules(tmp_path):
    parent = tmp_path / "ckpts"
    final = parent / "iter_0000005"
    assert recover(final) is None
    # Only an old copy (crash between move-aside and publish): restored.
    make_ckpt(parent / ".iter_0000005.old-a", "old")
    (parent / ".iter_0000005.old-b").mkdir()  # not a checkpoint: never used
    assert recover(final) == str(final)
    assert ckpt_version(final) == "old"
    # <name> is a checkpoint: leftovers are removed
    assert not (parent / ".iter_0000005.old-b").exists()
    # <name> exists but is junk: nothing is touched
    other = parent / "iter_0000006"
    other.mkdir()
    make_ckpt(parent / ".iter_0000006.old-z", "old")
    assert recover(other) is None
    assert is_checkpoint(parent / ".iter_0000006.old-z")
    # a temp dir with a manifest is still never recovered
    make_ckpt(Path(temp_dir_name(parent / "iter_0000007", "t")), "new")
    assert recover(parent / "iter_0000007") is None


# --------------------------------------------------------------------------- SIGKILL


WRITER = textwrap.dedent(
    """
    import os, sys
    from megashard import storage
    final, ready = sys.argv[1], sys.argv[2]
    tmp = storage.make_temp_dir(final, "killed")
    i = 0
    while True:
        with open(os.path.join(tmp, f"shard_{i % 3}.tensors"), "wb") as f:
            f.write(os.urandom(1 << 16))
            storage.fsync_file(f)
        i += 1
        if i == 2:
            open(ready, "w").close()
    """
)


def test_sigkill_during_shard_writes_leaves_previous_checkpoint(tmp_path):
    parent = tmp_path / "ckpts"
    final = parent / "iter_0000100"
    make_ckpt(final, "old", shards=3)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(final), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, "writer died early"
            assert time.monotonic() < deadline, "writer never got going"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    tmp = Path(temp_dir_name(final, "killed"))
    assert tmp.is_dir() and any(tmp.iterdir())
    assert not is_checkpoint(tmp)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert cleanup_stale_temps(parent / "elsewhere") == [] and tmp.is_dir()
    # recover (`megashard recover`) removes it: its owner record names a process of this machine
    # that is gone (cleanup_stale_temps' rule, what the next save's commit would do)
    done = storage.Recovery()
    assert recover(final, into=done) == str(final) and ckpt_version(final) == "old"
    assert done.removed == [str(tmp)] and done.restored == []
    assert sorted(os.listdir(parent)) == ["iter_0000100"]


# --------------------------------------------------------------------------- cleanup


def test_cleanup_stale_temps(tmp_path):
    parent = tmp_path
    make_ckpt(parent / "iter_0000001", "a")
    make_ckpt(parent / ".iter_0000001.old-x", "older")  # superseded: removable
    make_ckpt(parent / ".iter_0000002.old-x", "only")  # the only copy of iter 2: kept
    (parent / ".iter_0000003.tmp-y").mkdir()
    (parent / ".iter_0000003.tmp-y" / "s.tensors").write_bytes(b"x")
    (parent / f".{TRACKER_NAME}.tmp-{'a' * 32}").write_text("5")
    (parent / f".iter_0000009.del-{'b' * 32}").mkdir()
    (parent / ".hidden").mkdir()
    (parent / "notes.tmp-x").write_text("not ours")
    old = time.time() - 2 * 86400  # no owner record: removed once a day old
    for e in os.listdir(parent):
        os.utime(parent / e, (old, old))
    for sub in (parent / ".iter_0000003.tmp-y").iterdir():
        os.utime(sub, (old, old))

    assert cleanup_stale_temps(parent, name="iter_0000003") == [str(parent / ".iter_0000003.tmp-y")]
    removed = cleanup_stale_temps(parent)
    assert sorted(removed) == sorted(
        str(parent / e) for e in [".iter_0000001.old-x", f".{TRACKER_NAME}.tmp-{'a' * 32}",
                                  f".iter_0000009.del-{'b' * 32}"]
    )
    assert sorted(os.listdir(parent)) == sorted(
        [".hidden", ".iter_0000002.old-x", "iter_0000001", "notes.tmp-x"]
    )
    assert cleanup_stale_temps(tmp_path / "missing") == []


def test_cleanup_respects_recent_activity_inside_temp(tmp_path):
    tmpd = tmp_path / ".iter_0000003.tmp-y"
    tmpd.mkdir()
    (tmpd / "s.tensors").write_bytes(b"x")
    old = time.time() - 2 * 86400
    os.utime(tmpd, (old, old))  # the dir looks old, but a shard was written just now
    assert cleanup_stale_temps(tmp_path) == []
    assert tmpd.exists()


# --------------------------------------------------------------------------- tracker


@pytest.mark.parametrize("it", [0, 1, 100, 12345678, "release"])
def test_tracker_roundtrip(tmp_path, it):
    root = tmp_path / "save"
    assert read_tracker(root) is None
    write_tracker(root, it)
    assert read_tracker(root) == it
    assert (root / TRACKER_NAME).read_text() == str(it)  # Megatron's format
    assert sorted(os.listdir(root)) == [TRACKER_NAME]


@pytest.mark.parametrize("content", ["250\n", " 250 ", "250"])
def test_tracker_tolerates_whitespace(tmp_path, content):
    (tmp_path / TRACKER_NAME).write_text(content)
    assert read_tracker(tmp_path) == 250


@pytest.mark.parametrize("content", [b"", b"abc", b"12abc", b"-5", b"1.5", b"\xff\xfe", b"7" * 5000,
                                     b"Release", b"\xd9\xa3"])
def test_garbage_tracker_is_an_error_naming_the_file(tmp_path, content):
    (tmp_path / TRACKER_NAME).write_bytes(content)
    with pytest.raises(CheckpointError) as ei:
        read_tracker(tmp_path)
    assert str(tmp_path / TRACKER_NAME) in str(ei.value)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "latest", None, "7"])
def test_bad_iterations_refused(tmp_path, bad):
    with pytest.raises(CheckpointError):
        write_tracker(tmp_path, bad)
    with pytest.raises(CheckpointError):
        iteration_dir_name(bad)
    assert not (tmp_path / TRACKER_NAME).exists()


def test_iteration_dir_names():
    assert iteration_dir_name(100) == "iter_0000100"
    assert iteration_dir_name(0) == "iter_0000000"
    assert iteration_dir_name(12345678) == "iter_12345678"
    assert iteration_dir_name("release") == "release"
    for it in (0, 100, 12345678, "release"):
        assert parse_iteration_dir_name(iteration_dir_name(it)) == it
    for name in ("iter_100", "iter_00001x0", ".iter_0000100.tmp-a", "foo"):
        assert parse_iteration_dir_name(name) is None


# --------------------------------------------------------------------------- retention


def _saves(root: Path, iters, tracker=None):
    for it in iters:
        make_ckpt(root / iteration_dir_name(it), f"v{it}", shards=1)
    if tracker is not None:
        write_tracker(root, tracker)


def _left(root: Path):
    return sorted(e for e in os.listdir(root) if e != TRACKER_NAME)


def test_retention_keeps_newest_and_tracked(tmp_path):
    _saves(tmp_path, [100, 200, 300, 400, 500, 600], tracker=200)
    (tmp_path / "iter_0000050").mkdir()  # not a checkpoint: not ours to judge
    make_ckpt(tmp_path / "release", "r", shards=1)
    make_ckpt(tmp_path / ".iter_0000100.old-x", "stale", shards=1)  # would resurrect iter 100
    deleted = apply_retention(tmp_path, keep_last=2, protect=[str(tmp_path / "iter_0000300")])
    assert deleted == [str(tmp_path / "iter_0000100"), str(tmp_path / "iter_0000400")]
    assert _left(tmp_path) == ["iter_0000050", "iter_0000200", "iter_0000300", "iter_0000500",
                               "iter_0000600", "release"]
    assert recover(tmp_path / "iter_0000100") is None
    assert ckpt_version(tmp_path / "iter_0000200") == "v200"
    # idempotent
    assert apply_retention(tmp_path, keep_last=2, protect=["iter_0000300"]) == []


def test_retention_keep_zero_and_large(tmp_path):
    _saves(tmp_path, [1, 2, 3], tracker=3)
    assert apply_retention(tmp_path, keep_last=10) == []
    assert apply_retention(tmp_path, keep_last=0) == [str(tmp_path / "iter_0000001"),
                                                      str(tmp_path / "iter_0000002")]
    assert _left(tmp_path) == ["iter_0000003"]
    with pytest.raises(CheckpointError):
        apply_retention(tmp_path, keep_last=-1)
    assert apply_retention(tmp_path / "missing", keep_last=1) == []


def test_retention_refuses_with_garbage_tracker(tmp_path):
    _saves(tmp_path, [1, 2, 3])
    (tmp_path / TRACKER_NAME).write_text("garbage")
    with pytest.raises(CheckpointError, match=TRACKER_NAME):
        apply_retention(tmp_path, keep_last=1)
    assert _left(tmp_path) == ["iter_0000001", "iter_0000002", "iter_0000003"]


def test_remove_checkpoint_drops_manifest_first(tmp_path, monkeypatch):
    make_ckpt(tmp_path / "iter_0000001", "a")

    real_unlink = os.unlink

    def boom(name, *a, **k):
        if name != MANIFEST_NAME:  # the manifest goes first; the process dies on the next file
            raise SimulatedCrash("died mid-delete")
        return real_unlink(name, *a, **k)

    monkeypatch.setattr(os, "unlink", boom)
    with pytest.raises(SimulatedCrash):
        storage.remove_checkpoint(tmp_path / "iter_0000001")
    monkeypatch.undo()
    # Half-deleted: recognisably garbage, never a checkpoint, cleaned up once its deleter is gone.
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".iter_0000001.del-") and not is_checkpoint(tmp_path / left)
    assert "shard_0.tensors" in os.listdir(tmp_path / left)
    assert cleanup_stale_temps(tmp_path, older_than_s=0) == []  # this process (its deleter) still runs
    rec = json.loads((tmp_path / left / storage.OWNER_NAME).read_text())
    rec["start"] = int(rec["start"]) + 12345  # as if its pid now belonged to another process
    (tmp_path / left / storage.OWNER_NAME).write_text(json.dumps(rec))
    assert cleanup_stale_temps(tmp_path) == [str(tmp_path / left)]
    assert os.listdir(tmp_path) == []


def test_errors_are_megashard_errors():
    assert issubclass(CheckpointError, MegashardError)

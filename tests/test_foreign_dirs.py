"""Directories megashard did not create survive every save, clean-up and retention (issue 27).

A directory is a megashard checkpoint only when its ``manifest.json`` parses as megashard's
head (format name, version, head schema): a tensorizer model directory with the user's own
``manifest.json`` is never replaced or deleted. Deletion works relative to an opened directory
(a symbolic link swapped in is never followed), and ``.X.del-*`` directories follow the owner
rule of temporaries.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import megashard
from megashard import saveroot, storage
from megashard.errors import CheckpointError
from megashard.sharded import ShardedTensor

tensorizer = pytest.importorskip("tensorizer")
from tensorizer import TensorSerializer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


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
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(16, dtype=torch.float32) + v), "v": v}


def loaded_w(path) -> torch.Tensor:
    return megashard.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(16))}, path)["w"].data


# What a user's manifest.json beside a tensorizer model may hold: arbitrary JSON, and JSON shaped
# like megashard's head but without its format name or version, or with nothing of its schema.
USER_MANIFESTS = {
    "arbitrary": {"model": "llama-3-8b", "files": ["model.tensors"], "sha256": "0" * 64},
    "no-format-no-version": {"created": 1.0, "world_size": 1, "layout": {}, "rank_trees": ["a"], "extra": {},
                             "tensors": [], "objects": [], "files": [], "trees": [],
                             "index": {"file": "manifest.index", "bytes": 0}},
    "no-version": {"format": "megashard", "world_size": 1, "layout": {}, "rank_trees": ["a"], "extra": {},
                   "tensors": [], "objects": [], "files": [], "trees": [],
                   "index": {"file": "manifest.index", "bytes": 0}},
    "no-format": {"version": 2, "world_size": 1, "layout": {}, "rank_trees": ["a"], "extra": {},
                  "tensors": [], "objects": [], "files": [], "trees": [],
                  "index": {"file": "manifest.index", "bytes": 0}},
    "format-and-version-only": {"format": "megashard", "version": 2},
}


def tensorizer_model_dir(path: Path, manifest: dict) -> None:
    """A model directory as tensorizer users have it: ``model.tensors`` written by tensorizer's
    TensorSerializer, and the user's own ``manifest.json`` beside it."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    s = TensorSerializer(str(path / "model.tensors"))
    s.write_state_dict({"embed.weight": torch.randn(8, 4, generator=g), "lm_head.bias": torch.randn(8, generator=g)})
    s.close()
    (path / "manifest.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- a save never replaces it


@pytest.mark.parametrize("kind", sorted(USER_MANIFESTS))
def test_save_refuses_a_tensorizer_model_directory_with_a_user_manifest(tmp_path, kind):
    model = tmp_path / "model"
    tensorizer_model_dir(model, USER_MANIFESTS[kind])
    before = tree(tmp_path)
    with pytest.raises(CheckpointError) as ei:
        megashard.save(state(1), model)
    msg = str(ei.value)
    assert f"refusing to save to {model}: it is not a megashard checkpoint" in msg
    assert "manifest.json is not a megashard manifest" in msg
    assert "Save to a new directory" in msg and "move it away first" in msg
    assert tree(tmp_path) == before  # both files byte-identical, nothing left beside them
    assert not storage.is_checkpoint(model)


def test_a_real_checkpoint_is_still_replaced(tmp_path):
    ck = tmp_path / "ck"
    megashard.save(state(1), ck)
    assert storage.is_checkpoint(ck) and storage.replace_problem(ck) is None
    megashard.save(state(2), ck)
    assert torch.equal(loaded_w(ck), torch.arange(16, dtype=torch.float32) + 2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# --------------------------------------------------------------------------- nor does clean-up or retention


@pytest.mark.parametrize("kind", ["arbitrary", "no-format-no-version"])
def test_old_copy_cleanup_and_recover_keep_a_tensorizer_directory(tmp_path, kind):
    ck = tmp_path / "ck"
    megashard.save(state(1), ck)
    junk = tmp_path / ".ck.old-user1"  # named like a copy a re-save moved aside
    tensorizer_model_dir(junk, USER_MANIFESTS[kind])
    before = tree(junk)
    assert storage.recover(ck) == str(ck)
    assert storage.cleanup_stale_temps(tmp_path, older_than_s=0) == []
    megashard.save(state(2), ck)  # its commit cleans up its parent
    assert tree(junk) == before
    assert sorted(os.listdir(tmp_path)) == [".ck.old-user1", "ck"]


def test_retention_keeps_a_tensorizer_directory_named_like_an_iteration(tmp_path):
    user = tmp_path / "iter_0000001"
    tensorizer_model_dir(user, USER_MANIFESTS["arbitrary"])
    before = tree(user)
    megashard.save(state(2), tmp_path / "iter_0000002")
    megashard.save(state(3), tmp_path / "iter_0000003")
    storage.write_tracker(tmp_path, 3)
    assert storage.apply_retention(tmp_path, keep_last=1) == [str(tmp_path / "iter_0000002")]
    assert tree(user) == before
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000003", saveroot.TRACKER_NAME]


# --------------------------------------------------------------------------- a swapped-in link is never followed


def test_remove_checkpoint_never_follows_a_symlink_swapped_in_before_its_rename(tmp_path, monkeypatch):
    victim = tmp_path / "victim"  # another run's checkpoint, outside the directory being cleaned
    megashard.save(state(7), victim)
    victim_before = tree(victim)
    parent = tmp_path / "run"
    megashard.save(state(1), parent / "ck")
    doomed = parent / ".ck.old-x"
    megashard.save(state(0), parent / "x")
    os.rename(parent / "x", doomed)
    moved = parent / "moved-away"
    real_rename = os.rename
    swapped = []

    def racing_rename(src, dst, *a, **kw):
        # between the check and the rename, the directory is replaced by a link to the victim
        if not swapped and os.path.basename(os.fspath(src)) == doomed.name:
            real_rename(doomed, moved)
            os.symlink(victim, doomed)
            swapped.append(True)
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", racing_rename)
    storage.remove_checkpoint(doomed)
    monkeypatch.undo()
    assert swapped
    assert tree(victim) == victim_before
    assert torch.equal(loaded_w(victim), torch.arange(16, dtype=torch.float32) + 7)
    assert os.readlink(doomed) == str(victim)  # the link is left where it was swapped in


def test_recover_never_follows_a_symlink_swapped_in_before_its_rename(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    megashard.save(state(7), victim)
    victim_before = tree(victim)
    parent = tmp_path / "run"
    megashard.save(state(1), parent / "ck")
    doomed = parent / ".ck.old-x"  # superseded: recover removes it
    megashard.save(state(0), parent / "x")
    os.rename(parent / "x", doomed)
    real_rename = os.rename
    swapped = []

    def racing_rename(src, dst, *a, **kw):
        if not swapped and os.path.basename(os.fspath(src)) == doomed.name:
            real_rename(doomed, parent / "moved-away")
            os.symlink(victim, doomed)
            swapped.append(True)
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", racing_rename)
    assert storage.recover(parent / "ck") == str(parent / "ck")
    monkeypatch.undo()
    assert swapped and tree(victim) == victim_before


# --------------------------------------------------------------------------- .X.del-* directories


KILLED_DELETER = textwrap.dedent("""
    import os, sys
    from megashard import storage
    real_unlink = os.unlink

    def die(p, *a, **k):  # killed right after the rename to .<name>.del-<hex>
        if os.path.basename(os.fspath(p)) == storage.MANIFEST_NAME:
            os.kill(os.getpid(), 9)
        return real_unlink(p, *a, **k)

    os.unlink = die
    storage.remove_checkpoint(sys.argv[1])
""")


def test_a_users_del_named_directory_survives_a_save_and_a_dead_deletion_is_removed(tmp_path):
    mine_short = tmp_path / ".foo.del-abcd1234"
    mine_long = tmp_path / f".foo.del-{'abcd1234' * 4}"  # the shape of megashard's own names
    for d in (mine_short, mine_long):
        d.mkdir()
        (d / "results.csv").write_text("step,loss\n1,2.5\n")
        (d / "model.tensors").write_bytes(b"not ours")
    old = time.time() - 30 * 86400
    for d in (mine_short, mine_long):
        for p in [*d.iterdir(), d]:
            os.utime(p, (old, old))
    # a megashard deletion killed mid-way (its process is gone)
    megashard.save(state(3), tmp_path / "gone")
    subprocess.run([sys.executable, "-c", KILLED_DELETER, str(tmp_path / "gone")], env=ENV, timeout=120)
    dead = [n for n in os.listdir(tmp_path) if n.startswith(".gone.del-")]
    assert len(dead) == 1 and not (tmp_path / "gone").exists()
    before = {d.name: tree(d) for d in (mine_short, mine_long)}

    megashard.save(state(1), tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == sorted([mine_short.name, mine_long.name, "ck"])
    assert {d.name: tree(d) for d in (mine_short, mine_long)} == before
    assert storage.cleanup_stale_temps(tmp_path, older_than_s=0) == []
    assert {d.name: tree(d) for d in (mine_short, mine_long)} == before


def test_a_deletion_still_running_is_left_to_its_process(tmp_path, monkeypatch):
    megashard.save(state(1), tmp_path / "ck")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "unlink", interrupted)
    with pytest.raises(KeyboardInterrupt):
        storage.remove_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".ck.del-")
    owner = json.loads((tmp_path / left / storage.OWNER_NAME).read_text())
    assert owner["pid"] == os.getpid()  # this process is deleting it: another clean-up leaves it
    assert storage.cleanup_stale_temps(tmp_path, older_than_s=0) == []
    storage.remove_checkpoint(tmp_path / left)  # its own process finishes it
    assert os.listdir(tmp_path) == []


KILLED_LATER_DELETER = textwrap.dedent("""
    import os, sys
    from megashard import storage
    real_unlink, n = os.unlink, int(sys.argv[2])

    def die(p, *a, **k):  # killed before its n-th unlink of the deletion
        global n
        n -= 1
        if n < 0:
            os.kill(os.getpid(), 9)
        return real_unlink(p, *a, **k)

    os.unlink = die
    storage.remove_checkpoint(sys.argv[1])
""")


def test_a_deletion_killed_at_any_point_leaves_what_a_clean_up_removes(tmp_path):
    """The deleter's owner record goes last: killed after any of its unlinks, what is left
    still names its (dead) deleter, so the next clean-up removes it at once, not after 24 h
    (seen in test_two_concurrent_savers_and_a_sigkill_leave_a_complete_checkpoint: a
    `.ckpt.del-*` holding only manifest.sha256)."""
    megashard.save(state(3), tmp_path / "probe")
    files = len(os.listdir(tmp_path / "probe"))  # manifest.json, .sha256, .index, .tensors, the owner record
    storage.remove_checkpoint(tmp_path / "probe")
    for n in range(1, files):
        d = tmp_path / f"run{n}"
        megashard.save(state(3), d / "gone")
        subprocess.run([sys.executable, "-c", KILLED_LATER_DELETER, str(d / "gone"), str(n)], env=ENV, timeout=120)
        dead = [x for x in os.listdir(d) if x.startswith(".gone.del-")]
        assert len(dead) == 1, (n, os.listdir(d))
        assert storage.OWNER_NAME in os.listdir(d / dead[0]), (n, os.listdir(d / dead[0]))
        assert storage.cleanup_stale_temps(d) == [str(d / dead[0])], n  # removed: its deleter is dead
        assert os.listdir(d) == [], n


@pytest.mark.parametrize("names", [["a.tensors", "b.tensors"], ["zz.tensors", "00.tensors", "state-r00001.tensors"]])
def test_a_deletion_removes_its_owner_record_last(tmp_path, monkeypatch, names):
    """Whatever order the directory lists its entries in, the owner record is unlinked after
    every other entry: a deleter killed in between leaves a directory naming it."""
    megashard.save(state(3), tmp_path / "gone")
    for n in names:  # more entries, so the listing order differs from the creation order
        (tmp_path / "gone" / n).write_bytes(b"")
    order = []
    real_unlink = os.unlink

    def spy(p, *a, **k):
        order.append(os.path.basename(os.fspath(p)))
        return real_unlink(p, *a, **k)

    monkeypatch.setattr(os, "unlink", spy)
    storage.remove_checkpoint(tmp_path / "gone")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    assert order[-1] == storage.OWNER_NAME, order
    assert order.count(storage.OWNER_NAME) == 1


def test_the_owner_record_is_composed_before_its_file_exists(tmp_path, monkeypatch):
    """Composing the record reads /proc (slow on a loaded machine); done after creating the
    file, a save killed in between left an empty record and its temp dir for 24 h (seen as
    a `.ckpt.tmp-*` holding an empty .megashard-owner.json)."""
    from megashard.storage import ownership

    d = tmp_path / "d"
    d.mkdir()
    real = ownership.owner_record
    seen = []

    def spy():
        seen.append(os.path.exists(d / storage.OWNER_NAME))
        return real()

    monkeypatch.setattr(ownership, "owner_record", spy)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ownership.write_owner(fd)
    finally:
        os.close(fd)
    assert seen == [False]
    assert json.loads((d / storage.OWNER_NAME).read_text())["pid"] == os.getpid()


def test_an_empty_deletion_directory_is_removed_at_once(tmp_path):
    """A deleter killed between unlinking the last entry and removing the directory leaves an
    empty `.X.del-<hex>`: nothing in it to lose, so the next clean-up removes it (it kept it 24 h:
    a flake of test_two_concurrent_savers_and_a_sigkill). A non-empty one without a record is kept."""
    empty = tmp_path / f".ck.del-{'ab12' * 8}"
    empty.mkdir()
    kept = tmp_path / f".ck.del-{'cd34' * 8}"
    kept.mkdir()
    (kept / "manifest.json").write_text("{}")
    assert storage.cleanup_stale_temps(tmp_path) == [str(empty)]
    assert sorted(os.listdir(tmp_path)) == [kept.name]

"""``save(..., new_only=True)`` and the rename that never replaces (issue 27): a checkpoint another
writer creates at the target while a save or a conversion runs is never replaced."""
from __future__ import annotations

import os

import pytest
import torch

import megashard
from megashard import storage
from megashard.convert import ConvertInputError, convert
from megashard.errors import CommitConflictError

from test_hf_convert import write_hf


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "mkdir-then-rename"])
def test_rename_new_only_never_replaces(tmp_path, monkeypatch, fallback):
    if fallback:  # a kernel or file system without RENAME_NOREPLACE
        monkeypatch.setattr(storage.posix, "_renameat2", lambda *a: None)
    src = tmp_path / "src"
    src.mkdir()
    (src / "manifest.json").write_text("mine")
    for kind in ("empty-dir", "dir", "file"):
        dst = tmp_path / kind
        if kind == "file":
            dst.write_text("theirs")
        else:
            dst.mkdir()
            if kind == "dir":
                (dst / "manifest.json").write_text("theirs")
        with pytest.raises(FileExistsError):
            storage.rename_new_only(src, dst)
        assert (src / "manifest.json").read_text() == "mine"
        assert (dst.read_text() if kind == "file" else sorted(os.listdir(dst))) == \
            ("theirs" if kind == "file" else ([] if kind == "empty-dir" else ["manifest.json"]))
    storage.rename_new_only(src, tmp_path / "new")
    assert (tmp_path / "new" / "manifest.json").read_text() == "mine" and not src.exists()


def test_save_new_only_refuses_a_checkpoint_that_exists_or_appears(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    megashard.save({"w": torch.arange(3.0)}, path)
    with pytest.raises(CommitConflictError, match="exists") as e:
        megashard.save({"w": torch.zeros(3)}, path, new_only=True)
    assert str(path) in str(e.value)
    other = tmp_path / "other"
    real = storage.DirectorySave.commit

    def another_writer_first(self, *a, **k):
        monkeypatch.setattr(storage.DirectorySave, "commit", real)
        megashard.save({"w": torch.arange(3.0)}, other)
        return real(self, *a, **k)

    monkeypatch.setattr(storage.DirectorySave, "commit", another_writer_first)
    with pytest.raises(CommitConflictError, match="appeared") as e:
        megashard.save({"w": torch.zeros(3)}, other, new_only=True)
    assert str(other) in str(e.value)
    assert torch.equal(megashard.load({"w": torch.empty(3)}, other)["w"], torch.arange(3.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "other"]  # no temporaries left


@pytest.mark.parametrize("what", ["checkpoint", "empty-dir"])
def test_a_dst_created_during_a_local_convert_is_never_replaced(tmp_path, monkeypatch, what):
    write_hf(tmp_path / "hf")
    dst = tmp_path / "out"
    import megashard.api

    real = megashard.api.save

    def save_then_another_writer(*a, **k):
        out = real(*a, **k)
        if what == "checkpoint":
            real({"w": torch.arange(2.0)}, dst)
        else:
            dst.mkdir()
        return out

    monkeypatch.setattr(megashard.api, "save", save_then_another_writer)
    with pytest.raises(ConvertInputError, match="appeared") as e:
        convert(str(tmp_path / "hf"), str(dst))
    assert str(dst) in str(e.value)
    if what == "checkpoint":
        assert torch.equal(megashard.load({"w": torch.empty(2)}, dst)["w"], torch.arange(2.0))
    else:
        assert os.listdir(dst) == []
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]  # the conversion's temp dir is gone

"""megashard.storage picks a store by location; every store's module provides the same functions."""
from __future__ import annotations

import os
import sys
import types

import pytest

from megashard import storage
from megashard.errors import CheckpointError
from megashard.storage import posix
from megashard.storage.base import Store
from megashard.storage.s3 import checkpoint as s3_store

INTERFACE = sorted(n for n in vars(Store) if not n.startswith("_"))


@pytest.mark.parametrize("module", [posix, s3_store], ids=["posix", "s3"])
def test_every_store_provides_the_whole_interface(module: types.ModuleType) -> None:
    missing = [n for n in INTERFACE if not callable(getattr(module, n, None))]
    assert missing == []


def test_a_path_goes_to_the_file_system_and_a_url_to_the_store_of_its_scheme() -> None:
    assert storage.store("/some/dir") is posix
    assert storage.store("relative/dir") is posix
    assert storage.store("s3://bkt/run") is s3_store
    assert storage.store("MSC://profile/run") is s3_store
    # a scheme no store takes goes to the S3 store, whose URL check refuses it by name
    with pytest.raises(CheckpointError, match="not an object-store URL"):
        storage.location("gs://bkt/run")


def test_a_new_store_is_one_module_and_one_line(monkeypatch, tmp_path) -> None:
    """Registering a module for a scheme routes every call of the interface to it: what adding GCS,
    Azure Blob or another store amounts to."""
    calls = []
    fake = types.ModuleType("fake_store")
    for name in INTERFACE:
        def fn(*args, _name=name, **kwargs):
            calls.append((_name, args[0]))
            return {"location": "mem://b/run", "locate": "mem://b/run", "is_checkpoint": True,
                    "read_tracker": 7, "iteration_names": ["iter_0000007"], "child": "mem://b/run/iter_0000007",
                    "checkpoint_location": "mem://b/run"}.get(_name)
        setattr(fake, name, fn)
    monkeypatch.setitem(sys.modules, "fake_store", fake)
    monkeypatch.setitem(storage.STORES, "mem", "fake_store")

    assert storage.is_checkpoint("mem://b/run") is True
    assert storage.read_tracker("mem://b/root") == 7
    storage.write_tracker("mem://b/root", 7)
    storage.write_tracker("mem://b/root", 7, new_only=True)
    assert storage.save_root_iterations("mem://b/root") == [7]
    assert storage.child("mem://b/root", "iter_0000007") == "mem://b/run/iter_0000007"
    storage.occupied("mem://b/new")
    storage.foreign_format("mem://b/tdist")
    assert ("write_tracker", "mem://b/root") in calls and ("is_checkpoint", "mem://b/run") in calls
    assert {("child", "mem://b/root"), ("occupied", "mem://b/new"), ("foreign_format", "mem://b/tdist")} <= set(calls)
    assert all(url.startswith("mem://") for _, url in calls)
    # paths still go to the file system
    assert storage.is_checkpoint(str(tmp_path)) is False


@pytest.mark.parametrize("save,files", [(posix.DirectorySave, posix.CheckpointFiles),
                                         (s3_store.ObjectSave, s3_store.ObjectCheckpointFiles)], ids=["posix", "s3"])
def test_every_store_s_seams_provide_what_copy_uses(save: type, files: type) -> None:
    """``megashard copy`` streams through the save seam (``write_stream``) and sizes its reads by the
    read seam (``read_threads``): each store's classes provide them, so copy names no store."""
    assert callable(save.write_stream)
    assert isinstance(files.read_threads(), int) and files.read_threads() >= 1


def test_a_local_tracker_new_only_never_replaces_one(tmp_path) -> None:
    """``write_tracker(new_only=True)`` on a file system: written where none is; refused (the old
    one kept, no temporary left) where one is, as the object store's If-None-Match PUT refuses."""
    from megashard.errors import CommitConflictError

    storage.write_tracker(tmp_path, 5, new_only=True)
    assert storage.read_tracker(tmp_path) == 5
    with pytest.raises(CommitConflictError, match="latest_checkpointed_iteration.txt exists"):
        storage.write_tracker(tmp_path, 9, new_only=True)
    assert storage.read_tracker(tmp_path) == 5
    assert sorted(os.listdir(tmp_path)) == ["latest_checkpointed_iteration.txt"]
    storage.write_tracker(tmp_path, 9)  # without new_only: replaced
    assert storage.read_tracker(tmp_path) == 9


def test_occupied_on_a_file_system(tmp_path) -> None:
    assert storage.occupied(tmp_path / "new") is False
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    assert storage.occupied(tmp_path / "dangling") is True
    assert storage.occupied(tmp_path) is True

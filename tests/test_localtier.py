"""megashard.localtier: which iteration a restarted job takes from the local tier, and what a save
leaves there (versions kept, modes, leftovers of a killed save)."""
from __future__ import annotations

import json
import os
import stat

import torch

from megashard import api, localtier, storage
from megashard.transport import SOLO


def test_choose_takes_newest_complete_on_every_rank_newer_than_persistent():
    assert localtier.choose([[5, 6], [5, 6]], 4) == (6, "")
    # rank 1 was killed before committing 6: never 6 for one rank and 5 for the other
    assert localtier.choose([[5, 6], [5]], 4) == (5, "")
    assert localtier.choose([[5, 6], [5]], 5) == (None, "the newest local checkpoint complete on every rank "
                                                       "(iteration 5) is not newer than the persistent one "
                                                       "(iteration 5)")
    assert localtier.choose([[5, 6], []], -1) == (None, "no complete local checkpoint on rank 1")
    assert localtier.choose([[], []], -1) == (None, "no complete local checkpoint on any rank")
    assert localtier.choose([[6], [5]], -1) == (None, "no iteration complete on every rank "
                                                      "(newest per rank: rank 0: 6, rank 1: 5)")


def test_save_keeps_two_versions_mode_0600_and_clears_a_killed_save(tmp_path):
    root, name = str(tmp_path / "local"), localtier.layout_name(2, {"tp": 2, "pp": 1, "ep": 1, "vp": 1})
    assert name == "w2-tp2-pp1-ep1-vp1"
    d = localtier.prepare(root, name, 1)
    assert d == str(tmp_path / "local" / "megashard-w2-tp2-pp1-ep1-vp1" / "rank00001")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for it in (1, 2, 3):
        sd = {"w": torch.full((4,), float(it)), "iteration": it}
        api.save(sd, localtier.version_dir(root, name, 1, it), process_group=SOLO, fsync=False)
        localtier.after_commit(root, name, 1, it)
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000003"]  # 1 removed by the save of 3
    v3 = localtier.version_dir(root, name, 1, 3)
    assert {stat.S_IMODE(os.stat(os.path.join(v3, f)).st_mode) for f in os.listdir(v3)} == {0o600}
    # a save killed mid-write: only a temporary, never a version; the next prepare() removes it
    tmp = storage.make_temp_dir(localtier.version_dir(root, name, 1, 4), "deadbeef")
    owner = os.path.join(tmp, storage.OWNER_NAME)
    record = json.loads(open(owner).read()) | {"pid": 2**22 + 1}  # a process of this machine that is gone
    with open(owner, "w") as f:
        json.dump(record, f)
    assert localtier.complete_iterations(root, name, 1) == [2, 3]
    localtier.prepare(root, name, 1)
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000003"]
    out = {"w": torch.empty(4), "iteration": None}
    api.load(out, v3, process_group=SOLO)
    assert torch.equal(out["w"], torch.full((4,), 3.0))
    assert localtier.complete_iterations(root, name, 0) == []  # another rank's directory: nothing


def test_megatron_flags_are_taken_before_megatrons_validation():
    """``--non-persistent-ckpt-type local`` with ``--save-format tensors``: megashard takes the flags, so
    Megatron's validate_args (which requires nvidia-resiliency-ext for ``local``) never sees ``local``."""
    import types

    import pytest

    from megashard.errors import CheckpointError
    from megashard.megatron.args import take_local_checkpointing

    def ns(**kw):
        return types.SimpleNamespace(**({"save_format": "tensors", "non_persistent_ckpt_type": "local",
                                         "non_persistent_local_ckpt_dir": "/dev/shm/ckpt", "replication": True,
                                         "replication_jump": 8, "replication_factor": 2} | kw))

    args = ns()
    assert take_local_checkpointing(args)
    assert (args.megashard_local_ckpt_dir, args.megashard_replication) == ("/dev/shm/ckpt", [8, 2])
    assert (args.non_persistent_ckpt_type, args.replication, args.replication_jump) == (None, False, None)
    untouched = ns(save_format="torch_dist")
    assert not take_local_checkpointing(untouched) and untouched.non_persistent_ckpt_type == "local"
    with pytest.raises(CheckpointError, match="--non-persistent-ckpt-type local needs "
                                              "--non-persistent-local-ckpt-dir DIR"):
        take_local_checkpointing(ns(non_persistent_local_ckpt_dir=None))
    with pytest.raises(CheckpointError, match="--replication requires --replication-jump J"):
        take_local_checkpointing(ns(replication_jump=None))


def test_solo_sync_save_leaves_the_async_save_in_flight(tmp_path):
    """A local-tier save (synchronous, SOLO) does not finalize the job's async save: training does
    not wait for the persistent write; the async save commits when it is finalized."""
    from megashard import async_save

    handle = api.save({"w": torch.arange(8.0)}, tmp_path / "persistent", async_save=True)
    api.save({"w": torch.ones(4)}, tmp_path / "local", process_group=SOLO, fsync=False)
    assert async_save.in_flight() is handle and storage.is_checkpoint(tmp_path / "local")
    handle.result()
    out = {"w": torch.empty(8)}
    api.load(out, tmp_path / "persistent")
    assert async_save.in_flight() is None and torch.equal(out["w"], torch.arange(8.0))

"""A full disk and an unwritable --save (issue 28 item 11): the error names the path, the
bytes needed and free, and is still an OSError with errno ENOSPC."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import megashard
from megashard import CheckpointError, NoSpaceError
from megashard.sharded import ShardedTensor

from distributed import run_ranks


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs (CI runs as root); unmounted afterwards."""
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _state(rank=0):
    return {"w": ShardedTensor("w", torch.ones(1 << 19), (2 << 19,), (rank << 19,))}  # 2 MiB a rank


def test_full_disk_names_path_bytes_and_is_enospc(tiny_fs):
    target = os.path.join(tiny_fs, "ckpt")
    with pytest.raises(OSError) as ei:
        megashard.save({"w": ShardedTensor("w", torch.ones(1 << 19), (1 << 19,), (0,))}, target)
    e = ei.value
    assert isinstance(e, NoSpaceError) and isinstance(e, CheckpointError)
    assert e.errno == errno.ENOSPC
    msg = str(e)
    assert f"No space left on device writing {tiny_fs}/" in msg and ".tensors" in msg
    assert "need about 2097152 bytes" in msg and "bytes free on that file system" in msg
    assert not os.path.exists(target)


def _save_body(rank, world, target):
    try:
        megashard.save(_state(rank), target)
    except OSError as e:
        return {"type": type(e).__name__, "errno": e.errno, "nospace": isinstance(e, NoSpaceError), "msg": str(e)}
    return None


def test_full_disk_on_two_ranks_raises_enospc_on_every_rank(tiny_fs):
    target = os.path.join(tiny_fs, "ckpt")
    res = run_ranks(_save_body, 2, target)
    for ok, v in res:
        assert ok and v is not None, res
        assert v["errno"] == errno.ENOSPC and v["nospace"], v
        assert "No space left on device writing" in v["msg"] and "need about 2097152 bytes" in v["msg"]


def test_read_only_save_is_reported_at_start_up(tmp_path):
    """Before: training ran until the first --save-interval, then failed."""
    pytest.importorskip("megatron.core")
    from megatron_helpers.runner import pretrain

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        run = pretrain(["--save", str(ro / "ckpt"), "--train-iters", "4", "--lr-decay-iters", "4",
                        "--save-interval", "2"])
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert run.returncode != 0
    assert run.losses == {}, "trained before failing"
    assert f"--save {ro / 'ckpt'}: cannot write in {ro} (Read-only file system)" in run.output, run.output[-3000:]

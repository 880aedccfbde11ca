"""Every load checks the CRC32 of every saved tensor it reads whole (issue 28 item 5):
a flipped bit fails a default load in own and scatter modes, with the file, the tensor and
what to do; ``check_crc=False`` loads it."""
from __future__ import annotations

import os

import pytest
import torch

import megashard
from megashard import ChecksumError
from megashard.storage import open_index
from megashard.plan import Box
from megashard.sharded import ShardedTensor

from distributed import run_ranks

W = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)


def _state(rank=0, world=1, empty=False):
    rows = 64 // world
    w = torch.empty(rows, 32) if empty else W[rank * rows:(rank + 1) * rows].clone()
    local = torch.zeros(100) if empty else torch.full((100,), float(rank + 1))
    return {"w": ShardedTensor("w", w, (64, 32), (rank * rows, 0)), "local": local}


def _save_body(rank, world, ckpt):
    megashard.save(_state(rank, world), ckpt)
    return True


def _flip(ckpt, key=None, name=None, bit=3):
    """Flip one bit in the middle of a saved tensor's data; returns (file, tensor name)."""
    index = open_index(ckpt)
    try:
        if key is not None:
            rec = min(index.pieces(key, Box((0, 0), (64, 32))), key=lambda r: r.offset)
            f, n, off, nb = rec.file, rec.name, rec.data_offset, rec.nbytes
        else:
            ref = index.tree_for_rank(0)[name]["ref"]
            f, n, off, nb = ref["file"], ref["name"], ref["data_offset"], ref["nbytes"]
    finally:
        index.close()
    path = os.path.join(ckpt, f)
    with open(path, "r+b") as fh:
        fh.seek(off + nb // 2)
        b = fh.read(1)[0]
        fh.seek(off + nb // 2)
        fh.write(bytes([b ^ (1 << bit)]))
    return f, n


def test_flipped_bit_in_a_shard_fails_a_default_load(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    megashard.save(_state(), ckpt)
    out, stats = megashard.load(_state(empty=True), ckpt, return_stats=True)
    assert torch.equal(out["w"], W)
    assert stats.crc_checked == W.numel() * 4 + 100 * 4  # every byte it read was checked
    f, n = _flip(ckpt, key="w")
    with pytest.raises(ChecksumError) as ei:
        megashard.load(_state(empty=True), ckpt)
    msg = str(ei.value)
    assert f"{ckpt}/{f}" in msg and repr(n) in msg and "'w' chunk [0, 0]+[64, 32]" in msg
    assert "is damaged" in msg and "Load an earlier checkpoint" in msg and "check_crc=False" in msg
    assert "--megashard-no-crc-on-load" in msg and f"megashard verify {ckpt}" in msg
    out, stats = megashard.load(_state(empty=True), ckpt, check_crc=False, return_stats=True)  # the opt-out
    assert stats.crc_checked == 0
    diff = (out["w"].view(torch.int32) ^ W.view(torch.int32)).nonzero()
    assert diff.shape[0] == 1  # the one flipped bit, loaded as asked


def test_flipped_bit_in_a_rank_local_tensor_fails_a_default_load(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    megashard.save(_state(), ckpt)
    f, n = _flip(ckpt, name="local")
    with pytest.raises(ChecksumError, match=r"tensor .* \(state local\) is damaged"):
        megashard.load(_state(empty=True), ckpt)
    out = megashard.load(_state(empty=True), ckpt, check_crc=False)
    assert not torch.equal(out["local"], torch.ones(100))


def _load_body(rank, world, ckpt, mode, check_crc, rows_from):
    t = {"w": ShardedTensor("w", torch.empty(64 // world, 32), (64, 32), (rank * 64 // world, 0))}
    try:
        out, stats = megashard.load(t, ckpt, mode=mode, check_crc=check_crc, return_stats=True)
    except ChecksumError as e:
        return ("ChecksumError", str(e))
    return ("ok", bool(torch.equal(out["w"], W[rank * 64 // world:(rank + 1) * 64 // world])), stats.crc_checked)


@pytest.mark.parametrize("mode", ["own", "scatter"])
def test_flipped_bit_fails_own_and_scatter_loads_on_every_rank(tmp_path, mode):
    ckpt = str(tmp_path / "ckpt")
    assert all(ok for ok, _ in run_ranks(_save_body, 2, ckpt))
    res = run_ranks(_load_body, 2, ckpt, mode, True, None)
    assert [v for _, v in res] == [("ok", True, 32 * 32 * 4 + 400)] * 2  # its rows and its saved "local"
    f, n = _flip(ckpt, key="w")  # the first shard: rank 0's rows
    res = run_ranks(_load_body, 2, ckpt, mode, True, None)
    for ok, v in res:  # one rank found it, every rank raises
        assert ok and v[0] == "ChecksumError", v
        assert f"{ckpt}/{f}" in v[1] and repr(n) in v[1] and "is damaged" in v[1]
    res = run_ranks(_load_body, 2, ckpt, mode, False, None)
    assert [v for _, v in res] == [("ok", False, 0), ("ok", True, 0)]


def test_resharding_load_checks_what_it_reads_whole(tmp_path):
    """Saved as 2 row shards, loaded as 1 (reads both whole: checked) and as 4 (reads halves:
    a CRC32 covers a whole tensor, so these reads are not checked; verify=True re-reads whole)."""
    ckpt = str(tmp_path / "ckpt")
    assert all(ok for ok, _ in run_ranks(_save_body, 2, ckpt))
    f, n = _flip(ckpt, key="w")
    with pytest.raises(ChecksumError, match="is damaged"):
        megashard.load({"w": ShardedTensor("w", torch.empty(64, 32), (64, 32), (0, 0))}, ckpt)
    quarter = {"w": ShardedTensor("w", torch.empty(16, 32), (64, 32), (16, 0))}  # half of the damaged shard
    out, stats = megashard.load(quarter, ckpt, return_stats=True)
    assert stats.crc_checked == 400  # only rank 0's saved "local", read whole
    assert not torch.equal(out["w"], W[16:32])  # the damaged bytes, unchecked
    with pytest.raises(ChecksumError):
        megashard.load(quarter, ckpt, verify=True)

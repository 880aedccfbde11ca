"""A ShardedObject whose JSON is over ``saving.OBJECT_IN_FILE_THRESHOLD`` is stored by the rank that
writes it, in its own ``.tensors`` file (a uint8 tensor holding the JSON text), and the index keeps a
small reference: Megatron's per-rank RNG state under expert parallelism (~20 KB a rank) no longer
passes through rank 0 or fills the index (issue 32). Loads in every mode read it like a rank-local
tensor, check its CRC32 whatever ``check_crc`` says, and decode it without a resolver.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import megashard
from megashard import saving, storage
from megashard.checkpoint_tools import verify_checkpoint
from megashard.errors import ChecksumError, CheckpointError
from megashard.sharded import ShardedObject, ShardedTensor

from distributed import all_ok, run_ranks


def _rng_like(seed: int) -> dict:
    """The shape of megashard.megatron.state.capture_rng_state()'s value: ~20 KB of JSON."""
    r = random.Random(seed)
    return {"format": "megashard-rng-v1",
            "random_rng_state": {"version": 3, "state": [r.getrandbits(32) for _ in range(625)], "gauss_next": None},
            "np_rng_state": {"kind": "MT19937", "keys": [r.getrandbits(32) for _ in range(624)], "pos": 624,
                             "has_gauss": 0, "cached_gaussian": 0.0},
            "torch_rng_state": r.randbytes(5056).hex(), "rng_tracker_states": {"model-parallel-rng": "ab" * 8},
            "step": (seed, 1.5)}


def _state(rank: int, world: int) -> dict:
    w = torch.arange(8 * world, dtype=torch.float32).view(world, 8)[rank:rank + 1].clone()
    return {"w": ShardedTensor("w", w, (world, 8), (rank, 0)),
            "rng": ShardedObject("rng", _rng_like(rank), (world,), (rank,), replica_id=0),
            "small": ShardedObject("small", {"n": rank}, (world,), (rank,), replica_id=0),
            "shared": ShardedObject("shared", _rng_like(99), (1,), (0,), replica_id=rank)}


def _template(rank: int, world: int) -> dict:
    return {"w": ShardedTensor("w", torch.zeros(1, 8), (world, 8), (rank, 0)),
            "rng": ShardedObject("rng", None, (world,), (rank,), replica_id=0),
            "small": ShardedObject("small", None, (world,), (rank,), replica_id=0),
            "shared": ShardedObject("shared", None, (1,), (0,), replica_id=rank)}


def _expected(rank: int) -> dict:
    """What a load gives back: JSON has no tuples, so the tuple comes back as megashard encodes it (a tuple)."""
    return {"rng": _rng_like(rank), "small": {"n": rank}, "shared": _rng_like(99)}


def _blob(ckpt: str, ukey: str) -> dict:
    m = storage.read_manifest(ckpt)
    value = m.object(ukey)["value"]
    assert value["__ms__"] == "ref" and value["ref"]["kind"] == "json", value
    return value["ref"]


def test_large_object_is_stored_in_its_file_and_loads_exactly(tmp_path):
    ckpt = str(tmp_path / "ck")
    megashard.save(_state(0, 1), ckpt)
    m = storage.read_manifest(ckpt)
    ref = _blob(ckpt, "rng/shard_0_1")
    assert m.object("small/shard_0_1")["value"] == {"n": 0}  # small objects stay in the index
    assert len(json.dumps(m.object("rng/shard_0_1"))) < 600  # the index holds a reference, not 20 KB
    # the file holds the JSON as a named uint8 tensor that tensorizer reads
    from tensorizer import TensorDeserializer
    with TensorDeserializer(os.path.join(ckpt, ref["file"]), device="cpu") as d:
        blob = d[ref["name"]]
    assert blob.dtype == torch.uint8 and ref["name"] == "__object__/rng/shard_0_1"
    got = json.loads(bytes(blob.numpy()))
    assert got["random_rng_state"]["state"] == _rng_like(0)["random_rng_state"]["state"]
    out = megashard.load(_template(0, 1), ckpt)
    assert out["rng"] == _expected(0)["rng"] and out["shared"] == _expected(0)["shared"] and out["small"] == {"n": 0}
    assert isinstance(out["rng"]["step"], tuple)
    assert torch.equal(out["w"], torch.arange(8, dtype=torch.float32).view(1, 8))
    assert verify_checkpoint(ckpt) == []


def test_object_with_tensors_keeps_its_value_in_the_index(tmp_path):
    """Only pure-JSON values move: one that holds tensors keeps its (tensor-referencing) value inline."""
    ckpt = str(tmp_path / "ck")
    value = {"t": torch.arange(4), "pad": "x" * 4096}
    megashard.save({"o": ShardedObject("o", value, (1,), (0,), replica_id=0)}, ckpt)
    entry = storage.read_manifest(ckpt).object("o/shard_0_1")["value"]
    assert entry.get("__ms__") != "ref" and entry["pad"] == "x" * 4096
    out = megashard.load({"o": ShardedObject("o", None, (1,), (0,), replica_id=0)}, ckpt)
    assert torch.equal(out["o"]["t"], torch.arange(4)) and out["o"]["pad"] == "x" * 4096


@pytest.mark.parametrize("check_crc", [True, False])
@pytest.mark.parametrize("where", ["data", "header"])
def test_damaged_stored_object_fails_the_load_naming_file_and_object(tmp_path, check_crc, where):
    ckpt = str(tmp_path / "ck")
    megashard.save(_state(0, 1), ckpt)
    ref = _blob(ckpt, "rng/shard_0_1")
    # data: one byte of the JSON text (found by the CRC32 before any parsing); header: a byte of its name
    at = ref["data_offset"] + 10 if where == "data" else ref["header_offset"] + 20
    with open(os.path.join(ckpt, ref["file"]), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChecksumError, match=r"model|state") as e:
        megashard.load(_template(0, 1), ckpt, check_crc=check_crc)
    assert ref["file"] in str(e.value) and "rng/shard_0_1" in str(e.value)
    assert any(ref["file"] in p for p in verify_checkpoint(ckpt))


def test_forged_reference_is_refused_before_reading(tmp_path):
    from megashard import loading
    from megashard.loading import _LoadWork, _decode_saved_tree

    ckpt = str(tmp_path / "ck")
    megashard.save(_state(0, 1), ckpt)
    m = storage.read_manifest(ckpt)
    ref = dict(_blob(ckpt, "rng/shard_0_1"))
    for bad, msg in ((dict(ref, shape=[1, ref["shape"][0]]), "1-D uint8"),
                     (dict(ref, header_offset=None), "header offset"),
                     (dict(ref, data_offset=10**9), "past the end")):
        with pytest.raises(CheckpointError, match=msg):
            _decode_saved_tree({"__ms__": "ref", "ref": bad}, m, _LoadWork(), "rng")
    assert loading  # the module under test


def _job(rank: int, world: int, ckpt: str) -> dict:
    megashard.save(_state(rank, world), ckpt)
    out = {}
    for mode in ("own", "scatter", "readonce"):
        got = megashard.load(_template(rank, world), ckpt, mode=mode)
        assert got["rng"] == _expected(rank)["rng"], (mode, rank)
        assert got["shared"] == _expected(rank)["shared"] and got["small"] == {"n": rank}, (mode, rank)
        assert torch.equal(got["w"], torch.arange(8 * world, dtype=torch.float32).view(world, 8)[rank:rank + 1])
        out[mode] = True
    files = {}
    if rank == 0:
        m = storage.read_manifest(ckpt)
        # a per-rank object does not make the ranks' state trees differ: one tree for all ranks
        assert len(set(m.rank_trees)) == 1, m.rank_trees
        for r in range(world):
            files[r] = _blob(ckpt, f"rng/shard_{r}_{world}")["file"]
    return {"modes": out, "files": files}


def test_every_rank_stores_its_own_object_and_every_mode_loads_it(tmp_path):
    world = 4
    env = {str(r): {"MEGASHARD_NODE_ID": f"n{r * 2 // world}", "MEGASHARD_HUGEPAGES": "0"} for r in range(world)}
    res = all_ok(run_ranks(_job, world, str(tmp_path / "ck"), env=env, timeout=240))
    assert all(r["modes"] == {"own": True, "scatter": True, "readonce": True} for r in res)
    # each rank's object sits in that rank's own file: nothing of it went through rank 0's file
    assert {r: f.split("-r")[1] for r, f in res[0]["files"].items()} == {r: f"{r:05d}.tensors" for r in range(world)}
    assert saving.OBJECT_IN_FILE_THRESHOLD < len(json.dumps(_rng_like(0)))


def test_reference_stays_equal_when_the_value_changes_so_a_steady_save_resends_nothing(tmp_path):
    """An RNG state changes at every save; its stored reference must not (the plan cache's steady-state
    commit then sends no object): the JSON is padded to a remembered capacity and the reference holds no
    CRC32 (the tensor header's own CRC32 in the file guards it)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    megashard.save(_state(0, 1), a)
    state = _state(0, 1)
    state["rng"] = ShardedObject("rng", _rng_like(7), (1,), (0,), replica_id=0)
    state["rng"].data["random_rng_state"]["state"][:40] = [1] * 40  # a shorter text than the first save's
    megashard.save(state, b)
    ma, mb = storage.read_manifest(a), storage.read_manifest(b)
    assert ma.object("rng/shard_0_1") == mb.object("rng/shard_0_1")  # equal reference, other value
    assert "crc32" not in _blob(b, "rng/shard_0_1")
    assert ma.files == mb.files  # the file keeps its size
    assert saving.steady_commit({"records": [], **{k: {} for k in saving.META_FIELDS}})  # the API used below
    got = megashard.load(_template(0, 1), b)
    assert got["rng"] == json.loads(json.dumps(state["rng"].data)) | {"step": (7, 1.5)}
    assert verify_checkpoint(b) == []


def test_copy_checks_a_stored_object_by_its_header_and_the_copy_loads(tmp_path):
    from megashard.copy import copy

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    megashard.save(_state(0, 1), src)
    copy(src, dst)
    assert megashard.load(_template(0, 1), dst)["rng"] == _expected(0)["rng"]
    ref = _blob(src, "rng/shard_0_1")
    with open(os.path.join(src, ref["file"]), "r+b") as f:  # damage the source: the copy refuses it
        f.seek(ref["data_offset"] + 3)
        b = f.read(1)
        f.seek(ref["data_offset"] + 3)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(megashard.MegashardError, match=ref["file"]):
        copy(src, str(tmp_path / "dst2"))


def test_verify_and_load_refuse_a_stored_object_that_is_not_json(tmp_path, monkeypatch):
    """Bytes whose CRC32 matches (written so) but that do not parse: verify names the object, a load
    fails with a CheckpointError instead of returning anything."""
    real = saving._dumps

    def truncating(x):  # the object's text loses its last byte before it is written (and hashed)
        text = real(x)
        return text[:-1] if isinstance(x, dict) and x.get("format") == "not-json-test" else text

    monkeypatch.setattr(saving, "_dumps", truncating)
    ckpt = str(tmp_path / "ck")
    value = {"format": "not-json-test", "pad": "x" * 4000}
    megashard.save({"o": ShardedObject("o", value, (1,), (0,), replica_id=0)}, ckpt)
    monkeypatch.setattr(saving, "_dumps", real)
    problems = verify_checkpoint(ckpt)
    assert any("'o/shard_0_1'" in p and "not valid JSON" in p for p in problems), problems
    with pytest.raises(CheckpointError, match="not valid JSON"):
        megashard.load({"o": ShardedObject("o", None, (1,), (0,), replica_id=0)}, ckpt)

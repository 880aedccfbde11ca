"""Index version 3 (2 plus the records' CRC32s in one binary region): a small head plus
CRC-guarded sections, read lazily; versions 1 and 2 still load."""
from __future__ import annotations

import json
import os

import pytest
import torch

import megashard
from megashard import manifest, storage
from megashard.errors import CheckpointError, MegashardError
from megashard.storage import open_index
from megashard.plan import Box
from megashard.sharded import ShardedTensor
from tamper import encode_doc_v2, read_manifest_doc, write_manifest_doc, write_manifest_text

N_KEYS = 40


def _save(path: str) -> None:
    # one process holding both row halves of every key (two "ranks" worth of chunks)
    sd = {f"a{i}": ShardedTensor(f"k{i}", torch.full((4, 8), float(i)), (8, 8), (0, 0)) for i in range(N_KEYS)}
    sd.update({f"b{i}": ShardedTensor(f"k{i}", torch.full((4, 8), float(-i)), (8, 8), (4, 0)) for i in range(N_KEYS)})
    sd.update(args={"lr": 0.5, "note": "x" * 1000}, iteration=3, local=torch.arange(7))
    megashard.save(sd, path)


def test_written_as_version_3_and_read_lazily(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    head = json.loads(open(os.path.join(path, storage.MANIFEST_NAME)).read())
    assert head["version"] == 3 and head["index"]["file"] == manifest.INDEX_NAME
    assert os.path.getsize(os.path.join(path, manifest.INDEX_NAME)) == head["index"]["bytes"]
    index = open_index(path)
    head_bytes = index.bytes_read
    recs = index.pieces("k3", Box((4, 0), (4, 8)))  # one chunk of one key: one section
    assert [(r.offset, r.shape) for r in recs] == [((4, 0), (4, 8))]
    nsections = os.path.getsize(os.path.join(path, manifest.INDEX_NAME))
    assert index.bytes_read - head_bytes < nsections / 3  # its key's bucket and that section, not the index
    index.close()
    # loading a subset reads a small part of the index
    t = {"x": ShardedTensor("k5", torch.zeros(2, 8), (8, 8), (3, 0))}
    out, stats = megashard.load(t, path, strict=False, return_stats=True)
    assert torch.equal(out["x"], torch.tensor([[5.0] * 8, [-5.0] * 8]))
    index = open_index(path)
    index.tree_for_rank(0)
    index.pieces("k5", Box((3, 0), (2, 8)))  # the two chunks the request overlaps
    expected = index.bytes_read  # head + this rank's state tree + those two chunks' sections
    index.close()
    nsections = os.path.getsize(os.path.join(path, manifest.INDEX_NAME))
    assert stats.index_bytes_read == expected
    assert expected - head_bytes < nsections  # the other 78 chunks' sections were not read


def test_full_manifest_equals_what_was_saved(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    m = megashard.read_manifest(path)
    assert m.version == 3 and len(m.tensors) == N_KEYS
    assert all([s.offset for s in t.shards] == [(0, 0), (4, 0)] for t in m.tensors.values())
    tree = m.tree_for_rank(0)
    assert tree["args"] == {"lr": 0.5, "note": "x" * 1000} and tree["iteration"] == 3
    assert megashard.load_common(path, ["args"]) == {"args": {"lr": 0.5, "note": "x" * 1000}}


def test_version_1_checkpoint_still_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    doc = read_manifest_doc(path)
    doc["version"] = 1
    os.unlink(os.path.join(path, manifest.INDEX_NAME))
    write_manifest_text(path, json.dumps(doc))
    t = {f"k{i}": ShardedTensor(f"k{i}", torch.zeros(8, 8), (8, 8), (0, 0)) for i in range(N_KEYS)}
    t["local"] = torch.zeros(7, dtype=torch.int64)
    out = megashard.load(t, path, verify=True)
    for i in range(N_KEYS):
        assert torch.equal(out[f"k{i}"], torch.cat([torch.full((4, 8), float(i)), torch.full((4, 8), float(-i))]))
    assert torch.equal(out["local"], torch.arange(7)) and out["iteration"] == 3
    assert megashard.read_manifest(path).version == 1


def test_version_2_checkpoint_still_loads(tmp_path):
    """Version 2 (each record's CRC32 inside its chunk section's JSON) is still read, CRC32s
    included: a damaged tensor is still caught."""
    path = str(tmp_path / "ckpt")
    _save(path)
    doc = read_manifest_doc(path)
    head, sections = encode_doc_v2(doc)
    assert json.loads(head)["version"] == 2 and "crcs" not in json.loads(head)
    with open(os.path.join(path, manifest.INDEX_NAME), "wb") as f:
        f.write(sections)
    write_manifest_text(path, head)
    t = {f"k{i}": ShardedTensor(f"k{i}", torch.zeros(8, 8), (8, 8), (0, 0)) for i in range(N_KEYS)}
    t["local"] = torch.zeros(7, dtype=torch.int64)
    out = megashard.load(t, path, verify=True)
    for i in range(N_KEYS):
        assert torch.equal(out[f"k{i}"], torch.cat([torch.full((4, 8), float(i)), torch.full((4, 8), float(-i))]))
    assert torch.equal(out["local"], torch.arange(7)) and out["iteration"] == 3
    m = megashard.read_manifest(path)
    assert m.version == 2
    assert read_manifest_doc(path)["tensors"] == doc["tensors"]
    crcs = {(k, tuple(s["offset"])): s["crc32"] for k, t in doc["tensors"].items() for s in t["shards"]}
    assert {(k, s.offset): s.crc32 for k, t in m.tensors.items() for s in t.shards} == crcs
    assert all(crcs.values())


def _template() -> dict:
    return {f"k{i}": ShardedTensor(f"k{i}", torch.zeros(8, 8), (8, 8), (0, 0)) for i in range(N_KEYS)}


@pytest.mark.parametrize("damage", ["flip_section_byte", "truncate_index", "symlink_index", "missing_index",
                                    "section_past_end", "chunk_ints_garbage", "flip_crc_region_byte",
                                    "flip_crc_table_byte", "crc_count_huge", "crc_count_short", "crcs_missing"])
def test_damaged_index_is_a_clear_error(tmp_path, damage, monkeypatch):
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.2")  # a missing index is waited for this long
    path = str(tmp_path / "ckpt")
    _save(path)
    ipath = os.path.join(path, manifest.INDEX_NAME)
    head = json.loads(open(os.path.join(path, storage.MANIFEST_NAME)).read())
    if damage == "flip_section_byte":
        data = bytearray(open(ipath, "rb").read())
        data[len(data) // 3] ^= 0x20
        open(ipath, "wb").write(bytes(data))
    elif damage == "truncate_index":
        os.truncate(ipath, os.path.getsize(ipath) - 1)
    elif damage == "symlink_index":
        os.replace(ipath, str(tmp_path / "elsewhere"))
        os.symlink(str(tmp_path / "elsewhere"), ipath)
    elif damage == "missing_index":
        os.unlink(ipath)
    elif damage == "section_past_end":
        head["tensors"][0][1] = head["index"]["bytes"] - 2
        write_manifest_text(path, json.dumps(head))
    elif damage == "chunk_ints_garbage":
        doc = read_manifest_doc(path)
        doc["tensors"]["k1"]["shards"][0]["offset"] = [-1, 0]
        write_manifest_doc(path, doc)
    elif damage.startswith("flip_crc"):  # a record's CRC32, or the table of the blocks' CRC32s
        start, count, _ = head["crcs"]
        data = bytearray(open(ipath, "rb").read())
        data[start + (4 * count if damage == "flip_crc_table_byte" else 5)] ^= 0x01
        open(ipath, "wb").write(bytes(data))
    elif damage == "crc_count_huge":  # refused before anything is allocated for it
        head["crcs"][1] = 10 ** 15
        write_manifest_text(path, json.dumps(head))
    elif damage == "crc_count_short":  # the chunk sections name CRC32s past the region's end
        head["crcs"][1:] = [0, 0]
        write_manifest_text(path, json.dumps(head))
    elif damage == "crcs_missing":
        del head["crcs"]
        write_manifest_text(path, json.dumps(head))
    with pytest.raises(MegashardError) as e:
        megashard.load(_template(), path)
    assert isinstance(e.value, CheckpointError), e.value
    assert manifest.INDEX_NAME in str(e.value) or "manifest.json" in str(e.value), e.value
    with pytest.raises(CheckpointError):
        megashard.read_manifest(path)


def test_pieces_exact_chunk_lookup_agrees_with_the_scan(tmp_path):
    """LazyIndex.pieces answers a box that is exactly one saved chunk with a lookup and any
    other box with a scan of every chunk: both give the same shards (overlapping, touching,
    disjoint and zero-size boxes)."""
    import itertools

    path = str(tmp_path / "ckpt")
    sd = {f"p{r}{c}": ShardedTensor("t", torch.full((2, 4), float(4 * r + c)), (8, 8), (2 * r, 4 * c))
          for r in range(4) for c in range(2)}
    sd["z"] = ShardedTensor("z", torch.zeros(0, 3), (0, 3), (0, 0))
    megashard.save(sd, path)
    boxes = [Box((a, b), (h, w)) for a, b, h, w in itertools.product(range(0, 8, 2), range(0, 8, 4), (0, 1, 2, 3), (1, 4))
             if a + h <= 8 and b + w <= 8]
    boxes += [Box((0, 0), (8, 8)), Box((0, 0), (0, 3))]
    assert sum(1 for b in boxes if b.numel and b.offset[0] % 2 == 0 and b.shape == (2, 4)) == 8  # exact chunks

    def answers(lookup: bool):
        index = open_index(path)
        if not lookup:
            index._exact.update(t={}, z={})  # no chunk found by lookup: every box is scanned
        try:
            return [[(r.offset, r.shape, r.name) for r in index.pieces(k, b)] for k in ("t", "z") for b in boxes]
        finally:
            index.close()

    fast, scanned = answers(True), answers(False)
    assert fast == scanned
    assert len(fast[boxes.index(Box((0, 0), (8, 8)))]) == 8 and fast[-1] == [((0, 0), (0, 3), fast[-1][0][2])]

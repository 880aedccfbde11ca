"""``megashard copy`` (issue 28 item 1): checkpoints and Megatron save roots between directories and an
S3 endpoint (SeaweedFS on 127.0.0.1, tests/s3_endpoint.py), streamed, checked on the way, committed as a save."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import megashard
from megashard import CheckpointError, MegashardError, saveroot, storage
from megashard.cli import main as cli_main
from megashard.copy import copy
from megashard.format import write_file
from megashard.format.streamverify import StreamVerifier
from megashard.errors import FormatError
from megashard.storage.s3.client import ObjectStore
from megashard.sharded import ShardedTensor

from bitexact import assert_same

MiB = 1 << 20


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    """5 MiB parts (S3's minimum): the ~12 MiB file below goes up in a multipart upload of several chunks."""
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "big": torch.randn(3 * MiB + 1000, generator=g),  # ~12 MiB: three 5 MiB parts
        "g": ShardedTensor("layer.g", torch.randn(8, 4, generator=g), (8, 4), (0, 0)),  # a global tensor
        "iteration": 7 + seed,
    }


def template(s: dict) -> dict:
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else
                ShardedTensor(v.key, torch.empty_like(v.data), v.global_shape, v.global_offset)
                if isinstance(v, ShardedTensor) else None) for k, v in s.items()}


def check_loaded(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, ShardedTensor):
            assert_same(got[k].data if isinstance(got[k], ShardedTensor) else got[k], v.data)
        elif isinstance(v, torch.Tensor):
            assert_same(got[k], v)
        else:
            assert got[k] == v


def _objects(url: str) -> dict:
    store, key = ObjectStore.for_url(url)
    objects, _ = store.list(key + "/")
    return {o.key[len(key) + 1:]: o for o in objects}


def _files(d) -> dict:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


def _flip_a_data_bit(ckpt) -> None:
    """One bit inside the big tensor's bytes (not a header, not the index)."""
    name = next(n for n in os.listdir(ckpt) if n.endswith(".tensors"))
    with open(ckpt / name, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x10]))


def test_local_to_s3_to_local_round_trip_is_bit_exact(s3, tmp_path):
    want = state(0)
    megashard.save(want, tmp_path / "a")
    url = s3.url("run/iter_0000007")
    res = copy(tmp_path / "a", url, chunk_bytes=5 * MiB)  # the 12 MiB file in three chunks
    assert res.files == 1 and res.checkpoints == [(str(tmp_path / "a"), url)]
    check_loaded(megashard.load(template(want), url, verify=True), want)
    names = set(_objects(url))  # the layout a save writes: the head and one save prefix
    assert "manifest.json" in names and all(n == "manifest.json" or n.startswith(".megashard-save-") for n in names)
    assert any(r["method"] == "POST" and "uploads" in r.get("query", "") for r in s3.requests())  # multipart
    copy(url, tmp_path / "b", chunk_bytes=3 * MiB)
    check_loaded(megashard.load(template(want), tmp_path / "b", verify=True), want)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(a[n] == b[n] for n in a if n.endswith(".tensors"))  # shards byte-identical both ways
    head = json.loads(b["manifest.json"])
    assert "data_prefix" not in head and "etag" not in head["index"]  # nothing of the object store's layout
    files = megashard.read_manifest(tmp_path / "b").files
    assert all("etag" not in f for f in files.values())
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # no temporaries left
    # local -> local keeps the index byte for byte
    copy(tmp_path / "a", tmp_path / "c")
    assert _files(tmp_path / "c") == a
    copy(url, tmp_path / "c")  # a megashard checkpoint at DST is replaced, as a re-save replaces it
    assert {n: v for n, v in _files(tmp_path / "c").items() if n.endswith(".tensors")} == \
        {n: v for n, v in a.items() if n.endswith(".tensors")}
    check_loaded(megashard.load(template(want), tmp_path / "c"), want)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]  # no temporaries left
    # s3 -> s3
    url2 = s3.url("other/ckpt")
    copy(url, url2)
    check_loaded(megashard.load(template(want), url2), want)
    # a file below one part goes up in one PUT (no multipart upload)
    small = {"x": torch.arange(10), "iteration": 1}
    megashard.save(small, tmp_path / "small")
    s3.reset()
    copy(tmp_path / "small", s3.url("small"))
    assert not any(r["method"] == "POST" and "uploads" in r.get("query", "") for r in s3.requests())
    check_loaded(megashard.load(template(small), s3.url("small")), small)


def test_a_flipped_bit_fails_the_copy_and_leaves_the_destination_untouched(s3, tmp_path):
    old = state(1)
    url = s3.url("run/iter_0000001")
    megashard.save(old, url)
    before = {n: o.etag for n, o in _objects(url).items()}
    megashard.save(state(0), tmp_path / "src")
    _flip_a_data_bit(tmp_path / "src")
    with pytest.raises(MegashardError, match=r"src/state-r00000\.tensors: tensor '[^']*big': hash mismatch: CRC32"):
        copy(tmp_path / "src", url, chunk_bytes=5 * MiB)
    assert {n: o.etag for n, o in _objects(url).items()} == before  # its save prefix was removed
    store, key = ObjectStore.for_url(url)
    assert store.list_uploads(key + "/") == []  # the multipart upload was aborted
    check_loaded(megashard.load(template(old), url), old)
    # to a directory: the previous checkpoint stays, no temporary is left
    megashard.save(old, tmp_path / "dst")
    kept = _files(tmp_path / "dst")
    with pytest.raises(MegashardError, match="CRC32"):
        copy(tmp_path / "src", tmp_path / "dst", chunk_bytes=1 * MiB)
    assert _files(tmp_path / "dst") == kept
    with pytest.raises(MegashardError, match="CRC32"):
        copy(tmp_path / "src", tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


def test_a_destination_that_is_not_a_megashard_checkpoint_is_refused(s3, tmp_path):
    megashard.save(state(0), tmp_path / "src")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a megashard checkpoint"):
        copy(tmp_path / "src", other)
    assert _files(other) == {"notes.txt": b"mine"}
    assert sorted(os.listdir(tmp_path)) == ["other", "src"]
    url = s3.url("foreign/x")
    store, key = ObjectStore.for_url(url)
    store.put_bytes(f"{key}/model_optim_rng.pt", b"not ours")
    with pytest.raises(CheckpointError, match="did not write"):
        copy(tmp_path / "src", url)
    assert set(_objects(url)) == {"model_optim_rng.pt"}


def test_a_checkpoint_copied_as_plain_objects_names_megashard_copy(s3, tmp_path, capsys):
    want = state(0)
    megashard.save(want, tmp_path / "a")
    url = s3.url("plain/iter_0000001")
    client = s3.boto3()
    for n in os.listdir(tmp_path / "a"):  # what `aws s3 cp --recursive` does
        client.upload_file(str(tmp_path / "a" / n), s3.bucket, f"plain/iter_0000001/{n}")
    with pytest.raises(CheckpointError, match=r"copied as plain objects.*`megashard copy DIR s3://"):
        megashard.load(template(want), url)
    assert cli_main(["inspect", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("megashard inspect: error: ") and "megashard copy" in err
    # and the other way: an S3 checkpoint's objects downloaded as plain files
    good = s3.url("good/iter_0000001")
    megashard.save(want, good)
    d = tmp_path / "downloaded"
    store, key = ObjectStore.for_url(good)
    for n, o in _objects(good).items():
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        (d / n).write_bytes(store.get_bytes(o.key, 64 * MiB)[0])
    with pytest.raises(CheckpointError, match=r"copied as plain files.*`megashard copy s3://"):
        megashard.load(template(want), d)
    # what works
    copy(tmp_path / "a", s3.url("copied/iter_0000001"))
    check_loaded(megashard.load(template(want), s3.url("copied/iter_0000001")), want)


def test_megatron_save_root_copies_the_tracked_iteration_and_writes_the_tracker_last(s3, tmp_path):
    root = tmp_path / "root"
    for it in (1, 2):
        megashard.save(state(it), root / saveroot.iteration_dir_name(it))
    storage.write_tracker(root, 2)
    url = s3.url("mlm")
    calls = []
    real = storage.write_tracker
    storage_write = lambda r, it: (calls.append((r, it, sorted(_objects(url)))), real(r, it))  # noqa: E731
    import megashard.copy as copy_mod

    mp = pytest.MonkeyPatch()
    mp.setattr(copy_mod.storage, "write_tracker", storage_write)
    try:
        res = copy(root, url)
    finally:
        mp.undo()
    assert res.tracker == 2 and [d for _, d in res.checkpoints] == [url + "/iter_0000002"]
    assert calls and calls[0][1] == 2 and "iter_0000002/manifest.json" in calls[0][2]  # after the commit
    assert storage.read_tracker(url) == 2 and storage.locate(url + "/iter_0000001") is None
    check_loaded(megashard.load(template(state(2)), url + "/iter_0000002"), state(2))
    # every iteration, back to a directory
    res = copy(url, tmp_path / "back", iteration=2)
    assert storage.read_tracker(tmp_path / "back") == 2
    res = copy(root, s3.url("all"), all_iterations=True)
    assert [d for _, d in res.checkpoints] == [s3.url("all/iter_0000001"), s3.url("all/iter_0000002")]
    assert storage.read_tracker(s3.url("all")) == 2
    check_loaded(megashard.load(template(state(1)), s3.url("all/iter_0000001")), state(1))
    # an older iteration into a root whose tracker names a later one leaves the tracker alone
    res = copy(root, s3.url("all"), iteration=1)
    assert res.tracker is None and storage.read_tracker(s3.url("all")) == 2


def test_cli_copy_and_convert_point_to_it(s3, tmp_path, capsys):
    megashard.save(state(0), tmp_path / "a")
    url = s3.url("cli/iter_0000001")
    assert cli_main(["copy", str(tmp_path / "a"), url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"copied {tmp_path / 'a'} -> {url}: 1 files,")
    assert cli_main(["convert", str(tmp_path / "a"), s3.url("conv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megashard convert: error: ") and f"`megashard copy {tmp_path / 'a'} {s3.url('conv')}`" in err
    (tmp_path / "nothing").mkdir()
    assert cli_main(["copy", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megashard copy: error: ") and "holds no latest_checkpointed_iteration.txt" in err
    assert cli_main(["copy", str(tmp_path / "a"), str(tmp_path / "a" / "inner")]) == 2
    assert "one holds the other" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "a" / "inner").exists()


def test_stream_verifier_catches_every_flipped_bit_in_any_chunking(tmp_path):
    p = tmp_path / "f.tensors"
    write_file({"a": torch.randn(300), "b": torch.arange(7, dtype=torch.int8),
                "m": torch.empty(3, 4, device="meta")}, p)
    data = p.read_bytes()
    rng = random.Random(0)

    def run(buf: bytes, step: int, sha256: bool) -> dict:
        v = StreamVerifier("f", len(buf), sha256=sha256)
        mv = memoryview(buf)
        for i in range(0, len(buf), step):
            v.feed(mv[i:i + step])
        return v.finish()

    crcs = run(data, 1, False)
    assert all(run(data, step, True) == crcs for step in (7, 4096, len(data)))
    missed = {False: [], True: []}
    for pos in range(0, len(data), 3):
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        for sha in (False, True):
            try:
                run(bytes(bad), rng.choice([13, 4096, len(data)]), sha)
            except FormatError:
                continue
            missed[sha].append(pos)
    assert missed[True] == []
    # without SHA-256 only the stored SHA-256 values themselves (32 bytes per tensor) go unchecked
    assert len(missed[False]) <= 3 * 32 // 3 + 3 and missed[False]
    for cut in (0, 5, 100, len(data) - 1):
        with pytest.raises(FormatError):
            run(data[:cut], 50, False)


def test_the_index_is_checked_against_the_files_and_reads_are_chunked(tmp_path, monkeypatch):
    from tamper import read_manifest_doc, write_manifest_doc

    want = state(0)
    megashard.save(want, tmp_path / "a")
    sizes = []
    real = storage.CheckpointFiles.read_into

    def spy(self, name, reqs, **kw):
        if name.endswith(".tensors"):
            sizes.extend(len(mv) for _, mv in reqs)
        return real(self, name, reqs, **kw)

    monkeypatch.setattr(storage.CheckpointFiles, "read_into", spy)
    copy(tmp_path / "a", tmp_path / "b", chunk_bytes=2 * MiB)
    assert max(sizes) == 2 * MiB and len(sizes) == 7  # ~12 MiB in 2 MiB chunks, never the whole file
    monkeypatch.undo()
    # an index whose CRC32 of a shard differs from the file's (both intact on their own)
    doc = read_manifest_doc(str(tmp_path / "b"))
    (tree,) = doc["trees"].values()
    tree["w"]["ref"]["crc32"] ^= 1
    write_manifest_doc(str(tmp_path / "b"), doc)
    with pytest.raises(CheckpointError, match=r"tensor '[^']*/w'.*differs from the index's"):
        copy(tmp_path / "b", tmp_path / "c")
    tree["w"]["ref"]["crc32"] ^= 1
    doc["tensors"]["layer.g"]["shards"][0]["crc32"] ^= 1  # a global tensor's shard
    write_manifest_doc(str(tmp_path / "b"), doc)
    with pytest.raises(CheckpointError, match=r"tensor 'layer\.g[^']*'.*differs from the index's"):
        copy(tmp_path / "b", tmp_path / "c")
    doc["tensors"]["layer.g"]["shards"][0]["crc32"] ^= 1
    # an index naming a file that is not a shard file
    doc["files"]["manifest.json"] = doc["files"].pop("state-r00000.tensors")
    doc["tensors"]["layer.g"]["shards"][0]["file"] = "manifest.json"
    write_manifest_doc(str(tmp_path / "b"), doc)
    with pytest.raises(CheckpointError, match="not a megashard shard file name"):
        copy(tmp_path / "b", tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]

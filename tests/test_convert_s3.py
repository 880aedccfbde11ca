"""``megashard convert`` with an s3:// end (issue 22), against the local S3 endpoint (tests/s3_endpoint.py):
an s3:// megashard checkpoint (or Megatron save root) as SRC for every target, and an s3:// DST for
``--to megashard`` (torch_dist, Hugging Face import), written by megashard's own save (commit protocol)."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

import megashard
from megashard import saveroot, storage
from megashard.cli import main as cli_main
from megashard.convert import ConvertInputError, _megatron_core, convert
from megashard.storage.s3.client import ObjectStore

from layouts import EXP_AVG, GLOBALS, Layout, bit_equal, expected_global, full, union_state
from test_convert import _torch_dist_shards
from test_hf_convert import write_hf

pytest.importorskip("megatron.core")

IT = saveroot.iteration_dir_name(10)


def _save_root(root: str) -> None:
    """A Megatron save root at ``root`` (a path or URL): iter 10 (tracker), TP=2 x DP=2, distributed optimizer."""
    sd = union_state(Layout(tp=2, dp=2), distopt=True)
    sd.update(iteration=10, args=argparse.Namespace(lr=3e-4, name="toy"), rng=torch.arange(5) + 10)
    megashard.save(sd, root.rstrip("/") + "/" + IT if storage.is_url(root) else os.path.join(root, IT))
    storage.write_tracker(root, 10)


def _objects(url: str) -> dict:
    """{key under url: ETag} of every object at or under ``url``."""
    store, key = ObjectStore.for_url(url)
    objects, _ = store.list(key + "/")
    return {o.key[len(key) + 1:]: o.etag for o in objects}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The working directory is tmp_path: a URL mistaken for a path would show up in it as ./s3:/..."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_s3_source_to_single_files_same_bytes_as_from_a_local_copy(s3, in_tmp, capsys):
    local, url = str(in_tmp / "save"), s3.url("run")
    _save_root(local)
    _save_root(url)
    s3.reset()
    for to in ("tensors", "safetensors"):
        a, b = str(in_tmp / f"from_s3.{to}"), str(in_tmp / f"from_local.{to}")
        res = convert(url, a, to=to)
        assert (res.src, res.iteration, res.tensors) == (f"{url}/{IT}", 10, 2 * len(GLOBALS))
        convert(local, b, to=to)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read(), to
    from safetensors.torch import load_file

    got = load_file(str(in_tmp / "from_s3.safetensors"))
    assert sorted(got) == sorted(list(GLOBALS) + [EXP_AVG + k for k in GLOBALS])
    for k, t in got.items():
        assert bit_equal(t, expected_global(k)), k
    # one checkpoint's URL (not the root), through the CLI, with --keys
    assert cli_main(["convert", f"{url}/{IT}", str(in_tmp / "emb.safetensors"), "--to", "safetensors",
                     "--keys", "embedding.*"]) == 0
    assert f"{url}/{IT} (megashard) -> " in capsys.readouterr().out
    assert list(load_file(str(in_tmp / "emb.safetensors"))) == ["embedding.word_embeddings.weight"]
    assert {r["method"] for r in s3.requests()} <= {"GET", "HEAD"}  # SRC only read, never listed or written
    assert sorted(os.listdir(in_tmp)) == sorted(["save", "emb.safetensors"] + [
        f"from_{w}.{to}" for w in ("s3", "local") for to in ("tensors", "safetensors")])


def test_s3_source_to_torch_dist(s3, in_tmp):
    url = s3.url("run")
    _save_root(url)
    td = str(in_tmp / "td")
    res = convert(url, td, to="torch_dist")
    assert res.tensors == 2 * len(GLOBALS)
    assert sorted(os.listdir(td)) == [IT, saveroot.TRACKER_NAME] and storage.read_tracker(td) == 10
    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ck = os.path.join(td, IT)
        common = serialization.load_common_state_dict(ck)
        assert common["iteration"] == 10 and common["args"].lr == 3e-4
        assert torch.equal(common["rng"], torch.arange(5) + 10)
        meta = dc.load_tensors_metadata(ck)
        assert set(meta) == set(GLOBALS) | {EXP_AVG + k for k in GLOBALS}
        fulls = dc.load({k: ShardedTensor.from_rank_offsets(k, torch.empty(m.global_shape, dtype=m.dtype))
                         for k, m in meta.items()}, ck)
        for k in meta:
            assert bit_equal(fulls[k], expected_global(k)), k


def test_torch_dist_to_s3_megashard_loads_bit_exact(s3, in_tmp):
    """A torch_dist Megatron save root -> s3://: DST/iter_0000003 committed by megashard's save (head
    written last, conditionally), then the tracker; nothing written locally."""
    root = in_tmp / "td"
    ck = str(root / saveroot.iteration_dir_name(3))
    os.makedirs(ck)
    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        dc.save({"model": _torch_dist_shards(Layout(tp=2)),
                 "extra": ShardedObject("extra", {"seed": 5}, (1,), (0,), replica_id=0),
                 "iteration": 3, "args": argparse.Namespace(tensor_model_parallel_size=2)}, ck)
    storage.write_tracker(str(root), 3)
    url = s3.url("ms")
    s3.reset()
    res = convert(str(root), url)
    assert (res.dst, res.source_format, res.tensors) == (url, "torch_dist", len(GLOBALS))
    assert storage.read_tracker(url) == 3
    got = megashard.load_consolidated(f"{url}/{saveroot.iteration_dir_name(3)}")
    assert set(got) == set(GLOBALS)
    for k, t in got.items():
        assert bit_equal(t, full(k)), k
    common = megashard.load_common(f"{url}/{saveroot.iteration_dir_name(3)}", ["iteration", "args"])
    assert common["iteration"] == 3 and common["args"].tensor_model_parallel_size == 2
    heads = [r for r in s3.requests() if r["method"] == "PUT" and r["key"].endswith("iter_0000003/manifest.json")]
    assert len(heads) == 1 and heads[0]["if_none_match"] == "*"  # the commit point, written once, new only
    names = _objects(url)
    assert saveroot.TRACKER_NAME in names and "iter_0000003/manifest.json" in names
    assert all(n in (saveroot.TRACKER_NAME, "iter_0000003/manifest.json")
               or n.startswith("iter_0000003/.megashard-save-") for n in names), names
    assert sorted(os.listdir(in_tmp)) == ["td"]  # no local temporaries, no ./s3:/ directory


def test_hugging_face_to_s3_and_back_from_s3(s3, in_tmp):
    """HF import straight into s3:// (DST/release + tracker), then export from s3:// to a local HF directory:
    the safetensors bytes come back bit for bit."""
    write_hf(in_tmp / "hf")
    url = s3.url("ft")
    res = convert(str(in_tmp / "hf"), url)
    assert res.target_format == "megashard" and res.tensors == 2 * 9 + 3
    assert storage.read_tracker(url) == "release" and storage.locate(f"{url}/release") is not None
    convert(url, str(in_tmp / "back"), to="hf", vocab_size=100)
    from safetensors.torch import load_file

    a = load_file(str(in_tmp / "hf" / "model.safetensors"))
    b = load_file(str(in_tmp / "back" / "model-00001-of-00001.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert sorted(os.listdir(in_tmp)) == ["back", "hf"]


def test_existing_s3_dst_and_non_megashard_s3_targets_refused(s3, in_tmp):
    write_hf(in_tmp / "hf")
    taken = s3.url("taken/iter_0000001")
    megashard.save({"w": torch.arange(4.0)}, taken)
    before = _objects(s3.url("taken"))
    for dst in (taken, s3.url("taken")):  # the checkpoint itself, and a root that holds one
        with pytest.raises(ConvertInputError, match="exists.*never overwrites") as e:
            convert(str(in_tmp / "hf"), dst)
        assert dst in str(e.value)
    assert _objects(s3.url("taken")) == before
    local = str(in_tmp / "ms")
    megashard.save({"w": torch.arange(4.0)}, local)
    for to in ("tensors", "safetensors", "hf", "torch_dist"):
        with pytest.raises(ConvertInputError, match="writes local files only") as e:
            convert(local, s3.url(f"out.{to}"), to=to)
        assert s3.url(f"out.{to}") in str(e.value)
    store, _ = ObjectStore.for_url(s3.url("x"))
    objects, _ = store.list("")
    assert sorted(o.key[len("taken/"):] for o in objects) == sorted(before)  # nothing else in the bucket
    assert sorted(os.listdir(in_tmp)) == ["hf", "ms"]


def test_a_bucket_without_a_key_prefix_as_dst_is_refused_before_any_request(s3, in_tmp):
    write_hf(in_tmp / "hf")
    before = len(s3.requests())
    with pytest.raises(ConvertInputError, match="key prefix inside the bucket") as e:
        convert(str(in_tmp / "hf"), s3.url())
    assert s3.url() in str(e.value)
    assert len(s3.requests()) == before


def test_a_torch_dist_checkpoint_at_a_url_is_named_with_what_to_do(s3, in_tmp):
    """The hint costs one HEAD (of metadata.json), on the error path only."""
    store, key = ObjectStore.for_url(s3.url("td/iter_0000003"))
    store.put_bytes(f"{key}/metadata.json", b'{"sharded_backend": "torch_dist"}')
    store.put_bytes("td/latest_checkpointed_iteration.txt", b"3")
    for src in (s3.url("td/iter_0000003"), s3.url("td")):
        with pytest.raises(ConvertInputError, match="looks like a torch_dist checkpoint.*copy it to a local path"):
            convert(src, str(in_tmp / "o.tensors"), to="tensors")
    before = len(s3.requests())
    with pytest.raises(ConvertInputError, match="not a megashard checkpoint"):
        convert(s3.url("td/iter_0000003"), str(in_tmp / "o.tensors"), to="tensors")
    heads = [r for r in s3.requests()[before:] if r.get("method") == "HEAD" and "metadata.json" in r.get("path", "")]
    assert len(heads) == 1, s3.requests()[before:]
    assert not os.path.exists(in_tmp / "o.tensors")


def test_s3_source_that_is_not_a_megashard_checkpoint_refused(s3, in_tmp):
    with pytest.raises(ConvertInputError, match="not a megashard checkpoint") as e:
        convert(s3.url("nothing"), str(in_tmp / "o.tensors"), to="tensors")
    assert s3.url("nothing") in str(e.value)
    s3.boto3().put_object(Bucket=s3.bucket, Key="td/metadata.json", Body=b'{"sharded_backend": "torch_dist"}')
    with pytest.raises(ConvertInputError, match="torch_dist checkpoint.*local directory only"):
        convert(s3.url("td"), str(in_tmp / "o"))
    url = s3.url("run")
    _save_root(url)
    with pytest.raises(ConvertInputError, match="iteration 5 is not a megashard checkpoint"):
        convert(url, str(in_tmp / "o.tensors"), to="tensors", iteration=5)
    assert os.listdir(in_tmp) == []


def test_failed_conversion_to_s3_leaves_nothing(s3, in_tmp, monkeypatch):
    """An upload refused midway: the save removes its own objects, convert its local scratch; DST stays absent."""
    import tempfile

    write_hf(in_tmp / "hf")
    scratch = in_tmp / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    url = s3.url("ft")
    s3.inject(status=403, code="AccessDenied", count=1, method="PUT", match=".tensors")
    with pytest.raises(megashard.MegashardError, match="403|AccessDenied"):
        convert(str(in_tmp / "hf"), url)
    assert _objects(url) == {} and storage.locate(f"{url}/release") is None
    assert os.listdir(scratch) == []
    convert(str(in_tmp / "hf"), url)  # and the same DST converts once the store lets it
    assert storage.read_tracker(url) == "release"


@pytest.mark.parametrize("when", ["check", "commit"])
def test_a_checkpoint_created_at_the_s3_dst_during_the_convert_is_never_replaced(s3, in_tmp, monkeypatch, when):
    """Another writer commits DST/release after convert's existence check, before the save plans (``check``)
    or before it commits: the conversion's save is "new only" (If-None-Match on the head), so it fails
    naming DST and theirs stands."""
    from megashard.storage.s3 import checkpoint as objck

    write_hf(in_tmp / "hf")
    url = s3.url("raced")
    theirs = {"w": torch.arange(6.0), "iteration": 3}
    real = getattr(objck.ObjectSave, when)

    def another_writer_first(self, *a, **k):
        monkeypatch.setattr(objck.ObjectSave, when, real)
        megashard.save(theirs, url + "/release")
        return real(self, *a, **k)

    monkeypatch.setattr(objck.ObjectSave, when, another_writer_first)
    with pytest.raises(ConvertInputError, match="appeared") as e:
        convert(str(in_tmp / "hf"), url)
    assert url in str(e.value)
    got = megashard.load({"w": torch.empty(6), "iteration": None}, url + "/release")
    assert torch.equal(got["w"], theirs["w"]) and got["iteration"] == 3
    assert storage.read_tracker(url) is None  # convert wrote no tracker beside their checkpoint
    assert len({n.split("/")[1] for n in _objects(url) if n.count("/") >= 2}) == 1  # only their save's prefix


def test_save_new_only_refuses_a_checkpoint_that_exists_or_appears_in_s3(s3, monkeypatch):
    from megashard.errors import CommitConflictError
    from megashard.storage.s3 import checkpoint as objck

    url = s3.url("newonly/iter_0000001")
    megashard.save({"w": torch.arange(3.0)}, url)
    before = _objects(url)
    with pytest.raises(CommitConflictError, match="exists") as e:
        megashard.save({"w": torch.zeros(3)}, url, new_only=True)
    assert url in str(e.value) and _objects(url) == before
    url2 = s3.url("newonly/iter_0000002")
    real = objck.ObjectSave.commit

    def another_writer_first(self, *a, **k):
        monkeypatch.setattr(objck.ObjectSave, "commit", real)
        megashard.save({"w": torch.arange(3.0)}, url2)
        return real(self, *a, **k)

    monkeypatch.setattr(objck.ObjectSave, "commit", another_writer_first)
    with pytest.raises(CommitConflictError, match="appeared") as e:
        megashard.save({"w": torch.zeros(3)}, url2, new_only=True)
    assert url2 in str(e.value)
    assert torch.equal(megashard.load({"w": torch.empty(3)}, url2)["w"], torch.arange(3.0))

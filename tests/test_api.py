"""megashard.save / megashard.load across spawned gloo ranks (world sizes 1, 2, 4)."""
from __future__ import annotations

import json
import os
import pickle
import signal

import pytest
import torch

import megashard
from megashard import DistributedError, StateDictError
from megashard.api import read_manifest
from megashard.checkpoint_tools import verify_checkpoint
from megashard.sharded import ShardedTensor

from distributed import all_ok, run_ranks
from layouts import Layout, bit_equal, check_state, extras, model_state


# -- rank bodies (top level so spawn can import them) ---------------------------------


def _save_body(rank, world, layout, ckpt, distopt):
    sd = model_state(layout, rank, distopt=distopt)
    sd.update(extras(rank))
    megashard.save(sd, ckpt, layout={"tp": layout.tp, "pp": layout.pp, "vp": layout.vp, "dp": layout.dp})
    return True


def _load_body(rank, world, layout, ckpt, distopt, mode, paths=None):
    from megashard.api import LAST_LOAD_STATS

    sd = model_state(layout, rank, empty=True, distopt=distopt)
    sd.update({"iteration": 0, "rng": torch.zeros(5056, dtype=torch.uint8)})
    path = paths[rank] if paths else ckpt
    out = megashard.load(sd, path, mode=mode)
    bad = check_state(sd)
    same_rank_saved = layout.world == world
    ex = extras(rank)
    return {
        "bad": bad,
        "iteration": out["iteration"],
        "args_lr": out["args"].lr,
        "args_dtype": str(out["args"].dtype),
        "blob_ok": out["blob"] == ex["blob"],
        "note": repr(out["note"]),
        "rng_ok": bool(torch.equal(out["rng"], ex["rng"])) if same_rank_saved else None,
        "rng_inplace": out["rng"] is sd["rng"],
        "stats": dict(LAST_LOAD_STATS.__dict__),
        "returned_tensor_is_template": _first_sharded_identity(sd, out),
    }


def _first_sharded_identity(template, out):
    for name, chunk in template.items():
        if name.startswith("model"):
            for k, sh in chunk.items():
                return out[name][k] is sh.data
    return None


def _save(layout, ckpt, distopt=False):
    if layout.world == 1:
        _save_body(0, 1, layout, ckpt, distopt)
    else:
        all_ok(run_ranks(_save_body, layout.world, layout, ckpt, distopt))


def _load(layout, ckpt, distopt=False, mode="auto", paths=None, env=None):
    if layout.world == 1 and not paths:
        return [_load_body(0, 1, layout, ckpt, distopt, mode)]
    return all_ok(run_ranks(_load_body, layout.world, layout, ckpt, distopt, mode, paths, env=env))


def _assert_loaded(results, exact_rank_state=True):
    for r, res in enumerate(results):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert res["iteration"] == 1234
        assert res["args_lr"] == 3e-4 and res["args_dtype"] == "torch.bfloat16"
        assert res["blob_ok"]
        assert res["returned_tensor_is_template"] is True
        if exact_rank_state:
            assert res["rng_ok"] is True and res["rng_inplace"] is True
            assert res["note"] == repr({"rank": r, 7: "int key", "t": (1, 2.5, None)})


# -- tests -----------------------------------------------------------------------------


def test_single_process_roundtrip(tmp_path):
    lay = Layout()
    ckpt = str(tmp_path / "ckpt")
    _save(lay, ckpt)
    _assert_loaded(_load(lay, ckpt))
    m = read_manifest(ckpt)
    assert m.world_size == 1 and m.layout["tp"] == 1
    assert verify_checkpoint(ckpt) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary directory left behind"


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(pp=2, vp=2), Layout(tp=2, pp=2)], ids=str)
def test_multi_rank_roundtrip_same_layout(tmp_path, layout):
    ckpt = str(tmp_path / "ckpt")
    _save(layout, ckpt)
    _assert_loaded(_load(layout, ckpt))
    m = read_manifest(ckpt)
    # one file per model chunk per writing rank
    model_files = [f for f in m.files if f.startswith("model")]
    assert len(model_files) == layout.world * layout.vp
    assert verify_checkpoint(ckpt) == []


@pytest.mark.parametrize(
    "src,dst",
    [
        (Layout(tp=2), Layout(tp=1)),
        (Layout(tp=1), Layout(tp=4)),
        (Layout(pp=2, vp=2), Layout(pp=1)),
        (Layout(dp=2), Layout(dp=1)),
        (Layout(tp=2), Layout(tp=1, dp=2)),
        (Layout(tp=2, pp=2), Layout(tp=4)),
    ],
    ids=lambda l: f"tp{l.tp}pp{l.pp}vp{l.vp}dp{l.dp}",
)
def test_reshard(tmp_path, src, dst):
    ckpt = str(tmp_path / "ckpt")
    _save(src, ckpt)
    _assert_loaded(_load(dst, ckpt), exact_rank_state=src.world == dst.world)


def test_reshard_distributed_optimizer_flat_ranges(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save(Layout(tp=2, dp=2), ckpt, distopt=True)
    m = read_manifest(ckpt)
    assert any(s.flat for t in m.tensors.values() for s in t.shards)
    _assert_loaded(_load(Layout(tp=1, dp=2), ckpt, distopt=True), exact_rank_state=False)  # flat -> other flat
    _assert_loaded(_load(Layout(tp=4), ckpt, distopt=True), exact_rank_state=False)


def test_dp_dedup_writes_each_byte_once_and_balances(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    lay = Layout(dp=4)
    _save(lay, ckpt)
    m = read_manifest(ckpt)
    for key, t in m.tensors.items():
        total = sum((s.flat[1] - s.flat[0]) if s.flat else int(torch.tensor(s.shape).prod()) for s in t.shards)
        assert total == int(torch.tensor(t.global_shape).prod()), key
    per_rank = {}
    for t in m.tensors.values():
        for s in t.shards:
            r = m.files[s.file]["rank"]
            per_rank[r] = per_rank.get(r, 0) + s.nbytes
    assert len(per_rank) == 4
    mean = sum(per_rank.values()) / 4
    assert max(per_rank.values()) <= 1.25 * mean, per_rank


def test_scatter_one_reader_per_node_hidden_dir(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    lay = Layout(tp=2, dp=2)
    _save(lay, ckpt)
    data_bytes = sum(s.nbytes for t in read_manifest(ckpt).tensors.values() for s in t.shards)
    # ranks 0,1 = node A, ranks 2,3 = node B; only the readers (0 and 2) can see the directory
    env = {"0": {"MEGASHARD_NODE_ID": "A"}, "1": {"MEGASHARD_NODE_ID": "A"},
           "2": {"MEGASHARD_NODE_ID": "B"}, "3": {"MEGASHARD_NODE_ID": "B"}}
    hidden = str(tmp_path / "not-visible-here")
    paths = [ckpt, hidden, ckpt, hidden]
    res = _load(lay, ckpt, mode="auto", paths=paths, env=env)
    _assert_loaded(res)
    stats = [r["stats"] for r in res]
    assert all(s["mode"] == "scatter" for s in stats)
    assert stats[1]["bytes_read"] == 0 and stats[3]["bytes_read"] == 0
    assert stats[1]["bytes_received"] > 0
    # each node needs all model bytes (TP ranks together need everything): read once per node
    for reader in (0, 2):
        assert data_bytes <= stats[reader]["bytes_read"] <= data_bytes + 64 * 1024, (stats[reader], data_bytes)


def test_scatter_small_chunks_bounded_staging(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save(Layout(tp=2), ckpt)
    res = all_ok(run_ranks(_load_small_chunks, 2, ckpt))
    assert res[0]["bad"] == [] and res[1]["bad"] == []


def _load_small_chunks(rank, world, ckpt):
    lay = Layout(tp=1, dp=2)
    sd = model_state(lay, rank, empty=True)
    megashard.load(sd, ckpt, mode="scatter", scatter_chunk_bytes=1000)
    return {"bad": check_state(sd)}


def _failing_save(rank, world, ckpt, how):
    sd = model_state(Layout(tp=2), rank)
    if how == "unsupported" and rank == 1:
        sd["oops"] = object()
    if how == "write" and rank == 1:
        import megashard.api as api

        def boom(*a, **k):
            raise OSError(28, "No space left on device")

        api.write_file = boom
    if how == "sigkill" and rank == 1:
        import megashard.api as api

        real = api.write_file

        def die(tensors, path, **k):
            real(dict(list(tensors.items())[:1]), path, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        api.write_file = die
    try:
        megashard.save(sd, ckpt)
    except DistributedError as e:
        return {"raised": "DistributedError", "failures": sorted(e.failures), "msg": str(e)}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "msg": str(e)}
    return {"raised": None}


@pytest.mark.parametrize("how", ["unsupported", "write"])
def test_failing_rank_makes_every_rank_raise(tmp_path, how):
    ckpt = str(tmp_path / "ckpt")
    _save(Layout(tp=2), ckpt)  # a previous good checkpoint
    before = read_manifest(ckpt).to_json()
    res = all_ok(run_ranks(_failing_save, 2, ckpt, how, timeout=120))
    for r in res:
        assert r["raised"] == "DistributedError" and r["failures"] == [1], r
    assert "rank 1" in res[0]["msg"]
    if how == "unsupported":
        assert "oops" in res[0]["msg"]
    else:
        assert "No space left" in res[0]["msg"]
    assert read_manifest(ckpt).to_json() == before
    _assert_loaded(_load(Layout(tp=2), ckpt))


def test_sigkilled_rank_leaves_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save(Layout(tp=2), ckpt)
    before = read_manifest(ckpt).to_json()
    res = run_ranks(_failing_save, 2, ckpt, "sigkill", timeout=150)
    assert res[1][0] is False  # killed
    # rank 0 must not hang and must not commit
    assert res[0][0] is False or res[0][1]["raised"] is not None
    assert read_manifest(ckpt).to_json() == before
    _assert_loaded(_load(Layout(tp=2), ckpt))


def test_strict_reports_all_mismatches_and_nonstrict_loads_rest(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save(Layout(), ckpt)
    sd = model_state(Layout(), 0, empty=True)
    chunk = sd["model"]
    chunk["extra"] = ShardedTensor("does.not.exist", torch.zeros(3), (3,), (0,))
    k = "decoder.final_layernorm.weight"
    chunk[k] = ShardedTensor(k, torch.zeros(16, dtype=torch.float64), (16,), (0,))
    k2 = "embedding.word_embeddings.weight"
    chunk[k2] = ShardedTensor(k2, torch.zeros(8, 16, dtype=torch.bfloat16), (8, 16), (0, 0))
    with pytest.raises(StateDictError) as ei:
        megashard.load(sd, ckpt)
    msg = str(ei.value)
    assert "does.not.exist" in msg and "dtype mismatch" in msg and "shape mismatch" in msg
    out = megashard.load(sd, ckpt, strict=False)
    assert bit_equal(out["model"]["decoder.layers.0.input_layernorm.weight"],
                     model_state(Layout(), 0)["model"]["decoder.layers.0.input_layernorm.weight"].data)
    assert torch.count_nonzero(chunk["extra"].data) == 0


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('MEGASHARD_PWNED', '/tmp/megashard-pwned')}",))


def test_pickle_payload_is_never_executed(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("MEGASHARD_PWNED", str(marker))
    payload = pickle.dumps(_Evil())
    ckpt = str(tmp_path / "ckpt")
    big = payload + b"\0" * 100_000  # large bytes go into the .tensors file
    megashard.save({"small": payload, "big": big, "w": torch.arange(4.0)}, ckpt)
    # also smuggle the payload into the manifest as a string and into the shard file name
    mpath = os.path.join(ckpt, "manifest.json")
    doc = json.load(open(mpath))
    doc["extra"]["evil"] = payload.decode("latin1")
    json.dump(doc, open(mpath, "w"))

    def no_pickle(*a, **k):
        raise AssertionError("pickle used on a load path")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle.Unpickler, "find_class", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    out = megashard.load({"w": torch.zeros(4)}, ckpt)
    assert out["small"] == payload and out["big"] == big
    assert not marker.exists()

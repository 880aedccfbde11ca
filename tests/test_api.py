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
from tamper import read_manifest_doc, write_manifest_doc
from megashard.checkpoint_tools import verify_checkpoint
from megashard.sharded import ShardedTensor

from distributed import all_ok, run_ranks
from layouts import Layout, bit_equal, check_state, extras, model_state


# -- rank bodies (top level so spawn can import them) ---------------------------------


def _save_body(rank, world, layout, ckpt, distopt, pg=None):
    sd = model_state(layout, rank, distopt=distopt)
    sd.update(extras(rank))
    megashard.save(sd, ckpt, process_group=pg,
                   layout={"tp": layout.tp, "pp": layout.pp, "vp": layout.vp, "dp": layout.dp})
    return True


def _load_body(rank, world, layout, ckpt, distopt, mode, saved_world, pg=None, chunk=None):
    sd = model_state(layout, rank, empty=True, distopt=distopt)
    sd.update({"iteration": 0, "rng": torch.zeros(5056, dtype=torch.uint8)})
    kw = {"scatter_chunk_bytes": chunk} if chunk else {}
    out, stats = megashard.load(sd, ckpt, mode=mode, process_group=pg, return_stats=True, **kw)
    ex = extras(rank)
    return {
        "bad": check_state(sd),
        "iteration": out["iteration"],
        "args_lr": out["args"].lr,
        "args_dtype": str(out["args"].dtype),
        "blob_ok": out["blob"] == ex["blob"],
        "note": repr(out["note"]),
        "rng_ok": bool(torch.equal(out["rng"], ex["rng"])),
        "rng_inplace": out["rng"] is sd["rng"],
        "stats": dict(stats.__dict__),
        "returned_tensor_is_template": _first_sharded_identity(sd, out),
        "same_world": saved_world == layout.world,
    }


def _first_sharded_identity(template, out):
    for name, chunk in template.items():
        if name.startswith("model"):
            for k, sh in chunk.items():
                return out[name][k] is sh.data
    return None


def _assert_loaded(results):
    for r, res in enumerate(results):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert res["iteration"] == 1234
        assert res["args_lr"] == 3e-4 and res["args_dtype"] == "torch.bfloat16"
        assert res["blob_ok"]
        assert res["returned_tensor_is_template"] is True
        assert res["rng_inplace"] is True
        if res["same_world"]:  # rank-local state comes back to the same rank
            assert res["rng_ok"] is True
            assert res["note"] == repr({"rank": r, 7: "int key", "t": (1, 2.5, None)})


def _lid(l):
    return f"tp{l.tp}pp{l.pp}vp{l.vp}dp{l.dp}"


# (name, save layout, load layout, distopt, mode, node ids for the load or None, hide dir from non-readers, chunk)
CASES = [
    ("same_tp2", Layout(tp=2), Layout(tp=2), False, "auto", None, False, None),
    ("same_pp2vp2", Layout(pp=2, vp=2), Layout(pp=2, vp=2), False, "own", None, False, None),
    ("same_tp2pp2", Layout(tp=2, pp=2), Layout(tp=2, pp=2), False, "auto", None, False, None),
    ("tp2_to_tp1", Layout(tp=2), Layout(tp=1), False, "auto", None, False, None),
    ("tp1_to_tp4", Layout(tp=1), Layout(tp=4), False, "auto", None, False, None),
    ("pp2vp2_to_pp1", Layout(pp=2, vp=2), Layout(pp=1), False, "auto", None, False, None),
    ("dp2_to_dp1", Layout(dp=2), Layout(dp=1), False, "auto", None, False, None),
    ("tp2_to_tp1dp2", Layout(tp=2), Layout(tp=1, dp=2), False, "auto", None, False, None),
    ("tp2pp2_to_tp4", Layout(tp=2, pp=2), Layout(tp=4), False, "auto", None, False, None),
    ("distopt_tp2dp2_to_tp1dp2", Layout(tp=2, dp=2), Layout(tp=1, dp=2), True, "auto", None, False, None),
    ("distopt_tp2dp2_to_tp4", Layout(tp=2, dp=2), Layout(tp=4), True, "auto", None, False, None),
    ("dedup_dp4", Layout(dp=4), Layout(dp=4), False, "auto", None, False, None),
    ("scatter_hidden_2nodes", Layout(tp=2, dp=2), Layout(tp=2, dp=2), False, "auto", ["A", "A", "B", "B"], True, None),
    ("scatter_reshard_small_chunks", Layout(tp=2), Layout(tp=1, dp=2), False, "scatter", None, False, 1000),
]


def _scenarios(rank, world, base):
    """Every save/load case in one world of 4 ranks, using subgroups for smaller layouts."""
    import torch.distributed as dist

    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 4)}
    out = {}
    for name, src, dst, distopt, mode, nodes, hide, chunk in CASES:
        ckpt = os.path.join(base, name)
        if rank < src.world:
            _save_body(rank, src.world, src, ckpt, distopt, groups[src.world])
        dist.barrier()
        if nodes:
            os.environ["MEGASHARD_NODE_ID"] = nodes[rank]
        path = ckpt
        if hide and nodes and nodes.index(nodes[rank]) != rank:
            path = os.path.join(base, "not-visible-" + str(rank))  # only node readers see the files
        if rank < dst.world:
            out[name] = _load_body(rank, dst.world, dst, path, distopt, mode, src.world, groups[dst.world], chunk)
        os.environ.pop("MEGASHARD_NODE_ID", None)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("scenarios"))
    res = all_ok(run_ranks(_scenarios, 4, base, timeout=400))
    return base, {name: [r[name] for r in res if name in r] for name, *_ in CASES}


# -- tests -----------------------------------------------------------------------------


def test_single_process_roundtrip(tmp_path):
    lay = Layout()
    ckpt = str(tmp_path / "ckpt")
    _save_body(0, 1, lay, ckpt, False)
    _assert_loaded([_load_body(0, 1, lay, ckpt, False, "auto", 1)])
    m = read_manifest(ckpt)
    assert m.world_size == 1 and m.layout["tp"] == 1
    assert verify_checkpoint(ckpt) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary directory left behind"


def test_plain_tensors_with_dotted_keys_and_one_shape_round_trip(tmp_path):
    """A plain state dict (``{"layer.0.weight": t, ...}``, tensors of one shape and dtype) saves and
    loads bit-exact. The state tree's per-key parts were shared by content when a key held a dot
    (its tensor's path was split at the dot, so the part was not taken for this rank's own): every
    same-shaped tensor then named one file entry and the load refused the checkpoint as forged.
    Nested dicts, whose paths also join keys with dots, and a key that is a prefix of another too."""
    flat = {f"layer.{i}.weight": torch.full((4, 3), float(i)) for i in range(5)}
    flat.update({"m0.w": torch.zeros(4, 3), "m0": torch.ones(4, 3), "emb": torch.arange(12.0).view(4, 3)})
    nested = {"model": {f"l{i}": {"w": torch.full((2,), float(i))} for i in range(3)}, "m.x": torch.ones(2)}
    for name, state in (("flat", flat), ("nested", nested)):
        megashard.save(state, tmp_path / name)
        got = megashard.load(_empty_like(state), tmp_path / name)
        assert _leaves(got).keys() == _leaves(state).keys()
        assert all(bit_equal(a, _leaves(state)[k]) for k, a in _leaves(got).items()), name
        assert verify_checkpoint(str(tmp_path / name)) == []


def _leaves(state, prefix=()):
    if isinstance(state, dict):
        return {k2: v2 for k, v in state.items() for k2, v2 in _leaves(v, prefix + (k,)).items()}
    return {prefix: state}


def _empty_like(state):
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    return torch.empty_like(state)


@pytest.mark.parametrize("name", ["same_tp2", "same_pp2vp2", "same_tp2pp2"])
def test_multi_rank_roundtrip_same_layout(scenarios, name):
    base, res = scenarios
    case = next(c for c in CASES if c[0] == name)
    _assert_loaded(res[name])
    assert all(r["stats"]["mode"] == "own" for r in res[name])
    m = read_manifest(os.path.join(base, name))
    model_files = [f for f in m.files if f.startswith("model")]
    assert len(model_files) == case[1].world * case[1].vp  # one file per model chunk per rank
    assert verify_checkpoint(os.path.join(base, name)) == []


@pytest.mark.parametrize("name", [c[0] for c in CASES if "_to_" in c[0]])
def test_reshard(scenarios, name):
    base, res = scenarios
    case = next(c for c in CASES if c[0] == name)
    assert len(res[name]) == case[2].world
    _assert_loaded(res[name])
    if case[3]:
        m = read_manifest(os.path.join(base, name))
        assert any(s.flat for t in m.tensors.values() for s in t.shards)


def test_own_mode_reads_only_needed_bytes(scenarios):
    base, res = scenarios
    # same layout: each rank reads exactly its own shards' bytes, not whole files of others
    m = read_manifest(os.path.join(base, "same_tp2"))
    total = sum(s.nbytes for t in m.tensors.values() for s in t.shards)
    replicated = sum(s.nbytes for k, t in m.tensors.items() for s in t.shards if "layernorm" in k)
    rng_bytes = 5056  # the rank-local RNG tensor
    expect = (total - replicated) // 2 + replicated + rng_bytes
    assert [r["stats"]["bytes_read"] for r in res["same_tp2"]] == [expect, expect]


def test_dp_dedup_writes_each_byte_once_and_balances(scenarios):
    base, res = scenarios
    m = read_manifest(os.path.join(base, "dedup_dp4"))
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


def test_scatter_one_reader_per_node_hidden_dir(scenarios):
    base, res = scenarios
    name = "scatter_hidden_2nodes"
    _assert_loaded(res[name])
    m = read_manifest(os.path.join(base, name))
    data_bytes = sum(s.nbytes for t in m.tensors.values() for s in t.shards)
    stats = [r["stats"] for r in res[name]]
    assert all(s["mode"] == "scatter" for s in stats)
    # the non-readers (which cannot see the directory) read their own bytes through the reader's
    # descriptors and receive the replicated ones through shared memory
    assert stats[1]["bytes_read"] > 0 and stats[3]["bytes_read"] > 0
    assert stats[1]["bytes_received"] > 0 and stats[3]["bytes_received"] > 0
    # each node's TP ranks together need every model byte: read once per node, never twice
    for reader in (0, 2):
        node_read = stats[reader]["bytes_read"] + stats[reader + 1]["bytes_read"]
        assert data_bytes <= node_read <= data_bytes + 64 * 1024, (stats[reader], stats[reader + 1], data_bytes)


def test_scatter_small_chunks(scenarios):
    base, res = scenarios
    _assert_loaded(res["scatter_reshard_small_chunks"])
    # TP1·DP2: both ranks need the whole model (through the reader's ring); rank 1 reads only its
    # rank-local RNG state (5056 bytes), which no other rank needs, through the reader's descriptor
    assert res["scatter_reshard_small_chunks"][1]["stats"]["bytes_read"] == 5056


def _failing_save(rank, world, ckpt, how):
    sd = model_state(Layout(tp=2), rank)
    sd.update(extras(rank))
    megashard.save(sd, ckpt)  # a previous good checkpoint
    from megashard.api import read_manifest as _rm

    before = json.dumps(_rm(ckpt).to_doc()) if rank == 0 else None
    if before is not None:
        with open(ckpt + ".before", "w") as f:
            f.write(before)
    if how == "unsupported" and rank == 1:
        sd["oops"] = object()
    if how == "write" and rank == 1:
        import megashard.saving as api

        def boom(*a, **k):
            raise OSError(28, "No space left on device")

        api.write_file = boom
    if how == "sigkill" and rank == 1:
        import megashard.saving as api

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
    res = all_ok(run_ranks(_failing_save, 2, ckpt, how, timeout=120))
    for r in res:
        assert r["raised"] == "DistributedError" and r["failures"] == [1], r
    assert "rank 1" in res[0]["msg"]
    if how == "unsupported":
        assert "oops" in res[0]["msg"]
    else:
        assert "No space left" in res[0]["msg"]
    assert json.dumps(read_manifest(ckpt).to_doc()) == open(ckpt + ".before").read()
    _assert_loaded([_load_body(0, 1, Layout(tp=1), ckpt, False, "auto", 2)])


def test_sigkilled_rank_leaves_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    res = run_ranks(_failing_save, 2, ckpt, "sigkill", timeout=150)
    assert res[1][0] is False  # killed
    # rank 0 must not hang and must not commit
    assert res[0][0] is False or res[0][1]["raised"] is not None
    assert json.dumps(read_manifest(ckpt).to_doc()) == open(ckpt + ".before").read()
    _assert_loaded([_load_body(0, 1, Layout(tp=1), ckpt, False, "auto", 2)])


def test_strict_reports_all_mismatches_and_nonstrict_loads_rest(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save_body(0, 1, Layout(), ckpt, False)
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
    doc = read_manifest_doc(ckpt)
    doc["extra"]["evil"] = payload.decode("latin1")
    write_manifest_doc(ckpt, doc)

    def no_pickle(*a, **k):
        raise AssertionError("pickle used on a load path")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    out = megashard.load({"w": torch.zeros(4)}, ckpt)
    assert out["small"] == payload and out["big"] == big
    out = megashard.load({"w": torch.zeros(4), "big": b""}, ckpt)
    assert out["small"] == payload and out["big"] == big
    assert not marker.exists()


def test_row_parallel_reshard_reads_runs_in_place(tmp_path):
    """A last-dim TP split loaded unsplit (and re-split) takes the run-by-run path: bit-exact."""
    g = torch.randn(3, 64, 1024).to(torch.bfloat16)
    ckpt = str(tmp_path / "ckpt")
    megashard.save({f"p{i}": ShardedTensor("w", g[:, :, i * 512:(i + 1) * 512].clone(), (3, 64, 1024), (0, 0, i * 512))
                    for i in range(2)}, ckpt)
    dest = torch.nn.Parameter(torch.zeros(3, 64, 1024, dtype=torch.bfloat16))
    megashard.load({"w": ShardedTensor("w", dest, (3, 64, 1024), (0, 0, 0))}, ckpt)
    assert bit_equal(dest.data, g)
    part = torch.zeros(3, 64, 256, dtype=torch.bfloat16)
    megashard.load({"w": ShardedTensor("w", part, (3, 64, 1024), (0, 0, 384))}, ckpt)
    assert bit_equal(part, g[:, :, 384:640])

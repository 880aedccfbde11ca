"""Fast, single-process checks of megashard.megatron's building blocks (no torchrun)."""
from __future__ import annotations

import argparse
import json
import random
import types

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

import megashard.megatron as msm  # noqa: E402
from megashard.megatron import checkpointing as ck  # noqa: E402
from megashard.megatron import state as st  # noqa: E402


def test_add_arguments_flags_and_defaults():
    p = msm.add_arguments(argparse.ArgumentParser())
    a = p.parse_args([])
    assert (a.save_format, a.megashard_load_mode, a.megashard_verify_on_load, a.megashard_strict_load) == (
        None, "auto", False, True)
    a = p.parse_args(["--save-format", "tensors", "--megashard-load-mode", "scatter",
                      "--megashard-verify-on-load", "--megashard-non-strict-load"])
    assert (a.save_format, a.megashard_load_mode, a.megashard_verify_on_load, a.megashard_strict_load) == (
        "tensors", "scatter", True, False)
    assert p.parse_args(["--megashard-direct-io"]).megashard_direct_io is True
    assert a.megashard_direct_io is False
    assert p.parse_args(["--megashard-no-sha256"]).megashard_sha256 is False
    assert a.megashard_sha256 is None  # not given: MEGASHARD_SHA256 decides (default on)
    with pytest.raises(SystemExit):
        p.parse_args(["--save-format", "zarr"])
    # usable as extra_args_provider: returns the parser, safe to apply twice
    assert msm.add_arguments(p) is p


@pytest.mark.parametrize("flag,want", [([], None), (["--megashard-no-sha256"], False)])
def test_save_checkpoint_passes_the_sha256_flag(monkeypatch, tmp_path, flag, want):
    calls = []
    monkeypatch.setattr(ck, "_saved_state", lambda *a: ({"x": torch.ones(2)}, {}, {}))
    monkeypatch.setattr(ck, "_api", lambda: types.SimpleNamespace(
        save=lambda sd, ckpt, file_stems=None, layout=None, direct_io=False, sha256=None: calls.append(sha256)))
    monkeypatch.setattr(ck, "commit_tracker", lambda *a: None)
    args = msm.add_arguments(argparse.ArgumentParser()).parse_args(flag)
    args.save = str(tmp_path)
    ck.save_checkpoint(1, None, None, None, 0, args=args)
    assert calls == [want]


def test_model_keys_use_vp_stage():
    chunks = [types.SimpleNamespace(vp_stage=1), types.SimpleNamespace(vp_stage=0)]
    assert st.model_keys(chunks) == ["model1", "model0"]
    assert st.model_keys([types.SimpleNamespace(vp_stage=0)]) == ["model"]


def test_file_stems_one_file_per_chunk():
    chunks = [types.SimpleNamespace(vp_stage=0), types.SimpleNamespace(vp_stage=1)]
    layout = {"tp": 2, "tp_rank": 1, "pp": 2, "pp_rank": 1, "dp": 1, "dp_rank": 0, "ep": 1, "ep_rank": 0}
    assert ck.file_stems(chunks, layout) == {
        "model0": "model_tp01_pp001_vp0", "model1": "model_tp01_pp001_vp1", "__rest__": "state_tp01_pp001"}
    layout.update(ep=2, ep_rank=1)
    assert ck.file_stems(chunks[:1], layout)["model"] == "model_tp01_pp001_vp0_ep001"


def test_checkpoint_dir_and_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.2")  # the checkpoint the tracker names is waited for this long
    assert ck.checkpoint_dir(str(tmp_path), 10).endswith("iter_0000010")
    assert ck.read_tracker(str(tmp_path)) == (-1, False)
    ck.write_tracker(str(tmp_path), 42)
    assert ck.read_tracker(str(tmp_path)) == (42, False)
    assert ck.find_checkpoint(str(tmp_path)) is None  # tracker but no megashard checkpoint


def test_args_are_stored_as_json_values():
    ns = argparse.Namespace(num_layers=4, params_dtype=torch.bfloat16, lr=1e-3, fn=print, groups=[1, (2, 3)],
                            pg=object())
    out = st.jsonable_args(ns)
    assert out.num_layers == 4 and out.params_dtype is torch.bfloat16 and out.groups == [1, (2, 3)]
    assert out.fn.startswith("<unrepresentable") and out.pg.startswith("<unrepresentable")


def test_rng_state_roundtrip_is_json_and_exact():
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    g = torch.Generator().manual_seed(7)
    tracker.set_states({"model-parallel-rng": g.get_state()})
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    saved = st.capture_rng_state()
    json.dumps(saved)  # plain JSON, no pickle
    expect = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(9).get_state()})
    st.restore_rng_state(saved)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    assert torch.equal(tracker.get_states()["model-parallel-rng"], g.get_state())
    tracker.reset()


def test_nonpersistent_objects_removed_and_restored():
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    sd = {"optimizer": {"param_groups": [{"lr": 1.0, "params": LocalNonpersistentObject([0, 1])}]}}
    prepared = st.prepare_for_load(sd)
    assert prepared.request == {"optimizer": {"param_groups": [{"lr": 1.0}]}}
    loaded = {"optimizer": {"param_groups": [{"lr": 0.5}]}}
    out = st.finish_load(loaded, prepared)
    assert out == {"optimizer": {"param_groups": [{"lr": 0.5, "params": [0, 1]}]}}


def test_scalar_tensors_restored_from_numbers():
    tmpl = {"optimizer": {"state": {"common_step": torch.tensor(0.0)}}}
    loaded = {"optimizer": {"state": {"common_step": 7.0}}}
    st.restore_scalar_tensors(loaded, tmpl)
    assert torch.equal(loaded["optimizer"]["state"]["common_step"], torch.tensor(7.0))


def _swiglu_template(w: torch.Tensor) -> dict:
    """A model template holding one SwiGLU fc1 weight as megatron-core builds it (a factory)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    sh = ShardedTensor.from_rank_offsets("decoder.layers.0.mlp.linear_fc1.weight", w, (0, 0, 1))
    return {"model": {"decoder.layers.0.mlp.linear_fc1.weight": apply_swiglu_sharded_factory(sh, ())},
            "other": {"n": 3}}


def test_swiglu_merge_is_elided_when_the_load_filled_the_weight_in_place(tmp_path):
    """The load fills the factory's own tensor through its two halves; the merge (torch.cat)
    is left out and the weight itself is the result: same values, no second copy. A merge
    whose parts are not in-place views still runs."""
    import megashard

    saved = torch.randn(8, 4)
    megashard.save(st.prepare_for_save(_swiglu_template(saved)), str(tmp_path / "ckpt"))
    key = "decoder.layers.0.mlp.linear_fc1.weight"

    dest = torch.zeros(8, 4)
    prepared = st.prepare_for_load(_swiglu_template(dest))
    loaded = st.finish_load(megashard.load(prepared.request, str(tmp_path / "ckpt")), prepared)
    assert loaded["model"][key] is dest  # not a concatenated copy
    assert torch.equal(dest, saved) and loaded["other"] == {"n": 3}

    prepared = st.prepare_for_load(_swiglu_template(torch.zeros(8, 4)))
    loaded = megashard.load(prepared.request, str(tmp_path / "ckpt"))
    halves = loaded["model"][key]
    loaded["model"][key] = [h.clone() for h in halves]  # parts that are not views of the weight
    merged = st.finish_load(loaded, prepared)["model"][key]
    assert merged is not prepared.factory_template["model"][key].data and torch.equal(merged, saved)


def test_tiles_in_order_checks_memory_order_and_shape():
    w = torch.arange(24.0).reshape(6, 4)
    a, b = torch.chunk(w, 2)
    assert st._tiles_in_order([a, b], w)
    assert not st._tiles_in_order([b, a], w)  # out of order
    assert not st._tiles_in_order([a], w)  # does not cover it
    assert not st._tiles_in_order([a, b.clone()], w)  # another tensor's memory
    assert not st._tiles_in_order([a, b.double()], w)
    assert not st._tiles_in_order(list(torch.chunk(w, 2, dim=1)), w)  # dim 1 halves are not a dim 0 cat
    flat = torch.arange(10.0)
    assert st._tiles_in_order(list(torch.chunk(flat, 2)), flat)  # DistributedOptimizer's flat fragments


def test_a_url_is_never_taken_for_a_local_load_directory(monkeypatch):
    """``--load s3://...`` used to read no tracker at ``./s3:/...`` and start from random init;
    an unusable URL is refused, and install() routing hands URLs other than s3:// (Megatron's
    msc:// for torch_dist) to Megatron's loader untouched."""
    from megashard import MegashardError
    from megashard.megatron import hooks

    with pytest.raises(MegashardError, match="not an object-store URL"):
        ck.resolve_load("gs://bucket/run")
    calls = []

    def original(*a, **k):
        calls.append(a)
        return "megatron's"

    monkeypatch.setattr(hooks, "_megatron_args", lambda: types.SimpleNamespace(load="msc://profile/run",
                                                                                 pretrained_checkpoint=None))
    assert hooks.make_load_wrapper(original)(None, None, None) == "megatron's" and len(calls) == 1


def test_example_writes_each_line_in_one_write(monkeypatch):
    """Ranks share torchrun's stdout: a line written as text then newline (``print``) let another rank's
    line land in between ("done at iteration 6iteration 6 | loss ..."), and the loss went unparsed."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "pretrain_gpt.py")
    spec = importlib.util.spec_from_file_location("example_pretrain_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    writes = []

    class Out:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr(example.sys, "stdout", Out())
    example.say("iteration 6 | loss 4.8 | lr 0.0001 | grad-norm 1.07")
    assert writes == ["iteration 6 | loss 4.8 | lr 0.0001 | grad-norm 1.07\n"]


@pytest.mark.parametrize("fmt", ["hf", "torch_dist"])
def test_load_of_a_torch_dist_or_hf_directory_names_convert_not_random_init(tmp_path, monkeypatch, fmt):
    """``--load`` naming a Hugging Face or torch_dist directory (no tracker) used to start from random
    init; both load paths (megashard's own and the Megatron-LM hook) refuse, naming the convert command."""
    from megashard import MegashardError
    from megashard.megatron import hooks

    d = tmp_path / fmt
    d.mkdir()
    if fmt == "hf":
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(b"\0" * 16)
    else:
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
        (d / "common.pt").write_bytes(b"not a pickle")
    target = ck.resolve_load(str(d))
    assert target.foreign == fmt and target.checkpoint is None
    want = f"--load {d}: it is a"
    with pytest.raises(MegashardError) as e:
        ck.load_checkpoint(None, None, None, args=types.SimpleNamespace(load=str(d)))
    assert str(e.value).startswith(want) and f"`megashard convert {d} NEW_DIR`" in str(e.value)
    calls = []
    monkeypatch.setattr(hooks, "_megatron_args", lambda: types.SimpleNamespace(load=str(d), pretrained_checkpoint=None))
    with pytest.raises(MegashardError) as e:
        hooks.make_load_wrapper(lambda *a, **k: calls.append(a))(None, None, None)
    assert str(e.value).startswith(want) and not calls
    assert ck.resolve_load(str(tmp_path / "new")).foreign is None  # an empty --load still starts fresh


def test_resolve_load_waits_for_the_checkpoint_its_tracker_names(tmp_path, monkeypatch):
    """Resume on a node whose shared mount lags another node's commit: the tracker it reads names
    iter_N, which does not show yet; resolve_load waits for it (bounded by MEGASHARD_FS_WAIT_S)
    instead of answering "no checkpoint". A --ckpt-step the user names is looked up once."""
    import os
    import threading
    import time

    import megashard

    root = tmp_path / "root"
    it = root / "iter_0000002"
    megashard.save({"w": torch.arange(4.0)}, str(it))
    (root / ck.TRACKER_FILENAME).write_text("2")
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "10")
    os.rename(it, str(it) + ".hidden")
    t = threading.Timer(0.4, lambda: os.rename(str(it) + ".hidden", it))
    t.start()
    try:
        target = ck.resolve_load(str(root))
    finally:
        t.join()
    assert target.checkpoint == str(it) and target.seen_by == 1 and target.iteration == 2
    assert torch.equal(megashard.load({"w": torch.zeros(4)}, target.checkpoint)["w"], torch.arange(4.0))
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.3")
    (root / ck.TRACKER_FILENAME).write_text("5")  # names a checkpoint that never shows
    t0 = time.monotonic()
    target = ck.resolve_load(str(root))
    assert target.checkpoint is None and target.iteration == 5 and "iter_0000005" in target.why
    assert time.monotonic() - t0 >= 0.3
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "30")
    t0 = time.monotonic()
    assert ck.resolve_load(str(root), ckpt_step=7).checkpoint is None
    assert time.monotonic() - t0 < 10

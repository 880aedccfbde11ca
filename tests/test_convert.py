"""megashard convert: every direction, bit-exact, in one process; wrong inputs exit 2 with DST untouched."""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import megashard
from megashard import saveroot, storage
from megashard.convert import ConvertInputError, _megatron_core, convert
from megashard.sharded import is_main_replica

from layouts import EXP_AVG, GLOBALS, Layout, bit_equal, expected_global, full, model_state, union_state

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def megatron_root(tmp_path_factory):
    """A Megatron save directory: iter 5 and iter 10 (tracker), TP=2 x DP=2, distributed-optimizer state."""
    root = str(tmp_path_factory.mktemp("conv") / "save")
    for it in (5, 10):
        sd = union_state(Layout(tp=2, dp=2), distopt=True)
        sd.update(iteration=it, args=argparse.Namespace(lr=3e-4, name="toy"), rng=torch.arange(5) + it)
        megashard.save(sd, os.path.join(root, saveroot.iteration_dir_name(it)))
    storage.write_tracker(root, 10)
    return root


def _torch_dist_shards(layout: Layout):
    """megatron-core ShardedTensors of every rank of ``layout`` (main replicas), for a world of one."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for r in range(layout.world):
        for name, chunk in model_state(layout, r).items():
            for path, sh in chunk.items():
                if not is_main_replica(sh.replica_id):
                    continue
                frag = tuple(g // c for g, c in zip(sh.global_shape, sh.chunk_shape))
                out[f"{name}.{path}.r{r}"] = ShardedTensor(
                    sh.key, sh.data, sh.dtype, tuple(sh.local_shape), tuple(sh.global_shape), tuple(sh.global_offset),
                    frag, replica_id=0, prepend_axis_num=sh.prepend_axis_num)
    return out


def test_megashard_to_tensors_read_by_tensorizer_with_hashes(megatron_root, tmp_path):
    from tensorizer import TensorDeserializer

    dst = str(tmp_path / "model.tensors")
    res = convert(megatron_root, dst, to="tensors")
    assert res.iteration == 10 and res.tensors == 2 * len(GLOBALS)
    assert res.bytes == sum(expected_global(k).numel() * expected_global(k).element_size() for k in GLOBALS) + sum(
        expected_global(EXP_AVG + k).numel() * 4 for k in GLOBALS)
    with TensorDeserializer(dst, device="cpu", verify_hash=True) as d:
        got = {k: d[k].clone() for k in d.keys()}
    assert len(got) == 2 * len(GLOBALS)
    for k, t in got.items():
        assert bit_equal(t, expected_global(k)), k
    assert any("args" in x for x in res.dropped)


def test_megashard_to_safetensors_keys_and_iteration(megatron_root, tmp_path, capsys):
    from safetensors import safe_open

    dst = str(tmp_path / "model.safetensors")
    res = convert(megatron_root, dst, to="safetensors", keys=["decoder.*"], iteration=5, progress=True)
    assert res.iteration == 5
    assert "megashard -> safetensors" in capsys.readouterr().err  # the tqdm bar (forced on; default: TTY only)
    with safe_open(dst, "pt") as f:
        keys = sorted(f.keys())
        assert f.metadata()["iteration"] == "5"
        got = {k: f.get_tensor(k) for k in keys}
    assert keys == sorted(k for k in GLOBALS if k.startswith("decoder."))
    for k, t in got.items():
        assert bit_equal(t, full(k)), k


def test_megashard_torch_dist_megashard_round_trip(megatron_root, tmp_path):
    """megashard -> torch_dist (Megatron layout + tracker); megatron-core loads it as TP=4 shards and as
    full tensors; back to megashard, which loads as TP=1 and equals the source bit for bit."""
    td = str(tmp_path / "td")
    res = convert(megatron_root, td, to="torch_dist")
    assert res.tensors == 2 * len(GLOBALS)
    assert storage.read_tracker(td) == 10
    assert sorted(os.listdir(td)) == ["iter_0000010", saveroot.TRACKER_NAME]
    ck = os.path.join(td, "iter_0000010")
    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        from megatron.core.dist_checkpointing import serialization

        common = serialization.load_common_state_dict(ck)
        assert common["iteration"] == 10 and common["args"].lr == 3e-4
        assert torch.equal(common["rng"], torch.arange(5) + 10)
        # TP=4 pieces of the embedding (the checkpoint holds it unsharded), in a world of one
        k = "embedding.word_embeddings.weight"
        emb = full(k)
        req = {f"p{i}": ShardedTensor.from_rank_offsets(k, torch.empty_like(emb[i * 16:(i + 1) * 16]), (0, i, 4))
               for i in range(4)}
        got = dc.load(req, ck)
        for i in range(4):
            assert bit_equal(got[f"p{i}"], emb[i * 16:(i + 1) * 16])
        # full tensors, including the flattened distributed-optimizer state
        meta = dc.load_tensors_metadata(ck)
        assert set(meta) == set(megashard.read_manifest(os.path.join(megatron_root, "iter_0000010")).tensors)
        fulls = dc.load({k: ShardedTensor.from_rank_offsets(k, torch.empty(m.global_shape, dtype=m.dtype))
                         for k, m in meta.items()}, ck)
        for k in meta:
            assert bit_equal(fulls[k], expected_global(k)), k
    back = str(tmp_path / "back")
    res2 = convert(td, back)
    assert storage.read_tracker(back) == 10
    src = megashard.load_consolidated(os.path.join(megatron_root, "iter_0000010"))
    dst = megashard.load_consolidated(os.path.join(back, "iter_0000010"))
    assert set(src) == set(dst) and res2.tensors == len(src)
    for k in src:
        assert bit_equal(src[k], dst[k]), k
    # and into a TP=1 template with megashard.load (no process group)
    tmpl = model_state(Layout(tp=1), 0, empty=True)
    tmpl.update(rng=torch.zeros(5, dtype=torch.int64))
    out = megashard.load(tmpl, os.path.join(back, "iter_0000010"))
    for path, sh in tmpl["model"].items():
        assert bit_equal(sh.data, full(sh.key)[tuple(slice(o, o + c) for o, c in zip(sh.global_offset, sh.chunk_shape))]
                         .reshape(sh.local_shape)), path
    assert torch.equal(out["rng"], torch.arange(5) + 10)
    assert out["args"].name == "toy" and out["iteration"] == 10


def test_torch_dist_made_by_megatron_core_to_megashard(tmp_path):
    """A torch_dist checkpoint written by dist_checkpointing.save (TP=2 shards, a ShardedObject, common state)."""
    ck = str(tmp_path / "td")
    os.makedirs(ck)
    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        def megatron_rng(i):  # what Megatron-LM's get_rng_state() puts in each rng_state shard
            random.seed(i)
            np.random.seed(i)
            return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                     "torch_rng_state": torch.manual_seed(i).get_state(), "cuda_rng_state": None,
                     "rng_tracker_states": {"model-parallel-rng": torch.manual_seed(100 + i).get_state()},
                     "seed": i}]

        sd = {"model": _torch_dist_shards(Layout(tp=2)),
              "rng_state": [ShardedObject("rng_state", megatron_rng(i), (1, 2), (0, i), replica_id=0)
                            for i in range(2)],
              "iteration": 77, "args": argparse.Namespace(tensor_model_parallel_size=2),
              "optimizer": {"param_groups": [{"lr": 0.5, "params": [0, 1]}]}}
        dc.save(sd, ck)
    dst = str(tmp_path / "ms")
    res = convert(ck, dst)
    assert res.source_format == "torch_dist" and res.tensors == len(GLOBALS)
    cons = megashard.load_consolidated(dst)
    assert set(cons) == set(GLOBALS)
    for k, t in cons.items():
        assert bit_equal(t, full(k)), k
    only = str(tmp_path / "only_embedding")
    assert convert(ck, only, keys=["embedding.*"]).tensors == 1
    assert list(megashard.load_consolidated(only)) == ["embedding.word_embeddings.weight"]
    common = megashard.load_common(dst, ["iteration", "args", "optimizer"])
    assert common["iteration"] == 77 and common["args"].tensor_model_parallel_size == 2
    assert common["optimizer"]["param_groups"][0]["lr"] == 0.5

    class _Obj:  # a ShardedObject template, duck-typed like megatron-core's
        def __init__(self, i):
            self.key, self.data, self.global_shape, self.global_offset, self.replica_id = (
                "rng_state", None, (1, 2), (0, i), 0)

    _Obj.__name__ = "ShardedObject"
    out = megashard.load({"a": _Obj(0), "b": _Obj(1)}, dst)
    for i, name in enumerate("ab"):
        want, got = megatron_rng(i)[0], out[name][0]
        assert got["seed"] == i and got["cuda_rng_state"] is None
        assert got["random_rng_state"] == want["random_rng_state"]
        assert got["np_rng_state"][0] == "MT19937" and np.array_equal(got["np_rng_state"][1], want["np_rng_state"][1])
        assert tuple(got["np_rng_state"][2:]) == tuple(want["np_rng_state"][2:])
        assert torch.equal(got["torch_rng_state"], want["torch_rng_state"])
        assert torch.equal(got["rng_tracker_states"]["model-parallel-rng"],
                           want["rng_tracker_states"]["model-parallel-rng"])


def _cli(capsys, *args):
    """``megashard convert ...`` in-process: (exit code, stdout, stderr)."""
    from megashard.cli import main

    try:
        rc = main(["convert", *args])
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_wrong_inputs_exit_2_and_leave_dst_untouched(megatron_root, tmp_path, capsys):
    notckpt = tmp_path / "notckpt"
    notckpt.mkdir()
    (notckpt / "x.txt").write_text("hi")
    r = subprocess.run([sys.executable, "-m", "megashard", "convert", str(notckpt), str(tmp_path / "o1")],
                       capture_output=True, text=True, timeout=120)  # the real process exit code
    assert r.returncode == 2 and "is not a checkpoint" in r.stderr
    assert not (tmp_path / "o1").exists()
    existing = tmp_path / "exists.tensors"
    existing.write_bytes(b"keep me")
    rc, _, err = _cli(capsys, megatron_root, str(existing), "--to", "tensors")
    assert rc == 2 and "exists" in err and existing.read_bytes() == b"keep me"
    rc, _, err = _cli(capsys, megatron_root, str(tmp_path / "o2"), "--to", "onnx")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = _cli(capsys, megatron_root, str(tmp_path / "o3"), "--iteration", "7")
    assert rc == 2 and "iter_0000007" in err
    rc, _, err = _cli(capsys, os.path.join(megatron_root, "iter_0000010"), str(tmp_path / "o4"), "--to", "megashard")
    assert rc == 2 and "is a megashard checkpoint already" in err and "`megashard copy " in err
    rc, _, err = _cli(capsys, megatron_root, str(tmp_path / "o5"), "--to", "tensors", "--keys", "nope*")
    assert rc == 2 and "nope" in err
    rc, _, err = _cli(capsys, megatron_root, str(tmp_path / "o6"), "--to", "torch_dist", "--keys", "nope*")
    assert rc == 2 and "nope" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.tensors", "notckpt"]  # no temporaries left
    # a good run prints one summary line (stdout is not a TTY: no progress bar)
    rc, out, err = _cli(capsys, os.path.join(megatron_root, "iter_0000005"), str(tmp_path / "m.safetensors"),
                        "--to", "safetensors")
    assert rc == 0, err
    assert out.count("\n") == 1 and out.startswith("converted ") and "GB/s" in out
    assert "\r" not in err


def test_convert_api_refuses_existing_dst(megatron_root, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(ConvertInputError, match="exists"):
        convert(megatron_root, str(d), to="torch_dist")
    assert list(d.iterdir()) == []


def test_failure_midway_leaves_no_dst_and_no_temporaries(megatron_root, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(os.path.join(megatron_root, "iter_0000010"), src)
    m = megashard.read_manifest(str(src))
    victim = sorted(m.files)[0]
    with open(src / victim, "r+b") as f:
        f.truncate(m.files[victim]["bytes"] - 100)  # a damaged shard file
    for to, dst in (("tensors", "x.tensors"), ("torch_dist", "x_td")):
        with pytest.raises(megashard.MegashardError, match=victim) as e:
            convert(str(src), str(tmp_path / dst), to=to)
        assert not isinstance(e.value, ConvertInputError)  # damaged input: exit code 1, not a usage error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_killed_conversion_leaves_a_temp_dir_that_cleanup_knows_is_dead(megatron_root, tmp_path):
    """convert's temporary directory carries the owner record a save's has: after a SIGKILL, ``recover``'s
    clean-up removes it at once (its owner is gone) instead of waiting a day for it to look stale; a
    committed DST holds no owner record."""
    dst = tmp_path / "out"
    code = ("import os, sys; from megashard import convert; "
            "o = convert._Output(sys.argv[1], True, 10, False); print(o.tmp, flush=True); os._exit(9)")
    p = subprocess.run([sys.executable, "-c", code, str(dst)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    tmp = p.stdout.strip()
    assert p.returncode == 9 and os.path.isdir(tmp), p.stderr
    assert storage.cleanup_stale_temps(tmp_path) == [tmp]
    assert sorted(os.listdir(tmp_path)) == []
    res = convert(str(megatron_root), str(dst), to="torch_dist", iteration=10)
    assert res.iteration == 10 and storage.read_tracker(str(dst)) == 10
    assert sorted(os.listdir(dst)) == ["iter_0000010", saveroot.TRACKER_NAME] and sorted(os.listdir(tmp_path)) == ["out"]


def test_inspect_and_load_of_a_real_torch_dist_checkpoint_name_convert(megatron_root, tmp_path, capsys):
    """A torch_dist checkpoint megatron-core wrote: inspect and load name the format and the command."""
    from megashard.cli import main as cli_main

    dst = str(tmp_path / "td")
    convert(megatron_root, dst, to="torch_dist")
    ckpt = os.path.join(dst, saveroot.iteration_dir_name(10))
    command = f"`megashard convert {ckpt} NEW_DIR`"
    assert cli_main(["inspect", ckpt]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"megashard inspect: error: {ckpt} is not a megashard checkpoint: it is a torch_dist "
                          "checkpoint") and command in err and err.count("\n") == 1, err
    with pytest.raises(megashard.MegashardError) as e:
        megashard.load({}, ckpt)
    assert "it is a torch_dist checkpoint" in str(e.value) and command in str(e.value)
    convert(ckpt, str(tmp_path / "back"))  # the command it names works
    assert storage.is_checkpoint(str(tmp_path / "back"))

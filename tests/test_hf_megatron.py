"""Hugging Face export and import against real models: megatron-core's GPTModel (TP=2 / PP=2 under
torchrun, tests/megatron_helpers/hf_llama.py) and transformers' LlamaForCausalLM
(tests/hf_helpers/hf_logits.py). Each side runs in its own process: megashard.megatron.cpu_compat
changes torch process-wide, and this process imports neither.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_helpers.runner import REPO, TESTS, torchrun

from megashard.convert import convert
from megashard.hf.safetensors import SafetensorsFile

MEGATRON = os.path.join(TESTS, "megatron_helpers", "hf_llama.py")
HF = os.path.join(TESTS, "hf_helpers", "hf_logits.py")
TOL = 1e-5


def megatron(mode: str, ckpt, out, *args: str, nproc: int = 2) -> np.ndarray:
    run = torchrun(MEGATRON, ["--mode", mode, "--dir", str(ckpt), "--logits", str(out), *args], nproc=nproc,
                   timeout=300)
    assert run.returncode == 0, run.output[-5000:]
    return _logits(out)


def hf(*args: str, out=None) -> np.ndarray | None:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, HF, *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-5000:]
    return _logits(out) if out is not None else None


def hf_each(*dirs) -> list:
    """transformers' logits of each HF directory, in one process: ``[logits of dirs[0], ...]``."""
    outs = [f"{d}.logits" for d in dirs]
    hf(dirs[0], outs[0], *[a for d, o in zip(dirs[1:], outs[1:]) for a in ("--also", d, o)])
    return [_logits(o) for o in outs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(*flags)``: (checkpoint, its logits) of ``hf_llama.py --mode save *flags``, made once per
    module for each set of flags (tests that need the same model share its launch; they only read it)."""
    made = {}

    def get(*flags: str):
        if flags not in made:
            d = tmp_path_factory.mktemp("saved")
            made[flags] = (d / "ckpt", megatron("save", d / "ckpt", d / "mg.logits", *flags))
        return made[flags]
    return get


def _logits(path) -> np.ndarray:
    shape = json.load(open(f"{path}.json"))
    return np.fromfile(path, dtype=np.float32).reshape(shape)


def tensors_of(d) -> dict:
    """{HF name: (dtype, shape, bytes)} over every safetensors file of an HF directory."""
    out = {}
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                with SafetensorsFile(fd, name, str(d)) as f:
                    for n, (dt, shape, a, b) in f.entries.items():
                        out[n] = (dt, shape, os.pread(f.fd, b - a, f.data_start + a))
    finally:
        os.close(fd)
    return out


def swap_gate_up(src, dst) -> None:
    """The negative control: the same directory with every layer's gate and up projections swapped."""
    swap_names(src, dst, "gate_proj", "up_proj")


def swap_names(src, dst, a: str, b: str) -> None:
    """A copy of an HF directory with the tensors whose names differ by ``a`` <-> ``b`` swapped."""
    import shutil

    from megashard.hf.safetensors import SafetensorsWriter

    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    files = {name: SafetensorsFile(fd, name, str(src)) for name in os.listdir(src) if name.endswith(".safetensors")}
    where = {n: f for f in files.values() for n in f.entries}
    for name, f in files.items():
        names = list(f.entries)
        w = SafetensorsWriter(os.path.join(dst, name), [(n, f.entries[n][0], f.entries[n][1]) for n in names])
        for n in names:
            other = n.replace(a, "@").replace(b, a).replace("@", b)
            w.write(n, where[other].tensor(other))
        w.close()
    for f in files.values():
        f.close()
    os.close(fd)


@pytest.mark.parametrize("flags", [
    pytest.param([], id="untied-gqa"),
    pytest.param(["--tied", "--bias", "--interleaved", "--groups", "1"], id="tied-bias-interleaved-1group"),
])
def test_export_tp2_logits_equal_transformers(tmp_path, saved, flags):
    ckpt, ref = saved("--tp", "2", *flags)
    res = convert(str(ckpt), str(tmp_path / "hf"), to="hf", vocab_size=100, shard_bytes=100_000)
    assert res.target_format == "hf" and res.iteration == 1
    files = sorted(os.listdir(tmp_path / "hf"))
    assert "config.json" in files and "model.safetensors.index.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", files
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg["vocab_size"] == 100 and cfg["tie_word_embeddings"] == ("--tied" in flags)
    # the negative control: gate and up swapped must not pass the same comparison
    swap_gate_up(tmp_path / "hf", tmp_path / "swapped")
    got, bad = hf_each(tmp_path / "hf", tmp_path / "swapped")
    assert ref.shape == got.shape == (2, 8, 100)
    assert np.abs(ref - got).max() < TOL, np.abs(ref - got).max()
    assert np.abs(ref - bad).max() > 1e-2


@pytest.mark.parametrize("layout", [
    pytest.param(["--pp", "2", "--layers", "4"], id="pp2"),
    pytest.param(["--pp", "2", "--vp", "2", "--layers", "4"], id="pp2-vp2"),
])
def test_export_pipeline_layouts_logits_equal_transformers(tmp_path, layout):
    # layers spread over stages (and model chunks): the export must put each at its global index
    ref = megatron("save", tmp_path / "ckpt", tmp_path / "mg.logits", "--bias", *layout)
    convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", vocab_size=100)
    assert json.load(open(tmp_path / "hf" / "config.json"))["num_hidden_layers"] == 4
    got = hf(tmp_path / "hf", tmp_path / "hf.logits", out=tmp_path / "hf.logits")
    assert ref.shape == got.shape == (2, 8, 100)
    assert np.abs(ref - got).max() < TOL, np.abs(ref - got).max()


def test_export_tensors_file_equals_safetensors_and_loads(tmp_path, saved):
    from tensorizer import TensorDeserializer

    ckpt, ref = saved("--tp", "2")  # test_export_tp2_logits_equal_transformers[untied-gqa]'s model
    convert(str(ckpt), str(tmp_path / "hf"), to="hf", vocab_size=100)
    res = convert(str(ckpt), str(tmp_path / "hft"), to="hf", vocab_size=100, hf_tensors=True)
    assert res.target_format == "hf (tensorizer)"
    assert sorted(os.listdir(tmp_path / "hft")) == ["config.json", "model.tensors"]
    assert open(tmp_path / "hft" / "config.json").read() == open(tmp_path / "hf" / "config.json").read()
    st = tensors_of(tmp_path / "hf")
    with TensorDeserializer(str(tmp_path / "hft" / "model.tensors"), device="cpu", verify_hash=True) as d:
        got = {k: v.clone() for k, v in d.items()}
    assert list(got) == list(st)  # same names, same order
    for k, t in got.items():
        dt, shape, raw = st[k]
        assert t.dtype == dt and tuple(t.shape) == shape and t.detach().contiguous().numpy().tobytes() == raw, k
    out = hf(tmp_path / "hft", tmp_path / "t.logits", "--tensors", tmp_path / "hft" / "model.tensors",
             out=tmp_path / "t.logits")
    assert np.abs(ref - out).max() < TOL


def test_import_loads_in_megatron_tp2_and_pp2_and_round_trips(tmp_path):
    # a random HF Llama (GQA, untied, vocab 100: at TP=2 Megatron pads to 256, rank 1 holds only padding)
    ref = hf(tmp_path / "hf", tmp_path / "hf.logits", "--make", "--vocab", "100", "--layers", "2",
             out=tmp_path / "hf.logits")  # made, then loaded back from the directory
    res = convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    assert res.source_format == "hf" and res.iteration == "release"
    assert open(tmp_path / "ms" / "latest_checkpointed_iteration.txt").read().strip() == "release"
    for layout in (["--tp", "2"], ["--pp", "2"]):
        got = megatron("load", tmp_path / "ms", tmp_path / "mg.logits", *layout)
        assert np.abs(ref - got).max() < TOL, (layout, np.abs(ref - got).max())
    # HF -> megashard -> HF: byte-identical tensors (the vocabulary is known: the import saved it unpadded)
    convert(str(tmp_path / "ms"), str(tmp_path / "back"), to="hf")
    a, b = tensors_of(tmp_path / "hf"), tensors_of(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)


def test_megashard_hf_megashard_same_model_tensors(tmp_path, saved):
    import torch

    import megashard

    # not the tied/interleaved model of test_export_tp2_logits_equal_transformers: the HF import makes a
    # non-interleaved checkpoint (the same logits, other tensors)
    ckpt, _ = saved("--tp", "2", "--bias")
    convert(str(ckpt), str(tmp_path / "hf"), to="hf", vocab_size=100)
    convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    a = megashard.load_consolidated(str(ckpt / "iter_0000001"))
    b = megashard.load_consolidated(str(tmp_path / "ms" / "release"))
    assert set(a) == set(b)
    for k in a:
        x = a[k][:100] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else a[k]
        assert x.dtype == b[k].dtype and x.shape == b[k].shape and torch.equal(x, b[k]), k


MOE = ["--experts", "4", "--topk", "2"]


def test_export_moe_ep2_logits_equal_mixtral(tmp_path):
    # 4 experts over EP=2 (2 per rank), top-2 softmax router, allgather dispatcher, SequentialMLP experts
    ref = megatron("save", tmp_path / "ckpt", tmp_path / "mg.logits", *MOE, "--ep", "2")
    convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", vocab_size=100, shard_bytes=100_000)
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert (cfg["architectures"], cfg["model_type"]) == (["MixtralForCausalLM"], "mixtral")
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (4, 2, 96)
    names = tensors_of(tmp_path / "hf")
    assert names["model.layers.1.block_sparse_moe.gate.weight"][1] == (4, 64)
    assert names["model.layers.1.block_sparse_moe.experts.3.w1.weight"][1] == (96, 64)
    assert names["model.layers.1.block_sparse_moe.experts.3.w2.weight"][1] == (64, 96)
    assert not any(".mlp." in n for n in names)
    # negative controls: an expert of EP rank 0 swapped with one of rank 1; gate (w1) and up (w3) swapped
    swaps = ((".experts.0.", ".experts.2."), (".w1.", ".w3."))
    for a, b in swaps:
        swap_names(tmp_path / "hf", tmp_path / f"bad{a}", a, b)
    got, *bads = hf_each(tmp_path / "hf", *[tmp_path / f"bad{a}" for a, _ in swaps])
    assert ref.shape == got.shape == (2, 8, 100)
    assert np.abs(ref - got).max() < TOL, np.abs(ref - got).max()
    for (a, b), bad in zip(swaps, bads):
        assert np.abs(ref - bad).max() > 1e-2, (a, b)
    # megashard -> HF -> megashard: the same model tensors (the embedding and output layer without padding)
    import torch

    import megashard

    convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    x = megashard.load_consolidated(str(tmp_path / "ckpt" / "iter_0000001"))
    y = megashard.load_consolidated(str(tmp_path / "ms" / "release"))
    assert set(x) == set(y) and any(".experts." in k for k in x)
    for k in x:
        v = x[k][:100] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else x[k]
        assert v.dtype == y[k].dtype and torch.equal(v, y[k]), k


def test_import_mixtral_loads_in_megatron_ep2_and_ep1_and_round_trips(tmp_path):
    ref = hf(tmp_path / "hf", tmp_path / "hf.logits", "--make", "--vocab", "100", *MOE,
             out=tmp_path / "hf.logits")  # made, then loaded back from the directory
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in tensors_of(tmp_path / "hf")  # the Hub's names
    res = convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    assert res.source_format == "hf"
    for layout in (["--ep", "2"], ["--ep", "1"]):
        got = megatron("load", tmp_path / "ms", tmp_path / "mg.logits", *MOE, *layout,
                       "--rotary-base", "1000000")  # MixtralConfig's default rope_theta
        assert np.abs(ref - got).max() < TOL, (layout, np.abs(ref - got).max())
    convert(str(tmp_path / "ms"), str(tmp_path / "back"), to="hf")
    a, b = tensors_of(tmp_path / "hf"), tensors_of(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)

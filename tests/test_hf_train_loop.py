"""Hugging Face -> megashard -> training -> Hugging Face: the loop of docs/hf.md, run from its own commands.

A tiny random ``LlamaForCausalLM`` (and ``MixtralForCausalLM``), made by transformers and saved with
``save_pretrained``, is imported with ``megashard convert``, trained 3 iterations with
``examples/pretrain_gpt.py`` (Llama at TP=2, Mixtral at EP=2; 2 ranks, CPU/gloo), exported with ``--to hf``
and loaded by transformers, which generates. The commands are the ones docs/hf.md shows (its blocks marked
``test_hf_train_loop``), so the page cannot drift from what works. transformers runs in its own processes
(tests/hf_helpers/): megashard.megatron.cpu_compat changes torch process-wide.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from typing import Dict, List

import numpy as np
import pytest

from megatron_helpers.runner import EXAMPLE, REPO, TESTS, Run, torchrun

from megashard.cli import main as megashard_cli
from test_hf_megatron import hf, tensors_of

DOC = os.path.join(REPO, "docs", "hf.md")
HF_LOSS = os.path.join(TESTS, "hf_helpers", "hf_loss.py")
TOL = 1e-5


def doc_block(name: str) -> str:
    """The fenced block after ``<!-- test_hf_train_loop: NAME -->`` in docs/hf.md."""
    text = open(DOC, encoding="utf-8").read()
    m = re.search(rf"<!-- test_hf_train_loop: {name} -->\n```\w*\n(.*?)\n```", text, re.S)
    assert m, f"docs/hf.md has no block marked test_hf_train_loop: {name}"
    return m.group(1)


def commands(block: str) -> List[List[str]]:
    """Shell lines of a block (backslash continuations joined, comments dropped) as argv lists."""
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run_doc_commands(block: str, cwd, extra: Dict[str, List[str]]) -> List[Run]:
    """Each ``python -m megashard ...`` in this process (the CLI's ``main``), each ``torchrun`` of the
    example through the tests' launcher (loopback, fast exit); ``extra`` appends test-only arguments."""
    runs = []
    for argv in commands(block):
        if argv[:3] == ["python", "-m", "megashard"]:  # in cwd (the caller's chdir)
            assert megashard_cli(argv[3:]) == 0, argv
        elif argv[0] == "torchrun":
            assert argv[1] == "--nproc-per-node" and argv[3] == "examples/pretrain_gpt.py", argv
            run = torchrun(EXAMPLE, [*argv[4:], *extra.get("torchrun", [])], nproc=int(argv[2]), cwd=str(cwd),
                           timeout=300)
            runs.append(run.check())
        else:
            raise AssertionError(f"docs/hf.md: a command this test does not know how to run: {argv}")
    return runs


def example_module():
    spec = importlib.util.spec_from_file_location("example_pretrain_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def batch_file(example, path, flags: List[str], iteration: int) -> str:
    """The example's global batch of ``iteration`` (its own ``make_sample``), for transformers' loss."""
    args = example.parse_args(flags)
    seqs = np.stack([example.make_sample(args, iteration * args.global_batch_size + j).numpy()
                     for j in range(args.global_batch_size)]).astype(np.int64)
    seqs.tofile(path)
    with open(f"{path}.json", "w") as f:
        json.dump(list(seqs.shape), f)
    return str(path)


def hf_losses(out, *pairs) -> List[float]:
    """transformers' loss of each (model directory, token file) pair, in one process."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, HF_LOSS, str(out), *map(str, pairs)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-5000:]
    return json.load(open(out))


COMMON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
          "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rope_parameters", "hidden_act",
          "intermediate_size", "architectures", "model_type")
MODELS = {  # docs/hf.md's block -> (hf_logits.py --make flags, config.json keys that must come back)
    "llama": (["--eps", "1e-6"], (*COMMON, "head_dim", "attention_bias", "mlp_bias")),
    "mixtral": (["--eps", "1e-6", "--experts", "4", "--topk", "2"],
                (*COMMON, "num_local_experts", "num_experts_per_tok")),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_import_train_export_generate(tmp_path, monkeypatch, model):
    make, keys = MODELS[model]
    monkeypatch.chdir(tmp_path)  # the docs' paths are relative
    hf(tmp_path / "hf_in", "--make", "--vocab", "256", "--layers", "2", *make)
    block = doc_block(model)
    (run,) = run_doc_commands(block, tmp_path, {"torchrun": ["--dump-loaded-state", "dump"]})
    assert run.started.startswith("started from checkpoint ck/release (iteration 0, weights only (a release")
    assert sorted(run.losses) == [1, 2, 3]

    # before any step: what the example loaded, saved again and exported is hf_in byte for byte
    assert megashard_cli(["convert", "dump", "hf0", "--to", "hf", "--vocab-size", "256"]) == 0
    a, b = tensors_of(tmp_path / "hf_in"), tensors_of(tmp_path / "hf0")
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    src, out = (json.load(open(tmp_path / d / "config.json")) for d in ("hf_in", "hf_out"))
    assert {k: out[k] for k in keys} == {k: src[k] for k in keys}

    # the first loss is the imported model's own, as transformers computes it on the same tokens; the
    # export of iteration 2 has the loss the example printed for the batch after it (iteration 3)
    assert megashard_cli(["convert", "run", "hf2", "--to", "hf", "--vocab-size", "256", "--iteration", "2"]) == 0
    example = example_module()
    monkeypatch.setenv("WORLD_SIZE", str(run_nproc(block)))  # the layout the example parsed its arguments for
    (train,) = [c[4:] for c in commands(block) if c[0] == "torchrun"]
    ref0, ref2 = hf_losses(tmp_path / "losses.json", tmp_path / "hf_in", batch_file(example, "batch0", train, 0),
                           tmp_path / "hf2", batch_file(example, "batch2", train, 2))
    print(f"{model}: |loss - transformers'| at iteration 1: {abs(run.losses[1] - ref0):.2e}, 3: "
          f"{abs(run.losses[3] - ref2):.2e}")
    assert abs(run.losses[1] - ref0) < TOL and abs(run.losses[3] - ref2) < TOL, (run.losses, ref0, ref2)
    assert abs(ref2 - ref0) > 1e-3  # training moved the model

    # the trained export (the tracker's iteration 3): every tensor changed, and transformers generates
    trained = tensors_of(tmp_path / "hf_out")
    assert sorted(trained) == sorted(a) and [k for k in a if trained[k][2] == a[k][2]] == []
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", doc_block("generate")], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-5000:]
    tokens = ast.literal_eval(p.stdout.strip().splitlines()[-1])
    assert len(tokens) == 12 and tokens[:4] == [1, 2, 3, 4] and all(0 <= t < 256 for t in tokens), tokens


def run_nproc(block: str) -> int:
    (n,) = [int(c[2]) for c in commands(block) if c[0] == "torchrun"]
    return n

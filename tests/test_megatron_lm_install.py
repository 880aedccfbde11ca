"""``megashard.megatron.install()`` inside Megatron-LM's own training loop (``pretrain_gpt.py``).

Megatron-LM's training side (``pretrain_gpt.py`` and, before 0.19, ``megatron/training``: the
code that parses ``--save-format``, calls ``save_checkpoint`` / ``load_checkpoint`` and runs
``pretrain()``) of the installed megatron-core's release is found by
:func:`megatron_helpers.mlm_tree.find_tree`: ``MEGATRON_LM_DIR``, then
``<repo>/../shared/vendor/Megatron-LM-core_vX.Y.Z.tar.gz``, then a cache directory, then a
``git`` fetch of the tag into it. None of these: the tests fail with the command that fixes
it, they do not skip.

The runs use Megatron-LM's real ``pretrain()``: its argument parser (with megashard's
``extra_args_provider``), ``initialize_megatron``,
``setup_model_and_optimizer`` → ``load_checkpoint``, ``train()`` →
``save_checkpoint_and_time`` → ``save_checkpoint``, mock GPT data, on CPU with gloo. The
tree is appended to the ranks' ``sys.path`` (after the installed packages), so
``megatron.core`` still comes from the wheel.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Callable, Dict, TypeVar

import pytest

import megashard
from megatron_helpers.mlm_tree import TAG_COMMITS, Tree, TreeMissing, find_tree, tree_version
from megatron_helpers.runner import REPO, TESTS, compare_checkpoints, torchrun

#: the installed release; no import: megatron.core warns on import
INSTALLED = importlib.metadata.version("megatron-core")
RELEASE = re.match(r"\d+\.\d+\.\d+", INSTALLED).group(0)

T = TypeVar("T")
#: what the session fixtures below made: pytest gives every module that imports a fixture its own copy
#: of it, so a session fixture imported by several modules would run once per module
_SESSION: Dict[str, object] = {}


def _once(key: str, make: Callable[[], T]) -> T:
    if key not in _SESSION:
        _SESSION[key] = make()
    return _SESSION[key]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def mlm_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    try:
        return _once("tree", lambda: find_tree(RELEASE, Path(REPO), lambda: tmp_path_factory.mktemp("megatron-lm")))
    except TreeMissing as e:
        pytest.fail(str(e))


SCRIPT = os.path.join(TESTS, "megatron_helpers", "mlm_pretrain_gpt.py")
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--lr-decay-iters", "6", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--transformer-impl", "local", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--tensor-model-parallel-size", "2"]


def mlm(tree: Tree, args, env=None):
    env = {"MEGATRON_LM_DIR": tree.path, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}
    run = torchrun(SCRIPT, [*ARGS, *args], env=env, timeout=300)
    assert run.returncode == 0, run.output[-6000:]
    # the training code is the tree's, megatron.core the installed wheel's (mlm_pretrain_gpt.py prints both)
    m = re.search(r"megatron\.core from (.+?) \| megatron\.training from (.+?) \| pretrain_gpt from (.+)",
                  run.output)
    assert m, run.output[-3000:]
    core, training, script = (os.path.realpath(p.strip()) for p in m.groups())
    inside = os.path.realpath(tree.path) + os.sep
    assert script.startswith(inside), (script, tree)
    assert not core.startswith(inside), (core, tree)
    # megatron/training: the tree's, unless the wheel ships it (0.19+), which then comes first on sys.path
    wheel_training = os.path.join(os.path.dirname(core), "training")
    assert training.startswith(inside) or training == wheel_training, (training, tree)
    return run, lm_losses(run.output)


def lm_losses(output: str) -> Dict[int, str]:
    """{iteration: lm loss as Megatron-LM logs it (every digit)} from a run's output."""
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", output)}


@pytest.fixture(scope="session")
def mlm_base(mlm_tree, tmp_path_factory):
    """The uninterrupted megashard run resumes are compared with: 6 iterations (TP=2), saved at 3 and 6.
    (directory, run, losses); one launch for every module that uses it. Tests only read the directory."""
    def make():
        a = tmp_path_factory.mktemp("mlm-base") / "a"
        run, losses = mlm(mlm_tree, ["--train-iters", "6", "--save-interval", "3", "--save", str(a),
                                     "--save-format", "tensors"])
        return a, run, losses
    return _once("base", make)


@pytest.fixture(scope="session")
def mlm_torch_dist(mlm_tree, tmp_path_factory):
    """Megatron-LM's own torch_dist checkpoint of iteration 2 (TP=2, stopped there), and Megatron-LM
    resuming from it with its own loader to iteration 4: (directory, resumed run, its losses). One
    launch pair for every module that uses it. Tests only read the directory."""
    def make():
        d = tmp_path_factory.mktemp("mlm-torch-dist") / "td"
        mlm(mlm_tree, ["--train-iters", "4", "--save-interval", "2", "--exit-interval", "2", "--save", str(d),
                       "--save-format", "torch_dist"])
        run, losses = mlm(mlm_tree, ["--train-iters", "4", "--load", str(d)])
        return d, run, losses
    return _once("torch_dist", make)


def test_version_matches_installed_megatron_core(mlm_tree):
    ver = tree_version(mlm_tree.path)
    assert ver is not None, (
        f"cannot tell which release the Megatron-LM tree from {mlm_tree.source} is: it has no "
        "megatron/core/package_info.py and its directory is not named Megatron-LM-core_vX.Y.Z")
    installed = importlib.metadata.version("megatron-core")  # no import: megatron.core warns on import
    assert ver.split(".")[:2] == installed.split(".")[:2], (
        f"Megatron-LM tree {mlm_tree.source} is release {ver}, installed megatron-core is {installed}")
    if mlm_tree.source.endswith(".tar.gz"):
        # the archive's name is only a name; git archive's pax header holds the commit it was made from
        assert mlm_tree.commit == TAG_COMMITS.get(ver), (
            f"{mlm_tree.source} was made from commit {mlm_tree.commit}; tag core_v{ver} is "
            f"{TAG_COMMITS.get(ver, 'not in TAG_COMMITS (add it)')}")


def test_megatron_lm_saves_and_resumes_through_megashard(mlm_tree, mlm_base, tmp_path):
    a, base, base_losses = mlm_base
    b = tmp_path / "b"
    assert "megashard installed into megatron.training.checkpointing, megatron.training.training" in base.output
    assert sorted(base_losses) == [1, 2, 3, 4, 5, 6]
    # Megatron-LM's layout, megashard's files, tracker written last
    assert open(a / "latest_checkpointed_iteration.txt").read().strip() == "6"
    for it in (3, 6):
        files = os.listdir(a / f"iter_{it:07d}")
        assert "manifest.json" in files and any(f.endswith(".tensors") for f in files)
        assert not any(f.endswith((".distcp", ".pt")) or f == "metadata.json" for f in files), files
    saved = megashard.read_manifest(str(a / "iter_0000003"))
    assert "model" in json.dumps(saved.trees)[:100000]

    resumed, losses = mlm(mlm_tree, ["--train-iters", "6", "--save-interval", "3", "--load", str(a),
                                     "--ckpt-step", "3", "--save", str(b), "--save-format", "tensors"])
    assert "holds a megashard checkpoint: loading with megashard" in resumed.output
    assert "at iteration 3 (optimizer loaded, rng loaded)" in resumed.output
    assert sorted(losses) == [4, 5, 6]
    assert losses[4] == base_losses[4]
    # the final model and optimizer state equal the uninterrupted run's, bit for bit
    cmp = compare_checkpoints(str(a / "iter_0000006"), str(b / "iter_0000006"))
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], cmp
    assert any(k.startswith("optimizer.state.exp_avg.") for k in cmp["compared"])


def test_other_formats_still_go_to_megatron(mlm_torch_dist):
    d, run, losses = mlm_torch_dist
    files = os.listdir(d / "iter_0000002")
    assert "metadata.json" in files and any(f.endswith(".distcp") for f in files), files   # Megatron's writer
    assert "loading with megashard" not in run.output
    assert "successfully loaded checkpoint from" in run.output and sorted(losses) == [3, 4]

"""The plain (non-Megatron) API as a new user meets it: non-strict loads, load templates,
the runnable example, the documented signatures (issue 28 items 3 and 12)."""
from __future__ import annotations

import torch

import megashard
from megashard.sharded import ShardedTensor


def test_nonstrict_unfillable_shard_comes_back_as_none(tmp_path):
    """README: with strict=False "a shard it cannot fill comes back as None, never as
    uninitialised memory" (before: the template's torch.empty tensor came back)."""
    ckpt = str(tmp_path / "ckpt")
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    megashard.save({"w": ShardedTensor("w", w, (4, 4), (0, 0))}, ckpt)
    t = {"w": ShardedTensor("w", torch.empty(4, 4), (4, 4), (0, 0)),
         "missing": ShardedTensor("nope", torch.empty(3), (3,), (0,)),
         "wrong_dtype": ShardedTensor("w", torch.empty(4, 4, dtype=torch.float64), (4, 4), (0, 0)),
         "wrong_shape": ShardedTensor("w", torch.empty(2, 4), (2, 4), (0, 0))}
    out = megashard.load(t, ckpt, strict=False)
    assert torch.equal(out["w"], w)
    assert out["missing"] is None
    assert out["wrong_dtype"] is None
    assert out["wrong_shape"] is None


def test_sharded_state_dict_from_a_model_saves_and_loads_in_place(tmp_path):
    """The template helper: keys are dotted paths, split axes make TP shards, a load fills
    the model's own parameters."""
    import pytest

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    sd = megashard.sharded_state_dict(m, {"0.*": 0}, rank=1, world=2, prefix="model.")
    assert sd["0.weight"].key == "model.0.weight"
    assert (sd["0.weight"].global_shape, sd["0.weight"].global_offset) == ((12, 4), (6, 0))
    assert (sd["1.weight"].global_shape, sd["1.weight"].global_offset) == ((4, 6), (0, 0))
    assert sd["0.weight"].data.data_ptr() == m[0].weight.data_ptr()
    with pytest.raises(ValueError, match=r"split names \['fc9.weight'\] but no tensor has such a key"):
        megashard.sharded_state_dict(m, {"fc9.weight": 0})
    ckpt = str(tmp_path / "ckpt")
    megashard.save({"m": megashard.sharded_state_dict(m), "step": 3}, ckpt)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    out = megashard.load({"m": megashard.sharded_state_dict(m2), "step": 0}, ckpt)
    assert out["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_plain_api_example_runs_on_two_ranks(tmp_path):
    """examples/plain_api.py: TP=2 save, TP=1 load on 2 gloo ranks, bit-exact."""
    import os
    import subprocess
    import sys

    from torchrun_ports import PORT_TRIES, free_port, port_taken

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    ckpt = str(tmp_path / "ckpt")
    for _ in range(PORT_TRIES):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(free_port()), os.path.join(repo, "examples", "plain_api.py"),
                            ckpt], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=env)
        if not (p.returncode != 0 and port_taken(p.stdout)):
            break
    assert p.returncode == 0, p.stdout[-4000:]
    assert f"saved {ckpt} at TP=2: ['fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight']" in p.stdout
    for r in (0, 1):
        assert f"rank {r}: loaded at TP=1, step 100, weights bit-exact: True, output equal: True" in p.stdout
        assert f"rank {r}: common values: {{'step': 100}}" in p.stdout


def test_save_and_load_document_every_argument():
    """help(megashard.save) / help(megashard.load) explain every argument and the return value."""
    import inspect

    for fn in (megashard.save, megashard.load):
        doc = inspect.getdoc(fn)
        for name in inspect.signature(fn).parameters:
            assert f"``{name}``" in doc, f"{fn.__name__}: {name} undocumented"
        assert "Returns" in doc


def test_megatron_non_strict_keeps_the_current_value_where_load_returns_none():
    """--megashard-non-strict-load: a shard load returns as None keeps the model's own tensor."""
    import pytest

    pytest.importorskip("megatron.core")
    from megashard.megatron.checkpointing import _keep_unloaded

    live = torch.ones(3)
    request = {"model": {"a": ShardedTensor("a", live, (3,), (0,)), "b": ShardedTensor("b", torch.zeros(2), (2,), (0,))},
               "opt": [ShardedTensor("c", live, (3,), (0,))]}
    loaded = {"model": {"a": None, "b": torch.full((2,), 7.0)}, "opt": [None]}
    out = _keep_unloaded(loaded, request)
    assert out["model"]["a"] is live and out["opt"][0] is live and torch.equal(out["model"]["b"], torch.full((2,), 7.0))


def test_distributed_error_lists_each_message_and_problem_once():
    """Every rank's StateDictError listed the same mismatches again (issue 28 item 6)."""
    from megashard.errors import DistributedError, distributed_error

    same = "StateDictError: state dict does not match checkpoint /c (2 problem(s)):\n  shape mismatch: 'a'\n  " \
           "shape mismatch: 'b'\nPass strict=False to load what matches."
    other = "StateDictError: state dict does not match checkpoint /c (2 problem(s)):\n  shape mismatch: 'b'\n  " \
            "shape mismatch: 'c'\nPass strict=False to load what matches."
    e = distributed_error({r: same for r in range(8)} | {8: other}, "load")
    text = str(e)
    assert text.count("shape mismatch: 'a'") == 1 and text.count("shape mismatch: 'b'") == 1
    assert text.count("shape mismatch: 'c'") == 1
    assert text.splitlines()[0] == "megashard load failed on rank(s) 0-8:"
    assert "[ranks 0-7] StateDictError" in text and "[rank 8] StateDictError" in text
    one = str(DistributedError({0: "CheckpointError: x", 1: "CheckpointError: x"}, "load (prepare)"))
    assert one == "megashard load (prepare) failed on rank(s) 0, 1:\n  [ranks 0, 1] CheckpointError: x"

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

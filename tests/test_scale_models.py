"""scripts/scale_models.py: fabricated per-rank state dicts against REAL megatron-core 0.16.1.

One torchrun job (4 CPU ranks, gloo) builds megatron-core's GPTModel (local spec, bf16),
Megatron's DDP and optimizer for several layouts and dumps the metadata of the state dict
megashard.megatron would save (tests/megatron_helpers/scale_dump.py). Every rank's
fabricated state dict must describe exactly the same leaves: path, key, dtype, global
shape, global offset, local shape, flattened range, full replica id, prepend axes, and the
same ShardedObjects. The big models are checked for internal consistency (every global
element held by exactly one main replica).
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import scale_models as sm  # noqa: E402
from megatron_helpers.scale_dump import describe  # noqa: E402

SCENARIOS = [
    dict(model="tiny-gpt", tp=2, pp=1, dp=2, distributed_optimizer=True),
    dict(model="tiny-gpt", tp=1, pp=2, dp=2, vp=2, distributed_optimizer=True),
    dict(model="tiny-moe", tp=1, pp=1, dp=4, ep=2, distributed_optimizer=True),
    dict(model="tiny-moe", tp=2, pp=1, dp=2, ep=2, distributed_optimizer=True),
    dict(model="tiny-gpt", tp=2, pp=1, dp=2, distributed_optimizer=False),
]
IDS = ["gpt-tp2-dp2-distopt", "gpt-pp2-vp2-dp2-distopt", "moe-ep2-dp4-distopt", "moe-tp2-ep2-dp2-distopt",
       "gpt-tp2-dp2-adam"]
# megashard.megatron adds these; the dump passes no scheduler / flop count (not sharded state)
COMMON_ONLY_FABRICATED = {"num_floating_point_operations_so_far", "opt_param_scheduler"}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from megatron_helpers.runner import torchrun

    out = tmp_path_factory.mktemp("scale_dump")
    run = torchrun(os.path.join(REPO, "tests", "megatron_helpers", "scale_dump.py"),
                   [str(out), json.dumps(SCENARIOS)], nproc=4, timeout=300)
    assert run.returncode == 0, run.output[-6000:]
    return str(out)


def _fabricated(i: int, rank: int):
    sc = dict(SCENARIOS[i])
    model = sc.pop("model")
    return json.loads(json.dumps(describe(sm.rank_state_dict(model, sm.Layout(**sc), rank))))


@pytest.mark.parametrize("i", range(len(SCENARIOS)), ids=IDS)
def test_fabricated_metadata_equals_real_megatron_core(real, i):
    for rank in range(4):
        with open(os.path.join(real, f"{i}-r{rank}.json")) as f:
            want = json.load(f)
        got = _fabricated(i, rank)
        assert want["tensors"], "real megatron-core produced no ShardedTensors"
        for part in ("tensors", "objects"):
            missing = [x for x in want[part] if x not in got[part]]
            extra = [x for x in got[part] if x not in want[part]]
            assert not missing and not extra, (
                f"{IDS[i]} rank {rank} {part}: only in megatron-core {missing[:5]}, only fabricated {extra[:5]}")
        assert set(got["top"]) - COMMON_ONLY_FABRICATED == set(want["top"])


def _coverage(model: str, layout: sm.Layout):
    """{key: elements covered by main replicas} and {key: global numel} over every rank."""
    covered, numel = defaultdict(int), {}

    def walk(x):
        if isinstance(x, sm.ShardedTensor):
            if all(r == 0 for r in x.replica_id):
                n = 1
                for d in x.local_shape:
                    n *= d
                fr = x.flat_range
                covered[x.key] += (fr[1] - fr[0]) if fr else n
            g = 1
            for d in x.global_shape:
                g *= d
            assert numel.setdefault(x.key, g) == g, f"{x.key}: global shapes differ between shards"
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for r in range(layout.world):
        walk(sm.rank_state_dict(model, layout, r, swiglu_dist_opt_quirk=False))
    return covered, numel


@pytest.mark.parametrize("model,layout", [
    ("llama3-70b", sm.Layout(tp=4, pp=4, dp=2, vp=2, distributed_optimizer=True)),
    ("deepseek-v3", sm.Layout(tp=2, pp=4, dp=4, ep=4, distributed_optimizer=True)),
])
def test_big_models_cover_every_element_once(model, layout):
    covered, numel = _coverage(model, layout)
    assert covered.keys() == numel.keys()
    # megatron-core: duplicated TELinear (MLA down projections) is a main replica on every TP rank
    dup = {k for k in numel if "_down_proj.weight" in k}
    bad = {k: (covered[k], numel[k]) for k in numel
           if covered[k] != numel[k] * (layout.tp if k in dup else 1)}
    assert not bad, list(bad.items())[:5]
    # sizes: the model's parameters add up to its published size
    params = sum(n for k, n in numel.items() if not k.startswith("optimizer.") and not k.endswith("expert_bias"))
    assert params == sum(n for k, n in numel.items() if k.startswith("optimizer.state.fp32_param."))
    expected = {"llama3-70b": 70.6e9, "deepseek-v3": 671e9}[model]
    assert abs(params - expected) / expected < 0.02, params


def test_deepseek_v3_te_objects_and_layer_keys():
    layout = sm.Layout(tp=1, pp=16, dp=1024, ep=64, distributed_optimizer=True)
    keys = set()
    for pp in range(16):
        for ep in range(64):  # rank = pp * 1024 + ep holds experts [4 ep, 4 ep + 4) of stage pp
            sd = sm.rank_state_dict("deepseek-v3", layout, pp * 1024 + ep)
            keys |= {(o.key, o.global_offset) for o in sd["model"].values() if isinstance(o, sm.ShardedObject)}
    experts = {k for k in keys if ".mlp.experts.experts." in k[0]}
    # 58 MoE layers x 256 experts x (fc1, fc2), plus the per-layer TE modules
    assert len(experts) == 58 * 256 * 2
    assert any(k[0] == "decoder.layers.60.self_attention.linear_q_up_proj._extra_state" for k in keys)
    with pytest.raises(ValueError):
        sm.Layout(tp=1, pp=1, dp=6, ep=4)

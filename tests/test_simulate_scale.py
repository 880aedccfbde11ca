"""The scale simulator at 1,024 ranks: the coordinator's plan is exact (every tensor covered
once, every byte written by exactly one rank), each rank receives only its own assignment,
and the simulated save equals a real multi-rank save of the same state."""
from __future__ import annotations

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import scale_models as sm  # noqa: E402
import simulate_scale as ss  # noqa: E402
from distributed import all_ok, run_ranks  # noqa: E402

import megashard  # noqa: E402
from megashard import manifest as mf  # noqa: E402
from megashard.plan import Box, coverage_problems, numel  # noqa: E402


def _full(out):
    return mf.LazyIndex(mf.parse_head(out["_head"], "sim"), lambda s, n: out["_sections"][s:s + n], "sim").full()


def test_1024_ranks_llama_distopt_plan_is_exact():
    layout = sm.Layout(tp=8, pp=8, dp=16, distributed_optimizer=True)
    out = ss.simulate_save("llama3-70b", layout)
    m = _full(out)
    assert m.world_size == 1024 and len(m.rank_trees) == 1024
    total = 0
    for key, t in m.tensors.items():
        assert coverage_problems(key, t.global_shape, [(Box(s.offset, s.shape), s.flat) for s in t.shards]) == []
        ids = [(s.offset, s.shape, s.flat) for s in t.shards]
        assert len(ids) == len(set(ids)), key  # each shard written once
        assert all(s.file in m.files for s in t.shards if s.nbytes)
        got = sum(s.nbytes for s in t.shards)
        assert got == numel(t.global_shape) * t.dtype.itemsize, key  # every byte, exactly once
        total += got
    assert total > 70e9 * 2  # bf16 weights + fp32 optimizer state of a 70B model
    # each rank received its own assignment only: a few hundred bytes, not O(world)
    assert out["max_rank_recv_bytes"]["save/plan"] < 4096
    assert out["max_rank_send_bytes"]["save/plan"] < 64 << 10
    # the writers are balanced over the data-parallel replicas
    per_rank = {}
    for f in m.files.values():
        per_rank[f["rank"]] = per_rank.get(f["rank"], 0) + f["bytes"]
    assert len(per_rank) == 1024
    assert max(per_rank.values()) < 1.5 * (sum(per_rank.values()) / len(per_rank))
    # load planning of sampled ranks (same layout and TP8 -> TP4): reads only what it needs
    for r in (0, 517, 1023):
        p = ss.plan_rank(out["_head"], out["_sections"], "llama3-70b", layout, r)
        assert p["problems"] == [] and p["read_bytes"] == p["needed_bytes"] > 0
        assert p["index_read_bytes"] < 4 << 20
    to = sm.Layout(tp=4, pp=8, dp=32, distributed_optimizer=True)
    for r in (0, 1023):
        p = ss.plan_rank(out["_head"], out["_sections"], "llama3-70b", to, r)
        assert p["problems"] == [] and p["read_bytes"] <= 1.1 * p["needed_bytes"]
        assert p["temp_bytes"] <= 256 << 20


def _materialized(model: str, layout: sm.Layout, rank: int) -> dict:
    """The fabricated state with real tensors (deterministic values) instead of meta ones."""
    sd = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=False)

    def fill(x):
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        data = getattr(x, "data", None)
        if isinstance(data, torch.Tensor) and data.is_meta:
            x.data = torch.full(data.shape, float(rank % 7), dtype=data.dtype)
        return x

    return fill(sd)


def _real_save(rank, world, model, layout, path):
    megashard.save(_materialized(model, layout, rank), path, file_stems=sm.file_stems(model, layout, rank),
                   layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp})
    return True


def test_simulated_save_equals_a_real_four_rank_save(tmp_path):
    layout = sm.Layout(tp=2, pp=1, dp=2, distributed_optimizer=True)
    path = str(tmp_path / "ckpt")
    all_ok(run_ranks(_real_save, 4, "tiny-gpt", layout, path, timeout=240))
    real = megashard.read_manifest(path)
    sim = _full(ss.simulate_save("tiny-gpt", layout))

    def records(m):
        return {k: sorted((s.offset, s.shape, s.flat, s.file, s.name, s.nbytes) for s in t.shards)
                for k, t in m.tensors.items()}

    assert records(sim) == records(real)
    assert {f: i["rank"] for f, i in sim.files.items()} == {f: i["rank"] for f, i in real.files.items()}
    assert set(sim.objects) == set(real.objects)
    assert sim.rank_trees == real.rank_trees

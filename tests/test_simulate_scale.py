"""The scale simulator at 1,024 ranks: the coordinator's plan is exact (every tensor covered
once, every byte written by exactly one rank), each rank receives only its own assignment,
and the simulated save equals a real multi-rank save of the same state."""
from __future__ import annotations

import json
import os
import sys

import pytest
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
    assert out["max_other_rank_recv_bytes"]["save/plan"] < 4096
    # the same save again reuses the plan: every rank's vote agrees and gives each rank its reply
    assert out["steady_plan_reused"] is True
    assert out["max_rank_send_bytes"]["save/plan"] < 64 << 10
    # 32 groups of 32 ranks: the busiest rank (rank 0 or a leader) receives far less than every rank's messages
    assert out["gather_groups"] == 32 and out["max_rank_recv_bytes"] < 8 << 20
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
    # the simulator's two-level gather (groups of 2: ranks 0 and 2 lead) gives the flat gather's index
    tree = ss.simulate_save("tiny-gpt", layout, group=2)
    assert tree["gather_groups"] == 2 and tree["_sections"] == ss.simulate_save("tiny-gpt", layout, group=4)["_sections"]
    assert {f: i["rank"] for f, i in sim.files.items()} == {f: i["rank"] for f, i in real.files.items()}
    assert set(sim.objects) == set(real.objects)
    assert sim.rank_trees == real.rank_trees


def _state_view(st, reply_of):
    """What a save does with a rank's prepared state: its announcement, state tree and parts,
    and the write job and records for a reply (fake writer)."""
    from megashard import saving

    msg = saving.announce(st, st.rank)
    res = saving._write_job(saving._select(st, reply_of(msg)), "/nonexistent", st.rank, 4096, False, None,
                            write=ss._fake_write)
    return msg, st.tree, st.tree_parts, res


@pytest.mark.parametrize("model,layout,ranks", [
    ("tiny-moe", sm.Layout(tp=2, pp=1, dp=4, ep=2, distributed_optimizer=True), range(8)),
    ("tiny-gpt", sm.Layout(tp=1, pp=2, dp=4, vp=2, distributed_optimizer=True), range(8)),
    ("llama3-70b", sm.Layout(tp=8, pp=8, dp=4, distributed_optimizer=True), [*range(0, 40), *range(224, 256)]),
    ("deepseek-v3", sm.Layout(tp=1, pp=16, dp=128, ep=64, distributed_optimizer=True),
     [*range(0, 140), *range(1920, 1930), 2047]),
], ids=["tiny-moe-tp2-ep2", "tiny-gpt-pp2-vp2", "llama-tp8-pp8-dp4", "deepseek-pp16-ep64-dp128"])
def test_model_chunks_reused_per_class_equal_each_ranks_own(model, layout, ranks):
    """The simulator encodes the model chunks once per ``scale_models.model_class`` and reuses them
    for the class's other ranks: every rank's announcement, state tree, tree parts and write
    records (writing every shard it holds) equal those of encoding its whole state dict."""

    def everything(msg):  # the reply of a plan that has this rank write every shard and object it holds
        shards = len(json.loads(msg["fixed"])) + len(json.loads(msg["flat"])[1])
        return {"write": list(range(shards)), "objects": list(range(len(json.loads(msg["objects"])))), "blobs": []}

    models = {}
    for r in ranks:
        got = _state_view(ss._save_state(model, layout, r, False, models), everything)
        want = _state_view(ss._save_state(model, layout, r, False), everything)
        assert got == want, r
        assert got[3]["records"], r


def test_s3_save_request_arithmetic():
    """The protocol's per-save counts, by hand: 1 LIST to plan; a PUT per file up to one part,
    else create + ceil(size/part) parts + complete; commit LIST pages of 1000 + 3 PUTs; the
    clean-up's LIST + upload listing; a re-save's GET of the old head, LIST + DeleteObjects of
    the old files and two index objects; the tracker PUT."""
    mib = 1 << 20
    got = ss.s3_save_requests([0, 5 * mib, 64 * mib - 1, 64 * mib, 64 * mib + 1, 1000 * mib], part_bytes=64 * mib)
    assert got == {"plan": {"LIST": 1},
                   "upload": {"PUT": 4, "MPU_CREATE": 2, "MPU_PART": 2 + 16, "MPU_COMPLETE": 2},
                   "commit": {"LIST": 1, "PUT": 3}, "cleanup": {"LIST": 1, "MPU_LIST": 1},
                   "resave_extra": {"GET": 1, "LIST": 1, "DELETE": 1}, "tracker": {"PUT": 1}}
    many = ss.s3_save_requests([1] * 1999)  # 1999 files: 2 LIST pages; +2 index objects: 3 pages / batches
    assert many["upload"]["PUT"] == 1999 and many["commit"] == {"LIST": 2, "PUT": 3}
    assert many["resave_extra"] == {"GET": 1, "LIST": 3, "DELETE": 3}


def test_s3_get_arithmetic():
    """Ranged GETs: per file, requests at most 1 MiB apart (or overlapping) coalesce into one run,
    each run ceil(len / 16 MiB) GETs."""
    mib = 1 << 20
    assert ss.s3_range_gets([]) == 0
    assert ss.s3_range_gets([("a", 0, 100), ("a", 100 + mib, 10), ("a", 200, 50)]) == 1  # gap of exactly 1 MiB
    assert ss.s3_range_gets([("a", 0, 100), ("a", 101 + mib, 10)]) == 2  # a byte more: two runs
    assert ss.s3_range_gets([("a", 0, 100), ("b", 0, 100), ("a", 50, 0)]) == 2  # per file; empty ignored
    assert ss.s3_range_gets([("a", 0, 16 * mib), ("a", 16 * mib, 1)]) == 2  # 16 MiB + 1 byte
    assert ss.s3_range_gets([("a", 0, 40 * mib), ("a", 8 * mib, 4 * mib)]) == 3  # overlap inside
    assert ss.s3_own_gets([("a", 0, 100), ("b", 0, 10), ("c", 5, 0)]) == {"GET": 3, "HEAD": 2, "data": 2}
    assert ss.s3_scatter_gets([[("a", 0, 100)], [("a", 0, 100), ("b", 0, 1)]]) == {
        "GET": 3, "HEAD": 1, "data": 2, "data_ranks": 0}
    # two ranks' halves of 40 MiB: each GETs its own (2 GETs of 16 + 4 MiB, the reader's and the other's);
    # column halves (1 KiB pieces interleaved): the ring, once, by the reader (3 GETs of the 40 MiB)
    half = 20 * mib
    assert ss.s3_scatter_gets([[("a", 0, half)], [("a", half, half)]]) == {
        "GET": 3, "HEAD": 1, "data": 2, "data_ranks": 2}
    cols = [[("a", k * 2048 + r * 1024, 1024) for k in range(half // 1024)] for r in range(2)]
    assert ss.s3_scatter_gets(cols) == {"GET": 3, "HEAD": 1, "data": 3, "data_ranks": 0}


def test_s3_report_small_config_exact():
    """--storage s3 on TP2·DP2 (4 ranks, 2 per node, all sampled): save counts from the index's files,
    own GETs summed over every rank, scatter GETs over both nodes' readers, each exact."""
    layout = sm.Layout(tp=2, pp=1, dp=2, distributed_optimizer=True)
    out = ss.simulate_save("tiny-gpt", layout)
    head, sections = out["_head"], out["_sections"]
    rep = ss.s3_report(head, sections, "tiny-gpt", layout, sample=16, ranks_per_node=2)
    m = _full(out)
    assert rep["s3_files"] == len(m.files) == 8
    assert all(f["bytes"] < ss.S3_PART_BYTES for f in m.files.values())  # tiny: one PUT each
    assert rep["s3_save_requests"]["upload"] == {"PUT": 8, "MPU_CREATE": 0, "MPU_PART": 0, "MPU_COMPLETE": 0}
    assert rep["s3_save_total"] == 1 + 8 + 4 + 2 + 1  # plan, uploads, commit, clean-up, tracker
    assert rep["s3_save_max_rank_uploads"] == 2  # each rank writes two files
    # own: every rank head + digest + index, a HEAD per file it reads, its data; every file is smaller
    # than the 1 MiB gap, so all of a rank's ranges in one file are one GET
    assert max(f["bytes"] for f in m.files.values()) < ss.S3_GAP_BYTES
    plans = [ss.plan_rank(head, sections, "tiny-gpt", layout, r, ranges=True) for r in range(4)]
    files_read = [len({f for f, _, n in p["ranges"] if n}) for p in plans]
    assert rep["s3_load_own_gets"] == {"GET": 12, "HEAD": sum(files_read), "data": sum(files_read),
                                       "total": 12 + 2 * sum(files_read)}
    assert rep["s3_load_own_max_rank_gets"] == max(3 + 2 * k for k in files_read)
    # scatter: one reader per node (2 nodes): head + digest + whole index, a HEAD per file the
    # reader's own plan reads, one GET per file the node reads
    scatter_plans = [ss.plan_rank(head, sections, "tiny-gpt", layout, r, rows_ok=False, ranges=True)["ranges"]
                     for r in range(4)]
    node_files = [len({f for r in (2 * nd, 2 * nd + 1) for f, _, n in scatter_plans[r] if n}) for nd in range(2)]
    reader_files = [len({f for f, _, n in scatter_plans[2 * nd] if n}) for nd in range(2)]
    assert rep["s3_load_scatter_gets"] == {"GET": 6, "HEAD": sum(reader_files), "data": sum(node_files),
                                           "data_ranks": 0, "total": 6 + sum(reader_files) + sum(node_files)}
    assert (rep["s3_load_own_gets"]["data"], rep["s3_load_scatter_gets"]["data"]) == (22, 12)  # as computed today

    assert rep["s3_rank_index_read_bytes"] == rep["s3_rank_index_read_bytes_whole"] == len(sections)
    assert rep["s3_rank_index_gets"] == 1


def test_s3_report_ranged_index_reads(monkeypatch):
    """An index above MEGASHARD_S3_INDEX_WHOLE_BYTES (here 0; 1 KiB blocks): each rank's own load
    is head + digest (2 GETs) and the index's block GETs (``index``: its last block, then those of
    its sections), as many as the
    load's block reader fetches, and fewer bytes than the whole index; the data GETs are as before."""
    monkeypatch.setenv("MEGASHARD_S3_INDEX_WHOLE_BYTES", "0")
    monkeypatch.setenv("MEGASHARD_S3_INDEX_BLOCK_BYTES", "1024")
    layout = sm.Layout(tp=2, pp=2, dp=2, distributed_optimizer=True)
    out = ss.simulate_save("tiny-gpt", layout)
    head, sections = out["_head"], out["_sections"]
    rep = ss.s3_report(head, sections, "tiny-gpt", layout, sample=16, ranks_per_node=2)
    plans = [ss.plan_rank(head, sections, "tiny-gpt", layout, r, ranges=True, s3_index=True) for r in range(8)]
    files_read = [len({f for f, _, n in p["ranges"] if n}) for p in plans]
    assert all(p["index_read_bytes"] - len(head) <= p["s3_index_bytes"] < len(sections) for p in plans), (
        [p["s3_index_bytes"] for p in plans], len(sections))
    assert rep["s3_rank_index_read_bytes"] == max(p["s3_index_bytes"] for p in plans)
    assert rep["s3_rank_index_gets"] == max(p["s3_index_gets"] for p in plans) >= 1
    own = rep["s3_load_own_gets"]
    assert own["GET"] == 16 and own["HEAD"] == sum(files_read)
    assert own["index"] == sum(p["s3_index_gets"] for p in plans)
    assert own["data"] == sum(ss.s3_range_gets(p["ranges"]) for p in plans)


def test_load_bytes_report_small_config_exact():
    """--load-bytes on TP2·DP2 (4 ranks, 2 per node, both nodes sampled): ``own`` is every rank's
    ranges summed, ``scatter`` each node's union, ``readonce`` every saved byte once; the two DP
    replicas read the parameters twice in ``own`` and ``scatter`` (one per node), once in ``readonce``."""
    layout = sm.Layout(tp=2, pp=1, dp=2)
    out = ss.simulate_save("tiny-gpt", layout)
    head, sections = out["_head"], out["_sections"]
    rep = ss.load_bytes_report(head, sections, "tiny-gpt", layout, sample=16, ranks_per_node=2)
    files = [f["bytes"] for f in _full(out).files.values()]
    plans = [ss.plan_rank(head, sections, "tiny-gpt", layout, r, ranges=True)["ranges"] for r in range(4)]
    own = sum(n for p in plans for _f, _o, n in p)
    sizes = {name: f["bytes"] for name, f in _full(out).files.items()}

    def covered(ranks):  # bytes the ranks read, each counted once (a mask per file)
        masks = {name: bytearray(n) for name, n in sizes.items()}
        for r in ranks:
            for f, o, n in plans[r]:
                masks[f][o:o + n] = b"\x01" * n
        return sum(m.count(1) for m in masks.values())

    covered = [covered(rs) for rs in ((0, 1), (2, 3), (0, 1, 2, 3))]
    by = rep["load_storage_bytes"]
    assert rep["load_unique_bytes"] == sum(files) and rep["load_nodes"] == 2
    assert by["own"]["total_bytes"] == own and by["own"]["max_node_bytes"] == max(
        sum(n for r in rs for _f, _o, n in plans[r]) for rs in ((0, 1), (2, 3)))
    assert by["scatter"]["total_bytes"] == covered[0] + covered[1]
    assert covered[0] == covered[1] == covered[2]  # each node needs every parameter byte
    # both replicas read everything again; own also reads TP-replicated norms once per TP rank
    assert by["own"]["total_bytes"] > by["scatter"]["total_bytes"] == 2 * covered[2]
    assert by["readonce"]["total_bytes"] == sum(files) >= covered[2]  # files also hold headers
    assert by["readonce"]["max_node_bytes"] <= sum(files) // 2 + max(files)


def test_s3_option_prints_in_the_simulators_format(capsys):
    assert ss.main(["--model", "tiny-gpt", "--tp", "2", "--dp", "2", "--distributed-optimizer",
                    "--storage", "s3", "--ranks-per-node", "2"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert {k.strip() for k in lines} >= {"s3_save_requests", "s3_load_own_gets", "s3_load_scatter_gets"}
    assert lines[f"{'s3_save_total':>34}"] == "16"


def test_swiglu_fc1_optimizer_state_uneven_over_dp_saves_at_70b():
    """llama3-70b TP8·PP8·DP2 with the DistributedOptimizer: fc1's DP pieces differ in length.
    megatron-core's own fc1 optimizer state (``quirk``: 1-D halves of each flat piece, global
    shape = piece length) is refused by the coordinator; what megashard.megatron passes since
    ``flatten_swiglu_optimizer_factories`` saves, every element once with the weight's global
    shape, and plans a load at TP4·DP4 without problems."""
    import pytest

    from megashard.errors import StateDictError

    layout = sm.Layout(tp=8, pp=8, dp=2, distributed_optimizer=True)
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    with pytest.raises(StateDictError, match=rf"'optimizer\.state\.exp_avg\.{fc1}': rank \d+ has dtype float32 "
                                             r"global shape \(80, \d+\), another rank has float32 \(80, \d+\)"):
        ss.simulate_save("llama3-70b", layout, quirk=True)
    out = ss.simulate_save("llama3-70b", layout)
    m = _full(out)
    for state in ("exp_avg", "exp_avg_sq", "fp32_param"):
        key = f"optimizer.state.{state}.{fc1}"
        t = m.tensors[key]
        assert t.global_shape == m.tensors[fc1].global_shape == (80, 2 * 28672, 8192)
        assert coverage_problems(key, t.global_shape,
                                 [(Box(s.offset, s.shape), s.flat) for s in t.shards]) == []
        assert any(s.flat is not None and s.flat[1] - s.flat[0] < numel(s.shape) for s in t.shards)
    p = ss.plan_rank(out["_head"], out["_sections"], "llama3-70b", sm.Layout(tp=4, pp=8, dp=4, distributed_optimizer=True), 5)
    assert p["problems"] == [] and p["read_bytes"] > 0

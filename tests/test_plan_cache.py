"""The save plan cache (megashard.saving: plan_vote / _reuse_plan) across 4 real gloo ranks.

A save whose layout equals the previous save's reuses its plan after one all-reduce; a
changed key, shape, dtype, replica flag, state-tree grouping or world size plans afresh.
Every checkpoint, reused plan or not, loads back bit-exact, and a reused plan writes the
same files and records as a fresh plan of the same state."""
from __future__ import annotations

import json
import os

import pytest
import torch

import megashard
from megashard import saving
from megashard.errors import CheckpointError, DistributedError
from megashard.plan import text_ints
from megashard.sharded import ShardedTensor

from bitexact import assert_same
from distributed import all_ok, run_ranks


def _values(step: int, rank: int, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (step + 1) + rank * 1000 + 0.25).to(dtype)


def _state(step: int, rank: int, world: int, *, bias_key: str = "b", rows: int = 8,
           m_dtype: torch.dtype = torch.float32, args_by_rank: bool = False, main_bias_rank: int = 0,
           empty: bool = False) -> dict:
    """TP2 x DP(world/2): ``w`` split by rows over TP, replicated over DP; ``bias_key``
    replicated on every rank; ``m`` a distributed-optimizer state (each TP chunk cut in DP
    flat ranges); plain values (shared, per rank) and a rank-local tensor."""
    tp, dp, ndp = rank % 2, rank // 2, world // 2
    half = rows // 2
    w = _values(step, tp, (half, 6), torch.float32)
    b = _values(step, 0, (6,), torch.bfloat16)
    chunk = _values(step + 7, tp, (half * 6,), m_dtype)
    per = half * 6 // ndp
    m = chunk[dp * per:(dp + 1) * per].clone()
    local = _values(step, rank, (3,), torch.float64)
    if empty:
        w, b, m, local = torch.zeros_like(w), torch.zeros_like(b), torch.zeros_like(m), torch.zeros_like(local)
    return {
        "model": {
            "w": ShardedTensor("w", w, (rows, 6), (tp * half, 0), replica_id=dp),
            bias_key: ShardedTensor(bias_key, b, (6,), (0,), replica_id=0 if rank == main_bias_rank else 1),
        },
        "optimizer": {"m": ShardedTensor("m", m, (rows, 6), (tp * half, 0), replica_id=0, local_shape=(half, 6),
                                         dtype=m_dtype, flattened_range=slice(dp * per, (dp + 1) * per))},
        "iteration": 100 + step,
        "args": {"lr": 0.5 if args_by_rank and rank == 3 else 0.25, "layers": [1, 2, 3]},
        "note": {"rank": rank},
        "local": local,
    }


def _check(rank: int, world: int, path: str, saved: dict, kw: dict, pg=None) -> None:
    """Load ``path`` into a zero template and compare bit-exact with what was saved."""
    tmpl = _state(0, rank, world, empty=True, **kw)
    out = megashard.load(tmpl, path, process_group=pg)
    for part, key in (("model", "w"), ("model", kw.get("bias_key", "b")), ("optimizer", "m")):
        assert_same(out[part][key], saved[part][key].data)
    assert_same(out["local"], saved["local"])
    assert out["iteration"] == saved["iteration"] and out["args"] == saved["args"] and out["note"] == saved["note"]


# (name, step, state keywords, plan reused?)
STEPS = [
    ("first", 0, {}, False),
    ("same_layout_new_values", 1, {}, True),
    ("key_renamed", 2, {"bias_key": "bias"}, False),
    ("renamed_again", 3, {"bias_key": "bias"}, True),
    ("shape_changed", 4, {"bias_key": "bias", "rows": 12}, False),
    ("dtype_changed", 5, {"bias_key": "bias", "rows": 12, "m_dtype": torch.bfloat16}, False),
    ("main_replica_moved", 6, {"bias_key": "bias", "rows": 12, "m_dtype": torch.bfloat16, "main_bias_rank": 2}, False),
    ("args_differ_on_rank3", 7, {"bias_key": "bias", "rows": 12, "m_dtype": torch.bfloat16, "main_bias_rank": 2,
                                 "args_by_rank": True}, False),
    ("args_still_differ", 8, {"bias_key": "bias", "rows": 12, "m_dtype": torch.bfloat16, "main_bias_rank": 2,
                              "args_by_rank": True}, True),
    # groups that merge keep their uploaders (ranks 0 and 3 both upload the same args): reused
    ("args_agree_again", 9, {"bias_key": "bias", "rows": 12, "m_dtype": torch.bfloat16, "main_bias_rank": 2}, True),
]


def _plan_id(world: int, rank: int):
    e = saving._PLAN_CACHE.get((world, rank))
    return e.plan_id if e is not None else None


def _records(path: str) -> dict:
    m = megashard.read_manifest(path)
    return {k: sorted((s.offset, s.shape, s.flat, s.file, s.name, s.nbytes, s.data_offset, s.crc32) for s in t.shards)
            for k, t in m.tensors.items()}


def _steps(rank, world, base):
    import torch.distributed as dist

    reused = []
    for name, step, kw, _ in STEPS:
        before = _plan_id(world, rank)
        sd = _state(step, rank, world, **kw)
        path = os.path.join(base, name)
        megashard.save(sd, path)
        after = _plan_id(world, rank)
        reused.append(before is not None and before == after)
        _check(rank, world, path, _state(step, rank, world, **kw), kw)
    # a reused plan writes what a fresh plan of the same state writes
    kw = STEPS[-1][2]
    steady = saving._PLAN_CACHE[(world, rank)].steady_commits
    megashard.save(_state(10, rank, world, **kw), os.path.join(base, "reused"))
    # ... and commits by sending only its CRC32s into rank 0's index skeleton
    reused.append((_plan_id(world, rank) == after, saving._PLAN_CACHE[(world, rank)].steady_commits == steady + 1))
    saving._PLAN_CACHE.clear()
    megashard.save(_state(10, rank, world, **kw), os.path.join(base, "fresh"))
    # another world size in the same job: a group of 2 plans afresh, and the 4-rank plan survives it
    g2 = dist.new_group([0, 1])
    if rank < 2:
        sd2 = _state(11, rank, 2)
        megashard.save(sd2, os.path.join(base, "world2"), process_group=g2)
        _check(rank, 2, os.path.join(base, "world2"), _state(11, rank, 2), {}, g2)
    dist.barrier()
    before = _plan_id(world, rank)
    megashard.save(_state(12, rank, world, **kw), os.path.join(base, "after_world2"))
    reused.append(before is not None and _plan_id(world, rank) == before)
    _check(rank, world, os.path.join(base, "after_world2"), _state(12, rank, world, **kw), kw)
    # a reused plan whose target rank 0 refuses: every rank raises, nothing is written, the plan stays
    refused = os.path.join(base, "refused")
    if rank == 0:
        with open(refused, "wb") as f:
            f.write(b"precious")
    dist.barrier()
    before = _plan_id(world, rank)
    try:
        megashard.save(_state(13, rank, world, **kw), refused)
        err = None
    except CheckpointError as e:
        err = (isinstance(e, DistributedError), refused in str(e) and "it is a file, not a directory" in str(e))
    reused.append((err, _plan_id(world, rank) == before))
    return reused


def _new_job(rank, world, base):
    """A new job (fresh processes) of another world size: nothing cached, a correct checkpoint."""
    assert _plan_id(world, rank) is None and not saving._PLAN_CACHE
    for step in (20, 21):
        path = os.path.join(base, f"job2_{step}")
        megashard.save(_state(step, rank, world), path)
        _check(rank, world, path, _state(step, rank, world), {})
    return _plan_id(world, rank) is not None


def test_plan_cache_reuses_only_an_unchanged_layout_and_every_checkpoint_is_exact(tmp_path):
    base = str(tmp_path)
    res = all_ok(run_ranks(_steps, 4, base, timeout=400))
    expected = [r for *_, r in STEPS] + [(True, True), True, ((True, True), True)]
    for rank, got in enumerate(res):
        assert got == expected, f"rank {rank}: reused {got}, expected {expected}"
    assert _records(os.path.join(base, "reused")) == _records(os.path.join(base, "fresh"))
    # the skeleton patched with this save's CRC32s is byte for byte the index a fresh plan builds
    with open(os.path.join(base, "reused", "manifest.index"), "rb") as f, \
            open(os.path.join(base, "fresh", "manifest.index"), "rb") as g:
        assert f.read() == g.read()
    # nothing cached on disk: every directory here is a checkpoint this test saved
    with open(os.path.join(base, "refused"), "rb") as f:
        assert f.read() == b"precious"
    names = set(os.listdir(base)) - {"refused"}
    assert names == {n for n, *_ in STEPS} | {"reused", "fresh", "world2", "after_world2"}
    assert all(os.path.exists(os.path.join(base, n, "manifest.json")) for n in names)
    assert all(all_ok(run_ranks(_new_job, 2, base, timeout=200)))
    assert os.path.exists(os.path.join(base, "job2_21", "manifest.json"))


# -- the vote alone (plain data, no processes) ------------------------------------------------


def _messages(world: int, args=None, rows: int = 8):
    """Announcements of ``world`` ranks holding replicas of one tensor, with shared and
    rank-local state-tree parts (``args[r]``: rank r's args part id)."""
    from megashard import plan

    out = []
    for r in range(world):
        entries = [["w", "float32", [rows, 6], [0, 0], [rows, 6], None, rows * 24]]
        blobs = [("iteration", "a" * 32), ("args", (args or {}).get(r, "b" * 32)), ("local", f"rank{r}/local")]
        msg, _ = plan.announcement(entries, [r == 0], [], [], blobs)
        out.append(msg)
    return out


def _agreed(entries, msgs) -> bool:
    world = len(msgs)
    total = [0, 0, 0]
    for r, (e, m) in enumerate(zip(entries, msgs)):
        total = [a + b for a, b in zip(total, saving.plan_vote(e, m, r, world))]
    return saving.plan_agreed(total)


def test_vote_agrees_only_when_every_rank_holds_the_same_plan_and_grouping():
    msgs = _messages(4)
    replies = saving.coordinate(msgs, "t")
    entries = [saving.remember_plan(m, rep) for m, rep in zip(msgs, replies)]
    assert _agreed(entries, msgs)
    # new content of shared parts (the iteration), same grouping: reused, the same uploader sends the new part
    new = _messages(4, args={r: "c" * 32 for r in range(4)})
    assert _agreed(entries, new)
    assert [saving.cached_reply(e, m)["blobs"] for e, m in zip(entries, new)] == \
        [["a" * 32, "c" * 32, "rank0/local"], ["rank1/local"], ["rank2/local"], ["rank3/local"]]
    # one rank's shared part now differs from its uploader's: nobody would upload it -> plan afresh
    assert not _agreed(entries, _messages(4, args={2: "d" * 32}))
    # a changed shape on one rank, or one rank without a cached plan: plan afresh
    assert not _agreed(entries, _messages(4, rows=10)[:1] + msgs[1:])
    assert not _agreed([None] + entries[1:], msgs)
    # one rank's plan is another save's (same layout, another plan id): plan afresh
    other = [saving.remember_plan(m, rep) for m, rep in zip(msgs, saving.coordinate(msgs, "u"))]
    assert other[3].plan_id != entries[3].plan_id
    assert not _agreed(entries[:3] + other[3:], msgs)
    assert _agreed(other, msgs)


# -- the index skeleton alone (plain data, no processes) ---------------------------------------

def _results(crc_of, world: int = 3):
    """Write records of ``world`` ranks: key ``w`` cut in rows by rank, each rank's piece in two
    flat ranges (records of one chunk from one rank), and an empty shard (file null)."""
    from megashard.manifest import record_text

    out = []
    for r in range(world):
        recs = []
        for i, (a, b) in enumerate(((0, 6), (6, 12))):
            text = record_text("w", (world * 2, 6), (2 * r, 0), (2, 6), (a, b), f"model-r{r:05d}.tensors", "n",
                               4096 * (i + 1), 8192 * (i + 1), 24)
            recs.append(["w", f"[[{2 * r},0],[2,6]]", a, text, crc_of(r, i)])
        recs.append(["e", "[[0],[0]]", 0, record_text("e", (0,), (0,), (0,), None, None, "", 0, 0, 0), 0])
        out.append({"files": {f"model-r{r:05d}.tensors": {"rank": r, "bytes": 1 << 20, "tensors": 2}}, "records": recs,
                    "objects": {}, "tree": [["step", "p"]], "parts": {"p": "7"}})
    return out


def test_index_skeleton_takes_new_crcs_and_equals_a_fresh_build():
    from megashard import manifest as mf
    from megashard.plan import Box

    tensors = {"w": ("float32", (6, 6)), "e": ("float32", (0,))}
    first = _results(lambda r, i: r * 10 + i)
    head, sections, skel = saving.build_index(first, tensors, 3, None)
    # 0, the largest CRC32 and every width between: the same bytes as a full build of those records
    crcs = [0, 0xFFFFFFFF, 5, 123456789, 1000000000, 9]
    new = _results(lambda r, i: crcs[2 * r + i])
    assert [saving.records_digest(r["records"]) for r in new] == [saving.records_digest(r["records"]) for r in first]
    steady = [saving.steady_commit(r) for r in new]
    assert saving._steady_crcs(steady).tolist() == [0, 0xFFFFFFFF, 0, 5, 123456789, 0, 1000000000, 9, 0]
    head2, sections2, skel2 = saving.build_index(steady, tensors, 3, None, skel)
    head3, sections3, _ = saving.build_index(new, tensors, 3, None)
    assert skel2 is skel and sections2 == sections3 and sections2 != sections
    doc = mf.parse_head(head2, "t")
    index = mf.LazyIndex(doc, lambda s, n: sections2[s:s + n], "t", len(head2))
    got = sorted((s.offset, s.flat, s.crc32) for s in index.pieces("w", Box((0, 0), (6, 6))))
    assert got == sorted(((2 * r, 0), ab, crcs[2 * r + i]) for r in range(3) for i, ab in enumerate(((0, 6), (6, 12))))
    assert sections2[:len(skel.prefix)] == sections[:len(skel.prefix)]  # only the CRC32 region differs
    assert sections2[len(skel.prefix):] != sections[len(skel.prefix):]
    # a record that changed other than its CRC32 changes the digest; a wrong count is refused
    moved = _results(lambda r, i: 0)
    moved[1]["records"][0][3] = moved[1]["records"][0][3].replace("8192", "8196")
    assert saving.records_digest(moved[1]["records"]) != saving.records_digest(first[1]["records"])
    with pytest.raises(ValueError, match="holds 9 records, got 8 CRC32s"):
        saving.build_index([dict(steady[0], crcs="0100000002000000")] + steady[1:], tensors, 3, None, skel)
    with pytest.raises(ValueError, match="rank 1 sent a malformed CRC32 list"):
        saving.build_index([steady[0], dict(steady[1], crcs="010000")] + steady[2:], tensors, 3, None, skel)
    with pytest.raises(ValueError, match="rank 2 sent a malformed CRC32 list"):
        saving.build_index(steady[:2] + [dict(steady[2], crcs="zz000000")], tensors, 3, None, skel)


def test_build_index_consuming_records_gives_the_same_index_and_one_copy_of_it():
    """Rank 0's commit lets the index builder take the records (``consume``: freed while the index
    is built, issue 32): the same bytes as a build that leaves them, the skeleton's prefix and tail
    are views of the index bytes (not second copies), and a steady commit from that skeleton gives
    the bytes of a full build."""
    tensors = {"w": ("float32", (6, 6)), "e": ("float32", (0,))}
    kept = _results(lambda r, i: r * 10 + i)
    taken = _results(lambda r, i: r * 10 + i)
    _, sections, _ = saving.build_index(kept, tensors, 3, None)
    _, sections_c, skel = saving.build_index(taken, tensors, 3, None, consume=True)
    assert sections_c == sections and type(sections_c) is bytes
    assert all(r["records"] is None for r in taken) and all(r["records"] for r in kept)
    assert [r["files"] for r in taken] == [r["files"] for r in kept]  # what the commit reads after
    assert isinstance(skel.prefix, memoryview) and skel.prefix.obj is sections_c
    assert isinstance(skel.tail.data, memoryview) and skel.tail.data.obj is sections_c
    assert bytes(skel.prefix) + sections_c[len(skel.prefix):skel.tail.start] + bytes(skel.tail.data) == sections_c
    new = _results(lambda r, i: 3 * r + i + 5)
    _, steady, _ = saving.build_index([saving.steady_commit(r) for r in new], tensors, 3, None, skel)
    assert steady == saving.build_index(new, tensors, 3, None, consume=True)[1]


def test_steady_commit_sends_only_what_changed_and_index_equals_a_fresh_build():
    """Version 3: the chunk sections and tensor table are byte-identical between saves of one
    layout (the CRC32s are in their own region); a rank whose files, objects and state-tree parts
    equal its last commit's sends its CRC32s only, and rank 0 writes what it kept."""
    from megashard import manifest as mf

    tensors = {"w": ("float32", (6, 6)), "e": ("float32", (0,))}
    first = _results(lambda r, i: r * 10 + i)
    head, sections, skel = saving.build_index(first, tensors, 3, None)
    assert mf.parse_head(head, "t")["version"] == 3
    prev = [saving.meta_digests(r) for r in first]
    new = _results(lambda r, i: 7 * r + i + 1)
    steady = [saving.steady_commit(r, p) for r, p in zip(new, prev)]
    assert all(set(m) == {"crcs"} for m in steady)  # nothing but the CRC32s
    head2, sections2, skel2 = saving.build_index(steady, tensors, 3, None, skel)
    head3, sections3, _ = saving.build_index(new, tensors, 3, None)
    assert skel2 is skel and sections2 == sections3
    assert sections2[:len(skel.prefix)] == sections[:len(skel.prefix)] == skel.prefix  # chunk sections, tensor table
    assert json.loads(head2)["tensors"] == json.loads(head)["tensors"]
    # rank 1's state-tree part changes (its iteration): it sends that, rank 0 keeps the others
    again = _results(lambda r, i: r + i)
    again[1]["parts"] = {"p2": "8"}
    again[1]["tree"] = [["step", "p2"]]
    prev = [saving.meta_digests(r) for r in new]
    steady = [saving.steady_commit(r, p) for r, p in zip(again, prev)]
    assert set(steady[1]) == {"crcs", "tree", "parts"} and set(steady[0]) == {"crcs"}
    head4, sections4, _ = saving.build_index(steady, tensors, 3, None, skel)
    head5, sections5, _ = saving.build_index(again, tensors, 3, None)
    assert sections4 == sections5
    doc4, doc5 = json.loads(head4), json.loads(head5)
    assert doc4["rank_trees"] == doc5["rank_trees"] and doc4["rank_trees"][1] != doc4["rank_trees"][0]
    m = mf.LazyIndex(mf.parse_head(head4, "t"), lambda s, n: sections4[s:s + n], "t", len(head4)).full()
    assert m.tree_for_rank(1) == {"step": 8} and m.tree_for_rank(0) == {"step": 7}
    assert sorted(s.crc32 for s in m.tensors["w"].shards) == sorted(r + i for r in range(3) for i in range(2))
    # only rank 2's file table changes (an object store's ETag): the rest of the last index is kept
    files_only = _results(lambda r, i: r + i)
    files_only[1].update(parts={"p2": "8"}, tree=[["step", "p2"]])
    files_only[2]["files"]["model-r00002.tensors"]["etag"] = "abc"
    prev = [saving.meta_digests(r) for r in again]
    steady = [saving.steady_commit(r, p) for r, p in zip(files_only, prev)]
    assert set(steady[2]) == {"crcs", "files"} and set(steady[1]) == {"crcs"}
    head6, sections6, _ = saving.build_index(steady, tensors, 3, None, skel)
    head7, sections7, _ = saving.build_index(files_only, tensors, 3, None)
    assert sections6 == sections7 and json.loads(head6)["files"] == json.loads(head7)["files"]
    assert json.loads(head6)["rank_trees"] == json.loads(head7)["rank_trees"]
    m = mf.LazyIndex(mf.parse_head(head6, "t"), lambda s, n: sections6[s:s + n], "t", len(head6)).full()
    assert m.files["model-r00002.tensors"]["etag"] == "abc" and m.tree_for_rank(1) == {"step": 8}
    # then rank 0's ShardedObject changes: objects and trees are laid out again
    objs = [dict(r) for r in files_only]
    objs[0] = dict(objs[0], objects={"rng/0": '{"s":1}'})
    prev = [saving.meta_digests(r) for r in files_only]
    steady = [saving.steady_commit(r, p) for r, p in zip(objs, prev)]
    assert set(steady[0]) == {"crcs", "objects"}
    head8, sections8, _ = saving.build_index(steady, tensors, 3, None, skel)
    head9, sections9, _ = saving.build_index(objs, tensors, 3, None)
    assert sections8 == sections9
    m = mf.LazyIndex(mf.parse_head(head8, "t"), lambda s, n: sections8[s:s + n], "t", len(head8)).full()
    assert m.object("rng/0") == {"s": 1} and m.files["model-r00002.tensors"]["etag"] == "abc"


def _results_split(crc_of, world: int = 3):
    """:func:`_results` plus key ``d`` (4 x 3) saved flat across the ranks: rank r holds elements
    4r..4r+4 of its one chunk, so that chunk's records lie in every rank's message."""
    from megashard.manifest import record_text

    out = _results(crc_of, world)
    for r, res in enumerate(out):
        a, b = 4 * r, 4 * r + 4
        text = record_text("d", (4, 3), (0, 0), (4, 3), (a, b), f"model-r{r:05d}.tensors", "d", 65536, 69632, 16)
        res["records"].insert(1, ["d", "[[0,0],[4,3]]", a, text, crc_of(r, 7)])
    return out


@pytest.mark.parametrize("groups", [[3], [1, 1, 1], [2, 1], [1, 2]])
def test_index_from_gather_groups_holds_every_record_as_one_group_build(groups):
    """Issue 32: rank 0 lays the first save's index out from its gather groups' parts
    (``saving.commit_part``, each leader's): a chunk whose records one group holds is written from
    the group's joined text; a chunk whose pieces several groups hold (``d``) is joined at rank 0
    in flat order. Every grouping gives the index of every record with its CRC32, and a steady
    commit from its skeleton the bytes of a fresh build of the same grouping."""
    from megashard import manifest as mf
    from megashard.plan import Box

    tensors = {"w": ("float32", (6, 6)), "e": ("float32", (0,)), "d": ("float32", (4, 3))}

    def build(results):
        parts, at = [], 0
        for n in groups:
            parts.append(saving.commit_part(results[at:at + n]))
            at += n
        split = [c for p in parts for c in _chunk_rows(p["records"]) if p["records"]["keys"][c[0]] == "d" and not c[-1]]
        assert len(split) == (0 if groups == [3] else len(groups))  # d is whole only in one group of all
        return saving.build_index_from_parts(parts, tensors, 3, None)

    def shards(head, sections):
        index = mf.LazyIndex(mf.parse_head(head, "t"), lambda s, n: sections[s:s + n], "t", len(head))
        return sorted((k, s.offset, s.flat, s.file, s.name, s.header_offset, s.data_offset, s.crc32)
                      for k, box in (("w", Box((0, 0), (6, 6))), ("d", Box((0, 0), (4, 3))))
                      for s in index.pieces(k, box)), index

    first = _results_split(lambda r, i: r * 100 + i)
    head, sections, skel = build(first)
    got, index = shards(head, sections)
    assert [g[:3] + (g[-1],) for g in got if g[0] == "d"] == [("d", (0, 0), (4 * r, 4 * r + 4), r * 100 + 7)
                                                               for r in range(3)]
    assert len([g for g in got if g[0] == "w"]) == 6 and index.full().tensors["e"].shards[0].nbytes == 0
    # the one-group build (build_index) holds the same records
    one_head, one_sections, _ = saving.build_index(_results_split(lambda r, i: r * 100 + i), tensors, 3, None)
    assert shards(one_head, one_sections)[0] == got
    # steady: new CRC32s into this grouping's skeleton = a fresh build of it
    new = _results_split(lambda r, i: 7 * r + i + 1)
    _, steady, _ = saving.build_index([saving.steady_commit(r) for r in new], tensors, 3, None, skel)
    assert steady == build(new)[1]


def test_commit_part_sends_each_distinct_state_tree_once_and_the_index_keeps_every_rank_s():
    """Issue 32: a leader sends its members' equal state trees once (``tree_of`` numbers them), so
    rank 0 decodes and holds one list per distinct tree; the index names the right tree for every rank."""
    from megashard import manifest as mf

    tensors = {"w": ("float32", (8, 6)), "e": ("float32", (0,))}
    results = _results(lambda r, i: r * 100 + i, world=4)
    results[2]["tree"] = [["step", "q"], ["extra", "p"]]
    results[2]["parts"] = {"q": "8"}
    part = saving.commit_part([dict(r) for r in results])
    assert part["tree_of"] == [0, 0, 1, 0] and part["tree"] == [[["step", "p"]], [["step", "q"], ["extra", "p"]]]
    head, sections, _ = saving.build_index_from_parts([part], tensors, 4, None)
    index = mf.LazyIndex(mf.parse_head(head, "t"), lambda s, n: sections[s:s + n], "t", len(head))
    assert [index.tree_for_rank(r) for r in range(4)] == [{"step": 7}, {"step": 7}, {"step": 8, "extra": 7},
                                                          {"step": 7}]
    assert len(set(index.rank_trees)) == 2
    one_head, one_sections, _ = saving.build_index(_results(lambda r, i: r * 100 + i, world=4)[:2] + [results[2]]
                                                   + _results(lambda r, i: r * 100 + i, world=4)[3:], tensors, 4, None)
    assert mf.parse_head(one_head, "t")["rank_trees"] == mf.parse_head(head, "t")["rank_trees"]


def _chunk_rows(grouped):
    """The chunk rows of a :func:`megashard.manifest.group_records` part, each ending in its whole flag."""
    ints, i, rows = text_ints(grouped["chunks"]).tolist(), 0, []
    while i < len(ints):
        nd = ints[i + 1]
        rows.append(ints[i:i + 6 + 2 * nd])
        i += 6 + 2 * nd
    return rows

"""Read-once loads: every byte the job needs leaves storage once, then travels over the process group.

The plan (``plan.plan_read_once``) is tested as a pure function; the loads run on gloo ranks
split over two fake nodes (``MEGASHARD_NODE_ID`` per rank), where ``mode="auto"`` picks
``readonce``. One spawned job of 4 ranks runs every scenario (world 2: a group of one rank per
node) to keep the suite fast.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed import all_ok, run_ranks
from layouts import GLOBALS, Layout, check_state, model_state
from tamper import flip_data_byte

from megashard import plan

# -- the plan, as a pure function ---------------------------------------------------------------


def _union(ranges: Sequence[Tuple[str, int, int]]) -> int:
    total = 0
    by_file: Dict[str, List[Tuple[int, int]]] = {}
    for f, a, n in ranges:
        if n:
            by_file.setdefault(f, []).append((a, a + n))
    for spans in by_file.values():
        end = None
        for a, b in sorted(spans):
            if end is None or a >= end:
                total += b - a
                end = b
            elif b > end:
                total += b - end
                end = b
    return total


def _check_plan(requests: List[List[Tuple[str, int, int]]], chunk: int,
                nodes: Sequence[int] = None) -> plan.ReadOncePlan:
    """Every byte of the union read once; every byte of every op delivered exactly once (read in
    place or received), from the right file offset; messages match on both sides. With
    ``nodes``: every file (every block of a file over the block size) read on one node."""
    p = plan.plan_read_once(requests, chunk, nodes)
    if nodes is not None:
        total = sum(e.stop - e.start for e in p.extents)
        block = max(plan.READ_ONCE_NODE_BLOCK, -(-total // len(set(nodes))))
        on: Dict[Tuple[str, int], set] = {}
        for k, e in enumerate(p.extents):
            on.setdefault((e.file, e.start // block), set()).add(nodes[p.reader[k]])
        assert all(len(ns) == 1 for ns in on.values()), on
    world = len(requests)
    flat = [r for ops in requests for r in ops]
    assert sum(e.stop - e.start for e in p.extents) == _union(flat)
    assert sum(p.read_bytes()) == _union(flat)
    assert all(0 < e.stop - e.start <= chunk for e in p.extents)
    by_file: Dict[str, List[Tuple[int, int]]] = {}
    for e in p.extents:
        by_file.setdefault(e.file, []).append((e.start, e.stop))
    for spans in by_file.values():  # disjoint
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    replies = p.replies()
    assert len(replies) == world
    got: List[List[List[int]]] = [[[] for _ in ops] for ops in requests]  # rank -> op -> offsets covered
    sent: Dict[Tuple[int, int, int], List[int]] = {}  # (src, dst, round) -> message sizes, in order
    for r, rep in enumerate(replies):
        for k, (f, a, b, mine, runs) in enumerate(rep["reads"]):
            for i, pos, n, off in mine:
                assert requests[r][i][0] == f and requests[r][i][1] + pos == a + off
                got[r][i].extend(range(pos, pos + n))
            for dst, off, n in runs:
                assert dst != r and 0 <= off and off + n <= b - a
                sent.setdefault((r, dst, k), []).append(n)
    for dst, rep in enumerate(replies):
        for k, msgs in rep["recvs"].items():
            by_src: Dict[int, List[int]] = {}
            for src, n, pieces in msgs:
                by_src.setdefault(src, []).append(n)
                f, a, b, _, runs = replies[src]["reads"][int(k)]
                start = [off for d, off, m in runs if d == dst][len(by_src[src]) - 1]
                for i, pos, m, off in pieces:
                    assert requests[dst][i][0] == f and requests[dst][i][1] + pos == a + start + off
                    got[dst][i].extend(range(pos, pos + m))
            for src, sizes in by_src.items():
                assert sent.pop((src, dst, int(k))) == sizes
    assert sent == {}  # every message has a receiver
    for r, ops in enumerate(requests):
        for i, (_, _, n) in enumerate(ops):
            assert sorted(got[r][i]) == list(range(n)), (r, i)
    return p


def test_replicas_split_the_reads_and_send_each_other_their_half() -> None:
    """Same-layout resume, DP=2: each byte is read by one of the two replicas and sent to the other."""
    ops = [("a", 0, 1000), ("b", 0, 600)]
    p = _check_plan([ops, ops], 100)
    assert p.read_bytes() == [800, 800]
    replies = p.replies()
    assert sum(n for rep in replies for *_, runs in rep["reads"] for _, _, n in runs) == 1600  # each byte once


def test_bytes_one_rank_needs_are_read_by_it_and_never_sent() -> None:
    p = _check_plan([[("a", 0, 500)], [("b", 0, 300)], [("a", 0, 500)]], 64)
    replies = p.replies()
    assert p.read_bytes()[1] == 300 and p.read_bytes()[0] + p.read_bytes()[2] == 500
    assert all(runs == [] for *_, runs in replies[1]["reads"]) and replies[1]["recvs"] == {}


def test_reads_spread_over_every_rank_within_a_chunk_of_the_mean() -> None:
    """Four ranks that all need one 64 KiB file, and two that need nothing: each of the six
    reads a sixth (byte-balanced over the job, not only over the ranks that keep the bytes)."""
    ops = [("f", 0, 65536)]
    p = _check_plan([ops, ops, ops, ops, [], []], 1024)
    loads = p.read_bytes()
    assert max(loads) - min(loads) <= 1024 and min(loads) > 0


def test_overlapping_ranges_of_one_rank_are_read_once() -> None:
    """A resharding rank's covering spans may overlap each other: still read once, delivered to both."""
    p = _check_plan([[("f", 0, 100), ("f", 50, 100)], [("f", 120, 30)]], 40)
    assert sum(p.read_bytes()) == 150


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 300), st.integers(0, 120)), max_size=5),
                min_size=1, max_size=5), st.integers(1, 90))
def test_plan_reads_the_union_once_and_delivers_every_byte(requests, chunk) -> None:
    _check_plan(requests, chunk)


def test_on_a_file_system_each_file_is_read_on_one_node_bytes_balanced() -> None:
    """A network file system's client fetches whole files (or large blocks): two nodes reading
    parts of one file would both fetch it. TP=2 x DP=2 over 2 nodes (one replica per node), six
    files of unequal sizes, every rank needing a part of every file: each file is read by the
    ranks of one node, the nodes read within the largest file of each other, and within a node
    its ranks within two chunks of each other (each stays within a chunk of the node's mean)."""
    sizes = {"a": 9000, "b": 7000, "c": 5000, "d": 4000, "e": 3000, "f": 2000}
    tp = [[(f, t * n // 2, n // 2) for f, n in sizes.items()] for t in range(2)]
    requests = [tp[0], tp[1], tp[0], tp[1]]
    nodes = [0, 0, 1, 1]
    p = _check_plan(requests, 256, nodes)
    loads = p.read_bytes()
    per_node = [loads[0] + loads[1], loads[2] + loads[3]]
    assert sum(per_node) == sum(sizes.values())
    assert abs(per_node[0] - per_node[1]) <= max(sizes.values()), per_node
    assert abs(loads[0] - loads[1]) <= 2 * 256 and abs(loads[2] - loads[3]) <= 2 * 256, loads
    # without nodes (an object store) extents of one file are spread over both nodes
    q = _check_plan(requests, 256)
    spread = {}
    for k, e in enumerate(q.extents):
        spread.setdefault(e.file, set()).add(nodes[q.reader[k]])
    assert any(len(ns) == 2 for ns in spread.values())


def test_on_a_file_system_a_file_goes_to_the_node_that_needs_it() -> None:
    """Files only one node needs are read there (nothing crosses nodes for them)."""
    requests = [[("x", 0, 4000)], [("x", 4000, 4000)], [("y", 0, 3000)], [("y", 3000, 5000)]]
    p = _check_plan(requests, 512, [7, 7, 3, 3])
    assert all(p.reader[k] in ((0, 1) if e.file == "x" else (2, 3)) for k, e in enumerate(p.extents))


def test_on_a_file_system_few_large_files_spread_over_every_node_in_blocks() -> None:
    """Two 256 MiB files (TP=2), one replica per node on 8 nodes of 2 ranks: whole files would leave
    6 nodes idle and 2 sending everything; instead each 64 MiB block (``READ_ONCE_NODE_BLOCK``) is
    read by the ranks of one node, and every node reads one block."""
    mib = 1 << 20
    tp = [[(f"t{t}", 0, 256 * mib)] for t in range(2)]
    nodes = [r // 2 for r in range(16)]
    p = plan.plan_read_once([tp[r % 2] for r in range(16)], 8 * mib, nodes)  # (too big for _check_plan)
    assert plan.READ_ONCE_NODE_BLOCK == 64 * mib
    assert sorted((e.file, e.start, e.stop) for e in p.extents) == [
        (f"t{t}", a, a + 8 * mib) for t in range(2) for a in range(0, 256 * mib, 8 * mib)]
    on: Dict[Tuple[str, int], set] = {}
    for k, e in enumerate(p.extents):
        on.setdefault((e.file, e.start // (64 * mib)), set()).add(nodes[p.reader[k]])
    assert len(on) == 8 and all(len(ns) == 1 for ns in on.values()), on
    loads = p.read_bytes()
    assert [loads[2 * n] + loads[2 * n + 1] for n in range(8)] == [64 * mib] * 8
    assert sorted(set(loads)) == [32 * mib]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 300), st.integers(0, 120)), max_size=5),
                min_size=2, max_size=6), st.integers(1, 90), st.integers(0, 2**16))
def test_plan_by_node_reads_each_file_on_one_node(requests, chunk, seed) -> None:
    nodes = [(seed >> r) % 2 for r in range(len(requests))]
    _check_plan(requests, chunk, nodes)


# -- loads on two fake nodes ----------------------------------------------------------------------


def _two_nodes(world: int) -> Dict[str, Any]:
    """Ranks 0..world/2-1 on node n0, the rest on n1."""
    return {str(r): {"MEGASHARD_NODE_ID": f"n{r * 2 // world}", "MEGASHARD_HUGEPAGES": "0"} for r in range(world)}


def _unique_bytes(distopt: bool) -> int:
    """Bytes of every saved tensor: what the job needs when its ranks together load everything."""
    model = sum(torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for s, dt in GLOBALS.values())
    return model + (sum(torch.Size(s).numel() * 4 for s, _ in GLOBALS.values()) if distopt else 0)


# (saved layout, loaded layout, distributed optimizer state): every case loads every saved byte
SCENARIOS = {
    2: [(Layout(dp=2), Layout(dp=2), False), (Layout(tp=2), Layout(dp=2), False),
        (Layout(dp=2), Layout(tp=2), True)],
    4: [(Layout(tp=2, dp=2), Layout(tp=2, dp=2), True), (Layout(tp=2, dp=2), Layout(tp=1, dp=4), True),
        (Layout(pp=2, tp=2), Layout(tp=2, dp=2), False)],
}


def _needed(template: Dict[str, Any]) -> int:
    out = 0

    def walk(node: Any) -> None:
        nonlocal out
        if hasattr(node, "key") and hasattr(node, "data"):
            out += node.data.numel() * node.data.element_size()
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)

    walk(template)
    return out


def _scenarios(rank: int, world: int, tmp: str, group: Any) -> List[Dict[str, Any]]:
    """``rank``/``world`` within ``group`` (None: the default group)."""
    import megashard

    out = []
    for n, (saved, loaded, distopt) in enumerate(SCENARIOS[world]):
        path = os.path.join(tmp, f"world{world}-ckpt{n}")
        megashard.save(model_state(saved, rank, distopt=distopt), path, process_group=group)
        modes = [("auto", 4096), ("auto", 8 << 20), ("own", 8 << 20)] + ([("scatter", 8 << 20)] if world == 2 else [])
        for mode, chunk in modes:
            template = model_state(loaded, rank, empty=True, distopt=distopt)
            verify = mode == "auto" and chunk == 8 << 20  # re-reads what it loaded, in place of the CRC32 check
            _, stats = megashard.load(template, path, mode=mode, return_stats=True, scatter_chunk_bytes=chunk,
                                      process_group=group, verify=verify)
            out.append({"scenario": n, "want": mode, "chunk": chunk, "mode": stats.mode, "bad": check_state(template),
                        "read": stats.bytes_read, "received": stats.bytes_received, "peak": stats.buffer_peak,
                        "needed": _needed(template), "crc": stats.crc_checked})
    return out


def _job(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """World 4 (ranks 0-1 on node n0, 2-3 on n1), then world 2 as the group of ranks 0 and 2
    (one per node): one spawn for every load of this module."""
    import torch.distributed as dist

    pair = dist.new_group([0, 2])
    out: Dict[str, Any] = {4: _scenarios(rank, 4, tmp, None), "failures": _failures(rank, tmp)}
    dist.barrier()
    if rank in (0, 2):
        out[2] = _scenarios(rank // 2, 2, tmp, pair)
    dist.barrier()
    return out


def _failures(rank: int, tmp: str) -> Dict[str, Any]:
    """World 4, TP=2 x DP=2: a damaged shard that ranks 1 and 3 keep (one reads it, the other
    receives it), and rank 2's storage failing mid-transfer."""
    import contextlib

    import torch.distributed as dist

    import megashard
    from megashard import storage

    layout = Layout(tp=2, dp=2)
    path = os.path.join(tmp, "fail-ckpt")
    megashard.save(model_state(layout, rank), path)
    if rank == 0:
        m = megashard.read_manifest(path)
        rec = [s for s in m.tensors["decoder.layers.self_attention.linear_qkv.weight"].shards
               if s.offset[0] == 7 and s.offset[1] > 0][0]
        flip_data_byte(path, rec)
    dist.barrier()
    out: Dict[str, Any] = {}

    def attempt(name: str, **kw: Any) -> None:
        try:
            megashard.load(model_state(layout, rank, empty=True), path, mode="auto", scatter_chunk_bytes=4096, **kw)
            out[name] = "no error"
        except megashard.DistributedError as e:
            out[name] = {"crc": isinstance(e, megashard.ChecksumError), "ranks": sorted(e.failures),
                         "text": {r: m[:300] for r, m in e.failures.items()}}

    attempt("damaged")
    real = storage.checkpoint_files

    class Failing:
        """Rank 2's storage: checks pass, every read of tensor bytes fails."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            self.inner = real(*a, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.close()

        def read_into(self, f: str, reqs: Any, **kw: Any) -> int:
            if reqs and f.endswith(".tensors"):
                raise OSError(5, "Input/output error")
            return self.inner.read_into(f, reqs, **kw)

    with contextlib.ExitStack() as stack:
        if rank == 2:
            storage.checkpoint_files = Failing  # type: ignore[assignment]
            stack.callback(setattr, storage, "checkpoint_files", real)
        attempt("read_fails", check_crc=False)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> List[Dict[str, Any]]:
    """Results by rank of the world 4 job; ranks 0 and 2 also of world 2."""
    tmp = str(tmp_path_factory.mktemp("readonce"))
    return all_ok(run_ranks(_job, 4, tmp, env=_two_nodes(4), timeout=240))


@pytest.mark.parametrize("world", [2, 4])
def test_read_once_loads_bit_exact_reading_each_byte_once_per_job(job, world: int) -> None:
    results = [r[world] for r in job if world in r]
    assert len(results) == world
    for i in range(len(results[0])):
        rows = [res[i] for res in results]
        saved, loaded, distopt = SCENARIOS[world][rows[0]["scenario"]]
        where = f"world {world}, {saved} -> {loaded}{' distopt' if distopt else ''}, {rows[0]['want']}, chunk {rows[0]['chunk']}"
        for rank, r in enumerate(rows):
            assert r["bad"] == [], f"{where}, rank {rank}: {r['bad']}"
        job_read = sum(r["read"] for r in rows)
        if rows[0]["want"] == "auto":
            assert [r["mode"] for r in rows] == ["readonce"] * world, where  # two nodes: auto reads once per job
            assert job_read == _unique_bytes(distopt), where  # every byte leaves storage once
            assert max(r["read"] for r in rows) <= job_read // world + rows[0]["chunk"], where  # byte-balanced
            assert all(r["read"] > 0 for r in rows), where  # reads on every rank of both nodes
            assert all(r["peak"] <= 3 * rows[0]["chunk"] for r in rows), where
            if saved == loaded:  # every byte a rank keeps it read itself or received once
                assert all(r["read"] + r["received"] >= r["needed"] for r in rows), where
                verified = rows[0]["chunk"] == 8 << 20  # verify=True replaces the CRC32 pass
                assert all(r["crc"] == (0 if verified else r["needed"]) for r in rows), where
        elif rows[0]["want"] == "own" and loaded.dp > 1:
            assert job_read > _unique_bytes(distopt), where  # each DP replica reads again
        elif rows[0]["want"] == "scatter" and loaded.dp > 1 and world == 2:
            assert job_read == 2 * _unique_bytes(distopt), where  # once per node


def test_read_once_failures_reach_every_rank(job) -> None:
    """Damaged bytes are caught by the CRC32 check on both ranks that keep them (the reader
    and the one that received them); a rank whose storage fails mid-transfer still sends, so
    every rank raises naming it instead of waiting."""
    for rank, r in enumerate(job):
        f = r["failures"]
        assert f["damaged"]["crc"] is True and f["damaged"]["ranks"] == [1, 3], (rank, f["damaged"])
        assert "is damaged" in f["damaged"]["text"][1], f["damaged"]
        assert f["read_fails"]["ranks"] == [2], (rank, f["read_fails"])
        assert "read-once load: reading" in f["read_fails"]["text"][2], f["read_fails"]
        assert "Input/output error" in f["read_fails"]["text"][2], f["read_fails"]


def test_auto_chooses_readonce_on_several_nodes_only_up_to_the_bound(tmp_path) -> None:
    """Rank 0 plans every rank's ranges for readonce: auto keeps own's per-rank plans above the bound."""
    from megashard.loading import READONCE_AUTO_MAX_RANKS, plan_probe

    def modes(world: int, nodes: int) -> set:
        infos = [{"sees": str(tmp_path), "node": f"n{r % nodes}", "why": None} for r in range(world)]
        return {p["mode"] for p in plan_probe(infos, str(tmp_path), "auto")}

    assert modes(4, 2) == {"readonce"} and modes(4, 1) == {"own"}
    assert modes(READONCE_AUTO_MAX_RANKS, 2) == {"readonce"}
    assert modes(READONCE_AUTO_MAX_RANKS + 1, 2) == {"own"}
    infos = [{"sees": str(tmp_path), "node": f"n{r % 2}", "why": None} for r in range(READONCE_AUTO_MAX_RANKS + 1)]
    assert {p["mode"] for p in plan_probe(infos, str(tmp_path), "readonce")} == {"readonce"}  # asked for: kept

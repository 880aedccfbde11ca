"""The two-level gather of save's coordinator (``transport.Comm.coordinate``) across 4 real
gloo ranks in groups of 2 (``MEGASHARD_GATHER_GROUP=2``: rank 2 leads ranks 2 and 3).

A save through the tree writes the index a flat gather writes (every record, CRC32, object and
tree; the sections in the groups' order); both load back
bit-exact, also after a plan-cache hit (the steady-state commit goes up the same tree); a
failure on a member of the non-leader group raises on every rank, naming that rank."""
from __future__ import annotations

import os
import random

import pytest

import megashard
from megashard import saving, transport
from megashard.errors import DistributedError

from distributed import all_ok, run_ranks
from test_plan_cache import _check, _state


def _save_flat_and_tree(rank, world, base):
    results = {}
    for name, group in (("tree", "2"), ("flat", "0")):
        os.environ["MEGASHARD_GATHER_GROUP"] = group
        saving._PLAN_CACHE.clear()
        path = os.path.join(base, name)
        megashard.save(_state(0, rank, world), path)
        _check(rank, world, path, _state(0, rank, world), {})
    # a steady-state save (plan reused, CRC32s into the skeleton) through the tree
    os.environ["MEGASHARD_GATHER_GROUP"] = "2"
    saving._PLAN_CACHE.clear()
    megashard.save(_state(1, rank, world), os.path.join(base, "tree_first"))
    steady = saving._PLAN_CACHE[(world, rank)].steady_commits
    megashard.save(_state(2, rank, world), os.path.join(base, "tree_steady"))
    results["steady"] = saving._PLAN_CACHE[(world, rank)].steady_commits == steady + 1
    _check(rank, world, os.path.join(base, "tree_steady"), _state(2, rank, world), {})
    # a member of the non-leader group fails to prepare: every rank raises, naming rank 3
    sd = _state(3, rank, world)
    if rank == 3:
        sd["bad"] = object()
    try:
        megashard.save(sd, os.path.join(base, "failed"))
        results["error"] = None
    except DistributedError as e:
        results["error"] = (sorted(e.failures), "'bad'" in str(e) and "rank 3" in str(e))
    results["group"] = transport.gather_group_size(world)
    return results


def test_tree_gather_writes_the_flat_index_and_agrees_on_errors(tmp_path):
    base = str(tmp_path)
    res = all_ok(run_ranks(_save_flat_and_tree, 4, base, timeout=200))
    for rank, got in enumerate(res):
        assert got == {"steady": True, "error": ([3], True), "group": 2}, f"rank {rank}: {got}"
    # the same index, laid out by groups (each leader joins its group's chunk records): every record,
    # CRC32, object and tree the flat gather's holds
    docs = [megashard.read_manifest(os.path.join(base, name)).to_doc() for name in ("tree", "flat")]
    for d in docs:
        d.pop("created")
    assert docs[0] == docs[1]
    assert sorted(os.listdir(os.path.join(base, "tree"))) == sorted(os.listdir(os.path.join(base, "flat")))
    assert not os.path.exists(os.path.join(base, "failed"))


def test_group_size_defaults_and_parts_round_trip(monkeypatch):
    monkeypatch.delenv("MEGASHARD_GATHER_GROUP", raising=False)
    assert [transport.gather_group_size(w) for w in (1, 64, 65, 16384, 131072)] == [1, 64, 9, 128, 363]
    sent = [{"a": "x" * 50, "b": [1, 2], "c": {"k": [1, 2]}}, {"a": "x" * 50, "b": [3], "c": {"k": [1, 2]}},
            [7], None, {"b": [1, 2], "line": "a\nb", "é": "ü"}, {}, {1: "int key"}]
    msgs = [transport.encode_message(None if r != 1 else "boom", p) for r, p in enumerate(sent)]
    want = [dict(p) if isinstance(p, dict) else p for p in sent]
    want[-1] = {"1": "int key"}  # a dict with a non-string key travels as one JSON text, as JSON has it
    assert transport.unpack_messages(msgs) == ({1: "boom"}, want)  # rank 0's own group
    errors, payloads = transport.unpack_part(transport.pack_part(msgs))  # another leader's group
    assert errors == {1: "boom"}
    assert payloads == want
    assert payloads[0]["a"] is payloads[1]["a"] and payloads[0]["c"] is payloads[1]["c"]  # shared: one object
    assert payloads[0]["b"] is payloads[4]["b"] and payloads[0]["b"] is not payloads[1]["b"]
    with pytest.raises(ValueError, match="past its fields"):
        transport.unpack_messages([msgs[0] + b"x"])
    replies = [{"ok": r} for r in range(3)]
    assert transport.unpack_replies(transport.pack_replies(replies)) == [transport._dumps_bytes(r) for r in replies]


def test_part_compresses_repeats_across_members():
    """Members' records repeat each other's texts (keys, file names, tree parts); the part
    stores a repeat within zlib's window about once, and round-trips."""
    rng = random.Random(3)
    shared = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12 << 10))
    sent = [{"records": [r, shared]} for r in range(8)]  # texts differ: pack_part's dedup keeps all 8
    part = transport.pack_part([transport.encode_message(None, p) for p in sent])
    assert transport.unpack_part(part) == ({}, sent)
    assert len(part) < 2 * len(shared)  # 8 copies of ~8 KB of entropy, stored about once

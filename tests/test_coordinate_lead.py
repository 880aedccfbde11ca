"""``transport.Comm.coordinate(..., lead=...)`` across 4 real gloo ranks in groups of 2
(``MEGASHARD_GATHER_GROUP=2``: rank 0 leads ranks 0-1, rank 2 leads ranks 2-3): each leader
reduces its group's payloads to one part, rank 0 computes one reply per group over the parts,
and each leader expands its group's reply to its members. A member's error, a reduce that
raises on a leader and a compute that raises reach every rank, naming the failing ranks."""
from __future__ import annotations

import sys
from typing import Any, List
from unittest import mock

import pytest

from megashard import transport
from megashard.errors import DistributedError

from distributed import all_ok, run_ranks


class _Sum:
    """A group's part: its ranks and their payloads' sum; the reply: the group's offset."""

    def __init__(self, fail_reduce_on: int = -1) -> None:
        self.fail_reduce_on = fail_reduce_on
        self.reduced: List[Any] = []

    def reduce(self, payloads: List[Any]) -> Any:
        if payloads[0]["rank"] == self.fail_reduce_on:
            raise ValueError(f"reduce refuses the group of rank {self.fail_reduce_on}")
        self.reduced.append([p["rank"] for p in payloads])
        return {"ranks": [p["rank"] for p in payloads], "sum": sum(p["value"] for p in payloads)}

    def expand(self, group_reply: Any, payloads: List[Any]) -> List[Any]:
        return [{"rank": p["rank"], "got": group_reply, "value": p["value"]} for p in payloads]


def _compute(parts: List[Any]) -> List[Any]:
    total = sum(p["sum"] for p in parts)
    return [{"ranks": p["ranks"], "total": total, "group": g} for g, p in enumerate(parts)]


class _Streamed(_Sum):
    streams = True  # rank 0's compute takes the parts as an iterator, each decoded when reached


def _streamed_cases(comm: Any, rank: int) -> Any:
    """A streaming lead: rank 0's compute gets an iterator, not a list, and each other group's part
    is decoded only when compute reaches it (the log interleaves decodes with uses)."""
    log: List[str] = []
    unpack = transport.unpack_led_part

    def logged_unpack(data):
        log.append("decode")
        return unpack(data)

    def compute(parts):
        kinds = type(parts).__name__
        seen = []
        for p in parts:
            log.append(f"use {p['ranks']}")
            seen.append(p)
        return [dict(r, kind=kinds) for r in _compute(seen)]

    transport.unpack_led_part = logged_unpack
    try:
        ok = comm.coordinate("lead test", None, {"rank": rank, "value": 10 * rank + 1}, compute, _Streamed())
        err = _raises(lambda: comm.coordinate("lead test", "rank 3 broke" if rank == 3 else None,
                                              {"rank": rank, "value": 1}, compute, _Streamed()))
    finally:
        transport.unpack_led_part = unpack
    return {"ok": ok, "log": log, "member": (err[0], "rank 3 broke" in err[1]) if err else None}


def _raises(fn):
    try:
        fn()
    except DistributedError as e:
        return sorted(e.failures), str(e)
    return None


def _lead_cases(rank, world):
    comm = transport.Comm()
    out = {"group": transport.gather_group_size(world)}
    lead = _Sum()
    out["ok"] = comm.coordinate("lead test", None, {"rank": rank, "value": 10 * rank + 1}, _compute, lead)
    out["reduced"] = lead.reduced  # only leaders reduce, over their group in rank order
    # a member of the non-leader group fails: its leader does not reduce, rank 0 does not compute, every
    # rank raises naming rank 3
    lead = _Sum()
    err = _raises(lambda: comm.coordinate("lead test", "rank 3 broke" if rank == 3 else None,
                                          {"rank": rank, "value": 1}, _compute, lead))
    out["member"] = (err[0], "rank 3 broke" in err[1]) if err else None
    out["member_reduced"] = lead.reduced
    # the leader of ranks 2-3 fails to reduce: every rank raises naming rank 2
    err = _raises(lambda: comm.coordinate("lead test", None, {"rank": rank, "value": 1}, _compute, _Sum(2)))
    out["reduce"] = (err[0], "reduce refuses the group of rank 2" in err[1]) if err else None

    # compute raises on rank 0: every rank raises naming rank 0
    def bad(parts):
        raise ValueError(f"compute refuses {len(parts)} parts")

    err = _raises(lambda: comm.coordinate("lead test", None, {"rank": rank, "value": 1}, bad, _Sum()))
    out["compute"] = (err[0], "compute refuses 2 parts" in err[1]) if err else None
    # compute answers the wrong number of groups: an internal error on every rank
    err = _raises(lambda: comm.coordinate("lead test", None, {"rank": rank, "value": 1}, lambda p: [1], _Sum()))
    out["count"] = (err[0], "no reply per group" in err[1]) if err else None
    out["streamed"] = _streamed_cases(comm, rank)
    # and the same Comm still coordinates without lead afterwards
    out["plain"] = comm.coordinate("plain", None, rank, lambda ps: [p * 2 for p in ps])
    return out


def test_leaders_reduce_and_expand_and_failures_reach_every_rank():
    res = all_ok(run_ranks(_lead_cases, 4, timeout=200, env={"MEGASHARD_GATHER_GROUP": "2"}))
    for rank, got in enumerate(res):
        g = rank // 2
        want_ok = {"rank": rank, "value": 10 * rank + 1,
                   "got": {"ranks": [2 * g, 2 * g + 1], "total": 1 + 11 + 21 + 31, "group": g}}
        assert got["group"] == 2
        assert got["ok"] == want_ok, f"rank {rank}: {got['ok']}"
        assert got["reduced"] == ([[rank, rank + 1]] if rank % 2 == 0 else [])
        assert got["member"] == ([3], True), f"rank {rank}: {got['member']}"
        assert got["member_reduced"] == ([[0, 1]] if rank == 0 else [])  # the failing group does not reduce
        assert got["reduce"] == ([2], True), f"rank {rank}: {got['reduce']}"
        assert got["compute"] == ([0], True), f"rank {rank}: {got['compute']}"
        assert got["count"] == ([0], True), f"rank {rank}: {got['count']}"
        assert got["plain"] == 2 * rank
        streamed = got["streamed"]
        assert streamed["ok"]["got"] == dict(want_ok["got"], kind="generator"), f"rank {rank}: {streamed}"
        # rank 0: its own group's part is used, then the other group's decoded only when compute reaches it;
        # a failing member's group sends its failures, decoded without compute running
        assert streamed["log"] == (["use [0, 1]", "decode", "use [2, 3]", "decode"] if rank == 0 else []), streamed
        assert streamed["member"] == ([3], True), f"rank {rank}: {streamed['member']}"


def test_a_world_of_one_reduces_computes_and_expands():
    comm = transport.Comm(transport.SOLO)
    lead = _Sum()
    got = comm.coordinate("solo", None, {"rank": 0, "value": 5}, _compute, lead)
    assert got == {"rank": 0, "value": 5, "got": {"ranks": [0], "total": 5, "group": 0}}
    assert lead.reduced == [[0]]
    err = _raises(lambda: comm.coordinate("solo", "broke", {"rank": 0, "value": 5}, _compute, _Sum()))
    assert err is not None and err[0] == [0] and "broke" in err[1]


def test_led_parts_round_trip():
    part = {"part": {"a": [1, 2], "b": "x" * 100}}
    assert transport.unpack_led_part(transport.pack_led_part(part)) == part
    assert not transport.led_part_failed(transport.pack_led_part(part))
    assert transport.led_part_failed(transport.pack_led_part({"failures": {"3": "broke"}}))


def test_led_parts_carry_bytes_beside_the_json_and_keep_no_decompressed_part():
    """A part's bytes values (a group's joined records and object texts) travel after the JSON, as
    they are: equal on arrival, and nothing of the decompressed part outlives the decoded one even
    with the collector paused (rank 0 decodes hundreds of parts under ``gc_paused``)."""
    body = b'[null,"a\\"b.tensors",null,1,2,3]' * 1000
    part = {"part": {"records": {"body": body, "n": [1, 2]}, "objects": {"names": ["u"], "body": b"{}"},
                     "empty": {"body": b""}, "text": "x"}}
    packed = transport.pack_led_part(part)
    assert len(packed) < len(body) // 10  # compressed with the JSON
    kept: List[bytes] = []
    real = transport.zlib.decompress

    def watched(data: bytes) -> bytes:
        kept.append(real(data))
        return kept[-1]

    with transport.gc_paused(), mock.patch.object(transport.zlib, "decompress", watched):
        got = transport.unpack_led_part(packed)
        assert got == part and type(got["part"]["records"]["body"]) is bytes
        refs = sys.getrefcount(kept[0])  # kept's and the call's (not in the assert: pytest keeps its operands)
        assert len(kept) == 1 and refs == 2, "the decompressed part outlived its decoding"
    with pytest.raises(transport.DistributedError):  # a bytes value said to lie past the part's end
        transport.unpack_led_part(packed[:1] + transport.zlib.compress(real(packed[1:])[:-10]))


@pytest.mark.parametrize("raw", [
    b"not zlib at all",
    "z:" + '{"a":{"\u0000blob":"x"}}',  # a blob reference that is not [offset, size]
    "z:" + '{"a":{"\u0000blob":[0]}}',
    "z:" + '{"a":{"\u0000blob":[true, 1.5]}}',
    "z:" + '{"a":{"\u0000blob":[-1, 0]}}',
    "z:" + '[1, 2]',  # not an object
    "z:" + '{"a": ',  # not JSON
    "short",  # decompresses to fewer than 8 bytes
])
def test_a_malformed_led_part_is_a_distributed_error_not_a_bare_exception(raw):
    """Only our own leaders make these parts, but rank 0 decodes hundreds of them: a damaged one
    (a mixed-version job, a bit flipped in transit) is refused as a gather failure, never a bare
    TypeError/ValueError/zlib.error that would leave the other ranks waiting."""
    if isinstance(raw, bytes):
        data = b"P" + raw
    elif raw.startswith("z:"):
        text = raw[2:].encode()
        data = b"P" + transport.zlib.compress(len(text).to_bytes(8, "little") + text)
    else:
        data = b"P" + transport.zlib.compress(raw.encode())
    with pytest.raises(transport.DistributedError, match="malformed"):
        transport.unpack_led_part(data)

"""manifest.NamedTexts: every rank's files and objects kept as texts at rank 0 (the first commit at
131,072 ranks held them as ~2 M small dicts), and the index tables cut from them byte for byte."""

from __future__ import annotations

import json

from megashard import manifest
from megashard.manifest import NamedTexts, _Sections, named_texts

_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _ranks() -> list:
    return [{"b-r1.tensors": {"rank": 0, "bytes": 10, "tensors": 1}, "ä-r0.tensors": {"rank": 0, "bytes": 3, "tensors": 2}},
            {},
            {"a-r2.tensors": {"rank": 2, "bytes": 7, "tensors": 1, "etag": "\"x\""}},
            {"b-r1.tensors": {"rank": 3, "bytes": 11, "tensors": 1}}]  # a name twice: the last rank's wins, as dict.update


def _texts(ranks: list) -> list:
    return [{n: _dumps(f) for n, f in fs.items()} for fs in ranks]


def _groups(ranks: list, size: int) -> NamedTexts:
    t = NamedTexts()
    for g in range(0, len(ranks), size):
        t.add(named_texts(_texts(ranks[g:g + size])))
    return t


def test_file_table_equals_the_dict_table_byte_for_byte_whatever_the_groups():
    ranks = _ranks()
    merged: dict = {}
    for fs in ranks:
        merged.update(fs)
    for size in (1, 2, 3, 4):
        t = _groups(ranks, size)
        assert t.ranks == 4 and t.by_rank() == ranks
        got, want = _Sections(), _Sections()
        assert manifest._text_buckets(got, t, 2) == manifest._buckets(want, merged, 2)
        assert got.take() == want.take()


def test_objects_placed_one_section_each_then_bucketed_as_before():
    objs = [{"o/1": _dumps({"v": [1, 2]}), "o/0": _dumps({"v": "é"})}, {}, {"o/2": _dumps(None)}]
    t = NamedTexts.of(objs)
    sec = _Sections()
    sec.write(b"xyz")
    rows = manifest._place_named(sec, t)
    got = manifest._row_buckets(sec, t, rows.__getitem__, 64)
    data = sec.take()
    (first, start, length, crc), = got
    table = json.loads(data[start:start + length])
    assert first == "o/0" and list(table) == ["o/0", "o/1", "o/2"]
    for u, (a, n, c) in table.items():
        text = next(o[u] for o in objs if u in o)
        assert data[a:a + n] == text.encode() and manifest.zlib.crc32(data[a:a + n]) == c


def test_replaced_swaps_only_the_changed_ranks_entries():
    ranks = _ranks()
    t = _groups(ranks, 2)
    new = {"c-r0.tensors": {"rank": 0, "bytes": 1, "tensors": 1}}
    for changes in ({0: new}, {1: new}, {3: new}, {0: new, 2: {}, 3: new}, {}, {7: new}):
        want = [changes.get(r, fs) if r < 4 else fs for r, fs in enumerate(ranks)]
        got = t.replaced({r: _texts([fs])[0] for r, fs in changes.items()})
        assert got.by_rank() == want and got.ranks == 4, changes
    assert t.by_rank() == ranks  # the original is left as it was


def test_order_keeps_the_last_of_equal_names():
    t = NamedTexts.of([{"b": "1", "a": "2"}, {"b": "3"}, {"c": "4", "a": "5"}])
    assert [(t.names[j], j) for j in t.order()] == [("a", 4), ("b", 2), ("c", 3)]


def test_texts_that_are_not_ascii_keep_their_byte_lengths():
    t = NamedTexts.of([{"a": '"ü"', "b": '"x"'}, {"c": "[1]"}])
    assert t.by_rank() == [{"a": "ü", "b": "x"}, {"c": [1]}]

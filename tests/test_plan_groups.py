"""The save plan in two levels (``plan.PlanLead`` on each group leader, ``plan.plan_groups`` on
rank 0) gives every rank the reply main's one-level coordinator gave (``plan_reference``, commit
6540075), reply for reply, whatever the group size, and the index's tensor table; replicated
flat pieces (held by several ranks), objects without a main replica and shared state-tree blobs
included; and refuses what it refused."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest

from megashard import plan, saving

from plan_reference import reference_coordinate_save

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import scale_models as sm  # noqa: E402
import simulate_scale as ss  # noqa: E402


def _messages(model, layout):
    models = {}
    return [saving.announce(ss._save_state(model, layout, r, False, models), r) for r in range(layout.world)]


def _same(messages, sizes):
    want = reference_coordinate_save(messages)
    for size in sizes:
        got = plan.coordinate_grouped(messages, size)
        assert json.dumps(got.replies) == json.dumps(want.replies), size
        assert got.tensors == want.tensors
        assert got.blob_owner == want.blob_owner
    return want


@pytest.mark.parametrize("model,layout", [
    ("tiny-moe", sm.Layout(tp=2, pp=1, dp=4, ep=2, distributed_optimizer=True)),
    ("tiny-gpt", sm.Layout(tp=1, pp=2, dp=4, vp=2, distributed_optimizer=True)),
    ("tiny-gpt", sm.Layout(tp=2, pp=2, dp=2)),
    ("llama3-70b", sm.Layout(tp=8, pp=8, dp=2, distributed_optimizer=True)),
    ("deepseek-v3", sm.Layout(tp=1, pp=16, dp=8, ep=8, distributed_optimizer=True)),
])
def test_grouped_plan_replies_equal_the_one_level_plan(model, layout):
    msgs = _messages(model, layout)
    _same(msgs, [1, 3, 7, 64, layout.world])


def _msg(entries, main=None, objects=(), objects_main=(), blobs=()):
    return plan.announcement(entries, main or [True] * len(entries), list(objects),
                             list(objects_main) or [False] * len(objects), list(blobs))[0]


def test_replicated_flat_pieces_objects_and_blobs_across_groups():
    """Flat pieces held by two ranks (two optimizer instances) in other groups, a flat piece
    listed twice by one rank, objects with and without main replicas, blobs shared by ranks of
    different groups."""
    rng = random.Random(5)
    msgs = []
    for r in range(12):
        inst = r % 6  # ranks r and r+6 hold the same flat pieces
        fixed = [["w", "float32", [8, 4], [0, 0], [4, 4], None, 64], ["w", "float32", [8, 4], [4, 0], [4, 4], None, 64]]
        flat = [["o", "float32", [12], [0], [12], [2 * inst, 2 * inst + 2], 8]]
        if r == 3:
            flat = flat + flat  # one rank lists a piece twice
        objects = ["a", "b", f"own{r}"] + (["c"] if r > 4 else [])
        main = [r == 2, r == 2] + [True] * len(flat) if r < 6 else [False] * (2 + len(flat))
        msgs.append(_msg(fixed + flat, main, objects, [r == 7, False, True] + ([False] if r > 4 else []),
                         [["args", "s1"], ["iteration", "s2" if r < 8 else "s3"], ["mine", f"rank{r}/mine"]]))
    rng.shuffle(msgs[:0])
    want = _same(msgs, [1, 2, 4, 5, 12])
    assert sum(r["write"].count(2) for r in want.replies) == 6  # each flat piece written once
    # a main replica named twice is refused the same way
    bad = list(msgs)
    bad[9] = _msg([["w", "float32", [8, 4], [0, 0], [4, 4], None, 64], ["w", "float32", [8, 4], [4, 0], [4, 4], None, 64],
                   ["o", "float32", [12], [0], [12], [6, 8], 8]], None, ["a"], [True])
    with pytest.raises(ValueError) as want_e:
        reference_coordinate_save(bad)
    for size in (1, 4, 12):
        with pytest.raises(ValueError) as got_e:
            plan.coordinate_grouped(bad, size)
        assert str(got_e.value) == str(want_e.value)


def test_grouped_plan_refuses_inconsistent_layouts_like_the_one_level_plan():
    a = [["w", "float32", [8], [0], [4], None, 16]]
    cases = [
        [_msg(a), _msg([["w", "float32", [9], [4], [4], None, 16]])],  # another global shape
        [_msg(a), _msg([["w", "float32", [8], [2], [6], None, 24]])],  # overlap
        [_msg(a), _msg([["w", "float32", [8], [4], [4], [0, 8], 16]])],  # flat piece outside its chunk
        [_msg(a)],  # a hole
        [_msg(a + [["o", "float32", [8], [0], [8], [0, 4], 16]]),
         _msg([["w", "float32", [8], [4], [4], None, 16], ["o", "int8", [8], [0], [8], [4, 8], 16]])],  # dtype
    ]
    for msgs in cases:
        with pytest.raises(ValueError) as want_e:
            reference_coordinate_save(msgs)
        for size in (1, 2):
            with pytest.raises(ValueError) as got_e:
                plan.coordinate_grouped(msgs, size)
            assert str(got_e.value) == str(want_e.value), (msgs, size)
    bad = _msg(a)
    bad["flat"] = "[[1,2],[]]"
    with pytest.raises(ValueError, match="malformed announcement of flattened shards from rank 1"):
        plan.coordinate_grouped([_msg(a), bad], 1)

"""megashard.megatron's tracker and lookup steps are decided by all ranks together (2 gloo ranks).

Which checkpoint ``--load`` names must be the same answer on every rank, including a rank
that cannot see the directory (scatter mode) and when only an interrupted re-save's
``.iter_N.old-*`` copy exists; a rank that fails to read or write the tracker makes every
rank raise one DistributedError instead of leaving the others in a collective.
The Megatron-LM end-to-end versions of these cases are in test_megatron_lm_ranks.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import megashard
from distributed import all_ok, run_ranks

pytest.importorskip("megatron.core")

TRACKER = "latest_checkpointed_iteration.txt"
PROMPT_S = 30  # the ranks' process-group timeout is 60 s


def _ckpt(path) -> None:
    megashard.save({"w": torch.arange(4.0)}, str(path))


def _lookup(root, ckpt_step=None):
    from megashard.megatron import checkpointing as ck

    t = ck.resolve_load(root, ckpt_step)
    return {"find": ck.find_checkpoint(root, ckpt_step), "tracker": list(ck.read_tracker(root)),
            "seen_by": t.seen_by, "iteration": t.iteration, "direct": t.direct}


def _raises(fn_name, *args):
    from megashard.megatron import checkpointing as ck

    t0 = time.monotonic()
    try:
        getattr(ck, fn_name)(*args)
    except megashard.MegashardError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return None


def _rank_cases(rank, world, cases):
    """Every case in one job (spawning ranks that import megatron.core is the slow part):
    ``cases`` maps a name to (function name, per-rank argument tuples)."""
    return {name: globals()[fn](*per_rank[rank]) for name, (fn, per_rank) in cases.items()}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """Each case's result on rank 0 and rank 1 (2 gloo ranks, one job)."""
    tmp = tmp_path_factory.mktemp("agree")
    a, blind = tmp / "a", str(tmp / "elsewhere")
    _ckpt(a / "iter_0000003")
    (a / TRACKER).write_text("3")
    old = tmp / "c"
    _ckpt(old / ".iter_0000003.old-0123abcd")
    (old / TRACKER).write_text("3")
    direct = tmp / "iter_0000007"
    _ckpt(direct)
    empty = tmp / "empty"
    empty.mkdir()
    bad = tmp / "bad"
    bad.mkdir()
    (bad / TRACKER).write_text("three")
    unwritable = tmp / "save"
    (unwritable / TRACKER).mkdir(parents=True)  # rank 0 cannot replace a directory with the tracker file
    both = lambda *args: [args, args]  # noqa: E731
    cases = {
        "blind": ("_lookup", [(str(a),), (blind,)]),
        "blind_step": ("_lookup", [(str(a), 3), (blind, 3)]),
        "blind_missing_step": ("_lookup", [(str(a), 5), (blind, 5)]),
        "old": ("_lookup", both(str(old))),
        "direct": ("_lookup", both(str(direct))),
        "empty": ("_lookup", both(str(empty))),
        "garbage": ("_raises", [("find_checkpoint", str(a)), ("find_checkpoint", str(bad))]),
        "tracker_write": ("_raises", both("commit_tracker", str(unwritable), 3)),
    }
    old_listing = sorted(os.listdir(old))
    r0, r1 = all_ok(run_ranks(_rank_cases, 2, cases))
    return {"tmp": tmp, "a": a, "blind": blind, "old": old, "old_listing": old_listing, "direct": direct,
            "bad": bad, "unwritable": unwritable, "results": {k: (r0[k], r1[k]) for k in cases}}


def test_rank_that_cannot_see_the_checkpoint_gets_the_same_answer(outcome):
    a, blind = outcome["a"], outcome["blind"]
    r0, r1 = outcome["results"]["blind"]
    assert r0 == {"find": str(a / "iter_0000003"), "tracker": [3, False], "seen_by": 1, "iteration": 3,
                  "direct": False}
    assert r1 == {**r0, "find": os.path.join(blind, "iter_0000003")}
    # --ckpt-step: the same, whatever the tracker says; a step nobody sees: None everywhere
    assert [r["find"] for r in outcome["results"]["blind_step"]] == [r0["find"], r1["find"]]
    assert [r["find"] for r in outcome["results"]["blind_missing_step"]] == [None, None]


def test_interrupted_resave_copy_is_found_and_left_in_place(outcome):
    old = outcome["old"]
    out = outcome["results"]["old"]
    assert [r["find"] for r in out] == [str(old / "iter_0000003")] * 2
    assert [r["seen_by"] for r in out] == [2, 2]
    assert sorted(os.listdir(old)) == outcome["old_listing"]


def test_load_points_at_a_checkpoint_directory_itself(outcome):
    d = outcome["direct"]
    assert [(r["find"], r["direct"]) for r in outcome["results"]["direct"]] == [(str(d), True)] * 2


def test_no_tracker_means_no_checkpoint_on_every_rank(outcome):
    out = outcome["results"]["empty"]
    assert [(r["find"], r["tracker"], r["seen_by"]) for r in out] == [(None, [-1, False], 0)] * 2


def test_garbage_tracker_on_one_rank_raises_on_every_rank(outcome):
    bad = outcome["bad"]
    for o in outcome["results"]["garbage"]:
        assert o is not None and o["type"] == "DistributedCheckpointError", o
        assert "failed on rank(s) 1:" in o["message"] and str(bad / TRACKER) in o["message"], o["message"]
        assert o["seconds"] < PROMPT_S


def test_tracker_write_failure_raises_on_every_rank(outcome):
    root = outcome["unwritable"]
    for o in outcome["results"]["tracker_write"]:
        assert o is not None and o["type"] == "DistributedCheckpointError", o
        assert "save (tracker) failed on rank(s) 0:" in o["message"], o["message"]
        assert f"cannot write tracker file {root / TRACKER}" in o["message"], o["message"]
        assert o["seconds"] < PROMPT_S
    assert os.path.isdir(root / TRACKER) and os.listdir(root / TRACKER) == []

"""``--async-save`` inside Megatron-LM's own training loop (``install()``): megashard's
snapshot, Megatron's ``schedule_async_save`` / ``maybe_finalize_async_save`` driving the
commit and tracker, and a bit-exact resume from the async checkpoint.

``--ckpt-format torch`` keeps Megatron-LM's non-persistent (fork) async caller:
Megatron-LM disables ``--async-save`` for dist formats without
``--use-persistent-ckpt-worker``, and the persistent worker (a spawned process calling
``torch.cuda.set_device``) cannot start on a CPU-only host.
"""
from __future__ import annotations

import os

from megatron_helpers.runner import compare_checkpoints
from test_megatron_lm_install import RELEASE, mlm, mlm_tree  # noqa: F401 - the fixture is used by name

#: Megatron-LM core_v0.19 drives async saves through nvidia-resiliency-ext by default
#: (``--async-strategy nvrx``); without it installed, megatron-core's own queue is the one to ask for
STRATEGY = ["--async-strategy", "mcore"] if tuple(map(int, RELEASE.split("."))) >= (0, 19) else []


def test_megatron_lm_async_save_and_bit_exact_resume(mlm_tree, tmp_path):  # noqa: F811
    a, b = tmp_path / "a", tmp_path / "b"
    fmt = ["--save-format", "tensors", "--ckpt-format", "torch", "--async-save", *STRATEGY]
    base, base_losses = mlm(mlm_tree, ["--train-iters", "6", "--save-interval", "3", "--save", str(a), *fmt])
    assert "megashard installed into" in base.output
    assert "--async-save is not supported" not in base.output
    assert "scheduled an async save of iteration 3" in base.output
    assert "async checkpoint at iteration 3 committed" in base.output
    assert sorted(base_losses) == [1, 2, 3, 4, 5, 6]
    assert open(a / "latest_checkpointed_iteration.txt").read().strip() == "6"
    assert not [n for n in os.listdir(a) if n.startswith(".")]  # nothing abandoned or half-written
    resumed, losses = mlm(mlm_tree, ["--train-iters", "6", "--save-interval", "3", "--load", str(a),
                                     "--ckpt-step", "3", "--save", str(b), *fmt])
    assert "loading with megashard" in resumed.output
    assert sorted(losses) == [4, 5, 6] and losses[4] == base_losses[4]  # as the synchronous test checks
    # the final model and optimizer state equal the uninterrupted async run's, bit for bit
    cmp = compare_checkpoints(str(a / "iter_0000006"), str(b / "iter_0000006"))
    assert cmp["differ"] == {} and not cmp["only_a"] and not cmp["only_b"], cmp

"""The user story of ``megashard convert``: a torch_dist checkpoint written by Megatron-LM's own
``pretrain_gpt.py`` (TP=2, 2 ranks, CPU) is converted in one process and Megatron-LM resumes from the
result through megashard exactly as it resumes from the original with its own loader.

Uses the vendored Megatron-LM tree and helpers of tests/test_megatron_lm_install.py (about a minute).
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

from test_megatron_lm_install import mlm, mlm_torch_dist, mlm_tree  # noqa: E402,F401 - fixtures used by name

import megashard  # noqa: E402
from megashard import storage  # noqa: E402
from megashard.convert import _megatron_core, convert  # noqa: E402

from layouts import bit_equal  # noqa: E402


def test_megatron_lm_torch_dist_converted_and_resumed(mlm_tree, mlm_torch_dist, tmp_path):  # noqa: F811
    # Megatron-LM's torch_dist save of iteration 2, and its own resume from it (shared with
    # test_megatron_lm_install.py's test_other_formats_still_go_to_megatron: one launch pair)
    td, _, reference = mlm_torch_dist
    ms = tmp_path / "ms"
    res = convert(str(td), str(ms))
    assert res.source_format == "torch_dist" and res.iteration == 2
    assert storage.read_tracker(str(ms)) == 2
    # every global tensor (model and optimizer state) equals what megatron-core reads from the original
    ours = megashard.load_consolidated(str(ms / "iter_0000002"))
    with _megatron_core() as dc:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        meta = dc.load_tensors_metadata(str(td / "iter_0000002"))
        theirs = dc.load({k: ShardedTensor.from_rank_offsets(k, ours[k].clone().zero_()) for k in meta},
                         str(td / "iter_0000002"))
    assert set(meta) == set(ours) and any(k.startswith("optimizer.") for k in ours)
    for k in meta:
        assert bit_equal(theirs[k], ours[k]), k
    # Megatron-LM resumes from the converted checkpoint through megashard (model, optimizer, RNG) ...
    run, losses = mlm(mlm_tree, ["--train-iters", "4", "--load", str(ms), "--save-format", "tensors"])
    assert "holds a megashard checkpoint: loading with megashard" in run.output
    assert "at iteration 2 (optimizer loaded, rng loaded)" in run.output
    # ... and trains on exactly as it does after resuming from the torch_dist original
    assert sorted(losses) == sorted(reference) == [3, 4]
    assert losses == reference
    assert os.path.isdir(td / "iter_0000002")  # the source is untouched

"""One INFO line per save and per load on rank 0, with aggregated bytes, seconds, GB/s and mode."""
from __future__ import annotations

import logging
import re

import torch

import megashard
from megashard.sharded import ShardedTensor


def test_one_summary_line_per_save_and_load(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    g = torch.arange(1 << 16, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="megashard"):
        megashard.save({"w": ShardedTensor("w", g.clone(), (1 << 16,), (0,))}, path)
        megashard.load({"w": ShardedTensor("w", torch.zeros(1 << 16), (1 << 16,), (0,))}, path)
        megashard.save({"w": ShardedTensor("w", g.clone(), (1 << 16,), (0,))}, path, async_save=True).result()
    lines = [r.getMessage() for r in caplog.records if r.name in ("megashard.saving", "megashard.loading") and r.levelno == logging.INFO]
    saved = [m for m in lines if "saved checkpoint" in m]
    loaded = [m for m in lines if "loaded checkpoint" in m]
    assert len(saved) == 2 and len(loaded) == 1, lines
    pat = r"\[rank 0\] (saved|loaded) checkpoint .*ckpt: [0-9.]+ GB over 1 rank\(s\) in [0-9.]+ s \([0-9.]+ GB/s, "
    assert all(re.match(pat, m) for m in saved + loaded), lines
    assert "own mode" in loaded[0] and "async" in saved[1] and "async" not in saved[0]

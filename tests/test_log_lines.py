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
    # 256 KiB: sizes and rates in units that show them (never "0.000 GB" or "0.00 GB/s"), 3 digits
    pat = r"\[rank 0\] (saved|loaded) checkpoint .*ckpt: [0-9.]+ k?B over 1 rank\(s\) in [0-9.]+ s \([0-9.]+ [kMG]?B/s, "
    assert all(re.match(pat, m) for m in saved + loaded), lines
    assert all("0.000 GB" not in m and "0.00 GB/s" not in m and " 0 kB/s" not in m for m in saved + loaded), lines
    assert ": 262 kB over 1 rank(s)" in loaded[0], loaded
    assert "own mode" in loaded[0] and "async" in saved[1] and "async" not in saved[0]


def test_size_and_rate_units():
    from megashard.logs import human_rate, human_size

    assert [human_size(n) for n in (0, 999, 262144, 3_960_000_000, 12_500_000_000_000)] == [
        "0 B", "999 B", "262 kB", "3.96 GB", "12.5 TB"]
    assert [human_rate(n, s) for n, s in ((262144, 0.5), (3_960_000_000, 7.2), (5 << 30, 1.0))] == [
        "524 kB/s", "550 MB/s", "5.37 GB/s"]


def test_importing_the_megatron_adapter_prints_no_optional_dependency_warnings():
    """megatron-core warns at import that Transformer Engine / Apex are missing: megashard's
    own import keeps that quiet, and leaves the process's warning filters as they were."""
    import os
    import subprocess
    import sys

    code = ("import warnings, torch; before = list(warnings.filters); import megashard.megatron; "
            "assert warnings.filters == before, warnings.filters[:3]; print('imported')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's default filters, as users have
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stderr[-3000:]
    assert "Transformer Engine" not in r.stderr and "Apex" not in r.stderr, r.stderr[-3000:]

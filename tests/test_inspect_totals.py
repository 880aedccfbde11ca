"""`megashard inspect DIR`: totals (bytes, files, tensors, layout, iteration, contents) before details."""
from __future__ import annotations

import argparse
import json
import os

import torch

import megashard
from megashard.cli import main
from megashard.sharded import ShardedTensor


def _save(path, optimizer: bool):
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sd = {
        "model": {"a": ShardedTensor("decoder.w", full[:4].clone(), (8, 8), (0, 0)),
                  "b": ShardedTensor("decoder.w", full[4:].clone(), (8, 8), (4, 0))},
        "iteration": 42,
        "args": argparse.Namespace(lr=0.1),
        "rng_state": {"torch": torch.arange(4, dtype=torch.uint8)},
        "note": "x",
    }
    if optimizer:
        sd["optimizer"] = {"state": {"exp_avg": ShardedTensor("optimizer.state.exp_avg.decoder.w",
                                                              torch.zeros(8, 8), (8, 8), (0, 0))},
                           "param_groups": [{"lr": 0.1}]}
    megashard.save(sd, path, layout={"tp": 2, "pp": 1})


def test_totals_json_and_text_order(tmp_path, capsys):
    path = str(tmp_path / "iter_0000042")
    _save(path, optimizer=True)
    assert main(["inspect", path, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert list(s)[0] == "totals"
    t = s["totals"]
    m = megashard.read_manifest(path)
    assert t["bytes"] == sum(os.path.getsize(os.path.join(path, f)) for f in m.files) == s["total_bytes"]
    assert (t["files"], t["global_tensors"], t["shards"]) == (len(m.files), 2, 3)
    assert t["layout"] == "tp=2, pp=1" and t["world_size"] == 1 and t["iteration"] == 42
    assert t["holds"] == {"model": "1 global tensors, 256 bytes", "optimizer": "1 global tensors, 256 bytes",
                          "rng": "yes", "args": "yes"}
    assert t["other_state"] == ["note"]
    assert main(["inspect", path]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == f"checkpoint:   {os.path.abspath(path)}"
    assert lines[1].startswith(f"size:         {t['bytes']} bytes (") and lines[1].endswith(f"in {t['files']} files")
    assert lines[2] == "tensors:      2 global tensors in 3 shards"
    assert lines[3] == "layout:       tp=2, pp=1 (saved by 1 ranks)"
    assert text.index("iteration:    42") < text.index("files:") < text.index("decoder.w")
    assert "  optimizer:  1 global tensors, 256 bytes" in text and "  args:       yes" in text


def test_totals_without_optimizer_or_args(tmp_path, capsys):
    path = str(tmp_path / "plain")
    megashard.save({"model": {"w": ShardedTensor("w", torch.ones(4), (4,), (0,))}}, path)
    assert main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert "iteration:    unknown" in text
    assert "  optimizer:  no" in text and "  rng:        no" in text and "  args:       no" in text
    assert "  model:      1 global tensors, 16 bytes" in text

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
    assert "  optimizer:  1 global tensors, 256 bytes" in text and "  args:       yes" in text
    assert main(["inspect", path, "--long"]) == 0  # the details: every file and global tensor
    long = capsys.readouterr().out
    assert long.startswith(text.rsplit("\n", 2)[0])  # the same summary first
    assert long.index("iteration:    42") < long.index("files:") < long.index("decoder.w")


def test_totals_without_optimizer_or_args(tmp_path, capsys):
    path = str(tmp_path / "plain")
    megashard.save({"model": {"w": ShardedTensor("w", torch.ones(4), (4,), (0,))}}, path)
    assert main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert "iteration:    unknown" in text
    assert "  optimizer:  no" in text and "  rng:        no" in text and "  args:       no" in text
    assert "  model:      1 global tensors, 16 bytes" in text


MEGATRON_ARGS = dict(padded_vocab_size=128, vocab_size=100, hidden_size=32, num_layers=4, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=64, seq_length=16, tensor_model_parallel_size=2,
                     pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                     expert_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1, world_size=2,
                     lr=3e-4, micro_batch_size=2)


def _save_many(path):
    """A toy of Megatron's shape: 4 layers x 6 global tensors, its args."""
    sd = {f"model{i}": ShardedTensor(f"decoder.layers.{i // 6}.t{i % 6}", torch.ones(4), (4,), (0,)) for i in range(24)}
    sd.update(iteration=5, args=argparse.Namespace(**MEGATRON_ARGS))
    megashard.save(sd, path, layout={"tp": 2, "pp": 1, "dp": 1})


def test_saved_args_in_summary_and_json(tmp_path, capsys):
    path = str(tmp_path / "iter_0000005")
    _save_many(path)
    assert main(["inspect", path, "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["totals"]
    assert t["saved_args"] == {k: v for k, v in MEGATRON_ARGS.items()
                               if v is not None and k not in ("lr", "micro_batch_size")}
    assert main(["inspect", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("iteration:    5")
    assert lines[at + 1:at + 3] == [
        "model:        vocabulary 128 (padded from 100), hidden 32, layers 4, heads 4, query groups 2, ffn 64, "
        "sequence 16",
        "parallel:     TP 2, PP 1, EP 1, CP 1, DP 1 (world 2)"]


def test_short_summary_by_default_details_behind_long(tmp_path, capsys):
    path = str(tmp_path / "iter_0000005")
    _save_many(path)
    assert main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 16, text
    assert "decoder.layers" not in text and text.count("tp=2") == 1
    assert text.splitlines()[-1] == f"details:      megashard inspect --long {path}"
    assert main(["inspect", path, "--long"]) == 0
    long = capsys.readouterr().out
    assert long.count("tp=2") == 1  # the layout once, not again in a dump of the summary
    rows = [ln.split() for ln in long.splitlines() if ln.startswith("  decoder.layers.")]
    assert len(rows) == 24 and rows[0] == ["decoder.layers.0.t0", "float32", "[4]", "16", "B,", "1", "shard"]
    files = [ln.split() for ln in long.splitlines() if ln.endswith(" tensors") and ln.startswith("  ")]
    assert [f[0] for f in files] == sorted(megashard.read_manifest(path).files) and files[0][1:3] == ["rank", "0,"]

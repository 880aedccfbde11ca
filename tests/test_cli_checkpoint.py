"""`megashard inspect|verify DIR` on checkpoints, healthy and damaged."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import megashard
from megashard.cli import main
from megashard.sharded import ShardedTensor
from tamper import read_manifest_doc, write_manifest_doc


@pytest.fixture()
def ckpt(tmp_path):
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sd = {
        "model": {
            "a": ShardedTensor("w", full[:4].clone(), (8, 8), (0, 0)),
            "b": ShardedTensor("w", full[4:].clone(), (8, 8), (4, 0)),
            "n": ShardedTensor("norm", torch.ones(8, dtype=torch.bfloat16), (8,), (0,)),
        },
        "iteration": 3,
        "local": torch.arange(5),
    }
    path = str(tmp_path / "ckpt")
    megashard.save(sd, path, layout={"tp": 1, "pp": 1, "dp": 1})
    return path


def test_inspect_json(ckpt, capsys):
    assert main(["inspect", ckpt, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    assert out["tensors"]["w"] == {"dtype": "float32", "shape": [8, 8], "bytes": 256, "shards": 2,
                                   "files": ["model-r00000.tensors"]}
    assert out["tensors"]["norm"]["dtype"] == "bfloat16"
    assert out["world_size"] == 1


def test_verify_ok_and_python_m(ckpt):
    r = subprocess.run([sys.executable, "-m", "megashard", "verify", ckpt], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_verify_reports_corrupt_byte(ckpt, capsys):
    m = megashard.read_manifest(ckpt)
    shard = m.tensors["w"].shards[1]
    path = os.path.join(ckpt, shard.file)
    with open(path, "r+b") as f:
        f.seek(shard.data_offset + 5)
        b = f.read(1)
        f.seek(shard.data_offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", ckpt]) != 0
    out = capsys.readouterr()
    assert shard.name in out.out + out.err


def test_verify_reports_missing_file_and_coverage_hole(ckpt, capsys):
    doc = read_manifest_doc(ckpt)
    doc["tensors"]["w"]["shards"].pop()  # a hole in "w"
    write_manifest_doc(ckpt, doc)
    os.unlink(os.path.join(ckpt, "state-r00000.tensors"))
    assert main(["verify", ckpt]) != 0
    text = "".join(capsys.readouterr())
    assert "state-r00000.tensors" in text and "missing" in text
    assert "w: shards cover 32 of 64 elements" in text


def test_verify_not_a_checkpoint(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) != 0
    assert "not a megashard checkpoint" in "".join(capsys.readouterr())


def test_verify_reports_a_truncated_file_once(tmp_path, capsys):
    """A truncated shard file is one problem, printed once (the state tree's reference to the
    same file must not repeat it)."""
    path = str(tmp_path / "ck")
    megashard.save({"w": torch.arange(1000.0), "v": torch.ones(10)}, path)
    (name,) = [f for f in os.listdir(path) if f.endswith(".tensors")]
    os.truncate(os.path.join(path, name), 600)
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    assert failed == [f"FAILED: {os.path.join(path, name)}: size 600 differs from the manifest's "
                      f"{megashard.read_manifest(path).files[name]['bytes']} bytes; the file is damaged or was replaced"]
    assert out.splitlines()[-1] == f"{path}: 1 problem(s)"

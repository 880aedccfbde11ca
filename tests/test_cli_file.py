"""The megashard CLI on single `.tensors` files (and its dispatch for directories)."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megashard.cli import main
from megashard.format import write_file


@pytest.fixture
def tfile(tmp_path: Path) -> tuple[Path, list]:
    sd = {"decoder.layers.0.mlp.linear_fc1.weight": torch.randn(16, 8).bfloat16(),
          "decoder.final_layernorm.weight": torch.ones(8),
          "step": torch.tensor(42)}
    p = tmp_path / "model.tensors"
    return p, write_file(sd, p)


def corrupt(p: Path, offset: int) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 0xFF
    p.write_bytes(bytes(data))


def test_inspect_human(tfile, capsys) -> None:  # type: ignore[no-untyped-def]
    p, infos = tfile
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "data version: 2" in out and "tensors:      3" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("decoder.layers.0.mlp.linear_fc1.weight"))
    assert line.split() == ["decoder.layers.0.mlp.linear_fc1.weight", "bfloat16", "[16,", "8]", "256",
                            str(infos[0].data_offset)]
    assert "[]" in next(ln for ln in out.splitlines() if ln.startswith("step"))


def test_inspect_json(tfile, capsys) -> None:  # type: ignore[no-untyped-def]
    p, infos = tfile
    assert main(["inspect", str(p), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["data_version"] == 2 and doc["tensor_count"] == 3 and doc["file_size"] == p.stat().st_size
    assert [t["name"] for t in doc["tensors"]] == [i.name for i in infos]
    t0 = doc["tensors"][0]
    assert (t0["dtype"], t0["shape"], t0["nbytes"], t0["data_offset"], t0["sha256"]) == (
        "bfloat16", [16, 8], 256, infos[0].data_offset, infos[0].sha256)
    assert int(t0["crc32"], 16) == infos[0].crc32


def test_verify_ok_and_failures(tfile, capsys) -> None:  # type: ignore[no-untyped-def]
    p, infos = tfile
    assert main(["verify", str(p)]) == 0
    assert "OK" in capsys.readouterr().out
    corrupt(p, infos[0].data_offset + 3)
    corrupt(p, infos[2].data_offset)
    assert main(["verify", str(p)]) == 1
    out = capsys.readouterr().out
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 2
    assert "decoder.layers.0.mlp.linear_fc1.weight" in failed[0] + failed[1] and "'step'" in out
    assert main(["verify", str(p), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and len(doc["problems"]) == 2


def test_unreadable_inputs(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.tensors"
    bad.write_bytes(b"not a tensors file at all" * 4)
    assert main(["verify", str(bad)]) == 1
    assert "bad magic" in capsys.readouterr().err
    assert main(["inspect", str(bad)]) == 1
    assert main(["inspect", str(tmp_path / "missing.tensors")]) == 1
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["frobnicate"])
    assert ei.value.code == 2


def test_directory_dispatch(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    calls = []
    fake = types.ModuleType("megashard.checkpoint_tools")
    fake.inspect_checkpoint = lambda path: calls.append(("inspect", path)) or {  # type: ignore[attr-defined]
        "iteration": 7, "tensors": {"w": {"shape": [4, 4]}}, "files": ["a.tensors"]}
    problems: list[str] = []
    fake.verify_checkpoint = lambda path, progress=None: calls.append(("verify", path)) or problems  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megashard.checkpoint_tools", fake)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "iteration: 7" in out and "shape:" in out and "- a.tensors" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration"] == 7
    assert main(["verify", str(tmp_path)]) == 0
    assert "OK" in capsys.readouterr().out
    problems.extend(["rank 1: a.tensors: hash mismatch", "tensor 'w' not covered"])
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: rank 1: a.tensors: hash mismatch" in out and "2 problem(s)" in out
    assert [c[0] for c in calls] == ["inspect", "inspect", "verify", "verify"]
    assert all(c[1] == str(tmp_path) for c in calls)


def test_python_dash_m_matches(tfile, capsys) -> None:  # type: ignore[no-untyped-def]
    """`python -m megashard` is the same program: same output, same exit code."""
    p, infos = tfile
    corrupt(p, infos[1].header_offset + 20)  # inside the second tensor's header
    res = subprocess.run([sys.executable, "-m", "megashard", "verify", str(p)],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert res.returncode == 1
    assert "decoder.final_layernorm.weight" in res.stdout
    assert main(["verify", str(p)]) == 1
    assert capsys.readouterr().out == res.stdout

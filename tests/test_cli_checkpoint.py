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


def test_verify_reports_missing_file_and_coverage_hole(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("MEGASHARD_FS_WAIT_S", "0.2")  # the missing file is waited for this long
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


# ---------------------------------------------------------------------------------- Megatron save roots
def _save_root(root, iterations=(3, 6), tracker=6):
    """A Megatron save root (what --save/--load take): iter_N checkpoints and the tracker."""
    from megashard import saveroot, storage

    for it in iterations:
        megashard.save({"w": ShardedTensor("w", torch.full((4, 4), float(it)), (4, 4), (0, 0)), "iteration": it},
                       os.path.join(root, saveroot.iteration_dir_name(it)), layout={"tp": 1, "pp": 1})
    if tracker is not None:
        storage.write_tracker(root, tracker)
    return root


def test_inspect_verify_and_load_consolidated_follow_the_tracker(tmp_path, capsys):
    root = _save_root(str(tmp_path / "run"))
    ck6 = os.path.join(root, "iter_0000006")
    assert main(["inspect", root, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["path"] == ck6 and s["totals"]["iteration"] == 6
    assert s["save_root"] == {"path": root, "tracker": 6, "iterations": [3, 6]}
    assert main(["inspect", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [f"save root:    {root}", "iterations:   3, 6 (the tracker names 6)", f"checkpoint:   {ck6}"]
    assert main(["verify", root]) == 0
    assert capsys.readouterr().out == f"OK: {ck6}: checkpoint verified (iteration 6, named by {root}'s tracker)\n"
    got = megashard.load_consolidated(root)
    assert torch.equal(got["w"], torch.full((4, 4), 6.0))
    shard = megashard.read_manifest(ck6).tensors["w"].shards[0]
    with open(os.path.join(ck6, shard.file), "r+b") as f:
        f.seek(shard.data_offset)
        b = f.read(1)
        f.seek(shard.data_offset)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", root]) == 1
    assert "iter_0000006" in capsys.readouterr().out


def test_a_save_root_without_tracker_lists_its_iterations(tmp_path, capsys):
    from megashard.errors import CheckpointError

    root = _save_root(str(tmp_path / "run"), tracker=None)
    assert main(["inspect", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"save_root": {"path": root, "tracker": None,
                                                                 "iterations": [3, 6]}}
    assert main(["inspect", root]) == 0
    assert capsys.readouterr().out.splitlines() == [f"save root:    {root}",
                                                    "iterations:   3, 6 (no latest_checkpointed_iteration.txt)"]
    assert main(["verify", root]) == 1
    err = capsys.readouterr().err
    assert err == (f"megashard verify: error: {root} is a Megatron save root without latest_checkpointed_iteration.txt;"
                   f" name one of its checkpoints: {root}/iter_0000003, {root}/iter_0000006\n")
    with pytest.raises(CheckpointError, match="save root without latest_checkpointed_iteration.txt"):
        megashard.load_consolidated(root)


def test_recover_a_save_root_removes_dead_temporaries_and_says_so(tmp_path, capsys):
    from megashard import storage

    root = _save_root(str(tmp_path / "run"))
    ck3, ck6 = os.path.join(root, "iter_0000003"), os.path.join(root, "iter_0000006")
    pid = os.fork()  # a save on this machine that died after creating its temp dir and writing a file
    if pid == 0:
        try:
            tmp = storage.make_temp_dir(os.path.join(root, "iter_0000009"), "dead")
            with open(os.path.join(tmp, "model-r00000.tensors"), "wb") as f:
                f.write(b"x" * 100)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    dead = os.path.join(root, ".iter_0000009.tmp-dead")
    live = storage.make_temp_dir(os.path.join(root, "iter_0000012"), "live")  # this process: still running
    foreign = os.path.join(root, ".iter_0000010.tmp-other")  # no owner record, holds a user's file
    os.makedirs(foreign)
    open(os.path.join(foreign, "notes.txt"), "w").close()
    os.rename(ck3, os.path.join(root, ".iter_0000003.old-abc"))  # a re-save of iteration 3 crashed mid-commit
    assert main(["recover", root]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"restored {ck3} from {root}/.iter_0000003.old-abc",
                   f"removed {dead} (a save that is no longer running left it)",
                   f"OK: {root}: save root, tracker names iteration 6; iterations 3, 6"]
    assert not os.path.exists(dead) and os.path.isdir(live) and os.path.isfile(os.path.join(foreign, "notes.txt"))
    assert storage.is_checkpoint(ck3) and storage.is_checkpoint(ck6)
    assert main(["recover", root]) == 0  # nothing left to do: says only OK
    assert capsys.readouterr().out.splitlines() == [f"OK: {root}: save root, tracker names iteration 6; iterations 3, 6"]


def test_recover_a_checkpoint_removes_its_dead_temporaries(tmp_path, capsys):
    from megashard import storage

    path = str(tmp_path / "ck")
    megashard.save({"w": torch.ones(4)}, path)
    pid = os.fork()
    if pid == 0:
        try:
            storage.make_temp_dir(path, "dead")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert main(["recover", path]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"removed {tmp_path}/.ck.tmp-dead (a save that is no longer running left it)", f"OK: {path}"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_tools_on_an_s3_save_root(s3, capsys):
    root = _save_root(s3.url("run"), iterations=(1, 2), tracker=2)
    assert main(["inspect", root, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["path"] == f"{root}/iter_0000002" and s["save_root"] == {"path": root, "tracker": 2, "iterations": [1, 2]}
    assert main(["verify", root]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {root}/iter_0000002: checkpoint verified")
    assert torch.equal(megashard.load_consolidated(root)["w"], torch.full((4, 4), 2.0))
    assert main(["recover", root]) == 0
    assert capsys.readouterr().out == f"OK: {root}: save root, tracker names iteration 2; iterations 1, 2\n"


def test_verify_shows_progress_on_a_terminal_only(ckpt, capsys, monkeypatch):
    assert main(["verify", ckpt]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out == f"OK: {ckpt}: checkpoint verified\n"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["verify", ckpt]) == 0
    out = capsys.readouterr()
    assert out.out == f"OK: {ckpt}: checkpoint verified\n"  # results stay on stdout, unchanged
    assert "\rverify ckpt:   0%|" in out.err and "B/s]" in out.err, out.err  # a tqdm bar of bytes

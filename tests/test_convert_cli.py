"""``megashard convert``'s command line as users type it, and what the tools say about a directory
in another format (torch_dist, Hugging Face): no megatron-core needed."""
from __future__ import annotations

import json
import os

import pytest
import torch

import megashard
from megashard.cli import main as cli_main
from megashard.sharded import ShardedTensor


@pytest.fixture
def ckpt(tmp_path):
    """A megashard checkpoint of three global tensors."""
    state = {"model": {k: ShardedTensor(k, torch.arange(6, dtype=torch.float32) + i, (6,), (0,))
                       for i, k in enumerate(("decoder.a", "decoder.b", "embedding.w"))}}
    megashard.save(state, str(tmp_path / "ck"))
    return str(tmp_path / "ck")


def _keys(path):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("argv", [
    ["--keys", "decoder.a", "embedding.*", "{src}", "{dst}", "--to", "safetensors"],
    ["--to", "safetensors", "--keys", "decoder.a", "embedding.*", "{src}", "{dst}"],
    ["{src}", "--keys", "decoder.a", "embedding.*", "{dst}", "--to", "safetensors"],
    ["--keys", "decoder.a", "embedding.*", "{src}", "--to", "safetensors", "{dst}"],
    ["{src}", "{dst}", "--keys", "decoder.a", "embedding.*", "--to", "safetensors"],
    ["{src}", "--to", "safetensors", "{dst}", "--keys", "decoder.a", "embedding.*"],
])
def test_keys_before_or_between_the_paths(ckpt, tmp_path, argv):
    """`convert --keys A B SRC DST`: the last words are SRC and DST, not more patterns."""
    dst = str(tmp_path / "out.safetensors")
    assert cli_main(["convert"] + [a.format(src=ckpt, dst=dst) for a in argv]) == 0
    assert _keys(dst) == ["decoder.a", "embedding.w"]


def test_keys_without_patterns_or_paths_exit_2(ckpt, tmp_path, capsys):
    dst = str(tmp_path / "out.safetensors")
    with pytest.raises(SystemExit) as e:
        cli_main(["convert", "--keys", ckpt, dst, "--to", "safetensors"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "megashard convert: error: --keys needs at least one PATTERN before SRC DST" in err
    with pytest.raises(SystemExit) as e:
        cli_main(["convert", ckpt, "--to", "safetensors"])
    assert e.value.code == 2 and "megashard convert: error: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["convert", ckpt, dst, "extra", "--to", "safetensors"])
    assert e.value.code == 2 and "unrecognized arguments: extra" in capsys.readouterr().err
    assert not os.path.exists(dst)


def _torch_dist_dir(path):
    """torch_dist's marker files (what megatron-core's dist_checkpointing.save writes beside its shards);
    common.pt is not a pickle here: nothing may read it."""
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    for name in (".metadata", "common.pt", "__0_0.distcp"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"not a pickle")
    return str(path)


def _hf_dir(path):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 16)
    return str(path)


@pytest.mark.parametrize("make, what", [(_torch_dist_dir, "a torch_dist checkpoint"),
                                        (_hf_dir, "a Hugging Face model directory")])
def test_inspect_verify_load_name_the_format_and_the_convert_command(tmp_path, capsys, make, what):
    """`megashard inspect|verify` and `megashard.load` on a directory in a format convert reads name
    the format and the exact command, instead of a missing manifest.json."""
    d = make(tmp_path / "src")
    command = f"`megashard convert {d} NEW_DIR`"
    assert cli_main(["inspect", d]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"megashard inspect: error: {d} is not a megashard checkpoint: "
                                                   f"it is {what}"), err
    assert command in err and "manifest.json" not in err, err
    assert cli_main(["verify", d]) == 1
    out = capsys.readouterr()
    assert f"{d} is not a megashard checkpoint: it is {what}" in out.out + out.err and command in out.out + out.err
    with pytest.raises(megashard.MegashardError) as e:
        megashard.load({}, d)
    assert f"it is {what}" in str(e.value) and command in str(e.value)


def test_a_plain_directory_still_says_what_is_missing(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert cli_main(["inspect", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "manifest.json" in err and "megashard convert" not in err

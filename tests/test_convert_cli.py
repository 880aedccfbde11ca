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

"""A URL is never taken for a local path (issue 22): before, ``save(state, "s3://b/run/iter")``
succeeded and wrote ``./s3:/b/run/iter``. ``s3://`` (and ``msc://`` with multi-storage-client)
is an object store (tests/test_s3_checkpoint.py; ``convert`` reads s3:// and writes megashard checkpoints
there: tests/test_convert_s3.py); any other URL is refused with a CheckpointError naming it, and nothing is
created."""
from __future__ import annotations

import os

import pytest
import torch

import megashard
from megashard import CheckpointError
from megashard.cli import main as cli_main
from megashard.convert import ConvertInputError, convert

UNSUPPORTED = ["gs://bucket/run/iter_0000100", "file:///tmp/x", "https://host/run/iter_0000100",
               "s3://Bad_Bucket/x", "s3://bucket/run/../iter_0000100"]
try:
    import multistorageclient  # noqa: F401
except ImportError:
    UNSUPPORTED.append("msc://profile/run/iter_0000100")  # needs multi-storage-client


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("url", UNSUPPORTED)
def test_every_entry_point_refuses_an_unusable_url_and_creates_nothing(in_tmp, url):
    state = {"w": torch.arange(4.0), "iteration": 1}
    calls = [
        lambda: megashard.save(state, url),
        lambda: megashard.save(state, url, async_save=True),
        lambda: megashard.load({"w": torch.empty(4)}, url),
        lambda: megashard.load_common(url, ["iteration"]),
        lambda: megashard.load_consolidated(url),
        lambda: convert(url, str(in_tmp / "out"), to="safetensors"),
    ]
    for call in calls:
        with pytest.raises(CheckpointError) as e:
            call()
        assert url in str(e.value) or repr(url) in str(e.value)
    assert os.listdir(in_tmp) == []  # no ./gs:/... directory anywhere


@pytest.mark.parametrize("url", UNSUPPORTED[:3])
def test_convert_refuses_an_unusable_url_at_either_end(in_tmp, url):
    ckpt = in_tmp / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, str(ckpt))
    for call in (lambda: convert(str(ckpt), url, to="safetensors"), lambda: convert(str(ckpt), url),
                 lambda: convert(url, str(in_tmp / "o"))):
        with pytest.raises(CheckpointError, match="URL") as e:
            call()
        assert url in str(e.value) or repr(url) in str(e.value)
    assert sorted(os.listdir(in_tmp)) == ["ckpt"]


@pytest.mark.parametrize("to", ["tensors", "safetensors", "hf", "torch_dist"])
def test_convert_to_s3_writes_only_megashard_checkpoints(in_tmp, to):
    """s3:// SRC and ``--to megashard`` s3:// DST are tests/test_convert_s3.py; a local-file target at an
    s3:// URL is refused before any request (no endpoint here) and nothing is written."""
    ckpt = in_tmp / "ckpt"
    megashard.save({"w": torch.arange(4.0)}, str(ckpt))
    url = "s3://bucket/run/out"
    with pytest.raises(ConvertInputError, match="writes local files only") as e:
        convert(str(ckpt), url, to=to)
    assert url in str(e.value)
    assert sorted(os.listdir(in_tmp)) == ["ckpt"]


@pytest.mark.parametrize("cmd", ["inspect", "verify", "recover"])
def test_cli_refuses_an_unusable_url(in_tmp, cmd, capsys):
    assert cli_main([cmd, "gs://bucket/run/iter_0000100"]) != 0
    assert "gs://bucket/run/iter_0000100" in capsys.readouterr().err
    assert os.listdir(in_tmp) == []

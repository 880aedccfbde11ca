"""A URL is never taken for a local path (issue 22): before, ``save(state, "s3://b/run/iter")``
succeeded and wrote ``./s3:/b/run/iter``. Until object storage is supported, every entry point
refuses a URL with a CheckpointError naming it, and creates nothing."""
from __future__ import annotations

import os

import pytest
import torch

import megashard
from megashard import CheckpointError
from megashard.cli import main as cli_main
from megashard.convert import convert

URLS = ["s3://bucket/run/iter_0000100", "msc://profile/run/iter_0000100", "gs://b/x", "file:///tmp/x"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("url", URLS)
def test_every_entry_point_refuses_a_url_and_creates_nothing(in_tmp, url):
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
        with pytest.raises(CheckpointError, match="URL") as e:
            call()
        assert url in str(e.value)
    ckpt = in_tmp / "ckpt"
    megashard.save(state, str(ckpt))
    with pytest.raises(CheckpointError, match="URL"):
        convert(str(ckpt), url, to="safetensors")
    assert sorted(os.listdir(in_tmp)) == ["ckpt"]  # no ./s3:/... directory anywhere


@pytest.mark.parametrize("cmd", ["inspect", "verify", "recover"])
def test_cli_refuses_a_url(in_tmp, cmd, capsys):
    assert cli_main([cmd, "s3://bucket/run/iter_0000100"]) != 0
    assert "URL" in capsys.readouterr().err
    assert os.listdir(in_tmp) == []

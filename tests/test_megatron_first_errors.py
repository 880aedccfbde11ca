"""What a Megatron user meets first when a resume cannot go on (issue 28 items 5 and 6):
one clear line for another model size, a damaged shard caught by the default CRC32 check."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

from megatron_helpers.runner import pretrain  # noqa: E402

ITERS = ["--train-iters", "2", "--lr-decay-iters", "2", "--save-interval", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-errors")
    pretrain(["--tensor-model-parallel-size", "2", "--hidden-size", "64", "--save", str(root), *ITERS]).check()
    return root


def test_resume_with_another_hidden_size_fails_in_one_line(saved):
    """Before: every layer's shape mismatch from every rank (~215 lines) came first."""
    run = pretrain(["--tensor-model-parallel-size", "2", "--load", str(saved), "--hidden-size", "128",
                    "--train-iters", "4", "--lr-decay-iters", "4"])
    assert run.returncode != 0
    lines = run.output.splitlines()
    want = "hidden_size value from checkpoint (64) is not equal to the input argument value (128)"
    assert any(want in ln for ln in lines), run.output[-4000:]
    assert not [ln for ln in lines if "mismatch" in ln], run.output[-4000:]  # no tensor listing
    assert len(lines) < 120, f"{len(lines)} lines:\n" + run.output[-6000:]  # two tracebacks and torchrun's


def test_flipped_bit_fails_the_resume_unless_opted_out(saved, tmp_path):
    import shutil

    from megashard.storage import open_index
    from megashard.plan import Box

    root = tmp_path / "damaged"
    shutil.copytree(saved, root)
    ck = os.path.join(root, "iter_0000002")
    import megashard

    tensors = megashard.read_manifest(ck).tensors
    key = next(k for k in sorted(tensors) if k.startswith("decoder.layers.") and k.endswith("fc1.weight"))
    shape = tuple(tensors[key].global_shape)
    index = open_index(ck)
    rec = index.pieces(key, Box((0,) * len(shape), shape))[0]
    index.close()
    with open(os.path.join(ck, rec.file), "r+b") as f:
        f.seek(rec.data_offset + 5)
        b = f.read(1)[0]
        f.seek(rec.data_offset + 5)
        f.write(bytes([b ^ 0x10]))
    args = ["--tensor-model-parallel-size", "2", "--hidden-size", "64", "--load", str(root), "--train-iters", "3",
            "--lr-decay-iters", "3"]
    run = pretrain(args)
    assert run.returncode != 0
    assert f"{ck}/{rec.file}: tensor {rec.name!r}" in run.output and "is damaged" in run.output, run.output[-4000:]
    assert "--megashard-no-crc-on-load" in run.output
    ok = pretrain([*args, "--megashard-no-crc-on-load"]).check()
    assert sorted(ok.losses) == [3]

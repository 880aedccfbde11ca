"""``file_segments``: write_file's bytes as (offset, view) parts for an object-store upload."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Dict

import pytest
import torch
from tensorizer import TensorDeserializer

from bitexact import assert_same
from megashard.errors import FormatError
from megashard.format import layout as L
from megashard.format import write_file
from megashard.format.fastio import tensor_memoryview
from megashard.format.writer import file_segments


def _mixed() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(33, 17, generator=g)
    x[0, 0] = float("nan")
    return {"bf16": x.bfloat16(), "f32": x, "i8": (x * 10).to(torch.int8), "bool": x > 0,
            "noncontig": x.t()[::2], "scalar": torch.tensor(-0.0)}


def _zero_and_meta() -> Dict[str, torch.Tensor]:
    return {"a": torch.arange(5, dtype=torch.int8), "empty": torch.zeros(0, 3),
            "meta": torch.empty(4, 2, device="meta"), "b": torch.ones(3, dtype=torch.bfloat16)}


def _long_shape() -> Dict[str, torch.Tensor]:  # a dimension >= 2**32: data version 5, u64 shapes
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "long": torch.zeros(0, L.LONG_DIM + 3), "b": torch.ones(3, dtype=torch.bfloat16)}


def _many_small() -> Dict[str, torch.Tensor]:
    return {f"layer.{i}.w": torch.full((i % 7 + 1,), i, dtype=torch.float32) for i in range(3000)}


def _one_large() -> Dict[str, torch.Tensor]:  # > INLINE_BYTES: hashed on several threads
    g = torch.Generator().manual_seed(1)
    return {"big": torch.randn(3 << 20, generator=g).bfloat16(), "small": torch.arange(3, dtype=torch.int8),
            "mid": torch.randn(1 << 19, generator=g)}


STATES: Dict[str, Callable[[], Dict[str, torch.Tensor]]] = {
    "mixed": _mixed, "zero_and_meta": _zero_and_meta, "long_shape": _long_shape,
    "many_small": _many_small, "one_large": _one_large}


@pytest.mark.parametrize("align", [1, 4096])
@pytest.mark.parametrize("state", sorted(STATES))
def test_segments_are_write_files_bytes(tmp_path: Path, state: str, align: int) -> None:
    sd = STATES[state]()
    p = tmp_path / "f.tensors"
    infos = write_file(sd, p, align=align)
    size, segments, seg_infos = file_segments(sd, align=align)
    want = p.read_bytes()
    assert size == len(want)
    assert seg_infos == infos
    pos = 0
    for off, view in segments:  # contiguous, in order, nothing empty, read-only
        assert off == pos and len(view) > 0 and view.readonly
        pos += len(view)
    assert pos == size
    joined = b"".join(segments[i][1] for i in range(len(segments)))
    assert joined == want
    # prologue, metadata, per tensor its header then its data (none when empty/meta), terminator
    n_data = sum(1 for i in infos if i.nbytes)
    assert len(segments) == 2 + len(infos) + n_data + 1
    assert [off for off, _ in segments[2:-1]] == sorted(
        [i.header_offset for i in infos] + [i.data_offset for i in infos if i.nbytes])
    with TensorDeserializer(io.BytesIO(joined), device="cpu", verify_hash=True) as d:
        assert list(d.keys()) == list(sd)
        for k, v in sd.items():
            if v.is_meta:  # tensorizer materialises a meta tensor as zeros
                assert_same(d[k], torch.zeros(v.shape, dtype=v.dtype))
            else:
                assert_same(d[k], v)


def test_data_segments_are_views_of_the_tensors() -> None:
    """No copy of the data: a tensor's segment is its own memory (contiguous input)."""
    t = torch.arange(1 << 16, dtype=torch.float32)
    _, segments, infos = file_segments({"t": t})
    (data,) = [v for off, v in segments if off == infos[0].data_offset]
    assert len(data) == t.numel() * 4
    t[0] = 42.0  # the view shows the change: same memory
    assert bytes(data[:4]) == bytes(tensor_memoryview(t)[:4])


def test_segments_refuse_what_write_file_refuses() -> None:
    with pytest.raises(FormatError, match="empty state dict"):
        file_segments({})
    with pytest.raises(FormatError, match="align must be a power of two"):
        file_segments({"a": torch.ones(1)}, align=3)
    with pytest.raises(FormatError, match="zero-element"):
        file_segments({"a": torch.zeros(0, dtype=torch.bfloat16)})

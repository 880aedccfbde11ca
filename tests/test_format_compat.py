"""Interoperability with tensorizer 2.12.1, both directions, bit for bit."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

tensorizer = pytest.importorskip("tensorizer")
from tensorizer import TensorDeserializer, TensorSerializer  # noqa: E402

from megashard.format import load_file, open_file, save_file  # noqa: E402
from bitexact import assert_same


def mixed_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 17, generator=g)
    x[0, 0] = float("nan")
    return {
        "module.decoder.layers.0.self_attention.linear_qkv.weight": x.bfloat16(),
        "f32": x,
        "f16": x.half(),
        "f64": x.double(),
        "fp8_e4m3fn": x.to(torch.float8_e4m3fn),
        "fp8_e5m2": x.to(torch.float8_e5m2),
        "i8": (x * 10).to(torch.int8),
        "i16": (x * 100).to(torch.int16),
        "i32": (x * 1000).to(torch.int32),
        "i64": (x * 1000).to(torch.int64),
        "u8": (x.abs() * 10).to(torch.uint8),
        "bool": x > 0,
        "c64": torch.complex(x, x * 2),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty_f32": torch.zeros(0, 3),
        "noncontig": x.t()[::2],
        "ünïcode.名前": torch.arange(5, dtype=torch.int32),
    }


@pytest.mark.parametrize("align", [1, 4096, 64])
def test_tensorizer_reads_our_files(tmp_path: Path, align: int) -> None:
    sd = mixed_dict()
    p = tmp_path / "ours.tensors"
    save_file(sd, p, align=align)
    with TensorDeserializer(str(p), device="cpu", verify_hash=True) as d:
        assert list(d.keys()) == list(sd)
        for k, v in sd.items():
            assert_same(d[k], v)
    if align > 1:
        with open_file(p) as r:
            assert all(i.data_offset % align == 0 for i in r.infos() if i.nbytes)


def test_tensorizer_verify_module_and_lazy_load(tmp_path: Path) -> None:
    sd = mixed_dict()
    p = tmp_path / "ours.tensors"
    save_file(sd, p)
    with TensorDeserializer(str(p), device="cpu", lazy_load=True, num_readers=1, verify_hash=True) as d:
        for k in sd:  # (tensorizer's lazy mode cannot go backwards, even on its own files)
            assert_same(d[k], sd[k])


def _tensorizer_write(path: Path, sd: object) -> None:
    s = TensorSerializer(str(path))
    s.write_state_dict(sd)  # type: ignore[arg-type]
    s.close()


def test_we_read_tensorizer_state_dict(tmp_path: Path) -> None:
    sd = mixed_dict()
    p = tmp_path / "theirs.tensors"
    _tensorizer_write(p, sd)
    loaded = load_file(p, verify=True)
    assert list(loaded) == list(sd)
    for k, v in sd.items():
        assert_same(loaded[k], v)
    with open_file(p) as r:
        assert r.version == 2
        assert r.verify_all() == []
        for k, v in sd.items():
            out = torch.empty_like(v, memory_format=torch.contiguous_format)
            assert r.read(k, out=out, verify=True) is out
            assert_same(out, v)


def test_we_read_nested_names_and_meta(tmp_path: Path) -> None:
    """Nested state dicts (\\x1e JSON paths) and meta tensors (data version 4)."""
    w = torch.randn(4, 4).bfloat16()
    nested = {"model": {"layers": [{"w": w}, {"w": w * 2}]}, "top": torch.arange(3),
              "marker": torch.empty(7, 2, device="meta")}
    p = tmp_path / "nested.tensors"
    _tensorizer_write(p, nested)
    with open_file(p) as r:
        assert r.version == 4
        assert r.keys() == ["model.layers.0.w", "model.layers.1.w", "top", "marker"]
        assert r.verify_all() == []
        assert r.info("marker").is_meta and r.info("marker").nbytes == 0
        out = torch.full((7, 2), 5.0)
        assert torch.equal(r.read("marker", out=out), torch.zeros(7, 2))  # meta reads as zeros
    loaded = load_file(p, verify=True)
    assert_same(loaded["model.layers.0.w"], w)
    assert_same(loaded["model.layers.1.w"], w * 2)
    assert_same(loaded["top"], torch.arange(3))
    assert loaded["marker"].is_meta and loaded["marker"].shape == (7, 2)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
        self.norm = torch.nn.BatchNorm1d(4)
        self.top = torch.nn.Parameter(torch.randn(3))


def test_we_read_tensorizer_write_module(tmp_path: Path) -> None:
    """write_module: types 0/1, module indices, root-level '.top' names, vLLM's meta marker."""
    m = _Block()
    m.vllm_tensorized_marker = torch.nn.Parameter(torch.tensor((1,), device="meta"), requires_grad=False)
    p = tmp_path / "module.tensors"
    s = TensorSerializer(str(p))
    s.write_module(m)
    s.close()
    expected = {f"{mod}.{name}" if mod else f".{name}": t
                for mod, sub in m.named_modules() for name, t in
                list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))}
    with open_file(p) as r:
        assert r.version == 4
        assert set(r.keys()) == set(expected)
        assert ".vllm_tensorized_marker" in r
        types = {i.name: i.tensor_type for i in r.infos()}
        assert types["lin.weight"] == 0 and types["norm.running_mean"] == 1
        assert r.verify_all() == []
    loaded = load_file(p, verify=True)
    for k, v in expected.items():
        if v.is_meta:
            assert loaded[k].is_meta
        else:
            assert_same(loaded[k], v)


def test_2000_tensor_tensorizer_file(tmp_path: Path) -> None:
    sd = {f"module.decoder.layers.{i}.self_attention.linear_qkv.weight":
          torch.full((2, 3), float(i), dtype=torch.bfloat16) for i in range(2000)}
    p = tmp_path / "t2000.tensors"
    _tensorizer_write(p, sd)
    loaded = load_file(p, verify=True)
    assert list(loaded) == list(sd)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_10000_tensors_we_write_tensorizer_reads(tmp_path: Path) -> None:
    """tensorizer's writer overflows its 256 KiB index at ~2.4k tensors; ours sizes it to fit."""
    sd = {f"module.decoder.layers.{i // 10}.mlp.experts.{i % 10}.weight":
          torch.full((2, 3), float(i), dtype=torch.bfloat16) for i in range(10_000)}
    p = tmp_path / "t10k.tensors"
    save_file(sd, p)  # default align=4096: metadata ~1.1 MB, sized to fit
    with open_file(p) as r:
        assert len(r) == 10_000
    with TensorDeserializer(str(p), device="cpu", verify_hash=True) as d:
        assert len(d) == 10_000
        for k, v in sd.items():
            assert torch.equal(d[k], v)
    p1 = tmp_path / "t10k_align1.tensors"
    save_file(sd, p1, align=1)  # tensorizer's layout, metadata grown past 256 KiB
    loaded = load_file(p1, verify=True)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_we_read_tensorizer_v5_long_dims(tmp_path: Path) -> None:
    sd = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
          "long": torch.empty(2**32 + 5, dtype=torch.uint8, device="meta"),
          "b": torch.ones(3, dtype=torch.bfloat16)}
    p = tmp_path / "v5.tensors"
    _tensorizer_write(p, sd)
    with open_file(p) as r:
        assert r.version == 5
        assert r.info("long").shape == (2**32 + 5,)
        assert r.verify_all() == []
        rows = r.read_rows("long", 2**32, 2**32 + 5)
        assert rows.is_meta and rows.shape == (5,)
    loaded = load_file(p)
    assert_same(loaded["a"], sd["a"])
    assert_same(loaded["b"], sd["b"])

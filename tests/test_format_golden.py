"""Golden bytes: with align=1 megashard writes exactly what tensorizer 2.12.1 writes."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

tensorizer = pytest.importorskip("tensorizer")
from tensorizer import TensorSerializer  # noqa: E402

from megashard.format import open_file, save_file, write_file  # noqa: E402
from megashard.format import layout as L  # noqa: E402

# SHA-256 of the 6-tensor reference file of docs/tensorizer-format.md §1.13 (262,816 bytes).
PINNED_SHA256 = "723c9ca45ade045c293f2c5a837e0686913553dc877807fd5fec7f1031cd06fb"


def reference_dict() -> dict[str, torch.Tensor]:
    return {
        "f32": torch.tensor([1.0, 2.0, 3.0]),
        "bf16": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
        "i64": torch.tensor([[1, 2], [3, 4]]),
        "scalar": torch.tensor(7.5),
        "empty": torch.zeros(0, 5),
        "noncontig": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


def tensorizer_bytes(sd: dict[str, torch.Tensor], path: Path) -> bytes:
    s = TensorSerializer(str(path))
    s.write_state_dict(sd)
    s.close()
    return path.read_bytes()


def all_numpy_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, generator=g) * 50
    return {
        "float32": base.clone(),
        "float16": base.half(),
        "float64": base.double(),
        "int8": base.to(torch.int8),
        "int16": base.to(torch.int16),
        "int32": base.to(torch.int32),
        "int64": base.to(torch.int64),
        "uint8": base.abs().to(torch.uint8),
        "bool": base > 0,
        "complex64": torch.complex(base, -base),
        "complex128": torch.complex(base, base).to(torch.complex128),
        "uint16": base.abs().to(torch.int32).to(torch.uint16),
        "uint32": base.abs().to(torch.int64).to(torch.uint32),
        "uint64": base.abs().to(torch.int64).to(torch.uint64),
        "zero_dim_i32": torch.tensor(-7, dtype=torch.int32),
        "empty_f16": torch.zeros(4, 0, dtype=torch.float16),
        "transposed": base.t(),
        "sliced": base[:, 1::2],
    }


def opaque_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 6, generator=g)
    return {
        "bf16": base.bfloat16(),
        "fp8_e4m3": base.to(torch.float8_e4m3fn),
        "fp8_e5m2": base.to(torch.float8_e5m2),
        "fp8_e4m3fnuz": base.to(torch.float8_e4m3fnuz),
        "fp8_e5m2fnuz": base.to(torch.float8_e5m2fnuz),
        "complex32": torch.complex(base, base).to(torch.complex32),
        "bf16_scalar": torch.tensor(3.25, dtype=torch.bfloat16),
        "bf16_noncontig": base.bfloat16().t(),
        "f32": base,
    }


def test_pinned_reference_file(tmp_path: Path) -> None:
    p = tmp_path / "ref.tensors"
    save_file(reference_dict(), p, align=1)
    data = p.read_bytes()
    assert len(data) == 262_816
    assert hashlib.sha256(data).hexdigest() == PINNED_SHA256


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("make", [reference_dict, all_numpy_dtypes, opaque_dtypes],
                         ids=["reference", "numpy_dtypes_v1", "opaque_dtypes_v2"])
def test_bytes_equal_tensorizer(tmp_path: Path, make) -> None:  # type: ignore[no-untyped-def]
    sd = make()
    ours, theirs = tmp_path / "ours.tensors", tmp_path / "theirs.tensors"
    save_file(sd, ours, align=1)
    assert ours.read_bytes() == tensorizer_bytes(sd, theirs)


def test_versions_chosen_like_tensorizer(tmp_path: Path) -> None:
    cases = {
        1: {"a": torch.ones(3)},
        2: {"a": torch.ones(3), "b": torch.ones(2, dtype=torch.bfloat16)},
        4: {"a": torch.ones(3), "m": torch.empty(2, 3, device="meta")},
    }
    for version, sd in cases.items():
        ours, theirs = tmp_path / f"o{version}.tensors", tmp_path / f"t{version}.tensors"
        save_file(sd, ours, align=1)
        assert ours.read_bytes() == tensorizer_bytes(sd, theirs)
        with open_file(ours) as r:
            assert r.version == version


def test_long_dimension_v5_bytes(tmp_path: Path) -> None:
    """A dim >= 2**32 makes data version 5 with u64 shapes and tagged metadata entries."""
    sd = {"small": torch.arange(4, dtype=torch.int16),
          "huge": torch.empty(2**32, dtype=torch.uint8, device="meta"),
          "after": torch.ones(2, 2)}
    ours, theirs = tmp_path / "o.tensors", tmp_path / "t.tensors"
    save_file(sd, ours, align=1)
    assert ours.read_bytes() == tensorizer_bytes(sd, theirs)
    with open_file(ours) as r:
        assert r.version == 5
        assert r.info("huge").shape == (2**32,)
        assert r.info("huge").is_meta


def test_write_file_infos_match_file(tmp_path: Path) -> None:
    sd = reference_dict()
    p = tmp_path / "x.tensors"
    infos = write_file(sd, p, align=1)
    assert [i.name for i in infos] == list(sd)
    with open_file(p) as r:
        assert r.infos() == infos
    data = p.read_bytes()
    for i in infos:
        # data_length field sits right before the data; header starts with its size
        assert int.from_bytes(data[i.data_offset - 8:i.data_offset], "little") == i.nbytes
        assert int.from_bytes(data[i.header_offset:i.header_offset + 8], "little") == i.data_offset - i.header_offset
        assert i.tensor_type == L.TENSOR_TYPE_STATE_DICT


def test_hashes_are_tensorizers(tmp_path: Path) -> None:
    """Our CRC32/SHA-256 equal the ones in tensorizer's own file (same header bytes)."""
    sd = opaque_dtypes()
    ours, theirs = tmp_path / "o.tensors", tmp_path / "t.tensors"
    infos = write_file(sd, ours, align=1)
    tensorizer_bytes(sd, theirs)
    with open_file(theirs) as r:
        assert [(i.crc32, i.sha256) for i in r.infos()] == [(i.crc32, i.sha256) for i in infos]

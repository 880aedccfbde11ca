"""megashard.format round trips: dtypes, shapes, reading APIs, buffers, big tensors."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megashard.errors import FormatError
from megashard.format import (
    MissingTensorError,
    TensorInfo,
    empty_buffer,
    load_file,
    open_file,
    parallel_read,
    save_file,
    write_file,
)
from isal import isal_zlib

from megashard.format import layout as L
from megashard.format import writer as W
from megashard.format.fastio import tensor_memoryview
from megashard.format.dtypes import SUPPORTED_DTYPES, decode_dtype, encode_dtype
from bitexact import assert_same


MEGATRON_DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float8_e4m3fn,
                   torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                   torch.bool, torch.complex64]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 8).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("align", [1, 4096])
@pytest.mark.parametrize("threads", [1, 3])
def test_every_megatron_dtype_and_shape(tmp_path: Path, align: int, threads: int) -> None:
    sd: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(MEGATRON_DTYPES):
        name = str(dt).removeprefix("torch.")
        sd[f"{name}.matrix"] = sample(dt, (7, 13), i)
        sd[f"{name}.scalar"] = sample(dt, (), i)
        sd[f"{name}.noncontig"] = sample(dt, (6, 10), i).t()[1::2]
        sd[f"{name}.big"] = sample(dt, (1500, 700), i)  # > 1 MiB for most dtypes: the fused path
        if dt in (torch.float32, torch.int64, torch.bool, torch.complex64):
            sd[f"{name}.empty"] = sample(dt, (0, 4), i)
    p = tmp_path / "all.tensors"
    infos = write_file(sd, p, align=align, threads=threads)
    assert [i.name for i in infos] == list(sd)
    loaded = load_file(p, verify=True)
    for k, v in sd.items():
        assert_same(loaded[k], v)
    with open_file(p) as r:
        assert r.infos() == infos
        assert r.verify_all() == []
        for k, v in sd.items():
            assert_same(r.read(k, verify=True), v)
    if align > 1:
        assert all(i.data_offset % align == 0 for i in infos if i.nbytes)


def test_dtype_table_round_trips() -> None:
    for dt in SUPPORTED_DTYPES:
        codec = encode_dtype(dt)
        assert decode_dtype(codec.encoded, where="x").dtype == dt
        assert codec.itemsize == dt.itemsize
    with pytest.raises(FormatError, match="cannot be stored"):
        encode_dtype(torch.quint8)


def test_read_into_existing_and_views(tmp_path: Path) -> None:
    x = torch.randn(64, 32).bfloat16()
    p = tmp_path / "x.tensors"
    save_file({"x": x, "y": torch.arange(10)}, p)
    big = torch.zeros(100, 32, dtype=torch.bfloat16)
    with open_file(p) as r:
        out = big[10:74]  # a view into a bigger tensor
        assert r.read("x", out=out) is out
        assert_same(big[10:74], x)
        assert torch.equal(big[:10], torch.zeros(10, 32, dtype=torch.bfloat16))
        flat = torch.empty(64 * 32, dtype=torch.bfloat16)  # same numel, other shape
        assert_same(r.read("x", out=flat).view(64, 32), x)
        pinned_like = empty_buffer(64 * 32 * 2).view(torch.bfloat16)
        assert_same(r.read("x", out=pinned_like).view(64, 32), x)
        with pytest.raises(FormatError, match=r"'x'.*dtype"):
            r.read("x", out=torch.empty(64, 32))
        with pytest.raises(FormatError, match=r"'x'.*elements"):
            r.read("x", out=torch.empty(64, 31, dtype=torch.bfloat16))
        with pytest.raises(FormatError, match=r"'x'.*contiguous"):
            r.read("x", out=torch.empty(32, 64, dtype=torch.bfloat16).t())
        with pytest.raises(MissingTensorError, match="nope") as ei:
            r.read("nope")
        assert isinstance(ei.value, KeyError) and str(p) in str(ei.value)


def test_read_rows(tmp_path: Path) -> None:
    x = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    s = torch.tensor(3)
    p = tmp_path / "r.tensors"
    save_file({"x": x, "s": s}, p)
    with open_file(p) as r:
        assert torch.equal(r.read_rows("x", 5, 17), x[5:17])
        assert r.read_rows("x", 3, 3).shape == (0, 6)
        out = torch.empty(2, 6)
        assert r.read_rows("x", 38, 40, out=out) is out and torch.equal(out, x[38:40])
        with pytest.raises(FormatError, match="out of range"):
            r.read_rows("x", 30, 41)
        with pytest.raises(FormatError, match="0-dim"):
            r.read_rows("s", 0, 1)
        with pytest.raises(FormatError, match="elements"):
            r.read_rows("x", 0, 2, out=torch.empty(3, 6))


def test_load_keys_and_device(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(5)}
    p = tmp_path / "k.tensors"
    save_file(sd, p)
    sub = load_file(p, keys=["t3", "t1"])
    assert list(sub) == ["t3", "t1"]
    assert torch.equal(sub["t3"], sd["t3"]) and torch.equal(sub["t1"], sd["t1"])
    assert torch.equal(load_file(p, device="cpu")["t4"], sd["t4"])
    with pytest.raises(MissingTensorError):
        load_file(p, keys=["t9"])


def test_parallel_read(tmp_path: Path) -> None:
    sd = {"a": torch.randn(300, 1000), "b": torch.randn(5).bfloat16(), "c": torch.arange(7)}
    p = tmp_path / "p.tensors"
    infos = {i.name: i for i in write_file(sd, p)}
    dest = empty_buffer(sum(v.nbytes + 64 for v in sd.values()))
    views, off = {}, 0
    for k, v in sd.items():
        views[k] = dest[off:off + v.nbytes].view(v.dtype).view(v.shape)
        off += v.nbytes + (-v.nbytes) % 64
    parallel_read(p, [(infos[k].data_offset, views[k]) for k in sd], threads=3)
    for k, v in sd.items():
        assert_same(views[k], v)
    # by fd, partial ranges, and a short read past EOF
    fd = os.open(p, os.O_RDONLY)
    try:
        part = torch.empty(10, dtype=torch.float32)
        parallel_read(fd, [(infos["a"].data_offset + 4 * 1000, part)])
        assert torch.equal(part, sd["a"][1, :10])
        with pytest.raises(FormatError, match="past the end"):
            parallel_read(fd, [(os.path.getsize(p) - 4, torch.empty(2, dtype=torch.float32))])
    finally:
        os.close(fd)
    with pytest.raises(FormatError, match=str(p)):
        parallel_read(p, [(os.path.getsize(p) - 4, torch.empty(2, dtype=torch.float32))])


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_parallel_read_random_requests(tmp_path: Path, threads: int) -> None:
    """Adjacent, overlapping, gapped, tiny and multi-MiB requests all get exactly their bytes."""
    import random

    rng = random.Random(threads)
    blob = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    p = tmp_path / "blob.bin"
    p.write_bytes(blob.numpy().tobytes())
    requests, expected = [], []
    pos = 0
    for i in range(200):
        n = rng.choice([1, 3, 64, 4096, 70_000, 300_000, 1 << 20]) if i % 100 else 9 << 20
        start = rng.choice([pos, pos + rng.randint(1, 5000), rng.randint(0, (24 << 20) - n)])
        start = min(start, (24 << 20) - n)
        pos = start + n
        dtype = rng.choice([torch.uint8, torch.int16, torch.float32]) if n % 4 == 0 else torch.uint8
        dest = torch.empty(n // dtype.itemsize, dtype=dtype)
        requests.append((start, dest))
        expected.append(blob[start:start + n])
    parallel_read(p, requests, threads=threads)
    for (start, dest), exp in zip(requests, expected):
        assert torch.equal(dest.view(torch.uint8), exp), start


def test_empty_buffer() -> None:
    small = empty_buffer(100)
    assert small.dtype == torch.uint8 and small.numel() == 100
    big = empty_buffer(5 << 20)
    assert big.numel() == 5 << 20 and big.data_ptr() % (2 << 20) == 0
    big.fill_(7)
    view = big[1000:2000].view(torch.int16)
    del big
    assert int(view.sum()) == 500 * (7 * 256 + 7)  # mapping still alive through the view
    assert empty_buffer(0).numel() == 0


def test_hugepage_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Huge pages unless a virtio balloon reports free pages to the host; env var wins."""
    from megashard.format import fastio

    def fake_device(name: str, device: str, features: str) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / "device").write_text(device + "\n")
        (d / "features").write_text(features + "\n")

    monkeypatch.setattr(fastio, "_VIRTIO_DEVICES", str(tmp_path))
    monkeypatch.delenv("MEGASHARD_HUGEPAGES", raising=False)
    fake_device("virtio0", "0x0002", "1" * 64)  # a block device: irrelevant
    fake_device("virtio1", "0x0005", "0110000100" + "0" * 54)  # balloon without reporting
    fastio.hugepages_enabled.cache_clear()
    try:
        assert fastio.hugepages_enabled() is True
        (tmp_path / "virtio1" / "features").write_text("0110010100" + "0" * 54)  # bit 5: reporting
        fastio.hugepages_enabled.cache_clear()
        assert fastio.hugepages_enabled() is False
        monkeypatch.setenv("MEGASHARD_HUGEPAGES", "1")
        fastio.hugepages_enabled.cache_clear()
        assert fastio.hugepages_enabled() is True
        monkeypatch.setenv("MEGASHARD_HUGEPAGES", "0")
        fastio.hugepages_enabled.cache_clear()
        assert fastio.hugepages_enabled() is False
        buf = fastio.empty_buffer(6 << 20)  # either way: a correct, 2 MiB-aligned buffer
        assert buf.numel() == 6 << 20 and buf.data_ptr() % (2 << 20) == 0
    finally:
        fastio.hugepages_enabled.cache_clear()


def test_large_tensor_split_path(tmp_path: Path) -> None:
    """A tensor bigger than its share of the work: SHA-256 and CRC+write run in separate tasks."""
    big = torch.randint(0, 255, (80 << 20,), dtype=torch.uint8)  # > SPLIT_MIN and > half the total
    sd = {"small": torch.ones(3), "big": big, "after": torch.arange(5)}
    p = tmp_path / "split.tensors"
    infos = write_file(sd, p, threads=2)
    one = tmp_path / "one.tensors"
    infos1 = write_file(sd, one, threads=1)  # fused path, same bytes and hashes
    assert infos == infos1
    assert p.read_bytes() == one.read_bytes()
    with open_file(p) as r:
        assert r.verify_all() == []
        assert torch.equal(r.read("big"), big)


def test_offset_math_beyond_4gib() -> None:
    """Header/metadata math with >4 GiB offsets and sizes (u64 everywhere)."""
    shape = (3, 2**31 + 5)  # 6 GiB of uint8, dims < 2**32: no long shape
    hdr = L.build_header(0, 2, b"w", b"|u1", shape, False, 3 * (2**31 + 5), pad=100)
    head = bytes(hdr.buf)
    entry = L.pack_metadata_entry(b"w", 2, b"|u1", shape, False, 5 << 30, (5 << 30) + len(head),
                                  3 * (2**31 + 5), False)
    fh = L.FileHeader(1, 0, 0, 1, len(entry))
    (e,) = L.parse_metadata(entry, fh, "f")
    assert e.shape == shape and e.header_offset == 5 << 30 and e.data_length == 3 * (2**31 + 5)
    L.validate_entries([e], fh, "f", file_size=e.data_offset + e.data_length)
    with pytest.raises(FormatError, match="past the end"):
        L.validate_entries([e], fh, "f", file_size=e.data_offset + e.data_length - 1)
    h = L.parse_header(head, e, "f")
    assert h.data_length == 3 * (2**31 + 5) and h.shape == shape
    long_shape = (2**33 + 1,)
    lh = L.build_header(0, 2, b"l", b"|u1", long_shape, True, 2**33 + 1)
    le = L.pack_metadata_entry(b"l", 2, b"|u1", long_shape, True, 73, 73 + len(lh.buf), 2**33 + 1, True)
    (e2,) = L.parse_metadata(le, L.FileHeader(5, 2, 0, 1, len(le)), "f")
    assert e2.long_shape and e2.shape == long_shape
    assert L.parse_header(bytes(lh.buf), e2, "f").shape == long_shape


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(_available_ram() < 10 << 30, reason="needs ~10 GiB of free RAM (page cache)")
def test_single_tensor_over_4gib(tmp_path: Path) -> None:
    """A real 4.1 GiB uint8 tensor (1-D: dim >= 2**32, so data version 5).

    Cheap: the source is a fresh anonymous mapping (zero pages, nothing resident)
    with a few marked bytes; only slices are read back, the hashes check the rest.
    """
    if _free_bytes(tmp_path) < 12 << 30:
        pytest.skip("needs ~12 GiB of free disk")
    n = (4 << 30) + (100 << 20)
    src = empty_buffer(n)  # anonymous mmap: guaranteed zeros, untouched
    marks = {0: 11, (1 << 32) - 1: 22, 1 << 32: 33, n - 1: 44, 3 << 30: 55}
    for pos, val in marks.items():
        src[pos] = val
    p = tmp_path / "huge.tensors"
    infos = write_file({"head": torch.arange(3), "huge": src, "tail": torch.ones(2)}, p, threads=2)
    huge = next(i for i in infos if i.name == "huge")
    assert huge.nbytes == n and huge.data_offset % 4096 == 0
    assert infos[-1].header_offset > 1 << 32
    with open_file(p) as r:
        assert r.version == 5
        assert r.info("huge") == huge
        for pos in marks:
            lo, hi = max(0, pos - 3), min(n, pos + 3)
            expected = torch.zeros(hi - lo, dtype=torch.uint8)
            for q, val in marks.items():
                if lo <= q < hi:
                    expected[q - lo] = val
            assert torch.equal(r.read_rows("huge", lo, hi), expected)
        assert torch.equal(r.read("tail"), torch.ones(2))
        # Every byte, via the stored CRC32 (ISA-L: ~10 GiB/s; a full SHA-256 pass would cost ~4 s).
        zeroed = L.parse_header(r._pread(huge.header_offset, huge.data_offset - huge.header_offset),
                                r._entry("huge"), str(p)).zeroed
    crc = isal_zlib.crc32(zeroed)
    chunk = torch.empty(64 << 20, dtype=torch.uint8)
    mv = tensor_memoryview(chunk)
    with open(p, "rb") as f:
        f.seek(huge.data_offset)
        left = n
        while left:
            got = f.readinto(mv[:min(left, len(mv))])
            assert got
            crc = isal_zlib.crc32(mv[:got], crc)
            left -= got
    assert crc == huge.crc32
    os.unlink(p)


def test_tensor_info_is_frozen_dataclass() -> None:
    import dataclasses

    assert dataclasses.is_dataclass(TensorInfo)
    info = TensorInfo("a", torch.float32, (1,), 0, 0, 4, 0, "", 2, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "b"  # type: ignore[misc]


def test_write_refusals(tmp_path: Path) -> None:
    p = tmp_path / "bad.tensors"
    cases = [
        ({}, "empty state dict"),
        ({"z": torch.empty(0, dtype=torch.bfloat16)}, "zero-element"),
        ({"z": torch.empty(2, 0, dtype=torch.float8_e4m3fn)}, "zero-element"),
        ({"m": torch.empty(3, dtype=torch.bfloat16, device="meta")}, "meta"),
        ({1: torch.ones(1)}, "must be str"),
        ({"": torch.ones(1)}, "empty tensor name"),
        ({"\x1ex": torch.ones(1)}, "nested path"),
        ({"x": [1, 2]}, "expected a torch.Tensor"),
        ({"x": torch.ones(2).to_sparse()}, "sparse"),
        ({"x": torch.ones(1).reshape([1] * 256)}, "255"),
    ]
    for sd, msg in cases:
        with pytest.raises(FormatError, match=msg):
            save_file(sd, p)  # type: ignore[arg-type]
        assert not p.exists()
    for align in (0, 3, 1 << 30):
        with pytest.raises(FormatError, match="align"):
            save_file({"x": torch.ones(1)}, p, align=align)
    # what tensorizer can read stays allowed
    save_file({"z": torch.empty(0, 3), "m": torch.empty(2, device="meta")}, p)
    with open_file(p) as r:
        assert r.version == 4 and r.verify_all() == []


def test_failed_write_removes_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "partial.tensors"

    def boom(*a: object, **k: object) -> None:
        raise OSError("disk full")
    monkeypatch.setattr(W, "pwrite_all", boom)
    with pytest.raises(OSError, match="disk full"):
        save_file({"x": torch.ones(1 << 20)}, p, threads=2)
    assert not p.exists()


def test_fsync_and_overwrite(tmp_path: Path) -> None:
    p = tmp_path / "f.tensors"
    save_file({"x": torch.ones(1000)}, p, fsync=True)
    save_file({"y": torch.zeros(3)}, p, fsync=True)  # overwrite truncates
    with open_file(p) as r:
        assert r.keys() == ["y"]
        assert r.file_size == p.stat().st_size

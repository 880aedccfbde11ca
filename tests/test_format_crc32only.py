"""CRC32-only tensor headers (issue 31 item 2): ``sha256=False`` writes tensorizer's own
header variant with one hash (CRC32, hash_count 1) and computes no SHA-256.

The oracle is tensorizer 2.12.1: its ``_TensorHeaderSerializer(include_sha256=False)`` builds
the same header bytes, and its reader verifies such files with ``verify_hash=True``.
Every megashard reader (format reader, ``megashard verify``, the load's CRC check, the
streaming verifier of ``megashard copy``) accepts both variants.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
import torch

tensorizer = pytest.importorskip("tensorizer")
from tensorizer import TensorDeserializer  # noqa: E402
from tensorizer.serialization import HashMismatchError, TensorType, _TensorHeaderSerializer  # noqa: E402

import megashard  # noqa: E402
from megashard.errors import ChecksumError, FormatError  # noqa: E402
from megashard.format import load_file, open_file, save_file, write_file  # noqa: E402
from megashard.format import layout as L  # noqa: E402
from megashard.format.streamverify import StreamVerifier  # noqa: E402
from megashard.format.verify import structure_problems  # noqa: E402

from bitexact import assert_same  # noqa: E402
from test_format_compat import mixed_dict  # noqa: E402


def _flip(p: Path, offset: int, bit: int = 2) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 1 << bit
    p.write_bytes(bytes(data))


# ------------------------------------------------------------------ golden bytes


def test_golden_crc32_only_header() -> None:
    """One CRC32-only header, byte for byte: hash_section_len 7 = 1 + (1+1+4), hash_count 1."""
    plan = L.build_header(0, L.TENSOR_TYPE_STATE_DICT, b"w", b"<f4", (2, 3), False, 24, sha256=False)
    data = torch.arange(6, dtype=torch.float32)
    zeroed = bytes(plan.buf)
    crc = zlib.crc32(data.numpy().tobytes(), zlib.crc32(zeroed))
    got = bytes(plan.finish(crc, None))
    want = bytes.fromhex(
        "2c00000000000000"  # header_size 44
        "0000" "02" "0100" "77"  # module_idx 0, STATE_DICT, name_len 1, "w"
        "03" "3c6634"  # dtype "<f4"
        "02" "02000000" "03000000"  # ndim 2, shape (2, 3)
        "0700" "01"  # hash section: 7 bytes follow, 1 hash
        "00" "04") + struct.pack("<I", crc) + bytes.fromhex(  # CRC32: type 0, length 4, value
        "1800000000000000")  # data_length 24
    assert got == want and len(got) == 44 == L.header_size(1, 3, 2, False, sha256=False)
    # tensorizer's own serializer, told to leave out the SHA-256, builds the same bytes
    tz = _TensorHeaderSerializer(0, TensorType.STATE_DICT, b"w", b"<f4", (2, 3), 24, 0,
                                 include_crc32=True, include_sha256=False)
    assert bytes(tz.buffer) == zeroed and tz.compute_crc32() == zlib.crc32(zeroed)  # what its CRC32 covers
    tz.add_crc32(crc)
    assert bytes(tz.buffer) == got


@pytest.mark.parametrize("long_shape,pad", [(False, 0), (False, 37), (True, 0)])
def test_headers_match_tensorizers_serializer(long_shape: bool, pad: int) -> None:
    shape = (2**32, 1) if long_shape else (5, 7, 3)
    plan = L.build_header(0, L.TENSOR_TYPE_STATE_DICT, b"layer.w", b"<f2", shape, long_shape, 0, pad, sha256=False)
    tz = _TensorHeaderSerializer(0, TensorType.STATE_DICT, b"layer.w", b"<f2", shape, 0, 0,
                                 include_crc32=True, include_sha256=False)
    if pad == 0:
        assert bytes(plan.buf) == bytes(tz.buffer)
    else:  # megashard's alignment padding goes between the hash block and data_length
        assert plan.buf[:8] == struct.pack("<Q", len(tz.buffer) + pad)  # header_size counts the padding
        assert bytes(plan.buf[8:-8 - pad]) == bytes(tz.buffer[8:-8]) and bytes(plan.buf[-8 - pad:-8]) == bytes(pad)
        assert plan.buf[-8:] == tz.buffer[-8:]
    assert len(plan.buf) == L.header_size(7, 3, len(shape), long_shape, pad, sha256=False)
    assert len(plan.buf) + 34 == L.header_size(7, 3, len(shape), long_shape, pad)


# ------------------------------------------------------------------ tensorizer reads them


@pytest.mark.parametrize("align", [1, 64, 4096])
def test_tensorizer_verifies_crc32_only_files_bit_exact(tmp_path: Path, align: int) -> None:
    sd = mixed_dict()
    p = tmp_path / "crc.tensors"
    infos = write_file(sd, p, align=align, sha256=False)
    assert all(i.sha256 == "" for i in infos)
    with TensorDeserializer(str(p), device="cpu", verify_hash=True) as d:
        assert list(d.keys()) == list(sd)
        for k, v in sd.items():
            assert_same(d[k], v)
    full = tmp_path / "full.tensors"
    save_file(sd, full, align=align)
    assert p.stat().st_size == full.stat().st_size - 34 * len(sd) or align > 1  # 34 bytes less per header at align 1
    with open_file(p) as r, open_file(full) as rf:
        assert [(i.crc32, i.nbytes) for i in r.infos()] != [] and all(i.sha256 == "" for i in r.infos())
        assert [i.sha256 != "" for i in rf.infos()] == [True] * len(sd)
        assert all(i.data_offset % align == 0 for i in r.infos() if i.nbytes)


def test_tensorizer_detects_a_flipped_data_byte(tmp_path: Path) -> None:
    sd = {"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(64, dtype=torch.bfloat16)}
    p = tmp_path / "crc.tensors"
    infos = write_file(sd, p, align=1, sha256=False)
    _flip(p, infos[1].data_offset + 17)
    with pytest.raises(HashMismatchError, match="CRC32"):
        with TensorDeserializer(str(p), device="cpu", verify_hash=True) as d:
            for k in d.keys():
                d[k]


# ------------------------------------------------------------------ megashard reads them


@pytest.mark.parametrize("align", [1, 4096])
def test_megashard_reader_verifies_crc32_only_files(tmp_path: Path, align: int) -> None:
    sd = mixed_dict()
    p = tmp_path / "crc.tensors"
    infos = write_file(sd, p, align=align, sha256=False)
    with open_file(p) as r:
        assert r.verify_all() == [] and structure_problems(r) == []
        assert [(i.name, i.crc32, i.sha256) for i in r.infos()] == [(i.name, i.crc32, "") for i in infos]
    for k, v in load_file(p, verify=True).items():
        assert_same(v, sd[k])
    big = next(i for i in infos if i.nbytes > 100)
    _flip(p, big.data_offset + big.nbytes // 2)
    with open_file(p) as r:
        problems = r.verify_all()
        with pytest.raises(ChecksumError, match=rf"{big.name!r}.*CRC32"):
            r.read(big.name, verify=True)
    assert len(problems) == 1 and repr(big.name) in problems[0]
    with pytest.raises(ChecksumError):
        load_file(p, verify=True)


@pytest.mark.parametrize("sha256", [False, True])
def test_large_split_tensors_without_sha256(tmp_path: Path, monkeypatch, sha256: bool) -> None:
    """Tensors above the split size (CRC32 in parallel chunks joined by crc32_combine, no SHA-256
    task without sha256) and small grouped ones; the file equals the deferred (upload) path's bytes."""
    from megashard.format import writer

    monkeypatch.setattr(writer, "SPLIT_MIN", 1 << 20)
    monkeypatch.setattr(writer, "COPY_TASK_BYTES", 3 << 20)
    tasks = []
    real_build = writer._build_tasks

    def build(*a, **kw):  # type: ignore[no-untyped-def]
        out = real_build(*a, **kw)
        tasks.append((len(out[1]), sum(1 for t in out[0] if getattr(t, "__name__", "") == "sha_task")))
        return out

    monkeypatch.setattr(writer, "_build_tasks", build)

    g = torch.Generator().manual_seed(4)
    sd = {"big": torch.randn(5 << 20, generator=g), "mid": torch.randn(300_000, generator=g),
          "small": torch.randn(10, generator=g)}
    p = tmp_path / "x.tensors"
    infos = write_file(sd, p, threads=4, sha256=sha256)
    assert tasks == [(1, 1 if sha256 else 0)]  # "big" was split; a SHA-256 task only with sha256
    size, segments, got = writer.file_segments(sd, threads=3, sha256=sha256)
    assert [(i.crc32, i.sha256) for i in got] == [(i.crc32, i.sha256) for i in infos]
    assert b"".join(bytes(v) for _, v in segments) == p.read_bytes() and size == p.stat().st_size
    with open_file(p) as r:
        assert r.verify_all() == []
    with TensorDeserializer(str(p), device="cpu", verify_hash=True) as d:
        assert_same(d["big"], sd["big"])


def test_stream_verifier_accepts_both_variants(tmp_path: Path) -> None:
    sd = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    for sha in (True, False):
        p = tmp_path / f"{sha}.tensors"
        save_file(sd, p, sha256=sha)
        data = p.read_bytes()
        for check_sha in (False, True):
            v = StreamVerifier(str(p), len(data), sha256=check_sha)
            for i in range(0, len(data), 1000):
                v.feed(memoryview(data)[i:i + 1000])
            crcs = v.finish()
            with open_file(p) as r:
                assert crcs == {i.name: i.crc32 for i in r.infos()}
        with open_file(p) as r:
            off = r.info("a").data_offset + 100
        bad = bytearray(data)
        bad[off] ^= 8
        v = StreamVerifier(str(p), len(bad), sha256=True)
        v.feed(memoryview(bytes(bad)))
        with pytest.raises(ChecksumError, match="'a'"):
            v.finish()


# ------------------------------------------------------------------ hostile hash blocks


def _crc_only_file(tmp_path: Path) -> tuple[Path, L.MetaEntry]:
    p = tmp_path / "h.tensors"
    write_file({"t": torch.arange(16, dtype=torch.int32)}, p, align=64, sha256=False)
    data = p.read_bytes()
    fh = L.parse_prologue(data[:L.PROLOGUE_SIZE], str(p), len(data))
    (e,) = L.parse_metadata(data[L.PROLOGUE_SIZE:L.PROLOGUE_SIZE + fh.metadata_len], fh, str(p))
    return p, e


def _hash_block_at(e: L.MetaEntry) -> int:
    """Offset of the u16 hash section length in the file."""
    return e.header_offset + 13 + len(e.raw_name) + 1 + len(e.codec.encoded) + 1 + 4 * len(e.shape)


@pytest.mark.parametrize("edit,match", [
    (lambda b, h: b.__setitem__(slice(h + 2, h + 3), b"\x00"), "lacks the CRC32"),  # hash_count 0
    (lambda b, h: b.__setitem__(slice(h + 2, h + 3), b"\x02"), "hash"),  # 2 hashes claimed, one present
    (lambda b, h: b.__setitem__(slice(h + 4, h + 5), b"\xff"), "hash"),  # CRC length 255
    (lambda b, h: b.__setitem__(slice(h + 4, h + 5), b"\x20"), "hash"),  # CRC length 32
    (lambda b, h: b.__setitem__(slice(h + 3, h + 4), b"\x01"), "hash"),  # type SHA-256 with length 4
    (lambda b, h: b.__setitem__(slice(h, h + 2), b"\xff\xff"), "hash block"),  # section length 65535
    (lambda b, h: b.__setitem__(slice(h, h + 2), b"\x00\x00"), "hash block"),  # section length 0
    (lambda b, h: b.__setitem__(slice(h + 3, h + 4), b"\x07"), "unknown hash type"),
])
def test_hostile_crc32_only_hash_blocks(tmp_path: Path, edit, match) -> None:  # type: ignore[no-untyped-def]
    p, e = _crc_only_file(tmp_path)
    data = bytearray(p.read_bytes())
    edit(data, _hash_block_at(e))
    p.write_bytes(bytes(data))
    with open_file(p) as r:
        with pytest.raises(FormatError, match=match):
            r.info("t")
        problems = r.verify_all()
    assert problems and all("'t'" in x for x in problems)
    v = StreamVerifier(str(p), len(data))
    with pytest.raises(FormatError):
        v.feed(memoryview(bytes(data)))
        v.finish()


def test_duplicate_crc32_entries_are_refused(tmp_path: Path) -> None:
    """Two CRC32 entries (section 13 bytes) in a header sized for it: refused, not 'last one wins'."""
    name, dtype, shape = b"t", b"<i4", (16,)
    plan = L.build_header(0, L.TENSOR_TYPE_STATE_DICT, name, dtype, shape, False, 64, pad=6, sha256=False)
    h = 13 + len(name) + 1 + len(dtype) + 1 + 4
    buf = bytearray(plan.buf)
    buf[h:h + 3] = struct.pack("<HB", 13, 2)
    buf[h + 9:h + 15] = bytes((0, 4)) + bytes(4)
    entry = L.MetaEntry("t", name, L.TENSOR_TYPE_STATE_DICT, L.decode_dtype(dtype, where="t"), shape, 0, len(buf),
                        64, False)
    with pytest.raises(FormatError, match="twice"):
        L.parse_header(bytes(buf), entry, "f")


# ------------------------------------------------------------------ checkpoints


def _state() -> dict:
    g = torch.Generator().manual_seed(8)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16(), "step": 3}


def _tensors_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.tensors"))


@pytest.mark.parametrize("how", ["arg", "env"])
def test_checkpoint_saved_without_sha256_loads_checked_and_verifies(tmp_path: Path, monkeypatch, how: str) -> None:
    from megashard.checkpoint_tools import verify_checkpoint
    from megashard.cli import main as cli_main

    ckpt = tmp_path / "ckpt"
    want = _state()
    if how == "env":
        monkeypatch.setenv("MEGASHARD_SHA256", "0")
        megashard.save(want, ckpt)
    else:
        monkeypatch.setenv("MEGASHARD_SHA256", "1")  # the argument wins over the environment
        megashard.save(want, ckpt, sha256=False)
    (f,) = _tensors_files(ckpt)
    with open_file(f) as r:
        assert {i.sha256 for i in r.infos()} == {""}
    with TensorDeserializer(str(f), device="cpu", verify_hash=True) as d:
        assert len(list(d.keys())) == 2
    tmpl = {"w": torch.empty(64, 32), "b": torch.empty(32, dtype=torch.bfloat16), "step": None}
    out, stats = megashard.load(tmpl, ckpt, return_stats=True)
    assert_same(out["w"], want["w"]) and stats.crc_checked > 0
    assert verify_checkpoint(str(ckpt)) == []
    assert cli_main(["verify", str(ckpt)]) == 0
    out = megashard.load(tmpl, ckpt, verify=True)
    assert_same(out["b"], want["b"])
    with open_file(f) as r:
        w = r.info(next(k for k in r.keys() if r.info(k).nbytes == 64 * 32 * 4))
    _flip(f, w.data_offset + 1000)
    with pytest.raises(ChecksumError, match="is damaged"):  # the default load's CRC check
        megashard.load(tmpl, ckpt)
    with pytest.raises(ChecksumError):
        megashard.load(tmpl, ckpt, verify=True)
    assert verify_checkpoint(str(ckpt)) != []
    assert cli_main(["verify", str(ckpt)]) == 1


def test_sha256_env_values(tmp_path: Path, monkeypatch) -> None:
    from megashard.saving import sha256_default

    for v, want in (("0", False), ("false", False), ("no", False), ("off", False), ("1", True), ("true", True),
                    ("", True)):
        monkeypatch.setenv("MEGASHARD_SHA256", v)
        assert sha256_default() is want, v
    monkeypatch.delenv("MEGASHARD_SHA256")
    assert sha256_default() is True
    monkeypatch.setenv("MEGASHARD_SHA256", "maybe")
    with pytest.raises(megashard.MegashardError, match="MEGASHARD_SHA256"):
        megashard.save({"x": torch.ones(2)}, tmp_path / "c")


def test_convert_and_copy_accept_crc32_only_checkpoints(tmp_path: Path) -> None:
    from megashard.copy import copy

    ckpt = tmp_path / "src"
    want = _state()
    megashard.save(want, ckpt, sha256=False)
    copy(str(ckpt), str(tmp_path / "dst"), sha256=True)
    tmpl = {"w": torch.empty(64, 32), "b": torch.empty(32, dtype=torch.bfloat16), "step": None}
    out = megashard.load(tmpl, tmp_path / "dst", verify=True)
    assert_same(out["w"], want["w"])
    assert [p.read_bytes() for p in _tensors_files(ckpt)] == [p.read_bytes() for p in _tensors_files(tmp_path / "dst")]


def test_async_save_without_sha256(tmp_path: Path) -> None:
    ckpt = tmp_path / "async"
    want = _state()
    handle = megashard.save(want, ckpt, async_save=True, sha256=False)
    handle.result()
    (f,) = _tensors_files(ckpt)
    with open_file(f) as r:
        assert {i.sha256 for i in r.infos()} == {""} and r.verify_all() == []
    tmpl = {"w": torch.empty(64, 32), "b": torch.empty(32, dtype=torch.bfloat16), "step": None}
    assert_same(megashard.load(tmpl, ckpt)["w"], want["w"])

"""Malformed, hostile and corrupted files: clear FormatErrors naming file and tensor."""
from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
import torch

from megashard.errors import ChecksumError, FormatError, MegashardError, UnsupportedFormatError
from megashard.format import load_file, open_file, save_file
from megashard.format import layout as L


def make_file(tmp_path: Path, name: str = "good.tensors") -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {"alpha": torch.arange(10, dtype=torch.float32),
          "beta": torch.ones(3, 4, dtype=torch.bfloat16),
          "gamma": torch.tensor([7, 8, 9], dtype=torch.int64)}
    p = tmp_path / name
    save_file(sd, p, align=64)
    return p, sd


def entries_of(data: bytes, path: str = "f") -> tuple[L.FileHeader, list[L.MetaEntry]]:
    fh = L.parse_prologue(data[:L.PROLOGUE_SIZE], path, len(data))
    return fh, L.parse_metadata(data[L.PROLOGUE_SIZE:L.PROLOGUE_SIZE + fh.metadata_len], fh, path)


def rewrite_entries(p: Path, change: Callable[[list[L.MetaEntry]], list[L.MetaEntry]]) -> None:
    """Re-pack the metadata index after `change` (same-size edits only)."""
    data = bytearray(p.read_bytes())
    fh, entries = entries_of(bytes(data))
    new = change(entries)
    packed = b"".join(L.pack_metadata_entry(e.raw_name, e.tensor_type, e.codec.encoded, e.shape, e.long_shape,
                                            e.header_offset, e.data_offset, e.data_length, fh.versioned_metadata)
                      for e in new)
    data[L.PROLOGUE_SIZE:L.PROLOGUE_SIZE + len(packed)] = packed
    p.write_bytes(bytes(data))


def patch(p: Path, offset: int, raw: bytes) -> None:
    data = bytearray(p.read_bytes())
    data[offset:offset + len(raw)] = raw
    p.write_bytes(bytes(data))


def exercise(p: Path) -> None:
    """Everything a caller might do with a file; raises what the reader raises."""
    with open_file(p) as r:
        r.infos()
        for k in r.keys():
            r.read(k, verify=True)
    load_file(p, verify=True)


def expect(p: Path, exc: type[BaseException], match: str) -> BaseException:
    with pytest.raises(exc, match=match) as ei:
        exercise(p)
    assert str(p) in str(ei.value), f"message does not name the file: {ei.value}"
    return ei.value


def test_bad_magic(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    patch(p, 0, b"|TZX|")
    expect(p, FormatError, "bad magic")
    (tmp_path / "text.tensors").write_bytes(b"hello")
    expect(tmp_path / "text.tensors", FormatError, "bad magic")


def test_empty_and_tiny_files(tmp_path: Path) -> None:
    for n in (0, 3, 5, 40, 72):
        p, _ = make_file(tmp_path)
        p.write_bytes(p.read_bytes()[:n])
        expect(p, FormatError, "truncated|bad magic")


def test_unknown_version(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    patch(p, 5, struct.pack("<I", 9))
    expect(p, UnsupportedFormatError, "unknown tensorizer data version 9")
    patch(p, 5, struct.pack("<I", 0))
    expect(p, UnsupportedFormatError, "version 0")


def test_unknown_feature_flags(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    patch(p, 5, struct.pack("<I", 4))
    patch(p, 9, (1 << 7).to_bytes(32, "little"))
    expect(p, UnsupportedFormatError, "unknown feature flags")
    patch(p, 9, (2).to_bytes(32, "little"))  # versioned headers need version 5
    expect(p, FormatError, "versioned-headers flag")
    patch(p, 5, struct.pack("<I", 2))  # flags are reserved (zero) before version 4
    expect(p, FormatError, "feature flags")


def test_encrypted_files_are_unsupported(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    patch(p, 5, struct.pack("<I", 3))
    e = expect(p, UnsupportedFormatError, "encrypted .* not supported")
    assert isinstance(e, FormatError)
    patch(p, 5, struct.pack("<I", 4))
    patch(p, 9, (1).to_bytes(32, "little"))
    expect(p, UnsupportedFormatError, "encrypted .* not supported")


@pytest.mark.parametrize("cut", ["metadata", "header", "data", "last_byte"])
def test_truncated(tmp_path: Path, cut: str) -> None:
    p, _ = make_file(tmp_path)
    data = p.read_bytes()
    fh, entries = entries_of(data)
    n = {"metadata": L.PROLOGUE_SIZE + 20, "header": entries[1].header_offset + 10,
         "data": entries[2].data_offset + 3, "last_byte": len(data) - 9}[cut]
    p.write_bytes(data[:n])
    expect(p, FormatError, "past the end|truncated")


def test_absurd_counts_and_lengths_rejected_before_allocating(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    patch(p, 65, struct.pack("<Q", 2**62))  # metadata_len
    expect(p, FormatError, "metadata length .* past the end")
    p, _ = make_file(tmp_path)
    patch(p, 57, struct.pack("<Q", 2**60))  # tensor_count
    expect(p, FormatError, "tensor_count .* cannot fit")
    patch(p, 57, struct.pack("<Q", 0))
    expect(p, FormatError, "no tensors")


def test_offsets_and_lengths_past_eof(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [es[0], replace(es[1], data_offset=2**50), es[2]])
    expect(p, FormatError, "'beta'.*past the end")
    p, _ = make_file(tmp_path)
    size = p.stat().st_size
    rewrite_entries(p, lambda es: [es[0], es[1], replace(es[2], header_offset=size - 100, data_offset=size - 20)])
    expect(p, FormatError, "'gamma'.*past the end")


def test_absurd_dims(tmp_path: Path) -> None:
    """A shape whose product dwarfs the file: rejected by the length check, no allocation."""
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [replace(es[0], shape=(2**32 - 1,)), es[1], es[2]])
    expect(p, FormatError, "'alpha'.*does not match shape")
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [es[0], replace(es[1], shape=(2**32 - 1, 2**32 - 1)), es[2]])
    expect(p, FormatError, "'beta'.*too large")


def test_absurd_meta_dims_never_allocate(tmp_path: Path) -> None:
    """Meta entries (no data) with huge shapes come back as meta tensors, not allocations."""
    p = tmp_path / "meta.tensors"
    save_file({"m": torch.empty(4, 4, device="meta"), "x": torch.ones(2)}, p, align=64)
    rewrite_entries(p, lambda es: [replace(es[0], shape=(2**20, 2**20)), es[1]])
    with open_file(p) as r:
        t = r.read("m")
        assert t.is_meta and t.shape == (2**20, 2**20)
        with pytest.raises(FormatError, match="'m'.*header shape"):
            r.info("m")
    assert load_file(p)["m"].is_meta
    save_file({"m": torch.empty(1, 1, 1, 1, 4, device="meta"), "x": torch.ones(2)}, p, align=64)
    rewrite_entries(p, lambda es: [replace(es[0], shape=(2**32 - 1,) * 5), es[1]])
    expect(p, FormatError, "'m'.*too large")


def test_overlapping_entries(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [es[0], replace(es[1], header_offset=es[0].data_offset + 4,
                                                   data_offset=es[0].data_offset + 100), es[2]])
    expect(p, FormatError, "overlap")
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [es[0], es[1], replace(es[2], header_offset=es[1].header_offset,
                                                          data_offset=es[1].data_offset)])
    expect(p, FormatError, "overlap")


def test_header_inside_metadata_and_no_room_for_header(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [replace(es[0], header_offset=10), es[1], es[2]])
    expect(p, FormatError, "'alpha'.*inside the metadata")
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [replace(es[0], data_offset=es[0].header_offset + 8), es[1], es[2]])
    expect(p, FormatError, "'alpha'.*no room")


def test_non_utf8_and_duplicate_names(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    data = p.read_bytes()
    at = data.index(b"alpha", L.PROLOGUE_SIZE)
    patch(p, at, b"\xffalph")
    expect(p, FormatError, "not valid UTF-8")
    p, _ = make_file(tmp_path)
    rewrite_entries(p, lambda es: [es[0], es[1], replace(es[2], raw_name=b"alpha", name="alpha")])
    expect(p, FormatError, "duplicate tensor name")
    p, _ = make_file(tmp_path)
    patch(p, p.read_bytes().index(b"gamma", L.PROLOGUE_SIZE), b"\x1e[1,{")
    expect(p, FormatError, "nested tensor path")


def test_unknown_dtype_and_tensor_type(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    data = p.read_bytes()
    patch(p, data.index(b"<f4", L.PROLOGUE_SIZE), b">f4")
    expect(p, UnsupportedFormatError, "big-endian")
    patch(p, data.index(b"<f4", L.PROLOGUE_SIZE), b"<x4")
    expect(p, UnsupportedFormatError, "unsupported dtype")
    p, _ = make_file(tmp_path)
    at = data.index(b"alpha", L.PROLOGUE_SIZE) + 5
    patch(p, at, b"\x07")
    expect(p, FormatError, "unknown tensor type 7")


def test_header_disagreeing_with_index(tmp_path: Path) -> None:
    p, _ = make_file(tmp_path)
    fh, es = entries_of(p.read_bytes())
    hdr_name_at = es[1].header_offset + 13
    patch(p, hdr_name_at, b"BETA")
    expect(p, FormatError, "'beta'.*header names")
    p, _ = make_file(tmp_path)
    patch(p, es[1].data_offset - 8, struct.pack("<q", 999))
    expect(p, FormatError, "'beta'.*header data length 999")
    p, _ = make_file(tmp_path)
    patch(p, es[0].header_offset, struct.pack("<Q", 12))
    expect(p, FormatError, "'alpha'.*header size 12")


def test_hash_mismatch(tmp_path: Path) -> None:
    p, sd = make_file(tmp_path)
    _, es = entries_of(p.read_bytes())
    beta = next(e for e in es if e.name == "beta")
    patch(p, beta.data_offset + 5, b"\x55")
    # Without verification the (corrupt) bytes load; with it: ChecksumError naming file and tensor.
    assert not torch.equal(load_file(p)["beta"], sd["beta"])
    for call in (lambda: load_file(p, verify=True),
                 lambda: open_file(p).read("beta", verify=True),
                 lambda: open_file(p).verify("beta")):
        with pytest.raises(ChecksumError, match=r"'beta'.*hash mismatch") as ei:
            call()
        assert str(p) in str(ei.value)
    with open_file(p) as r:
        problems = r.verify_all()
        r.verify("alpha")
        r.verify("gamma")
    assert len(problems) == 1 and "'beta'" in problems[0] and str(p) in problems[0]


def test_header_hash_mismatch(tmp_path: Path) -> None:
    """The hashes cover the header too (e.g. the alignment padding)."""
    p, _ = make_file(tmp_path)
    _, es = entries_of(p.read_bytes())
    patch(p, es[2].data_offset - 9, b"\x01")  # last padding byte before data_length
    with open_file(p) as r:
        with pytest.raises(ChecksumError, match="'gamma'"):
            r.verify("gamma")


def test_missing_file_and_closed_reader(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="cannot open"):
        open_file(tmp_path / "missing.tensors")
    with pytest.raises(FormatError, match="not a regular file"):
        open_file(tmp_path)
    p, _ = make_file(tmp_path)
    r = open_file(p)
    r.close()
    with pytest.raises(FormatError, match="closed"):
        r.read("alpha")


def test_all_errors_are_megashard_errors() -> None:
    for e in (FormatError, ChecksumError, UnsupportedFormatError):
        assert issubclass(e, MegashardError)

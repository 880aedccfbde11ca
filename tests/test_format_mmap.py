"""``load_file(..., mmap=True)`` / ``read(key, mmap=True)``: copy-on-write views of the file, bit for bit.

Also the pre-faulted fresh-buffer path of plain ``load_file`` (``fastio.prefault``).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from tensorizer import TensorSerializer

from megashard.errors import ChecksumError, FormatError
from megashard.format import fastio, load_file, open_file, save_file
from megashard.format.reader import MissingTensorError
from bitexact import assert_same


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 19, generator=g)
    x[1, 2] = float("nan")
    return {
        "emb.weight": x.bfloat16(),
        "f32": x,
        "f16": x.half(),
        "f64": x.double(),
        "fp8": x.to(torch.float8_e4m3fn),
        "i8": (x * 10).to(torch.int8),
        "i64": (x * 1000).to(torch.int64),
        "bool": x > 0,
        "c64": torch.complex(x, -x),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "odd": torch.arange(7, dtype=torch.int16),  # odd byte lengths shift what follows in align=1 files
        "empty": torch.zeros(0, 4),
        "big": torch.randn(300, 1000, generator=g),  # > PREFAULT_MIN, several pages
    }


def file_mapping(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, perms) of this process's mappings of `path` (from /proc/self/maps)."""
    ino = os.stat(path).st_ino
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and int(parts[4]) == ino and parts[5] == str(path):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[1]))
    return out


def in_private_mapping(t: torch.Tensor, path: Path) -> bool:
    a, n = t.data_ptr(), t.numel() * t.element_size()
    return any(s <= a and a + n <= e and perms.endswith("p") for s, e, perms in file_mapping(path))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("align", [4096, 64, 1])
@pytest.mark.parametrize("verify", [False, True])
def test_mmap_round_trip_bit_exact(tmp_path: Path, align: int, verify: bool) -> None:
    sd = mixed()
    p = tmp_path / "m.tensors"
    save_file(sd, p, align=align)
    out = load_file(p, mmap=True, verify=verify)
    assert list(out) == list(sd)
    for k, v in sd.items():
        assert_same(out[k], v)
    with open_file(p) as r:
        entries = {e.name: e for e in r._entries}
        for k, v in sd.items():
            t = r.read(k, mmap=True, verify=verify)
            assert_same(t, v)
            e = entries[k]
            aligned = e.data_offset % e.codec.itemsize == 0
            if v.numel():
                # mapped exactly when aligned to the element size (always, for align >= 8)
                assert in_private_mapping(t, p) == aligned, (k, e.data_offset)
                assert in_private_mapping(out[k], p) == aligned, k
                if align >= 8:
                    assert aligned
    assert sum(in_private_mapping(t, p) for t in out.values() if t.numel()) >= 1


def test_mmap_keys_subset_and_meta_and_missing(tmp_path: Path) -> None:
    sd = mixed()
    p = tmp_path / "m.tensors"
    save_file(sd, p)
    out = load_file(p, keys=["f16", "bool", "f16"], mmap=True)
    assert list(out) == ["f16", "bool"]
    assert_same(out["f16"], sd["f16"])
    assert_same(out["bool"], sd["bool"])
    empty = load_file(p, keys=["empty"], mmap=True)["empty"]
    assert empty.shape == (0, 4) and empty.dtype == torch.float32
    with pytest.raises(MissingTensorError, match="nope"):
        load_file(p, keys=["nope"], mmap=True)
    # meta tensors (data version 4) stay meta
    p2 = tmp_path / "meta.tensors"
    save_file({"w": torch.ones(3, 3), "marker": torch.empty(2, 2, device="meta")}, p2)
    out2 = load_file(p2, mmap=True, verify=True)
    assert out2["marker"].is_meta and out2["marker"].shape == (2, 2)
    assert_same(out2["w"], torch.ones(3, 3))
    assert in_private_mapping(out2["w"], p2)


def test_mmap_reads_tensorizer_written_file(tmp_path: Path) -> None:
    sd = mixed()
    del sd["empty"]  # tensorizer's reader refuses zero-element bf16/fp8; keep the dict plain
    p = tmp_path / "tz.tensors"
    s = TensorSerializer(str(p))
    s.write_state_dict(sd)
    s.close()
    out = load_file(p, mmap=True, verify=True)
    for k, v in sd.items():
        assert_same(out[k], v)
    with open_file(p) as r:
        aligned = [e.name for e in r._entries if e.data_length and e.data_offset % e.codec.itemsize == 0]
    assert aligned  # some tensors are mapped, the unaligned ones copied
    for k in sd:
        assert in_private_mapping(out[k], p) == (k in aligned), k


def test_mmap_is_copy_on_write(tmp_path: Path) -> None:
    sd = mixed()
    p = tmp_path / "m.tensors"
    save_file(sd, p)
    before = sha(p)
    out = load_file(p, mmap=True)
    with open_file(p) as r:
        t = r.read("big", mmap=True)
    assert in_private_mapping(out["big"], p) and in_private_mapping(t, p)
    out["big"].fill_(7.0)
    out["i8"] += 1
    t[0, 0] = -1.0
    assert (out["big"] == 7.0).all() and t[0, 0] == -1.0 and t[1, 0] == sd["big"][1, 0]
    assert sha(p) == before  # the file is untouched
    again = load_file(p, mmap=True)
    assert_same(again["big"], sd["big"])
    assert_same(again["i8"], sd["i8"])
    assert_same(load_file(p)["big"], sd["big"])


def test_mmap_tensors_outlive_reader(tmp_path: Path) -> None:
    sd = mixed()
    p = tmp_path / "m.tensors"
    save_file(sd, p)
    r = open_file(p)
    t = r.read("f64", mmap=True)
    fds = len(os.listdir("/proc/self/fd"))
    r.close()
    del r
    assert len(os.listdir("/proc/self/fd")) == fds - 1  # the mapping keeps no descriptor
    assert_same(t, sd["f64"])
    assert in_private_mapping(t, p)
    view = t[3:5].clone()
    del t
    assert_same(view, sd["f64"][3:5])


def test_mmap_verify_hashes_the_mapped_bytes(tmp_path: Path) -> None:
    sd = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(10, dtype=torch.int64)}
    p = tmp_path / "m.tensors"
    save_file(sd, p)
    with open_file(p) as r:
        off = r._entry("a").data_offset
    with open(p, "r+b") as f:
        f.seek(off + 4 * 100)
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(ChecksumError, match="'a'"):
        load_file(p, mmap=True, verify=True)
    with open_file(p) as r, pytest.raises(ChecksumError, match="'a'"):
        r.read("a", mmap=True, verify=True)
    # without verification the mapping shows exactly the file's (changed) bytes
    got = load_file(p, mmap=True)["a"]
    assert got.view(torch.uint8)[400:404].tolist() == [1, 2, 3, 4]
    assert_same(load_file(p, mmap=True, keys=["b"], verify=True)["b"], sd["b"])


def test_mmap_errors(tmp_path: Path) -> None:
    sd = {"a": torch.arange(100, dtype=torch.float32)}
    p = tmp_path / "m.tensors"
    save_file(sd, p)
    with open_file(p) as r:
        with pytest.raises(FormatError, match="cannot fill out="):
            r.read("a", out=torch.empty(100), mmap=True)
        with open(p, "ab") as f:  # the file grows after the index was validated: refuse to map
            f.write(b"\0" * 10)
        with pytest.raises(FormatError, match="changed size since it was opened"):
            r.read("a", mmap=True)
    with open(p, "r+b") as f:  # truncated into the data: refused at open, nothing mapped
        f.truncate(os.path.getsize(p) - 200)
    with pytest.raises(FormatError, match="m.tensors"):
        load_file(p, mmap=True)
    save_file(sd, p)
    r = open_file(p)
    r.close()
    with pytest.raises(FormatError, match="closed"):
        r.read("a", mmap=True)


def test_load_file_prefault_on_and_off_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = mixed()
    p = tmp_path / "m.tensors"
    save_file(sd, p, align=1)
    calls: list[int] = []
    real = fastio.prefault
    monkeypatch.setattr(fastio, "prefault", lambda mv: (calls.append(len(mv)), real(mv)))
    with_prefault = load_file(p)
    assert sum(calls) >= sum(t.nbytes for t in sd.values())  # every piece of the fresh buffer went through prefault
    monkeypatch.setattr(fastio, "_prefault_ok", False)
    without = load_file(p)
    for k, v in sd.items():
        assert_same(with_prefault[k], v)
        assert_same(without[k], v)
    # reads into caller-owned memory never pre-fault (it is not fresh)
    calls.clear()
    dest = torch.empty_like(sd["big"])
    with open_file(p) as r:
        r.read("big", out=dest)
    assert calls == [] and torch.equal(dest, sd["big"])

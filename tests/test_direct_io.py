"""``direct=True`` / ``direct_io=True``: large tensors' bodies bypass the page cache, the
bytes on disk stay exactly those of a page-cache write, and filesystems or writes that
refuse O_DIRECT fall back without losing a byte."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest
import torch

import megashard
from megashard.format import load_file, write_file
from megashard.format import writer as W
from bitexact import assert_same

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big.odd": torch.randn(3 * 1024 * 1024 // 4 + 5, generator=g),  # 3 MiB + 20 B: a body and a tail
        "small.a": torch.randn(100, generator=g),  # grouped with neighbours, through the page cache
        "big.bf16": torch.randn(1500, 1100, generator=g).to(torch.bfloat16),
        "exact": torch.randn(W.DIRECT_BUF // 4 + 1024, generator=g),  # more than one bounce buffer
        "small.b": torch.arange(7, dtype=torch.int64),
        "noncontig": torch.randn(900, 1300, generator=g).t(),
    }


def _cached_pages(path: Path, lo: int, hi: int) -> int:
    """Pages of the file's [lo, hi) in the page cache: ``mincore`` on a read-only mapping
    of the file (which faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            first, last = lo // page, (hi - 1) // page
            vec = ctypes.create_string_buffer(last - first + 1)
            assert libc.mincore(addr + first * page, (last - first + 1) * page, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 2])
def test_direct_write_is_byte_identical_to_a_page_cache_write(tmp_path: Path, threads: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "SPLIT_MIN", 4 << 20)  # the 'exact' tensor is split over threads (SHA apart)
    sd = _state()
    a, b = tmp_path / "cached.tensors", tmp_path / "direct.tensors"
    infos_a = write_file(sd, a, fsync=True, threads=threads)
    infos_b = write_file(sd, b, fsync=True, threads=threads, direct=True)
    assert a.read_bytes() == b.read_bytes()
    assert infos_a == infos_b
    back = load_file(b)
    for k, t in sd.items():
        assert_same(back[k], t.contiguous())


def test_direct_write_leaves_large_bodies_out_of_the_page_cache(tmp_path: Path) -> None:
    sd = {"w": torch.randn(4 << 20), "b": torch.randn(10)}  # 16 MiB body
    a, b = tmp_path / "cached.tensors", tmp_path / "direct.tensors"
    info_a = {i.name: i for i in write_file(sd, a, fsync=True)}["w"]
    info_b = {i.name: i for i in write_file(sd, b, fsync=True, direct=True)}["w"]
    pages = info_b.nbytes // mmap.PAGESIZE
    # the control: a page-cache write leaves (nearly) all its pages cached, so the check can see them
    assert _cached_pages(a, info_a.data_offset, info_a.data_offset + info_a.nbytes) > pages // 2
    assert _cached_pages(b, info_b.data_offset, info_b.data_offset + info_b.nbytes) == 0
    assert a.read_bytes() == b.read_bytes()


def test_filesystem_without_o_direct_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *a, **k):  # what open(2) says on a filesystem without O_DIRECT
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    sd = _state()
    write_file(sd, tmp_path / "ref.tensors", threads=2)
    monkeypatch.setattr(W.os, "open", no_direct)
    write_file(sd, tmp_path / "x.tensors", threads=2, direct=True)
    assert (tmp_path / "x.tensors").read_bytes() == (tmp_path / "ref.tensors").read_bytes()


def _fail_direct_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> set[int]:
    """Make every pwrite on an O_DIRECT descriptor fail with ``code``; returns those descriptors."""
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()

    def track(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fail(fd, data, off):
        if fd in direct_fds:
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(W.os, "open", track)
    monkeypatch.setattr(W.os, "pwrite", fail)
    return direct_fds


def test_refused_direct_write_falls_back_without_losing_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An O_DIRECT write that fails with EINVAL (alignment the device wants bigger than
    4 KiB) is written through the page cache instead; every byte arrives."""
    sd = _state()
    write_file(sd, tmp_path / "ref.tensors", threads=2)
    direct_fds = _fail_direct_writes(monkeypatch, errno.EINVAL)
    write_file(sd, tmp_path / "x.tensors", threads=2, direct=True)
    assert direct_fds  # the direct descriptor was opened, and refused
    assert (tmp_path / "x.tensors").read_bytes() == (tmp_path / "ref.tensors").read_bytes()


def test_other_write_errors_are_raised_not_swallowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_direct_writes(monkeypatch, errno.ENOSPC)
    with pytest.raises(OSError) as e:
        write_file(_state(), tmp_path / "x.tensors", direct=True)
    assert e.value.errno == errno.ENOSPC
    assert not (tmp_path / "x.tensors").exists()  # a failed write leaves no file behind


def test_save_direct_io_round_trip(tmp_path: Path) -> None:
    sd = _state()
    megashard.save(dict(sd), tmp_path / "ck", direct_io=True)
    got = megashard.load({k: torch.empty_like(t) for k, t in sd.items()}, tmp_path / "ck", verify=True)
    for k, t in sd.items():
        assert_same(got[k], t)
    megashard.save(dict(sd), tmp_path / "ref")
    for f in sorted(os.listdir(tmp_path / "ref")):
        if f.endswith(".tensors"):
            assert (tmp_path / "ck" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


def test_async_save_with_direct_io(tmp_path: Path) -> None:
    """The background writer writes the staged snapshot with O_DIRECT too; the caller may
    change its tensors as soon as the call returns."""
    sd = _state()
    want = {k: t.clone() for k, t in sd.items()}
    handle = megashard.save(sd, tmp_path / "ck", async_save=True, direct_io=True)
    for t in sd.values():
        t.zero_()
    handle.result()
    got = megashard.load({k: torch.empty_like(t) for k, t in want.items()}, tmp_path / "ck", verify=True)
    for k, t in want.items():
        assert_same(got[k], t)

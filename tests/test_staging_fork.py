"""Async-save staging stays out of forked children (MADV_DONTFORK), so a fork (torch_dist's
async writer, DataLoader workers) does not make every later snapshot take a copy-on-write
fault per page; snapshots stay exact across forks."""
from __future__ import annotations

import os

import torch

from megashard import async_save
from megashard.format.fastio import empty_buffer


def _vm_flags(addr: int) -> list:
    """The VmFlags of the mapping that holds ``addr`` (Linux /proc/self/smaps)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
    return flags


def test_fork_private_buffers_are_not_copied_into_children():
    private = empty_buffer(3 << 20, fork_private=True)
    plain = empty_buffer(3 << 20)
    assert "dc" in _vm_flags(private.data_ptr())  # "do not copy": left out of fork
    assert "dc" not in _vm_flags(plain.data_ptr())
    small = empty_buffer(4096, fork_private=True)  # small ones get their own mapping too
    assert "dc" in _vm_flags(small.data_ptr())


def test_snapshots_stay_exact_across_a_fork():
    staging = async_save.Staging()
    ts = [torch.randn(700, 300), torch.arange(5000, dtype=torch.int64), torch.randn(3, 4).t().contiguous()]
    first = staging.snapshot(ts)
    assert "dc" in _vm_flags(staging.arenas["cpu"].data_ptr())
    pid = os.fork()
    if pid == 0:  # the child never touches the staging (it does not have it)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    for t in ts:
        t.add_(1)
    again = staging.snapshot(ts)
    assert staging.allocations == 1 and all(a.data_ptr() == b.data_ptr() for a, b in zip(first, again))
    assert all(torch.equal(a, t) for a, t in zip(again, ts))


def test_forked_child_starts_with_no_async_state():
    """The fork handlers: a child has no save in flight, a writer not yet started, an empty
    staging (the parent's arenas are not mapped there) and no I/O pool threads."""
    from megashard.format import fastio

    stg = async_save.staging()
    stg.snapshot([torch.randn(1000)])
    fastio.run_parallel([lambda: None] * 3, 3)  # a pool with threads in this process
    assert stg.arenas and fastio._pools
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # report what the child sees, then leave without running pytest's teardown
        try:
            seen = [async_save.staging() is not stg, not async_save.staging().arenas,
                    async_save.staging().allocations == 0, async_save.in_flight() is None,
                    async_save._WRITER.thread is None, not fastio._pools]
            os.write(w, bytes(int(bool(x)) for x in seen))
        finally:
            os._exit(0)
    os.close(w)
    seen = list(os.read(r, 64))
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    assert seen == [1] * 6, seen
    assert async_save.staging() is stg and stg.arenas  # the parent's own state is untouched

"""Loads read through the files object's ``read_into``; descriptors only where it passes them.

An object store's files object has ``read_into`` (and ``read_files``) but no descriptors
(``passes_descriptors = False``). Here a wrapper around :class:`CheckpointFiles` with
exactly that surface is patched in for the loads: own and scatter loads (every transport)
must be bit-exact through it, scatter must not pass descriptors, and every byte a rank
reads must go through ``read_into``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from distributed import all_ok, run_ranks
from layouts import Layout, check_state, model_state

NODE_ENV = {"MEGASHARD_NODE_ID": "test-node", "MEGASHARD_HUGEPAGES": "0"}


class NoDescriptorFiles:
    """A :class:`CheckpointFiles` without ``descriptor`` (nor ``dir_fd``): a files object
    as an object store has it. Records what was read through ``read_into``."""

    passes_descriptors = False
    reads: List[Tuple[str, int, int]] = []  # (name, requests, bytes), per read_into with requests

    def __init__(self, base: Any, index: Any = None) -> None:
        from megashard.storage import CheckpointFiles

        self._inner = CheckpointFiles(base)

    def __getattr__(self, name: str) -> Any:  # the rest of the interface (head, sizes), never a descriptor
        if name in ("descriptor", "dir_fd"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def read_into(self, name: str, reqs: Sequence[Tuple[int, memoryview]], *, size: Optional[int],
                  threads: int) -> int:
        n = self._inner.read_into(name, reqs, size=size, threads=threads)
        if reqs:
            self.reads.append((name, len(reqs), n))
        return n

    def read_files(self, jobs: Sequence[Tuple[str, Sequence[Tuple[int, memoryview]], Optional[int]]], *,
                   threads: int) -> int:
        return sum(self.read_into(name, reqs, size=size, threads=threads) for name, reqs, size in jobs)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> "NoDescriptorFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load(layout: Layout, rank: int, path: str, **kw: Any) -> Dict[str, Any]:
    import megashard
    from megashard import fdpass, storage

    template = model_state(layout, rank, empty=True)
    passed: List[int] = []
    real_send, real_files = fdpass.send, storage.checkpoint_files

    def send(name: str, pid: int, fds: Any, timeout: float = 0) -> None:
        passed.append(len(fds))
        real_send(name, pid, fds, timeout) if timeout else real_send(name, pid, fds)

    NoDescriptorFiles.reads = []
    fdpass.send, storage.checkpoint_files = send, NoDescriptorFiles  # type: ignore[assignment]
    try:
        _, stats = megashard.load(template, path, return_stats=True, **kw)
    finally:
        fdpass.send, storage.checkpoint_files = real_send, real_files  # type: ignore[assignment]
    data = [r for r in NoDescriptorFiles.reads if r[0].endswith(".tensors")]
    return {"bad": check_state(template), "transport": stats.transport, "mode": stats.mode,
            "read": stats.bytes_read, "received": stats.bytes_received, "passed": passed,
            "through_read_into": sum(n for _, _, n in data), "requests": sum(k for _, k, _ in data),
            "index_reads": len(NoDescriptorFiles.reads) - len(data),
            "needed": sum(sh.data.numel() * sh.data.element_size() for c in template.values() for sh in c.values())}


CASES = [("own", "auto"), ("scatter", "auto"), ("scatter", "shm"), ("scatter", "group")]
SCENARIOS = [(Layout(tp=2), Layout(tp=2)), (Layout(tp=2), Layout(dp=2))]  # as saved; resharded (rows, shared bytes)


def _job(rank: int, world: int, tmp: str) -> List[Dict[str, Any]]:
    import megashard
    import torch.distributed as dist

    out = []
    for n, (saved, loaded) in enumerate(SCENARIOS):
        path = os.path.join(tmp, f"ckpt{n}")
        megashard.save(model_state(saved, rank), path)
        for mode, transport in CASES:
            r = _load(loaded, rank, path, mode=mode, scatter_transport=transport, scatter_chunk_bytes=700)
            r.update(scenario=n, want=(mode, transport))
            out.append(r)
        dist.barrier()
    return out


def test_loads_without_descriptors_are_bit_exact(tmp_path) -> None:
    res = all_ok(run_ranks(_job, 2, str(tmp_path), env=NODE_ENV, timeout=240))
    for rows0, rows1 in zip(*res):
        assert rows0["want"] == rows1["want"] and rows0["scenario"] == rows1["scenario"]
        mode, transport = rows0["want"]
        for rank, r in enumerate((rows0, rows1)):
            where = (rank, r["scenario"], mode, transport)
            assert r["bad"] == [], (where, r["bad"])
            assert r["mode"] == mode and r["passed"] == [], where  # no descriptor was ever passed
            assert r["index_reads"] > 0, where  # index sections through read_into too
            assert r["read"] == r["through_read_into"], where  # every byte read went through read_into
        if mode == "own":
            for r in (rows0, rows1):
                assert (r["read"], r["transport"]) == (r["needed"], ""), r
            continue
        assert rows0["transport"] == rows1["transport"] == ("group" if transport == "group" else "shm")
        # the reader reads every byte the node needs; the other rank none (no descriptors: all from the ring)
        assert (rows1["read"], rows1["through_read_into"], rows1["received"]) == (0, 0, rows1["needed"]), rows1
        assert rows0["received"] == 0 and rows0["read"] >= rows0["needed"]


def test_rows_go_through_read_into_one_request_each(tmp_path) -> None:
    """Own load of a TP-split matrix into a full one: back-to-back rows are one request each,
    handed to ``read_into`` as one row run per saved half, bit-exact."""
    import megashard
    import torch

    from megashard import readers, storage

    path = str(tmp_path / "ckpt")
    rows, cols = 64, 512  # a half row is 1 KiB: at least plan.MIN_ROW_BYTES, read in place
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sh = [ShardedTensor.from_rank_offsets("w", full[:, r * 256:(r + 1) * 256].contiguous(), (1, r, 2), replica_id=0)
          for r in range(2)]
    megashard.save({"a": sh[0], "b": sh[1]}, path)
    calls: List[Tuple[str, int]] = []
    runs: List[int] = []  # rows per row run handed to read_into
    real = storage.CheckpointFiles.read_into

    def spy(self: Any, name: str, reqs: Any, **kw: Any) -> int:
        if reqs and name.endswith(".tensors"):
            calls.append((name, len(reqs)))
            runs.extend(len(views) for _, _, views in getattr(reqs, "runs", ()))
        return real(self, name, reqs, **kw)

    dst = torch.zeros(rows, cols)
    storage.CheckpointFiles.read_into = spy  # type: ignore[method-assign]
    try:
        jobs: List[Any] = []
        real_read_own = readers.read_own

        def watch(base: str, files: Any, ops: Any, view_ops: Any, row_jobs: Any, threads: Any, *rest: Any) -> int:
            jobs.extend(row_jobs)
            return real_read_own(base, files, ops, view_ops, row_jobs, threads, *rest)

        readers.read_own = watch
        try:
            megashard.load({"w": ShardedTensor.from_rank_offsets("w", dst, replica_id=0)}, path, mode="own")
        finally:
            readers.read_own = real_read_own
    finally:
        storage.CheckpointFiles.read_into = real  # type: ignore[method-assign]
    assert torch.equal(dst, full)
    assert len(jobs) == 2 and all(len(j[3]) == rows for j in jobs)  # one row job per saved half
    assert sum(k for _, k in calls) == 2 * rows  # every row one request, nothing read elsewhere
    assert runs == [rows, rows]  # each job handed over as one row run (read one preadv per IOV_MAX rows)


def test_read_requests_many_back_to_back_and_scattered(tmp_path) -> None:
    """``read_requests`` (what ``CheckpointFiles.read_into`` runs): rows back to back, overlapping,
    empty and scattered requests in any order each get exactly their bytes; no preadv over IOV_MAX."""
    import random

    from megashard.format import fastio

    rng = random.Random(1)
    data = rng.randbytes(1 << 21)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for trial in range(40):
            want: List[Tuple[int, bytearray]] = []
            off = rng.randrange(1000)
            for _ in range(rng.choice([3, 50, 3000])):
                n = rng.choice([0, 1, 7, 600, 4096, 70_000])
                if rng.random() < 0.3:
                    off = rng.randrange(len(data))
                off = min(off, len(data) - n)
                want.append((off, bytearray(n)))
                off += n
            reqs = [(o, memoryview(b)) for o, b in want]
            rng.shuffle(reqs)
            for threads in (1, 3):
                assert all(len(iov) <= fastio.IOV_MAX for t in fastio.plan_reads(reqs, threads) for _, iov in t)
                for _, b in want:
                    b[:] = bytes(len(b))
                fastio.read_requests(fd, reqs, str(path), threads)
                assert all(bytes(b) == data[o:o + len(b)] for o, b in want), (trial, threads)
    finally:
        os.close(fd)


def test_row_runs_read_through_checkpoint_files_one_preadv_per_iov_max_rows(tmp_path, monkeypatch) -> None:
    """A ``Requests`` row run (rows back to back in the file, strided destination) read by
    ``CheckpointFiles.read_into`` lands bit-exact, one ``preadv`` per IOV_MAX rows (no per-row
    planning); iterated, it is the plain ``(offset + i * run, view)`` requests other stores read."""
    import random

    from megashard import storage
    from megashard.errors import FormatError
    from megashard.format import fastio

    rng = random.Random(2)
    run, nrows = 64, 2 * fastio.IOV_MAX + 452
    data = rng.randbytes(run * nrows + 50_000)
    (tmp_path / "x.tensors").write_bytes(data)
    calls: List[Tuple[int, int]] = []  # (offset, iovecs) per preadv
    real_preadv = os.preadv

    def counting_preadv(fd: int, iovs: Any, offset: int) -> int:
        calls.append((offset, len(iovs)))
        return real_preadv(fd, iovs, offset)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    for threads in (1, 3):
        dst = bytearray(b"\xaa" * (2 * run * nrows))  # every other row: strided destination
        views = [memoryview(dst)[2 * run * i:2 * run * i + run] for i in range(nrows)]
        tail = bytearray(3 * run)
        tail_views = [memoryview(tail)[i * run:(i + 1) * run] for i in range(3)]
        plain = [(run * nrows + 100, memoryview(bytearray(7)))]
        reqs = fastio.Requests(plain, [(10, run, views), (run * nrows + 1000, run, tail_views)])
        want = plain + [(10 + i * run, v) for i, v in enumerate(views)] + \
            [(run * nrows + 1000 + i * run, v) for i, v in enumerate(tail_views)]
        assert len(reqs) == len(want) and list(reqs) == want and [reqs[i] for i in (0, 1, -1)] == [want[0], want[1], want[-1]]
        calls.clear()
        with storage.CheckpointFiles(tmp_path) as cf:
            n = cf.read_into("x.tensors", reqs, size=len(data), threads=threads)
        assert n == sum(len(v) for _, v in want)
        for i in range(nrows):
            assert dst[2 * run * i:2 * run * i + run] == data[10 + i * run:10 + (i + 1) * run], (threads, i)
            assert dst[2 * run * i + run:2 * run * (i + 1)] == b"\xaa" * run  # the gaps between rows untouched
        assert bytes(tail) == data[run * nrows + 1000:run * nrows + 1000 + 3 * run]
        assert bytes(plain[0][1]) == data[run * nrows + 100:run * nrows + 107]
        rows_calls = sorted(c for c in calls if c[0] < run * nrows)
        assert rows_calls == [(10, fastio.IOV_MAX), (10 + fastio.IOV_MAX * run, fastio.IOV_MAX),
                              (10 + 2 * fastio.IOV_MAX * run, 452)], threads
        assert sorted(c for c in calls if c[0] >= run * nrows) == [(run * nrows + 100, 1), (run * nrows + 1000, 3)]
    short = fastio.Requests((), [(0, run, [memoryview(bytearray(run)), memoryview(bytearray(run - 1))])])
    with storage.CheckpointFiles(tmp_path) as cf, pytest.raises(FormatError, match="x.tensors: row run at offset 0"):
        cf.read_into("x.tensors", short, size=len(data), threads=1)

"""Loads into destinations without host memory (GPU tensors): pinned bounce buffers, ring copies.

On a machine without a GPU, ``pretend_device`` makes chosen CPU tensors look like device
memory to megashard (``on_host`` is false for them and taking a host memoryview of them
raises), so every load path must bounce through :class:`~megashard.devicecopy.DeviceCopier`
or copy with ``Tensor.copy_``, exactly as for CUDA tensors; the CUDA-only parts (streams,
events, pinning, page-locking the ring) run in ``scripts/gpu_check.py`` on a GPU.
"""
from __future__ import annotations

import contextlib
import os
from functools import partial
from typing import Any, Dict, Iterator, List, Set

import torch

from distributed import all_ok, run_ranks
from layouts import Layout, check_state, model_state

NODE_ENV = {"MEGASHARD_NODE_ID": "test-node", "MEGASHARD_HUGEPAGES": "0"}


@contextlib.contextmanager
def pretend_device(tensors: List[torch.Tensor]) -> Iterator[Set[int]]:
    """Treat the storages of ``tensors`` as device memory inside megashard."""
    import megashard.devicecopy as dc
    import megashard.format.fastio as fastio
    from megashard import loading, scatter

    storages = {t.untyped_storage().data_ptr() for t in tensors}
    touched: Set[int] = set()
    real_on_host, real_mv = dc.on_host, fastio.tensor_memoryview

    def on_host(t: torch.Tensor) -> bool:
        if t.untyped_storage().data_ptr() in storages:
            touched.add(t.untyped_storage().data_ptr())
            return False
        return real_on_host(t)

    def memoryview_of(t: torch.Tensor) -> memoryview:
        if t.untyped_storage().data_ptr() in storages:
            raise AssertionError("host memoryview taken of a device destination")
        return real_mv(t)

    patched = [(m, "on_host", on_host) for m in (dc, loading, scatter)]
    patched += [(m, "tensor_memoryview", memoryview_of) for m in (dc, scatter, loading)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patched]
    for m, name, f in patched:
        setattr(m, name, f)
    try:
        yield touched
    finally:
        for m, name, f in saved:
            setattr(m, name, f)


def test_bounce_reads_are_bit_exact(tmp_path) -> None:
    from megashard.devicecopy import DeviceCopier
    from megashard.storage import CheckpointFiles

    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    # pieces smaller than, equal to and larger than a buffer; unsorted; touching and overlapping sources
    spec = [(5, 3000), (0, 1), (70_000, 1024), (1, 17), (9000, 25_000), (9500, 100), (99_000, 1000)]
    dsts = [torch.zeros(n, dtype=torch.uint8) for _, n in spec]
    with CheckpointFiles(tmp_path) as files, pretend_device(dsts), \
            DeviceCopier([torch.device("cpu")], buffer_bytes=1024, buffers=2) as cp:
        total = cp.read(partial(files.read_into, "blob", size=100_000, threads=2),
                        [(off, d) for (off, _), d in zip(spec, dsts)])
        bufs = len(cp._bufs)
    assert total == sum(n for _, n in spec) and cp.bounced == total
    assert bufs == 2  # never more buffers than asked for, however many batches
    for (off, n), d in zip(spec, dsts):
        assert torch.equal(d, data[off:off + n]), (off, n)


SCENARIOS = [(Layout(tp=2), Layout(tp=2)), (Layout(tp=2), Layout(dp=2)), (Layout(pp=2, vp=2), Layout(tp=2))]


def _device_job(rank: int, world: int, tmp: str) -> List[Dict[str, Any]]:
    import torch.distributed as dist

    import megashard

    out = []
    for n, (saved, loaded) in enumerate(SCENARIOS):
        path = os.path.join(tmp, f"ckpt{n}")
        megashard.save(model_state(saved, rank), path)
        for mode, transport in (("own", "auto"), ("scatter", "shm"), ("scatter", "group")):
            template = model_state(loaded, rank, empty=True)
            dests = [sh.data for c in template.values() for sh in c.values()]
            with pretend_device(dests) as touched:
                _, stats = megashard.load(template, path, mode=mode, scatter_transport=transport,
                                          scatter_chunk_bytes=700, return_stats=True)
            out.append({"scenario": n, "mode": mode, "transport": stats.transport, "bad": check_state(template),
                        "touched": len(touched)})
        dist.barrier()
    return out


def test_loads_into_device_destinations_bit_exact(tmp_path) -> None:
    """own (bounce), scatter over shm (ring copies + bounce reads through passed descriptors)
    and scatter over the group (staged receives), same layout and resharded."""
    results = all_ok(run_ranks(_device_job, 2, str(tmp_path), env=NODE_ENV, timeout=240))
    for rank, rows in enumerate(results):
        for r in rows:
            where = f"rank {rank}, scenario {r['scenario']}, {r['mode']}/{r['transport']}"
            assert r["bad"] == [], f"{where}: {r['bad']}"
            # destinations were seen as device memory (and a host memoryview of one would have raised)
            assert r["touched"] > 0, where
            if r["mode"] == "scatter":
                assert r["transport"] in ("shm", "group"), where


"""Optimizer state allocated uninitialised for a resume (``state.preallocate_optimizer_state``).

The end-to-end resumes (tests/test_megatron_lm_install.py, tests/test_megatron_resume.py)
check that the loaded optimizer state is bit-exact; these check the allocation itself:
which optimizers get it, that reads into it pre-fault it and land exactly, and that a failed
load leaves zeros, never uninitialised memory.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from megashard.format import fastio
from megashard.megatron import state as st


def _megatron_like(amsgrad: bool = False, rows: int = 300) -> SimpleNamespace:
    params = [torch.nn.Parameter(torch.randn(rows, 700)), torch.nn.Parameter(torch.randn(5))]
    inner = torch.optim.Adam(params, lr=1e-3, amsgrad=amsgrad)
    return SimpleNamespace(optimizer=inner, init_state_fn=lambda opt, config=None: None,
                           config=SimpleNamespace(use_precision_aware_optimizer=False))


def test_fresh_adam_state_is_allocated_uninitialised_and_read_into_with_prefaulting(tmp_path):
    opt = _megatron_like(rows=64 << 10)  # 179 MB: above the allocator's mmap threshold, so never touched
    fresh = st.preallocate_optimizer_state(opt)
    inner = opt.optimizer
    assert len(fresh.tensors) == 4
    for p in inner.param_groups[0]["params"]:
        s = inner.state[p]
        assert set(s) == {"exp_avg", "exp_avg_sq"}
        assert s["exp_avg"].shape == p.shape and s["exp_avg"].dtype == p.dtype and s["exp_avg"].is_contiguous()
        assert s["exp_avg"].data_ptr() != s["exp_avg_sq"].data_ptr()
    # the state is not in memory yet, so a load's reads pre-fault it piece by piece; bytes land exactly
    t = inner.state[inner.param_groups[0]["params"][0]]["exp_avg"]
    assert not fastio.resident(fastio.tensor_memoryview(t))
    pattern = torch.arange(t.numel(), dtype=t.dtype).view(t.shape)
    path = tmp_path / "bytes"
    path.write_bytes(b"\0" * 4096 + pattern.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        fastio.read_requests(fd, [(4096, fastio.tensor_memoryview(t))], str(path), 2)
    finally:
        os.close(fd)
    assert torch.equal(t, pattern) and fastio.resident(fastio.tensor_memoryview(t))


def test_a_failed_load_leaves_zeros():
    opt = _megatron_like()
    fresh = st.preallocate_optimizer_state(opt)
    fresh.zero()
    for t in fresh.tensors:
        assert torch.count_nonzero(t) == 0


def test_stepped_amsgrad_and_other_optimizers_are_left_alone():
    stepped = _megatron_like()
    stepped.optimizer.param_groups[0]["params"][0].grad = torch.ones(300, 700)
    stepped.optimizer.param_groups[0]["params"][1].grad = torch.ones(5)
    stepped.optimizer.step()
    before = {id(v) for s in stepped.optimizer.state.values() for v in s.values()}
    assert st.preallocate_optimizer_state(stepped).tensors == []
    assert {id(v) for s in stepped.optimizer.state.values() for v in s.values()} == before

    assert st.preallocate_optimizer_state(_megatron_like(amsgrad=True)).tensors == []
    sgd = SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1),
                          init_state_fn=None, config=None)
    assert st.preallocate_optimizer_state(sgd).tensors == []
    assert len(sgd.optimizer.state) == 0

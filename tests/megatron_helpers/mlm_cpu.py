"""Test-only patches that let Megatron-LM's *training loop* (not just megatron-core) run on CPU.

``megashard.megatron.cpu_compat`` is enough for megatron-core; Megatron-LM's
``initialize_megatron`` additionally asserts ``torch.cuda.is_available()`` and its
training loop queries CUDA memory statistics. These stand-ins go on the ``torch.cuda``
view that Megatron's modules see (torch itself stays untouched), only inside the
Megatron-LM integration test process, after ``cpu_compat.apply()``.
"""
from __future__ import annotations

from types import SimpleNamespace

from megashard.megatron import cpu_compat


def apply() -> None:
    cuda = cpu_compat.cuda_view()
    assert cuda is not None, "cpu_compat.apply() first"
    cuda.is_available = lambda: True  # initialize_megatron: assert torch.cuda.is_available()
    cuda.device_count = lambda: 1
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_device_capability = lambda *a, **k: (8, 0)
    props = SimpleNamespace(major=8, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    cuda.get_device_properties = lambda *a, **k: props

    # the megatron-core wheel ships the compiled dataset helpers (helpers_cpp*.so) but not
    # their Makefile, so Megatron-LM's "make -C megatron/core/datasets" would fail
    import megatron.core.datasets.utils as dutils

    dutils.compile_helpers = lambda: None

    # fused CUDA kernels: nothing to build on CPU (the unfused paths are used)
    try:
        import megatron.legacy.fused_kernels as fk

        fk.load = lambda args: None
    except ImportError:
        pass

    # JIT warm-up runs the fused bias-gelu/bias-dropout kernels on "cuda" tensors
    import megatron.training.training as training

    training.set_jit_fusion_options = lambda *a, **k: None

"""CPU compatibility shim: lets megatron-core train and checkpoint without CUDA.

megatron-core hard-codes CUDA in many places (``device='cuda'`` tensors,
``torch.cuda.current_device()``, ``torch.cuda.synchronize()``, the CUDA RNG
state and ``param.type() == 'torch.cuda.FloatTensor'`` checks). On a machine
without a GPU (our CI: gloo on CPU) these fail although the maths is fine.

:func:`apply` installs the smallest set of monkeypatches we found that makes
GPTModel forward/backward, Megatron's DDP, its optimizers (plain Adam and the
DistributedOptimizer), the (interleaved) pipeline schedules and Megatron-LM's
checkpointing helpers run on CPU. It is **never** applied when CUDA is
available (unless ``force=True``), so GPU runs are untouched. Every patch is
listed in :data:`PATCHES` with the reason it is needed.

The "CUDA" generator is mapped onto the CPU generator: on CPU there is only
one device, so Megatron's tensor-parallel RNG tracker (which swaps "CUDA"
RNG states in and out) keeps working with the CPU generator instead.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Dict, List

import torch

logger = logging.getLogger(__name__)

_APPLIED = False

#: (what is patched, why) -- kept in sync with the code below; also used in docs.
PATCHES: List[tuple] = [
    ("torch.cuda.current_device -> torch.device('cpu')",
     "GlobalMemoryBuffer, DDP grad buffers, p2p recv buffers allocate on current_device()"),
    ("torch.cuda.{get,set}_rng_state, torch.cuda.manual_seed, tensor_parallel.random._set_cuda_rng_state -> CPU generator",
     "model_parallel_cuda_manual_seed and the TP RNG tracker (fork/add) swap CUDA RNG states"),
    ("torch.cuda.synchronize, Stream, current_stream, stream, Event, empty_cache -> no-ops/dummies",
     "DDP, pipeline schedules and checkpoint staging synchronise with the device"),
    ("torch.{tensor,zeros,ones,empty,full,arange,rand,randn,randint,*_like,empty_strided}: device cuda/int -> cpu",
     "optimizer.py/clip_grads.py/param_and_grad_buffer.py create device='cuda' scalars and buffers"),
    ("Tensor.cuda -> identity, Tensor.to('cuda') -> cpu",
     "explicit .cuda() calls (e.g. exchange utils, schedules)"),
    ("Tensor.type() on CPU tensors -> 'torch.cuda.<T>Tensor'",
     "optimizer.py and distrib_optimizer.py accept only torch.cuda.*Tensor params"),
    ("logging filter on megatron.core.tensor_parallel.random: 'CPU RNG state changed within GPU RNG context'",
     "expected here: the 'CUDA' generator *is* the CPU generator, so every TP-RNG fork changes it"),
]

_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "empty_strided", "as_tensor", "linspace", "eye",
)


def _is_cuda_device(device: Any) -> bool:
    """True for anything that names a CUDA device: 'cuda', 'cuda:0', torch.device('cuda'), int."""
    if device is None:
        return False
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_device_kwarg(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__megashard_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


class _DummyStream:
    """Stand-in for torch.cuda.Stream / Event: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable:
        return lambda *a, **k: None

    def __enter__(self) -> "_DummyStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _RngForkWarningFilter(logging.Filter):
    """Drop the fork warning that is always true when the CUDA RNG is mapped to the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def is_applied() -> bool:
    """Whether :func:`apply` has patched this process."""
    return _APPLIED


def apply(force: bool = False) -> bool:
    """Install the CPU patches if CUDA is unavailable (or ``force``). Idempotent.

    Returns True when the patches are (now) active.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False

    cuda = torch.cuda
    cpu = torch.device("cpu")

    # -- device queries ------------------------------------------------------
    cuda.current_device = lambda: cpu  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]

    # -- RNG: the "CUDA" generator is the CPU generator -----------------------
    def _get_rng_state(*a: Any, **k: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def _set_rng_state(state: torch.Tensor, *a: Any, **k: Any) -> None:
        torch.set_rng_state(state)

    cuda.get_rng_state = _get_rng_state  # type: ignore[assignment]
    cuda.set_rng_state = _set_rng_state  # type: ignore[assignment]
    cuda.random.get_rng_state = _get_rng_state  # type: ignore[assignment]
    cuda.random.set_rng_state = _set_rng_state  # type: ignore[assignment]
    cuda.manual_seed = lambda seed: torch.manual_seed(seed) and None  # type: ignore[assignment]
    cuda.random.manual_seed = cuda.manual_seed  # type: ignore[assignment]

    # -- synchronisation and streams -----------------------------------------
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.Stream = _DummyStream  # type: ignore[assignment,misc]
    cuda.Event = _DummyStream  # type: ignore[assignment,misc]
    cuda.current_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    cuda.default_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]

    # -- tensor factories and moves -------------------------------------------
    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "__megashard_cpu_compat__", False):
            setattr(torch, name, _cpu_device_kwarg(fn))

    orig_to = torch.Tensor.to
    orig_type = torch.Tensor.type

    def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and _is_cuda_device(args[0]):
            args = (cpu,) + tuple(args[1:])
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = cpu
        return orig_to(self, *args, **kwargs)

    def _cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return orig_type(self, *args, **kwargs)
        name = orig_type(self)
        if name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.to = _to  # type: ignore[method-assign]
    torch.Tensor.cuda = _cuda  # type: ignore[method-assign]
    torch.Tensor.type = _type  # type: ignore[method-assign]

    # -- megatron-core internals that captured CUDA functions at import ---------
    try:
        import megatron.core.tensor_parallel.random as tp_random

        tp_random._set_cuda_rng_state = (  # type: ignore[attr-defined]
            lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
        )
    except ImportError:  # megatron-core not installed: nothing else to patch
        pass

    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_RngForkWarningFilter())

    _APPLIED = True
    logger.warning(
        "CUDA is not available: megashard.megatron.cpu_compat patched torch.cuda/megatron-core "
        "for CPU (%d patches, see megashard/megatron/cpu_compat.py)", len(PATCHES)
    )
    return True


def describe() -> Dict[str, str]:
    """The patches and why each is needed (for docs and logs)."""
    return {what: why for what, why in PATCHES}

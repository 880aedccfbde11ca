"""CPU compatibility shim: lets megatron-core train and checkpoint without CUDA.

megatron-core hard-codes CUDA in many places (``device='cuda'`` tensors,
``torch.cuda.current_device()``, ``torch.cuda.synchronize()``, the CUDA RNG
state and ``param.type() == 'torch.cuda.FloatTensor'`` checks). On a machine
without a GPU (our CI: gloo on CPU) these fail although the maths is fine.

:func:`apply` makes GPTModel forward/backward, Megatron's DDP, its optimizers (plain
Adam and the DistributedOptimizer), MoE layers, the (interleaved) pipeline schedules
and Megatron-LM's checkpointing helpers run on CPU. It is **never** applied when CUDA
is available (unless ``force=True``), so GPU runs are untouched, and it changes
nothing for code outside Megatron:

* torch itself is not modified. Every ``megatron.*`` module (those imported later too,
  through an import hook) gets, in place of its global ``torch``, a view of torch whose
  tensor factories map ``device='cuda'`` to the CPU and whose ``torch.cuda`` is a view
  with CPU stand-ins (:data:`PATCHES`). ``transformers`` or any other library in the
  same process sees the real torch.
* ``Tensor.cuda``, ``Tensor.type`` and ``nn.Module.cuda`` are methods, looked up on the
  class, so they cannot be swapped per module: they are wrapped by functions that call
  the original unless the *calling* module is Megatron's.

The "CUDA" generator is mapped onto the CPU generator: on CPU there is only one
device, so Megatron's tensor-parallel RNG tracker (which swaps "CUDA" RNG states in
and out) keeps working with the CPU generator instead.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch

logger = logging.getLogger(__name__)

_APPLIED = False

#: (what is patched, why) -- kept in sync with the code below; also used in docs.
PATCHES: List[tuple] = [
    ("torch.cuda.current_device -> torch.device('cpu'); set_device -> no-op",
     "GlobalMemoryBuffer, DDP grad buffers, p2p recv buffers allocate on current_device()"),
    ("torch.cuda.{get,set}_rng_state, torch.cuda.manual_seed, tensor_parallel.random._set_cuda_rng_state -> CPU generator",
     "model_parallel_cuda_manual_seed and the TP RNG tracker (fork/add) swap CUDA RNG states"),
    ("torch.cuda.synchronize, Stream, current_stream, stream, Event, empty_cache -> no-ops/dummies",
     "DDP, pipeline schedules, MoE and checkpoint staging synchronise with the device"),
    ("torch.{tensor,zeros,ones,empty,full,arange,rand,randn,randint,*_like,empty_strided}: device cuda/int -> cpu",
     "optimizer.py/clip_grads.py/param_and_grad_buffer.py create device='cuda' scalars and buffers"),
    ("Tensor.cuda, nn.Module.cuda -> identity (for Megatron callers)",
     "explicit .cuda() calls (e.g. exchange utils, schedules, grad scaler, Megatron-LM's get_model)"),
    ("Tensor.type() on CPU tensors -> 'torch.cuda.<T>Tensor' (for Megatron callers)",
     "optimizer.py and distrib_optimizer.py accept only torch.cuda.*Tensor params"),
    ("megatron.core.transformer.moe.moe_utils: te_general_gemm -> None when Transformer Engine is absent",
     "0.16's router gating tests `te_general_gemm is not None`, a module global defined only when TE imports"),
    ("logging filter on megatron.core.tensor_parallel.random: 'CPU RNG state changed within GPU RNG context'",
     "expected here: the 'CUDA' generator *is* the CPU generator, so every TP-RNG fork changes it"),
]

_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "empty_strided", "as_tensor", "linspace", "eye",
)

#: modules (besides ``megatron`` and ``megatron.*``) that see the CPU views: see :func:`cover`
_COVERED: Set[str] = set()
_TORCH_VIEW: Optional[types.ModuleType] = None
_CUDA_VIEW: Optional[types.ModuleType] = None


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


class _ModuleView(types.ModuleType):
    """A module that answers with its overrides first and the real module otherwise.

    Megatron's modules get views in place of ``torch`` / ``torch.cuda``; the real modules
    stay untouched for everyone else.
    """

    def __init__(self, real: types.ModuleType, overrides: Dict[str, Any]) -> None:
        super().__init__(real.__name__)
        for dunder in ("__doc__", "__package__", "__loader__", "__spec__"):
            self.__dict__.pop(dunder, None)  # fall through to the real module's
        self.__dict__["_megashard_real"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_megashard_real"], name)

    def __dir__(self) -> List[str]:
        return sorted(set(dir(self.__dict__["_megashard_real"])) | set(self.__dict__))


def _build_views() -> types.ModuleType:
    """``torch`` as Megatron's modules see it on CPU."""
    global _TORCH_VIEW, _CUDA_VIEW
    cpu = torch.device("cpu")

    def get_rng_state(*a: Any, **k: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, *a: Any, **k: Any) -> None:
        torch.set_rng_state(state)

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    rng = {"get_rng_state": get_rng_state, "set_rng_state": set_rng_state, "manual_seed": manual_seed,
           "manual_seed_all": manual_seed}
    cuda_random = _ModuleView(torch.cuda.random, dict(rng))
    _CUDA_VIEW = _ModuleView(torch.cuda, {
        **rng,
        "random": cuda_random,
        "current_device": lambda: cpu,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "Stream": _DummyStream,
        "Event": _DummyStream,
        "current_stream": lambda *a, **k: _DummyStream(),
        "default_stream": lambda *a, **k: _DummyStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "empty_cache": lambda: None,
    })
    overrides: Dict[str, Any] = {"cuda": _CUDA_VIEW}
    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None:
            overrides[name] = _cpu_device_kwarg(fn)
    _TORCH_VIEW = _ModuleView(torch, overrides)
    return _TORCH_VIEW


def _is_covered(module_name: Any) -> bool:
    return isinstance(module_name, str) and (
        module_name == "megatron" or module_name.startswith("megatron.") or module_name in _COVERED)


def _swap_torch(module: types.ModuleType) -> None:
    """Point ``module``'s global ``torch`` at the CPU view (when it holds the real torch)."""
    if _TORCH_VIEW is not None and getattr(module, "torch", None) is torch:
        module.torch = _TORCH_VIEW  # type: ignore[attr-defined]


class _CoveredLoader(importlib.abc.Loader):
    """Runs the real loader, then gives the new Megatron module the CPU view of torch."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _swap_torch(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_data, ...
        return getattr(self._loader, name)


class _CoveredFinder(importlib.abc.MetaPathFinder):
    """Import hook: Megatron modules imported after :func:`apply` get the CPU view too."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if not _is_covered(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CoveredLoader(spec.loader)
                return spec
        return None


def _megatron_caller(depth: int = 2) -> bool:
    return _is_covered(sys._getframe(depth).f_globals.get("__name__"))


def _wrap_methods() -> None:
    """``Tensor.cuda`` / ``Tensor.type`` / ``nn.Module.cuda``: changed for Megatron's callers only."""
    tensor_cuda, tensor_type = torch.Tensor.cuda, torch.Tensor.type
    module_cuda = torch.nn.Module.cuda

    @functools.wraps(tensor_cuda)
    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _megatron_caller():
            return self
        return tensor_cuda(self, *args, **kwargs)

    @functools.wraps(tensor_type)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not _megatron_caller():
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)
        if name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    @functools.wraps(module_cuda)
    def mcuda(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if _megatron_caller():
            return self
        return module_cuda(self, *args, **kwargs)

    for fn in (cuda, type_, mcuda):
        fn.__megashard_cpu_compat__ = True  # type: ignore[attr-defined]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    torch.nn.Module.cuda = mcuda  # type: ignore[method-assign]


def _patch_megatron_internals() -> None:
    """megatron-core names that captured CUDA-only behaviour at import."""
    try:
        import megatron.core.tensor_parallel.random as tp_random

        tp_random._set_cuda_rng_state = (  # type: ignore[attr-defined]
            lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
        )
    except ImportError:  # megatron-core not installed: nothing else to patch
        return
    try:
        import megatron.core.transformer.moe.moe_utils as moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16: referenced, defined only when TE imports
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


class _RngForkWarningFilter(logging.Filter):
    """Drop the fork warning that is always true when the CUDA RNG is mapped to the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def is_applied() -> bool:
    """Whether :func:`apply` has patched this process."""
    return _APPLIED


def cover(*modules: types.ModuleType) -> None:
    """Let modules outside ``megatron.*`` (e.g. Megatron-LM's ``pretrain_gpt``) see the CPU views.

    Only meaningful after :func:`apply` returned True; a no-op otherwise.
    """
    if not _APPLIED:
        return
    for m in modules:
        _COVERED.add(m.__name__)
        _swap_torch(m)


def cuda_view() -> Optional[types.ModuleType]:
    """The ``torch.cuda`` Megatron's modules see (None unless applied); tests add stand-ins to it."""
    return _CUDA_VIEW


def apply(force: bool = False) -> bool:
    """Install the CPU stand-ins if CUDA is unavailable (or ``force``). Idempotent.

    Returns True when the stand-ins are (now) active.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    _build_views()
    for name, module in list(sys.modules.items()):
        if module is not None and _is_covered(name):
            _swap_torch(module)
    sys.meta_path.insert(0, _CoveredFinder())
    _wrap_methods()
    _APPLIED = True
    _patch_megatron_internals()
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_RngForkWarningFilter())
    logger.warning(
        "CUDA is not available: megashard.megatron.cpu_compat gives megatron's modules CPU "
        "stand-ins for CUDA (%d patches, see megashard/megatron/cpu_compat.py)", len(PATCHES)
    )
    return True


def describe() -> Dict[str, str]:
    """The patches and why each is needed (for docs and logs)."""
    return {what: why for what, why in PATCHES}

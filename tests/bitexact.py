"""Bit-exact tensor comparison for the format tests (NaNs and -0.0 included)."""
from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape))
    assert torch.equal(bits(a), bits(b))

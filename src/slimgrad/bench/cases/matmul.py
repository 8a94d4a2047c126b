"""Batched matmul (4x12x256x64 @ 64x256 shared operand) with slimgrad.ops.matmul."""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.ops.matmul import matmul


class _MatMul(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fn(a, b)


def build(device, dtype, small: bool = False):
    """Eager and slimgrad ``a @ b`` (b broadcast over the batch) and an input maker."""
    shape_a, shape_b = ((2, 3, 7, 5), (5, 7)) if small else ((4, 12, 256, 64), (64, 256))

    def make_inputs():
        a = torch.randn(shape_a, device=device, dtype=dtype, requires_grad=True)
        return a, torch.randn(shape_b, device=device, dtype=dtype, requires_grad=True)

    return _MatMul(torch.matmul), _MatMul(matmul), make_inputs

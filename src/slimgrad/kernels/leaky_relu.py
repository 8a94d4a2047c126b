"""Triton kernels for leaky_relu: y = x if x > 0 else slope x; dx = g or slope g by sign of y.

Same signatures as ``slimgrad.ops.leaky_relu._fwd_torch`` / ``_bwd_torch``; one elementwise kernel
per direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take
the PyTorch path. Memory: as ``slimgrad.ops.leaky_relu``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.kernels._output_act import LEAKY_RELU, mono_bwd, mono_fwd


# eager's own ops, the fallback for layouts and dtypes the kernels do not take (kernels import
# nothing from slimgrad.ops: NOTE [Kernels are leaves] in slimgrad._math)
def _eager(x: Tensor, negative_slope: float) -> Tensor:
    return torch.nn.functional.leaky_relu(x, negative_slope)


def _eager_bwd(g: Tensor, y: Tensor, negative_slope: float) -> Tensor:
    return torch.ops.aten.leaky_relu_backward(g, y, negative_slope, True)


def _fwd_triton(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    y = mono_fwd(x, LEAKY_RELU, negative_slope)
    return _eager(x, negative_slope) if y is None else y


def _fwd_triton_(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, LEAKY_RELU, negative_slope, out=x)
    return x.copy_(_eager(x, negative_slope)) if y is None else y


def _bwd_triton(
    g: Tensor, y: Tensor, negative_slope: float = 0.01, out: Tensor | None = None
) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, LEAKY_RELU, negative_slope, out=out)
    if dx is not None:
        return dx
    dx = _eager_bwd(g, y, negative_slope)
    return dx if out is None else out.copy_(dx)

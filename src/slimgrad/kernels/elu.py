"""Triton kernels for elu: y = x if x > 0 else alpha (e^x - 1); dx = g (y + alpha) where y <= 0.

Same signatures as ``slimgrad.ops.elu._fwd_torch`` / ``_bwd_torch``; one elementwise kernel per
direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take the
PyTorch path. Memory: as ``slimgrad.ops.elu``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.kernels._output_act import ELU, mono_bwd, mono_fwd


# eager's own ops, the fallback for layouts and dtypes the kernels do not take (kernels import
# nothing from slimgrad.ops: NOTE [Kernels are leaves] in slimgrad._math)
def _eager(x: Tensor, alpha: float) -> Tensor:
    return torch.nn.functional.elu(x, alpha)


def _eager_bwd(g: Tensor, y: Tensor, alpha: float) -> Tensor:
    return torch.ops.aten.elu_backward(g, alpha, 1.0, 1.0, True, y)


def _fwd_triton(x: Tensor, alpha: float = 1.0) -> Tensor:
    y = mono_fwd(x, ELU, alpha)
    return _eager(x, alpha) if y is None else y


def _fwd_triton_(x: Tensor, alpha: float = 1.0) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, ELU, alpha, out=x)
    return x.copy_(_eager(x, alpha)) if y is None else y


def _bwd_triton(g: Tensor, y: Tensor, alpha: float = 1.0, out: Tensor | None = None) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, ELU, alpha, out=out)
    if dx is not None:
        return dx
    dx = _eager_bwd(g, y, alpha)
    return dx if out is None else out.copy_(dx)

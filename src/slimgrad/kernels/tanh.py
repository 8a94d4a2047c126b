"""Triton kernels for tanh: y = tanh x; dx = g (1 - y^2).

Same signatures as ``slimgrad.ops.tanh._fwd_torch`` / ``_bwd_torch``; one elementwise kernel per
direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take the
PyTorch path. Memory: as ``slimgrad.ops.tanh``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.kernels._output_act import TANH, mono_bwd, mono_fwd


# eager's own ops, the fallback for layouts and dtypes the kernels do not take (kernels import
# nothing from slimgrad.ops: NOTE [Kernels are leaves] in slimgrad._math)
def _eager(x: Tensor) -> Tensor:
    return torch.tanh(x)


def _eager_bwd(g: Tensor, y: Tensor) -> Tensor:
    return torch.ops.aten.tanh_backward(g, y)


def _fwd_triton(x: Tensor) -> Tensor:
    y = mono_fwd(x, TANH)
    return _eager(x) if y is None else y


def _fwd_triton_(x: Tensor) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, TANH, out=x)
    return x.copy_(_eager(x)) if y is None else y


def _bwd_triton(g: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, TANH, out=out)
    if dx is not None:
        return dx
    dx = _eager_bwd(g, y)
    return dx if out is None else out.copy_(dx)

"""Triton kernels for hardtanh: y = clamp(x, min, max); dx = g [min < y < max].

Same signatures as ``slimgrad.ops.hardtanh._fwd_torch`` / ``_bwd_torch``; one elementwise kernel per
direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take the
PyTorch path. Memory: as ``slimgrad.ops.hardtanh``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.kernels._output_act import HARDTANH, mono_bwd, mono_fwd


# eager's own ops, the fallback for layouts and dtypes the kernels do not take (kernels import
# nothing from slimgrad.ops: NOTE [Kernels are leaves] in slimgrad._math)
def _eager(x: Tensor, min_val: float, max_val: float) -> Tensor:
    return torch.nn.functional.hardtanh(x, min_val, max_val)


def _eager_bwd(g: Tensor, y: Tensor, min_val: float, max_val: float) -> Tensor:
    return torch.ops.aten.hardtanh_backward(g, y, min_val, max_val)


def _fwd_triton(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    y = mono_fwd(x, HARDTANH, min_val, max_val)
    return _eager(x, min_val, max_val) if y is None else y


def _fwd_triton_(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, HARDTANH, min_val, max_val, out=x)
    return x.copy_(_eager(x, min_val, max_val)) if y is None else y


def _bwd_triton(
    g: Tensor, y: Tensor, min_val: float = -1.0, max_val: float = 1.0, out: Tensor | None = None
) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, HARDTANH, min_val, max_val, out=out)
    if dx is not None:
        return dx
    dx = _eager_bwd(g, y, min_val, max_val)
    return dx if out is None else out.copy_(dx)

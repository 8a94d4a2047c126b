"""Triton kernels for elu: y = x if x > 0 else alpha (e^x - 1); dx = g (y + alpha) where y <= 0.

Same signatures as ``slimgrad.ops.elu._fwd_torch`` / ``_bwd_torch``; one elementwise kernel per
direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take the
PyTorch path. Memory: as ``slimgrad.ops.elu``.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from slimgrad.kernels._output_act import ELU, mono_bwd, mono_fwd

# the submodules (slimgrad.ops re-exports functions under the same names)
_ref = importlib.import_module("slimgrad.ops.elu")


def _fwd_triton(x: Tensor, alpha: float = 1.0) -> Tensor:
    y = mono_fwd(x, ELU, alpha)
    return _ref._fwd_torch(x, alpha) if y is None else y


def _fwd_triton_(x: Tensor, alpha: float = 1.0) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, ELU, alpha, out=x)
    return x.copy_(_ref._fwd_torch(x, alpha)) if y is None else y


def _bwd_triton(g: Tensor, y: Tensor, alpha: float = 1.0, out: Tensor | None = None) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, ELU, alpha, out=out)
    if dx is not None:
        return dx
    dx = _ref._bwd_torch(g, y, alpha)
    return dx if out is None else out.copy_(dx)

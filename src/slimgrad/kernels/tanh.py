"""Triton kernels for tanh: y = tanh x; dx = g (1 - y^2).

Same signatures as ``slimgrad.ops.tanh._fwd_torch`` / ``_bwd_torch``; one elementwise kernel per
direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take the
PyTorch path. Memory: as ``slimgrad.ops.tanh``.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from slimgrad.kernels._output_act import TANH, mono_bwd, mono_fwd

# the submodules (slimgrad.ops re-exports functions under the same names)
_ref = importlib.import_module("slimgrad.ops.tanh")


def _fwd_triton(x: Tensor) -> Tensor:
    y = mono_fwd(x, TANH)
    return _ref._fwd_torch(x) if y is None else y


def _fwd_triton_(x: Tensor) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, TANH, out=x)
    return x.copy_(_ref._fwd_torch(x)) if y is None else y


def _bwd_triton(g: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, TANH, out=out)
    if dx is not None:
        return dx
    dx = _ref._bwd_torch(g, y)
    return dx if out is None else out.copy_(dx)

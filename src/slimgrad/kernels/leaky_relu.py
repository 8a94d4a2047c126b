"""Triton kernels for leaky_relu: y = x if x > 0 else slope x; dx = g or slope g by sign of y.

Same signatures as ``slimgrad.ops.leaky_relu._fwd_torch`` / ``_bwd_torch``; one elementwise kernel
per direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take
the PyTorch path. Memory: as ``slimgrad.ops.leaky_relu``.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from slimgrad.kernels._output_act import LEAKY_RELU, mono_bwd, mono_fwd

# the submodules (slimgrad.ops re-exports functions under the same names)
_ref = importlib.import_module("slimgrad.ops.leaky_relu")


def _fwd_triton(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    y = mono_fwd(x, LEAKY_RELU, negative_slope)
    return _ref._fwd_torch(x, negative_slope) if y is None else y


def _fwd_triton_(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, LEAKY_RELU, negative_slope, out=x)
    return x.copy_(_ref._fwd_torch(x, negative_slope)) if y is None else y


def _bwd_triton(
    g: Tensor, y: Tensor, negative_slope: float = 0.01, out: Tensor | None = None
) -> Tensor:
    # out: write dx there (g's own buffer when slimgrad.ownership grants it)
    dx = mono_bwd(g, y, LEAKY_RELU, negative_slope, out=out)
    if dx is not None:
        return dx
    dx = _ref._bwd_torch(g, y, negative_slope)
    return dx if out is None else out.copy_(dx)

"""Triton kernels for relu: y = max(x, 0); dx = g [y > 0].

Same signatures as ``slimgrad.ops.relu._fwd_torch`` / ``_bwd_torch``; one elementwise kernel per
direction (``kernels/_output_act.py``). Unsupported layouts/dtypes (float64, non-dense) take the
PyTorch path. Memory: as ``slimgrad.ops.relu``.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from slimgrad.kernels._output_act import RELU, mono_bwd, mono_fwd

# the submodules (slimgrad.ops re-exports functions under the same names)
_ref = importlib.import_module("slimgrad.ops.relu")


def _fwd_triton(x: Tensor) -> Tensor:
    y = mono_fwd(x, RELU)
    return _ref._fwd_torch(x) if y is None else y


def _fwd_triton_(x: Tensor) -> Tensor:
    # in place: x <- act(x); the PyTorch fallback writes through copy_
    y = mono_fwd(x, RELU, out=x)
    return x.copy_(_ref._fwd_torch(x)) if y is None else y


def _bwd_triton(g: Tensor, y: Tensor) -> Tensor:
    dx = mono_bwd(g, y, RELU)
    return _ref._bwd_torch(g, y) if dx is None else dx

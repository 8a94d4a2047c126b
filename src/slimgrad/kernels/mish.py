"""Triton kernels for Mish from its output and one branch bit.

Same signatures as ``slimgrad.ops.mish._fwd_torch`` / ``_bwd_torch``, except that ``_fwd_triton``
returns the saved side information too, as the op's forward custom op does: ``(y, bits, idx, xs)``
(``ops._output_act.smooth_fwd``'s layout, bit for bit). Kernels: ``kernels/_output_act.py``.

Memory: as ``slimgrad.ops.mish`` (y + 1 bit per element with y <= 0 + the sparse hard table).
"""

from __future__ import annotations

import importlib

from torch import Tensor

from slimgrad.kernels._output_act import MISH, smooth_fwd, smooth_grad

# the submodules (slimgrad.ops re-exports functions under the same names)
_ref = importlib.import_module("slimgrad.ops.mish")


def _fwd_triton(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return smooth_fwd(_ref.SPEC, MISH, x, _ref._fwd_torch)


def _bwd_triton(g, y, bits, idx, xs) -> Tensor:
    return smooth_grad(_ref.SPEC, g, y, bits, idx, xs, _ref._bwd_exact)

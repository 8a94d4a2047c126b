"""Triton kernels for SiLU from its output and one branch bit.

Same signatures as ``slimgrad.ops.silu._fwd_torch`` / ``_bwd_torch``, except that ``_fwd_triton``
returns the saved side information too, as the op's forward custom op does: ``(y, bits, idx, xs)``
(``_math.smooth.smooth_fwd``'s layout, bit for bit). Kernels: ``kernels/_output_act.py``.

Memory: as ``slimgrad.ops.silu`` (y + 1 bit per element with y <= 0 + the sparse hard table).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad._math.smooth import SILU as SPEC
from slimgrad.kernels._output_act import SILU, smooth_fwd, smooth_grad


def _fwd_triton(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return smooth_fwd(SPEC, SILU, x, torch.nn.functional.silu)


def _bwd_triton(g, y, bits, idx, xs) -> Tensor:
    return smooth_grad(SPEC, g, y, bits, idx, xs, torch.ops.aten.silu_backward)

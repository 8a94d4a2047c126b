"""Triton kernels for GELU (erf and tanh forms) from its output and one branch bit.

Same signatures as ``slimgrad.ops.gelu._fwd_torch`` / ``_bwd_torch``, except that ``_fwd_triton``
returns the saved side information too, as the op's forward custom op does: ``(y, bits, idx, xs)``
(``_math.smooth.smooth_fwd``'s layout, bit for bit). Kernels: ``kernels/_output_act.py``.

Memory: as ``slimgrad.ops.gelu`` (y + 1 bit per element with y <= 0 + the sparse hard table).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad._math.smooth import GELU, gelu_bwd_exact
from slimgrad.kernels._output_act import GELU_ERF, GELU_TANH, smooth_fwd, smooth_grad

_ACT = {"none": GELU_ERF, "tanh": GELU_TANH}


def _fwd_triton(x: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return smooth_fwd(
        GELU[approximate],
        _ACT[approximate],
        x,
        lambda t: torch.nn.functional.gelu(t, approximate=approximate),
    )


def _bwd_triton(g, y, bits, idx, xs, approximate: str = "none") -> Tensor:
    return smooth_grad(
        GELU[approximate],
        g,
        y,
        bits,
        idx,
        xs,
        lambda g_, x_: gelu_bwd_exact(g_, x_, approximate),
    )

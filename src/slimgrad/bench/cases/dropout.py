"""Dropout(p=0.1) on 4x256x768 (GPT-2 residual dropout): 1-bit mask vs eager's float mask."""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.nn.dropout import Dropout


def build(device, dtype, small: bool = False):
    """Eager and slimgrad ``Dropout(0.1)`` and an input maker."""
    shape = (2, 5, 12) if small else (4, 256, 768)
    eager, slim = nn.Dropout(0.1), Dropout(0.1)

    def make_inputs():
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    return eager, slim, make_inputs

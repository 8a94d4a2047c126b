"""dropout(softmax(S), 0.1) @ V on GPT-2 attention shapes (4x12x256x256, V 4x12x256x64)."""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.nn.softmax_dropout import SoftmaxDropoutMatmul


class EagerSoftmaxDropoutMatmul(nn.Module):
    """``F.dropout(F.softmax(s, -1), p) @ v`` in eager PyTorch."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.softmax(s, dim=-1)) @ v


def build(device, dtype, small: bool = False):
    """Eager and slimgrad softmax -> dropout -> @V and a (scores, value) input maker."""
    b, h, t, d = (2, 3, 7, 5) if small else (4, 12, 256, 64)
    eager, slim = EagerSoftmaxDropoutMatmul(0.1), SoftmaxDropoutMatmul(0.1)

    def make_inputs():
        s = torch.randn(b, h, t, t, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True)
        return s, v

    return eager, slim, make_inputs

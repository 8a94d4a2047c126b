"""GroupNorm(32, 128) between 3x3 convs on 8x128x32x32 (the GN output is shared)."""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.nn.group_norm import GroupNorm


def build(device, dtype, small: bool = False):
    """Eager and slimgrad ``conv(GroupNorm(conv(x)))`` (same weights) and an input maker."""
    n, c, hw, g = (2, 8, 5, 2) if small else (8, 128, 32, 32)
    eager = nn.Sequential(
        nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(g, c), nn.Conv2d(c, c, 3, 1, 1)
    )
    eager = eager.to(device=device, dtype=dtype)
    slim = nn.Sequential(eager[0], GroupNorm.from_torch(eager[1]), eager[2])

    def make_inputs():
        return torch.randn(n, c, hw, hw, device=device, dtype=dtype, requires_grad=True)

    return eager, slim, make_inputs

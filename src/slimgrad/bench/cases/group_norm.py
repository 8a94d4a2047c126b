"""GroupNorm(32, 128) between 3x3 convs on 8x128x32x32 (the GN output is shared).

Also ``group_norm_<N>x<C>x<H>x<W>_g<G>``: one ``nn.GroupNorm`` alone, forward + backward, at the
small and mid shapes of :data:`ALONE` (``small``: 2x8x5x5, 2 groups), so the per-call cost of
the norm itself is timed against eager's. Its input is an activation (``x * 1``, which keeps
nothing), not the leaf: eager's saved input then counts, as in a network.
"""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.bench.harness import register_case
from slimgrad.nn.group_norm import GroupNorm

#: (N, C, H, W, groups) of the ``group_norm_<shape>`` cases
ALONE = ((4, 16, 7, 7, 1), (8, 32, 16, 16, 8), (16, 64, 32, 32, 32), (2, 32, 56, 56, 32))


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


class _Activation(nn.Module):
    # the norm of an activation (a tensor of its own), not of the leaf input
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x * 1)


def _alone(shape):
    def build_alone(device, dtype, small: bool = False):
        n, c, h, w, g = (2, 8, 5, 5, 2) if small else shape
        eager = nn.GroupNorm(g, c).to(device=device, dtype=dtype)
        with torch.no_grad():  # |bias| < |weight|: no fallback channel
            gen = torch.Generator().manual_seed(c + g)
            eager.weight.copy_(torch.rand(c, generator=gen) + 0.5)
            eager.bias.copy_((torch.rand(c, generator=gen) - 0.5) * 0.8)
        slim = _Activation(GroupNorm.from_torch(eager))
        eager = _Activation(eager)

        def make_inputs():
            return torch.randn(n, c, h, w, device=device, dtype=dtype, requires_grad=True)

        return eager, slim, make_inputs

    return build_alone


for _s in ALONE:
    register_case(
        "group_norm_{}x{}x{}x{}_g{}".format(*_s),
        description="nn.GroupNorm({4}, {1}) alone on {0}x{1}x{2}x{3}, fwd + bwd".format(*_s),
        repeat=41,
    )(_alone(_s))

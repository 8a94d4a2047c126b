"""LayerNorm between Linears (GPT-2 ln_1 -> c_attn), 4x256x768: the LN output is shared."""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.nn.layer_norm import LayerNorm
from slimgrad.nn.linear import Linear


def norm_between_linears(eager_norm: type[nn.Module], slim_norm, device, dtype, small: bool):
    """Eager and slimgrad ``Linear(norm(Linear(x)))`` (same weights); an input maker.

    ``eager_norm(c)`` builds the torch norm; ``slim_norm.from_torch`` converts it.
    """
    b, t, c = (2, 5, 12) if small else (4, 256, 768)
    eager = nn.Sequential(nn.Linear(c, c), eager_norm(c), nn.Linear(c, c))
    eager = eager.to(device=device, dtype=dtype)
    slim = nn.Sequential(
        Linear.from_torch(eager[0]), slim_norm.from_torch(eager[1]), Linear.from_torch(eager[2])
    )

    def make_inputs():
        return torch.randn(b, t, c, device=device, dtype=dtype, requires_grad=True)

    return eager, slim, make_inputs


def build(device, dtype, small: bool = False):
    """Eager and slimgrad ``Linear(LayerNorm(Linear(x)))`` (same weights); an input maker."""
    return norm_between_linears(nn.LayerNorm, LayerNorm, device, dtype, small)

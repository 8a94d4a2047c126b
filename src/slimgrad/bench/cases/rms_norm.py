"""RMSNorm between Linears (Llama input_layernorm -> q_proj), 4x256x768: the LN output is shared."""

from __future__ import annotations

from torch import nn

from slimgrad.bench.cases.layer_norm import norm_between_linears
from slimgrad.nn.rms_norm import RMSNorm


def build(device, dtype, small: bool = False):
    """Eager and slimgrad ``Linear(RMSNorm(Linear(x)))`` (same weights); an input maker."""
    return norm_between_linears(nn.RMSNorm, RMSNorm, device, dtype, small)

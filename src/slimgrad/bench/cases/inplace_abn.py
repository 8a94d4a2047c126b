"""8 x [Conv2d(64, 64, 3, padding=1) -> BN + LeakyReLU(0.01)], 16x64x56x56: InPlaceABN vs eager.

Eager: ``BatchNorm2d`` + ``LeakyReLU(0.01, inplace=True)``. slimgrad:
``InPlaceABN(activation='leaky_relu')`` sharing the same Parameters.
BatchNorm weights in [0.5, 1.5] and biases in [-0.2, 0.2] (not the init's 1 and 0). Targets
(issue 3): saved <= 0.50 and peak <= 0.56 of eager, step <= 1.05x. Run: ``slimgrad bench
inplace_abn [--small]``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from slimgrad.bench.models import conv_chain
from slimgrad.nn.inplace_abn import InPlaceABN

BLOCKS, CHANNELS, SHAPE = 8, 64, (16, 64, 56, 56)
SMALL_SHAPE = (4, 64, 14, 14)


def _slim(eager: nn.Sequential) -> nn.Sequential:
    # Same Parameters; buffers copied so the two models' running statistics evolve separately.
    layers: list[nn.Module] = []
    for m in eager:
        if isinstance(m, nn.BatchNorm2d):
            bn = copy.copy(m)
            bn._buffers = {k: (v.clone() if v is not None else v) for k, v in m._buffers.items()}
            layers.append(InPlaceABN.from_torch(bn, activation="leaky_relu", activation_param=0.01))
        elif isinstance(m, nn.LeakyReLU):
            layers.append(nn.Identity())  # keeps parameter names (and state_dict keys) aligned
        else:
            layers.append(m)
    return nn.Sequential(*layers)


def build(device="cpu", dtype=torch.float32, small: bool = False):
    device = torch.device(device)
    torch.manual_seed(0)
    eager = conv_chain(BLOCKS, CHANNELS).to(device=device, dtype=dtype)
    with torch.no_grad():
        for m in eager:
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    slim = _slim(eager)
    shape = SMALL_SHAPE if small else SHAPE

    def make_inputs():
        return torch.randn(shape, device=device, dtype=dtype)

    return eager, slim, make_inputs

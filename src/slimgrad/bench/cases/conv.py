"""Convolutions that keep only what the requested gradients need (``slimgrad.ops.conv``).

- ``conv_frozen``: 4 x ``Conv2d(64, 64, 3, pad=1) -> SiLU`` with frozen weights and an input that
  needs grad (e.g. feature attribution, or layers trained below a frozen block), 8x64x56x56: eager
  keeps every conv input (the SiLU outputs) and every SiLU input, slimgrad only the SiLU inputs.
- ``resnet50_frozen_eval``: ResNet-50 with frozen weights and BatchNorm in eval, training the fc
  head and the input (memsave_torch's setting), 8x3x224x224.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from slimgrad.bench import harness
from slimgrad.bench.cases.models import eager_resnet50
from slimgrad.convert_handlers.cnn import convert_cnn_


@harness.register_case(
    "conv_frozen",
    description="4 x Conv2d(64,64,3)->SiLU, frozen weights, input needs grad, 8x64x56x56 "
    "(small: 2x8x12x12)",
    repeat=3,
)
def build_frozen(device, dtype, small=False):
    c, shape = (8, (2, 8, 12, 12)) if small else (64, (8, 64, 56, 56))
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Conv2d(c, c, 3, padding=1), nn.SiLU()]
    eager = nn.Sequential(*layers).to(device=device, dtype=dtype).requires_grad_(False)
    slim = convert_cnn_(copy.deepcopy(eager))

    def make_inputs():
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    return eager, slim, make_inputs


@harness.register_case(
    "resnet50_frozen_eval",
    description="ResNet-50, frozen backbone, BN eval, fc and input trained, 8x3x224x224 "
    "(small: 2x3x32x32)",
    repeat=3,
)
def build_resnet_frozen(device, dtype, small=False):
    eager, make_inputs = eager_resnet50(device, dtype, small, input_grad=True)
    eager.model.eval()
    for name, p in eager.model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    return eager, convert_cnn_(copy.deepcopy(eager)), make_inputs

"""BatchNorm -> ReLU keeping one tensor per block; the ResNet-50 targets with ReLUs unchanged.

Cases (eager against slimgrad's CNN handlers, ``slimgrad.convert_handlers.cnn``):

- ``resnet50_bn_relu``: the built-in ResNet-50 + cross-entropy at 8x3x224x224 (small: 2x3x32x32).
- ``bn_relu_chain``: 8 x ``Conv2d(64, 64, 3, pad=1, bias=False) -> BatchNorm2d -> ReLU(inplace)``
  at 16x64x56x56 (small: 2x8x12x12), the InPlace-ABN study's chain with ReLU kept.

ResNet-50 targets: saved bytes <= 1.9x the matmul-input floor, peak <= 0.80x eager's, every
gradient within the error rule. BN -> ReLU pairs keep the BN output only; bn3 and the downsample
BN, whose outputs feed the residual add, keep no input and re-run their 1x1 conv in backward (NOTE
[Recomputable inputs]). Measured figures: ``benchmarks/results/resnet50.jsonl`` and, for the
``recompute_input`` ablations, ``docs/measurements.md``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from slimgrad.bench import harness
from slimgrad.bench.cases.models import eager_resnet50
from slimgrad.convert_handlers.cnn import convert_cnn_


@harness.register_case(
    "resnet50_bn_relu",
    description="ResNet-50 + CE, 8x3x224x224, BN->ReLU keeps one tensor, bn3/downsample "
    "recompute their 1x1 conv (small: 2x3x32x32)",
    repeat=3,
)
def build_resnet50(device, dtype, small=False):
    eager, make_inputs = eager_resnet50(device, dtype, small)
    return eager, convert_cnn_(copy.deepcopy(eager)), make_inputs


def _chain(n_blocks: int, channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n_blocks):
        layers += [
            # No conv bias before BN (as in torchvision and every BN CNN): BN removes it, its
            # gradient is exactly 0, and any two float32 implementations return different
            # rounding noise there (~1e-5), which the 2x error rule would compare as a coin flip.
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
        ]
    return nn.Sequential(*layers)


@harness.register_case(
    "bn_relu_chain",
    description="8 x Conv2d(64,64,3,bias=False)->BatchNorm2d->ReLU(inplace), 16x64x56x56 "
    "(small: 2x8x12x12)",
    repeat=3,
)
def build_chain(device, dtype, small=False):
    c, shape = (8, (2, 8, 12, 12)) if small else (64, (16, 64, 56, 56))
    eager = _chain(8, c).to(device=device, dtype=dtype)
    slim = convert_cnn_(copy.deepcopy(eager))

    def make_inputs():
        return torch.randn(shape, device=device, dtype=dtype)

    return eager, slim, make_inputs

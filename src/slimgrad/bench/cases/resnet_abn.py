"""ResNet-50 through ``convert_(model, ConvertConfig(inplace_abn=True))`` (an opt-in model change:
ReLU -> leaky_relu(0.01)), against eager PyTorch on the same model with LeakyReLU(0.01, inplace).

- ``resnet50_inplace_abn``: the built-in ResNet-50 + cross-entropy at 8x3x224x224 (small:
  2x3x32x32).

Targets: saved bytes <= 1.10x the matmul-input floor, peak <= 0.52x eager's, every gradient
within the error rule. The cost is step time: the stem conv, each block's 1x1 conv1 and conv3 and
the downsample conv run again in backward (NOTE [Recomputed stem], NOTE [Recomputable inputs]).
Measured figures: ``benchmarks/results/resnet50_inplace_abn.jsonl`` and ``docs/measurements.md``.
"""

from __future__ import annotations

import copy

from torch import nn

import slimgrad
from slimgrad.bench import harness
from slimgrad.bench.cases.models import eager_resnet50


def _leaky(model: nn.Module, slope: float = 0.01) -> nn.Module:
    new: dict[int, nn.Module] = {}
    for mod in model.modules():
        for n, c in list(mod._modules.items()):
            if type(c) is nn.ReLU:
                mod._modules[n] = new.setdefault(id(c), nn.LeakyReLU(slope, inplace=c.inplace))
    return model


@harness.register_case(
    "resnet50_inplace_abn",
    description="ResNet-50 + CE, 8x3x224x224, convert_(inplace_abn=True) vs eager with "
    "LeakyReLU(0.01) (small: 2x3x32x32)",
    repeat=3,
)
def build_resnet50_abn(device, dtype, small=False):
    base, make_inputs = eager_resnet50(device, dtype, small)
    eager = _leaky(copy.deepcopy(base))
    slim = slimgrad.convert_(copy.deepcopy(base), slimgrad.ConvertConfig(inplace_abn=True))
    return eager, slim, make_inputs

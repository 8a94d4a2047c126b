"""ResNet-50 through ``convert_(model, ConvertConfig(inplace_abn=True))`` (an opt-in model change:
ReLU -> leaky_relu(0.01)), against eager PyTorch on the same model with LeakyReLU(0.01, inplace).

- ``resnet50_inplace_abn``: the built-in ResNet-50 + cross-entropy at 8x3x224x224 (small:
  2x3x32x32).

Measured here (harness record ``benchmarks/results/resnet50_inplace_abn.jsonl``, CPU 1 thread,
fp32, torch 2.13, repeat 3): eager saved 651.1 MiB = 2.39x the matmul-input floor (271.9 MiB), peak
699.0 MiB (the same as with ReLU); converted: saved 275.3 MiB = 1.013x the floor, peak 342.4 MiB =
0.490x eager (targets <= 1.10x, <= 0.52x); 161 gradients within the error rule. Step time
1.18x eager (1.17-1.33 over 3 pairs): the stem conv, each block's 1x1 conv1 and conv3 and the
downsample conv run again in backward (NOTE [Recomputed stem], NOTE [Recomputable inputs]).
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

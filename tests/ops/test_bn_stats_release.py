"""The BatchNorm's batch statistics are freed when its backward returns, as eager's are.

Found in timm's ``hgnetv2_b0`` (training, 2x3x32x32): each aggregation block's 1x1 conv ->
BatchNorm kept its save_mean and save_invstd (2 C float32) until the whole graph was freed, so at
the next conv's backward, the step's peak, the converted model held 33,792 B more than eager
(16,547,424 B against 16,513,632 B). The minimal block below is that aggregation conv block.
"""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.memory import measure


class _Affine(nn.Module):
    # timm's LearnableAffineBlock: scalar scale and bias after the activation
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.scale * x + self.bias


def _blocks(cin, c):
    yield "conv1x1-bn", nn.Sequential(nn.Conv2d(cin, c, 1, bias=False), nn.BatchNorm2d(c))
    yield (
        "conv1x1-bn-relu-affine",
        nn.Sequential(nn.Conv2d(cin, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), _Affine()),
    )


@pytest.mark.parametrize(
    "which,shape,c",
    [
        ("conv1x1-bn-relu-affine", (2, 160, 4, 4), 128),  # hgnetv2_b0's stages.1 aggregation.0
        ("conv1x1-bn", (2, 160, 4, 4), 128),
        ("conv1x1-bn", (3, 7, 5, 3), 5),
    ],
)
def test_peak_not_above_eager_at_the_input_conv_backward(which, shape, c):
    torch.manual_seed(0)
    eager = dict(_blocks(shape[1], c))[which].train()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert slimgrad.report(conv).converted, slimgrad.report(conv)  # not eager vs eager
    x = torch.randn(shape, requires_grad=True)
    res = {}
    for name, m in (("eager", eager), ("slim", conv)):
        m(x).sum().backward()  # warm-up: first-use caches count in the step that creates them
        x.grad = None
        for p in m.parameters():
            p.grad = None
        res[name] = measure(lambda m=m: m(x).sum(), module=m)
        x.grad = None
    e, s = res["eager"], res["slim"]
    assert s.saved_bytes <= e.saved_bytes
    # the statistics are gone by the input conv's backward (the hgnet step's peak), as eager's are
    assert s.peak_bytes <= e.peak_bytes
    # and the step ends holding what eager's does (the gradients)
    assert s.end_bytes == e.end_bytes

"""ConvertConfig(inplace_abn=True) and a forward set on an instance: the BN + activation fusions
(nn.Sequential one in nn/inplace_abn.py, the traced one in convert_handlers/abn.py) must not drop
it (NOTE [Instance forward on a fused leaf], NOTE [A traced parent runs its class forward])."""

import types

import pytest
import torch
from torch import nn

import slimgrad


def _seq(which):
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 1)
    )
    if which == "act":
        a = m[2]
        a.forward = lambda x: nn.LeakyReLU.forward(a, x) * 2.0 + 0.5
    elif which == "act_method":
        a = m[2]
        a.forward = types.MethodType(lambda self, x: nn.LeakyReLU.forward(self, x) - 1.0, a)
    elif which == "bn":
        bn = m[1]
        bn.forward = lambda x: nn.BatchNorm2d.forward(bn, x) * 2.0
    return m


def _step(m, x):
    x = x.clone().requires_grad_()
    out = m(x)
    out.pow(2).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("which", ["act", "act_method", "bn"])
def test_sequential_fusion_keeps_leaf_instance_forward(which):
    e, s = _seq(which), _seq(which)
    slimgrad.convert_(s, slimgrad.ConvertConfig(inplace_abn=True))
    x = torch.randn(2, 4, 5, 5)
    for a, b in zip(_step(e, x), _step(s, x)):
        torch.testing.assert_close(b, a)


class _Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


def _reads_b_twice(self, x):
    b = self.bn(self.conv(x))
    return self.relu(b) + b


def test_traced_pattern_reads_parent_instance_forward():
    torch.manual_seed(0)
    e = _Blk()
    torch.manual_seed(0)
    s = _Blk()
    e.forward = types.MethodType(_reads_b_twice, e)
    s.forward = types.MethodType(_reads_b_twice, s)
    slimgrad.convert_(s, slimgrad.ConvertConfig(inplace_abn=True))
    x = torch.randn(2, 4, 5, 5)
    for a, b in zip(_step(e, x), _step(s, x)):
        torch.testing.assert_close(b, a)


def test_traced_pattern_leaf_instance_forward_not_fused():
    # a ReLU with its own instance forward is not turned into LeakyReLUAfterABN + InPlaceABN
    m = _Blk()
    r = m.relu
    r.forward = lambda x: nn.ReLU.forward(r, x) + 1.0
    slimgrad.convert_(m, slimgrad.ConvertConfig(inplace_abn=True))
    assert type(m.bn).__name__ not in ("InPlaceABN", "RecomputeABN")
    assert type(m.relu).__name__ != "LeakyReLUAfterABN"
    x = torch.randn(2, 4, 5, 5)
    assert (m(x) >= 1.0).all()

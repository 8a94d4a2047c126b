"""Issue 30 class 7: a converted step never peaks above eager's where the caller holds the model's
output through backward (``out = model(x); loss = crit(out); loss.backward()``), nor inside a
reentrant checkpoint's backward, which holds the region's recomputed outputs.

A conv whose input and weight need gradients runs eager's op and registers a recipe for its
output; the recipe held a detached alias of the conv's input for as long as the output lived, past
the conv's own backward where eager lets the input go (NOTE [A recipe that reads x from eager's
conv node] in slimgrad/ops/_derived.py): a model ending in a conv kept its last conv's input for
the whole backward (below: 2,186,772 B against eager's 2,149,780), and a reentrant checkpoint over
conv -> BN -> ReLU(inplace) -> conv kept the ReLU's output through the BN's backward (+128 B at the
peak at 16 channels, +512 B at 64).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import measure


def _ends_in_conv(bn: bool) -> nn.Module:
    norm = (lambda c: nn.BatchNorm2d(c)) if bn else (lambda c: nn.Identity())
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), norm(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), norm(32), nn.ReLU(),
        nn.Conv2d(32, 3, 3, padding=1),
    )  # fmt: skip


def _peak_held(m: nn.Module, x: torch.Tensor) -> int:
    held = []

    def step():
        out = m(x)
        held.append(out)  # the caller's ``out``, alive through backward
        return out.square().sum()

    step().backward()
    held.clear()
    m.zero_grad(set_to_none=True)
    got = measure(step, timeline=False).peak_bytes
    held.clear()
    return got


@pytest.mark.parametrize("bn", [False, True])
def test_an_output_held_through_backward(bn):
    torch.manual_seed(0)
    eager = _ends_in_conv(bn)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(4, 3, 32, 32)
    e, s = _peak_held(eager, x), _peak_held(slim, x)
    assert s <= e, (s, e)
    rep = slimgrad.verify(eager, slim, x, loss_fn=lambda out: out.square().sum())
    assert rep.ok, str(rep)


class _Region(nn.Module):
    def __init__(self, c: int, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.n = nn.Conv2d(8, c, 3, padding=1), nn.BatchNorm2d(c)
        self.r, self.b = nn.ReLU(inplace=True), nn.Conv2d(c, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 1)

    def body(self, x):
        return self.b(self.r(self.n(self.a(x))))

    def forward(self, x):
        return self.c(checkpoint(self.body, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("c", [16, 64])
def test_a_checkpointed_conv_bn_relu_conv(c, reentrant):
    torch.manual_seed(0)
    eager = _Region(c, reentrant)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    e, s = (measure(lambda m=m: m(x).square().sum(), timeline=False) for m in (eager, slim))
    assert s.peak_bytes <= e.peak_bytes, (s.peak_bytes, e.peak_bytes)


class _ConvBn(nn.Module):
    # a 1x1 conv the BatchNorm after it replays (its recipe adopted), its output returned too
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.conv(x)
        return y, self.bn(y)


def _pair_conv_bn():
    torch.manual_seed(0)
    eager = _ConvBn()
    return eager, slimgrad.convert_(copy.deepcopy(eager))


def _x():
    return torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()


def test_a_batch_norm_replays_its_conv_after_the_convs_backward():
    # the conv's node has run its backward (its input let go) before the BatchNorm's: the BN
    # adopted a plain copy of the recipe at its forward (NodeRecipe.pinned)
    got = []
    for m in _pair_conv_bn():
        y, b = m(_x())
        y.square().sum().backward()
        got.append(torch.autograd.grad(b.square().sum(), m.bn.weight)[0])
    torch.testing.assert_close(got[1], got[0])


def test_a_batch_norm_on_the_output_after_the_convs_backward():
    # a lookup of a recipe whose node let its input go finds none: the BN keeps its input
    got = []
    for m in _pair_conv_bn():
        y, b = m(_x())
        b.square().sum().backward()
        z = m.bn(y)
        got.append(torch.autograd.grad(z.square().sum(), m.bn.weight)[0])
    torch.testing.assert_close(got[1], got[0])

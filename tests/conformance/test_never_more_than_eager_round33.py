"""Issue 30 class 7, round 33: a GroupNorm with fallback channels whose consumer keeps nothing of
its output saves no more, and peaks no higher, than eager.

With a fallback channel (``|beta| > |gamma|``) slimgrad's GroupNorm kept y, mean, rstd and the
channel's input where eager keeps x, mean and rstd: above eager's bytes where y's consumer keeps
another tensor (a ReLU, Sigmoid or Tanh keeps its own output). Sequential(Conv2d, GroupNorm(4,
16), ReLU, Conv2d) at 2x3x10x10 saved 12,368 B more than eager before. Now such a norm keeps x
there, with eager's backward (NOTE [GroupNorm's fallback channels only where y is kept after it]
in slimgrad/ops/group_norm.py), and keeps y where a consumer keeps it (a convolution, an
activation that keeps its input, a pool).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad
from slimgrad.memory import measure
from slimgrad.nn import GroupNorm

_NOT_KEPT = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "hardsigmoid": nn.Hardsigmoid,
}
_KEPT = {
    "silu": nn.SiLU,
    "maxpool": lambda: nn.MaxPool2d(2),
    "identity": nn.Identity,
}


def _model(act) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.GroupNorm(4, 16), act(), nn.Conv2d(16, 4, 1))
    with torch.no_grad():  # channels 1, 7 and 8 fall back (|beta| > |gamma|)
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.zero_()
        m[1].bias[[1, 7, 8]] = 3.0
    return m


def _bytes(m, x):
    for _ in range(2):  # steady state
        m(x).square().sum().backward()
    r = measure(lambda: m(x).square().sum(), module=m, timeline=False)
    return r.saved_bytes, r.peak_bytes


def _pair(act):
    eager = _model(act)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1))
    return eager, slim, x


@pytest.mark.parametrize("name", sorted(_NOT_KEPT))
def test_group_norm_before_a_module_that_keeps_nothing_of_y(name):
    eager, slim, x = _pair(_NOT_KEPT[name])
    assert slim[1].y_kept_after is False
    se, pe = _bytes(eager, x)
    ss, ps = _bytes(slim, x)
    assert ss <= se and ps <= pe, (ss, se, ps, pe)
    if name != "hardsigmoid":  # ReLU, Sigmoid, Tanh: the norm and the activation keep eager's set
        assert ss == se
    x.requires_grad_(True)
    for m in (eager, slim):
        m.zero_grad(set_to_none=True)
        m(x).square().sum().backward()
    # the norm's backward is eager's (the convolutions' are slimgrad's)
    for a, b in zip(eager.parameters(), slim.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("name", sorted(_KEPT))
def test_group_norm_before_a_module_that_keeps_y_keeps_its_saving(name):
    eager, slim, x = _pair(_KEPT[name])
    assert slim[1].y_kept_after is True
    se, _ = _bytes(eager, x)
    ss, _ = _bytes(slim, x)
    # y, mean, rstd and 3 channels' input with their indices, y shared with the consumer: x's
    # bytes (2 * 16 * 8 * 8 * 4) below eager's, less the channels (3 * 2 * 64 * 4 + 3 * 8)
    assert se - ss == 8192 - 1560, (ss, se)


def test_group_norm_at_the_output_of_a_leaky_relu_that_runs_eager():
    # a LeakyReLU at the model's output runs eager's op, which keeps its input: y is kept
    eager, slim, x = _pair(lambda: nn.LeakyReLU(0.1))
    del eager[3], slim[3]
    slimgrad.convert_(slim)
    assert slim[2].__dict__.get("keep_y") is False and slim[1].y_kept_after is True
    se, pe = _bytes(eager, x)
    ss, ps = _bytes(slim, x)
    assert se - ss == 8192 - 1560 and ps <= pe, (ss, se, ps, pe)


def test_group_norm_built_directly_keeps_x_with_a_fallback_channel():
    # a module built directly does not know its consumer: eager's saved set, backward and bits
    torch.manual_seed(0)
    gn = GroupNorm(3, 6)
    with torch.no_grad():
        gn.bias[1] = 5.0
    x = torch.randn(3, 6, 5, 7, requires_grad=True)
    r = torch.randn(3, 6, 5, 7)
    y = gn(x)
    saved = y.grad_fn.saved_tensors
    assert saved[0] is None and saved[4].shape == x.shape
    (y * r).sum().backward()
    got = [x.grad, gn.weight.grad, gn.bias.grad]
    x.grad = gn.weight.grad = gn.bias.grad = None
    y2 = F.group_norm(x, 3, gn.weight, gn.bias, gn.eps)
    (y2 * r).sum().backward()
    assert torch.equal(y, y2)
    for a, b in zip(got, [x.grad, gn.weight.grad, gn.bias.grad]):
        assert torch.equal(a, b)
    # a second derivative from the kept x
    ye = F.group_norm(x, 3, gn.weight, gn.bias)
    (gx,) = torch.autograd.grad((gn(x) * r).sum(), x, create_graph=True)
    (ge,) = torch.autograd.grad((ye * r).sum(), x, create_graph=True)
    (hx,) = torch.autograd.grad(gx.square().sum(), x)
    (he,) = torch.autograd.grad(ge.square().sum(), x)
    torch.testing.assert_close(hx, he)
    # the functional keeps y (its documented contract)
    y3 = slimgrad.ops.group_norm(x, 3, gn.weight, gn.bias)
    assert y3.grad_fn.saved_tensors[0] is not None

"""slimgrad's conv after a derived activation (ops/conv.py, ops/_derived.py).

NOTE [A stand-in for x]: the dx of a conv whose input x = act(b) (or act(b) * g) was rebuilt for
dW is computed with the kept b standing in for x: no full-size copy, the same bits as eager's
``convolution_backward`` on x. NOTE [Recomputable inputs]: the default policy keeps the input of a
norm after a conv whose input is a squeeze-excite output, also when that conv keeps its width
(RegNetY's conv3); other 1x1 convs are still replayed.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from slimgrad.convert_handlers.cnn import convert_cnn_
from slimgrad.ops import conv as conv_ops
from slimgrad.ops._derived import activation
from slimgrad.ops.batch_norm import batch_norm
from slimgrad.ops.squeeze_excite import squeeze_excite
from tests.ops.test_derived_rebuild import _SE  # the same SE block (x * gate)

_derived = importlib.import_module("slimgrad.ops._derived")


def _copies_in_conv_backward(fn):
    # aten::copy_ run inside aten::convolution_backward (its internal contiguous(); a dispatch
    # mode does not see it, the profiler does)
    with torch.profiler.profile() as prof:
        fn()
    n = 0
    for e in prof.events():
        p = e.cpu_parent
        while e.name == "aten::copy_" and p is not None:
            if p.name == "aten::convolution_backward":
                n += 1
                break
            p = p.cpu_parent
    return n


def _chain(x, w1, gamma, beta, w2, act, groups):
    c = torch.nn.functional.conv2d(x, w1, padding=1)
    b = batch_norm(c, None, None, gamma, beta, training=True)
    r = activation(b, act)
    return r, conv_ops.conv2d(r, w2, None, 1, 1, 1, groups)


@pytest.mark.parametrize("act", ["relu", "silu", "hardswish"])
@pytest.mark.parametrize("groups", [1, 5])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dx_after_a_derived_input_copies_nothing_and_is_eagers(act, groups, channels_last):
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(3, 4, 7, 9).to(memory_format=fmt)
    w1 = torch.randn(5, 4, 3, 3).to(memory_format=fmt).requires_grad_()
    gamma = torch.empty(5).uniform_(0.5, 1.5).requires_grad_()
    beta = torch.empty(5).uniform_(-0.2, 0.2).requires_grad_()
    w2 = torch.randn(10, 5 // groups, 3, 3).to(memory_format=fmt).requires_grad_()
    r, y = _chain(x, w1, gamma, beta, w2, act, groups)
    assert y.grad_fn.act == act  # the conv kept b, not r
    g = torch.randn_like(y)
    out = []
    n_slim = _copies_in_conv_backward(lambda: out.extend(torch.autograd.grad(y, (r, w2), g)))
    dr, dw = out

    def eager():  # eager's convolution_backward on r itself
        args = (None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups, [True, True, False])
        out[:] = torch.ops.aten.convolution_backward(g, r.detach(), w2.detach(), *args)

    n_eager = _copies_in_conv_backward(eager)
    ex, ew, _ = out
    assert n_slim == n_eager  # what the backend copies (channels_last: the 3x3 weight)
    torch.testing.assert_close(dr, ex, rtol=0, atol=0)
    torch.testing.assert_close(dw, ew, rtol=0, atol=0)
    assert dr.stride() == ex.stride()


def test_without_the_stand_in_dx_copies_x(monkeypatch):
    # the behaviour the stand-in removes (and the test above would catch): an expanded stand-in
    # is made contiguous inside convolution_backward, one full-size copy per conv
    monkeypatch.setattr(conv_ops, "_stands_in", lambda b, x: False)
    torch.manual_seed(0)
    x = torch.randn(3, 4, 7, 9)
    w1, w2 = (
        torch.randn(5, 4, 3, 3, requires_grad=True),
        torch.randn(6, 5, 3, 3, requires_grad=True),
    )
    gamma, beta = torch.ones(5, requires_grad=True), torch.zeros(5, requires_grad=True)
    r, y = _chain(x, w1, gamma, beta, w2, "relu", 1)
    g = torch.randn_like(y)
    assert _copies_in_conv_backward(lambda: torch.autograd.grad(y, (r, w2), g)) == 1


def _se_block(c_out):
    # conv -> BN -> ReLU -> SE gate -> conv1x1 (c -> c_out) -> BN: RegNetY's conv3 keeps the
    # width (c_out == c), EfficientNet's projection narrows it
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        _SE(6, lambda x, g: x * g),
        nn.Conv2d(6, c_out, 1),
        nn.BatchNorm2d(c_out),
    )
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            nn.init.uniform_(mod.weight, 0.5, 1.5)
            nn.init.uniform_(mod.bias, -0.2, 0.2)
    slim = copy.deepcopy(m)
    slim[3].op = squeeze_excite
    return m, convert_cnn_(slim)


@pytest.mark.parametrize("c_out", [6, 8, 4])
def test_default_policy_keeps_the_norm_input_after_any_gated_conv(c_out):
    eager, slim = _se_block(c_out)
    x = torch.randn(2, 3, 5, 7)
    y = slim(x)
    ctx = y.grad_fn
    assert type(ctx).__name__ == "_BatchNormFnBackward"
    assert ctx.recipe is None and ctx.x is not None
    slim[5].recompute_input = "always"  # the recipe is still there for the "always" policy
    assert slim(x).grad_fn.recipe is not None


def test_a_plain_pointwise_conv_is_still_replayed():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6)
    )
    slim = convert_cnn_(copy.deepcopy(m))
    # 2 x 5 x 7 = 70 values per channel: at most 32 the default replays nothing (NOTE [Which convs
    # the default replays] in ops/_derived.py)
    assert slim(torch.randn(2, 3, 7, 9)).grad_fn.recipe is not None

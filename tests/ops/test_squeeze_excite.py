"""slimgrad.ops.squeeze_excite: eager's ``x * g`` bit for bit, keeping neither x nor y.

The stacks are ``conv -> BatchNorm -> act -> SE gate -> conv`` with slimgrad's conv/BatchNorm/
``*AfterNorm`` modules (``convert_cnn_``); the reference is the same stack with eager's multiply,
so outputs and every gradient must agree bit for bit, and the saved bytes differ by exactly the
tensors the contract drops (x and y).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slimgrad.convert_handlers.cnn import convert_cnn_
from slimgrad.memory import measure
from slimgrad.ops.squeeze_excite import squeeze_excite
from slimgrad.testing import assert_within_rule

ACTS = {"relu": nn.ReLU, "silu": nn.SiLU, "hardswish": nn.Hardswish}


def _eager_gate(x, g, gate_first=False):
    return g * x if gate_first else x * g


class _SE(nn.Module):
    def __init__(self, c, op, gate_first=False):
        super().__init__()
        self.fc = nn.Conv2d(c, c, 1)
        self.op, self.gate_first = op, gate_first

    def forward(self, x):
        s = torch.sigmoid(self.fc(x.mean((2, 3), keepdim=True)))
        return self.op(x, s, self.gate_first)


def _stack(op, act="relu", c=6, norm=True, gate_first=False, dtype=torch.float32):
    torch.manual_seed(0)
    mid = [nn.BatchNorm2d(c), ACTS[act]()] if norm else [ACTS[act]()]
    m = nn.Sequential(nn.Conv2d(3, c, 3), *mid, _SE(c, op, gate_first), nn.Conv2d(c, 4, 1))
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            nn.init.uniform_(mod.weight, 0.5, 1.5)
            nn.init.uniform_(mod.bias, -0.2, 0.2)
    return convert_cnn_(m.to(dtype))


def _run(model, x, inputs=None):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    model.zero_grad(set_to_none=True)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()
    loss.backward(inputs=inputs(model, x) if inputs else None)
    grads = [p.grad for p in model.parameters()] + [x.grad]
    return out.detach(), grads


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _pair(**kw):
    eager = _stack(_eager_gate, **kw)
    slim = copy.deepcopy(eager)
    slim[-2].op = squeeze_excite
    return eager, slim


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("hw", [(9, 7), (3, 3)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("norm", [True, False])
def test_outputs_and_gradients_are_eagers_bit_for_bit(act, hw, layout, norm):
    eager, slim = _pair(act=act, norm=norm)
    x = torch.randn(3, 3, *hw)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
        eager, slim = (m.to(memory_format=torch.channels_last) for m in (eager, slim))
    ye, ge = _run(eager, x)
    ys, gs = _run(slim, x)
    _same(ys, ye)
    for a, b in zip(gs, ge, strict=True):
        _same(a, b)


def test_gate_first_and_eval_and_no_grad():
    eager, slim = _pair(gate_first=True)
    x = torch.randn(2, 3, 8, 6)
    for a, b in zip(_run(slim, x)[1], _run(eager, x)[1], strict=True):
        _same(a, b)
    eager.eval(), slim.eval()
    _same(_run(slim, x)[0], _run(eager, x)[0])
    with torch.no_grad():
        _same(slim(x), eager(x))


def test_within_rule_of_float64_reference():
    eager, slim = _pair(act="silu")
    ref = copy.deepcopy(eager).double()
    ref[-2].op = _eager_gate
    x = torch.randn(2, 3, 11, 9)
    ye, ge = _run(eager, x)
    ys, gs = _run(slim, x)
    yr, gr = _run(ref, x.double())
    assert_within_rule(ys, yr, ye)
    assert_within_rule(gs, gr, ge)


@pytest.mark.parametrize("which", ["input", "gate"])
def test_backward_inputs_subsets(which):
    def inputs(model, x):
        return [x] if which == "input" else [model[-2].fc.weight]

    eager, slim = _pair(norm=False)
    x = torch.randn(2, 3, 7, 5)
    for a, b in zip(_run(slim, x, inputs)[1], _run(eager, x, inputs)[1], strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            _same(a, b)


def test_autocast_bfloat16_is_eagers():
    eager, slim = _pair(act="silu")
    x = torch.randn(2, 3, 9, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ye, ge = _run(eager, x)
        ys, gs = _run(slim, x)
    _same(ys, ye)
    for a, b in zip(gs, ge, strict=True):
        _same(a, b)


def test_gradcheck_float64():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    g = torch.rand(2, 3, 1, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(squeeze_excite, (x, g))
    assert torch.autograd.gradcheck(lambda a, b: squeeze_excite(a, b, True), (x, g))


@pytest.mark.parametrize("norm", [True, False])
def test_memory_contract_is_exact(norm):
    # after a slimgrad BatchNorm + act neither x nor y is kept (b is the norm's); without the norm
    # x is kept (as eager) and y is not (the next conv keeps x instead)
    eager, slim = _pair(norm=norm)
    x = torch.randn(4, 3, 13, 11)
    full = 4 * 6 * 11 * 9 * 4  # one float32 tensor of the SE's size

    def step(m):
        return lambda: m(x).square().sum()

    me, ms = measure(step(eager)), measure(step(slim))
    assert me.saved_bytes - ms.saved_bytes == (2 if norm else 1) * full
    assert ms.peak_bytes < me.peak_bytes


def test_inplace_change_of_gate_raises():
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    g = torch.rand(2, 3, 1, 1, requires_grad=True) * 1
    y = squeeze_excite(x * 1, g)
    g.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_change_of_gate_after_a_conv_raises():
    # the conv after the gate keeps b and g to rebuild y: a changed g must not give a wrong dW
    _, slim = _pair()
    x = torch.randn(2, 3, 6, 6)
    h = slim[2](slim[1](slim[0](x)))
    s = torch.sigmoid(slim[3].fc(h.mean((2, 3), keepdim=True)))
    y = slim[4](squeeze_excite(h, s))
    s.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_other_shapes_and_dtypes_are_eagers_multiply():
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    for g in (torch.rand(1, 3, 1, 1), torch.rand(2, 3, 4, 1), torch.rand(2, 3, 1, 1).double()):
        g.requires_grad_()
        y = squeeze_excite(x, g)
        assert type(y.grad_fn).__name__ == "MulBackward0"

"""In-place slimgrad ops on the first tensor of a compiled region give eager's gradients.

NOTE [In-place Functions under torch.compile] in slimgrad/_autograd.py: AOTAutograd (torch 2.13)
drops the backward of a mark_dirty Function that writes a graph input; the ops call torch's own
in-place op while Dynamo traces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import slimgrad
import slimgrad.ops as O

pytest.importorskip("torch._dynamo")

CASES = {
    "relu_": (O.relu_, torch.relu_),
    "relu(inplace)": (lambda t: O.relu(t, True), lambda t: F.relu(t, True)),
    "leaky_relu_": (lambda t: O.leaky_relu_(t, 0.01), lambda t: F.leaky_relu_(t, 0.01)),
    # eager's in-place forms refuse a negative slope/alpha in backward; slimgrad's accept it
    "leaky_relu_(-0.5)": (
        lambda t: O.leaky_relu_(t, -0.5),
        lambda t: t.copy_(F.leaky_relu(t.clone(), -0.5)),
    ),
    "elu_(-0.5)": (lambda t: O.elu_(t, -0.5), lambda t: t.copy_(F.elu(t.clone(), -0.5))),
    "sigmoid_": (O.sigmoid_, torch.sigmoid_),
    "tanh_": (O.tanh_, torch.tanh_),
    "elu_": (O.elu_, F.elu_),
    "gelu_": (O.gelu_, lambda t: t.copy_(F.gelu(t.clone()))),
    "silu_": (O.silu_, lambda t: F.silu(t, True)),
    "mish_": (O.mish_, lambda t: F.mish(t, True)),
    "hardtanh_": (O.hardtanh_, F.hardtanh_),
    "relu6_": (O.relu6_, lambda t: F.relu6(t, True)),
    "hardswish_": (O.hardswish_, lambda t: F.hardswish(t, True)),
    "hardsigmoid_": (O.hardsigmoid_, lambda t: F.hardsigmoid(t, True)),
}


def _grad(fn, compiled: bool) -> torch.Tensor:
    torch._dynamo.reset()
    g = torch.compile(fn, backend="aot_eager") if compiled else fn
    x = torch.linspace(-4, 4, 64, dtype=torch.float64, requires_grad=True)
    t = x * 1  # a non-leaf tensor entering the compiled region: a graph input written in place
    (g(t) * torch.arange(64, dtype=torch.float64)).sum().backward()
    return x.grad


@pytest.mark.parametrize("name", list(CASES))
def test_inplace_op_on_graph_input_matches_eager(name):
    ours, ref = CASES[name]
    torch.testing.assert_close(_grad(ours, True), _grad(ref, False))


def test_converted_inplace_relu_after_graph_break():
    # the same through convert_: a ReLU(inplace=True) whose input comes from before a graph break
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8).double()
            self.act = torch.nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.lin(x)
            torch._dynamo.graph_break()
            return self.act(h)

    torch.manual_seed(0)
    eager = Net()
    conv = slimgrad.convert_(Net())
    assert slimgrad.report(conv).converted, slimgrad.report(conv)  # not eager vs eager
    conv.load_state_dict(eager.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64)
    w = torch.randn(5, 8, dtype=torch.float64)
    (eager(x) * w).sum().backward()
    torch._dynamo.reset()
    (torch.compile(conv, backend="aot_eager")(x) * w).sum().backward()
    for a, b in zip(eager.parameters(), conv.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)

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


def _inputs() -> tuple[list, list]:
    # leaves, and the non-leaf tensors that enter the compiled region: graph inputs written in place
    xs = [torch.linspace(-4, 4, 64, dtype=torch.float64, requires_grad=True) for _ in CASES]
    return xs, [x * 1 for x in xs]


def _backward(outs) -> None:
    sum((y * torch.arange(64, dtype=torch.float64)).sum() for y in outs).backward()


@pytest.fixture(scope="module")
def compiled_grads():
    # every case's op on its own graph input, in one compiled region (one graph: every op traced,
    # none run eagerly by a break), one compile for all
    ops = [ours for ours, _ in CASES.values()]

    def region(*ts):
        return [op(t) for op, t in zip(ops, ts, strict=True)]

    xs, ts = _inputs()
    torch._dynamo.reset()
    try:
        _backward(torch.compile(region, backend="aot_eager", fullgraph=True)(*ts))
    finally:
        torch._dynamo.reset()
    return dict(zip(CASES, (x.grad for x in xs), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_inplace_op_on_graph_input_matches_eager(compiled_grads, name):
    _, ref = CASES[name]
    x = torch.linspace(-4, 4, 64, dtype=torch.float64, requires_grad=True)
    _backward([ref(x * 1)])  # eager's op on a non-leaf, as in the region
    torch.testing.assert_close(compiled_grads[name], x.grad)


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

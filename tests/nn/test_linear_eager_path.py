"""A converted Linear / Conv1D outside autocast is eager's op (NOTE [Converted Linear outside
autocast] in slimgrad/nn/linear.py): eager's autograd graph, bits and tracker bytes; under autocast
slimgrad's Function stays (it keeps the fp32 weight instead of its cast)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from slimgrad.nn.linear import Conv1D

pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D as HFConv1D  # noqa: E402


def _graph(y: torch.Tensor) -> list[str]:
    # node class names, depth first from y's grad_fn (AccumulateGrad leaves included)
    names, stack, seen = [], [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.append(type(node).__name__)
        stack.extend(f for f, _ in node.next_functions)
    return names


def _make(kind: str, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Linear(24, 16, bias=bias)
    m = HFConv1D(16, 24)
    nn.init.normal_(m.bias)
    return m


CASES = [
    pytest.param(kind, bias, shape, id=f"{kind}-{'bias' if bias else 'nobias'}-{len(shape)}d")
    for kind, bias in (("linear", True), ("linear", False), ("conv1d", True))
    for shape in ((5, 24), (3, 5, 24), (2, 3, 4, 24))
]


@pytest.mark.parametrize("kind,bias,shape", CASES)
@pytest.mark.parametrize("need", ["all", "frozen_weight", "no_input_grad", "inplace_after"])
def test_outside_autocast_eagers_graph_bits_and_bytes(kind, bias, shape, need):
    eager = _make(kind, bias)
    ours = slimgrad.convert_(nn.Sequential(copy.deepcopy(eager)))[0]
    assert type(ours).__module__ == "slimgrad.nn.linear", type(ours)
    if need == "frozen_weight":
        eager.weight.requires_grad_(False)
        ours.weight.requires_grad_(False)
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    w = torch.randn(shape[:-1] + (16,), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, m in (("eager", eager), ("ours", ours)):
        x = x0.clone().requires_grad_(need != "no_input_grad")

        def step(m=m, x=x):
            y = m(x)
            if need == "inplace_after":
                y = y.mul_(1.5).relu_()
            return (y * w).sum()

        graph = _graph(m(x))
        rec = measure(step, module=m, timeline=False)
        grads = [x.grad] + [p.grad for p in m.parameters()]
        out[name] = graph, rec.saved_bytes, rec.floor_bytes, rec.peak_bytes, grads
        for p in m.parameters():
            p.grad = None
    (ge, se, fe, pe, de), (go, so, fo, po, do) = out["eager"], out["ours"]
    assert go == ge  # eager's nodes: no slimgrad Function (failed before: _LinearFnBackward)
    assert (so, fo, po) == (se, fe, pe)
    assert len(do) == len(de)
    for a, b in zip(de, do, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_under_autocast_the_function_stays(kind):
    ours = slimgrad.convert_(nn.Sequential(_make(kind, True)))[0]
    x = torch.randn(3, 5, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x)
    assert y.dtype == torch.bfloat16
    assert "_AutocastLinearFnBackward" in _graph(y)


def test_conv1d_without_bias_and_mismatched_shapes_keep_slimgrads_path():
    m = Conv1D(16, 24)
    m.bias = None
    x = torch.randn(3, 24, requires_grad=True)
    assert "_LinearFnBackward" in _graph(m(x))  # HF's addmm needs a bias: slimgrad's op
    lin = slimgrad.convert_(nn.Sequential(nn.Linear(24, 16)))[0]
    with pytest.raises(RuntimeError, match="slimgrad.ops.linear: input features"):
        lin(torch.randn(3, 23))

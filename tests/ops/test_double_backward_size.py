"""Second derivatives through the activations that keep their output (SiLU, GELU none/tanh, Mish,
Hardswish) are eager's on both sides of the few-element threshold (``DENSE_MAX``), not refused
above it: whether a model with an R1 / gradient penalty trains must not depend on its size
(NOTE [Second derivatives through the kept output] in slimgrad/ops/_output_act.py; issue 30)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops._output_act import DENSE_MAX
from slimgrad.ops.gelu import gelu
from slimgrad.ops.hardswish import hardswish
from slimgrad.ops.mish import mish
from slimgrad.ops.silu import silu
from slimgrad.testing import assert_within_rule

OPS = {
    "silu": (F.silu, silu, -1.27846),
    "gelu": (F.gelu, gelu, -0.75179),
    "gelu_tanh": (
        lambda x: F.gelu(x, approximate="tanh"),
        lambda x: gelu(x, approximate="tanh"),
        -0.7517,
    ),
    "mish": (F.mish, mish, -1.19217),
    "hardswish": (F.hardswish, hardswish, -1.5),
}
# below DENSE_MAX (x kept: eager's formula) and above it (y + bits + table)
SHAPES = [(7, 13), (37, 41)]


def _input(shape, x_star, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    flat = x.view(-1)
    # the hard elements (near x*, the tails, past the breakpoints) and their neighbours
    special = [x_star, x_star + 0.01, x_star - 0.04, x_star + 0.2, -7.0, -30.0, -3.0, 3.0, 2.9]
    special += [3.1, 25.0, 0.0, -2.6, -3.2, 8.5]
    flat[: len(special)] = torch.tensor(special, dtype=torch.float64)
    return x.to(dtype)


def _second(f, x0):
    # g depends on x (y**3), and the penalty weighs the first derivative unevenly: both paths of
    # the double backward (through g and through x) carry weight
    x = x0.clone().requires_grad_()
    y = f(x * 1)
    (gx,) = torch.autograd.grad((y**3).sum() + y.sum(), x, create_graph=True)
    assert gx.requires_grad, "first derivative without history under create_graph=True"
    w = torch.linspace(-1.0, 2.0, gx.numel(), dtype=gx.dtype).view_as(gx)
    (g2,) = torch.autograd.grad((gx.square() * w).sum(), x)
    return gx.detach(), g2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{math.prod(s)}")
@pytest.mark.parametrize("name", list(OPS))
def test_second_derivative_is_eager_below_and_above_threshold(name, shape, dtype):
    eager, ours, x_star = OPS[name]
    x0 = _input(shape, x_star, dtype)
    assert (math.prod(shape) > DENSE_MAX) == (shape == SHAPES[1])
    saved = ours(x0.clone().requires_grad_()).grad_fn.saved_tensors
    table = len(saved) == 4 and saved[0] is not None
    assert table == (math.prod(shape) > DENSE_MAX and dtype == torch.float32)
    f_o, s_o = _second(ours, x0)
    f_e, s_e = _second(eager, x0)
    f_r, s_r = _second(eager, x0.double())
    assert s_e.abs().max() > 0
    assert_within_rule([f_o, s_o], [f_r, s_r], [f_e, s_e], names=["first", "second"])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", ["silu", "hardswish"])
def test_second_derivative_after_linear_in_place(name, inplace):
    # the hunt's shape: Linear -> act (in place too) -> Linear, a gradient penalty on the input
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
    eager, ours, _ = OPS[name]
    fns = {
        "silu": (lambda h: F.silu(h, inplace=True), lambda h: silu(h, inplace=True)),
        "hardswish": (lambda h: F.hardswish(h, inplace=True), lambda h: hardswish(h, inplace=True)),
    }[name]
    if inplace:
        eager, ours = fns
    x0 = torch.randn(6, 11, 16)
    res = []
    for act in (eager, ours):
        x = x0.clone().requires_grad_()
        (g,) = torch.autograd.grad(lin2(act(lin1(x))).sum(), x, create_graph=True)
        params = [x, *lin1.parameters(), *lin2.parameters()]
        res.append(torch.autograd.grad(g.pow(2).sum(), params, allow_unused=True))
    for a, b in zip(*res, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(OPS))
def test_gradgradcheck_float64(name):
    _, ours, _ = OPS[name]
    for n in (29, DENSE_MAX + 3):
        x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) * 2
        x = (x + 0.37).requires_grad_()  # away from hardswish's breakpoints at this seed
        assert torch.autograd.gradcheck(ours, (x,))
        assert torch.autograd.gradgradcheck(ours, (x,))


@pytest.mark.parametrize("name", list(OPS))
def test_third_derivative_refused(name):
    _, ours, _ = OPS[name]
    x = torch.randn(40, 40, generator=torch.Generator().manual_seed(2)).requires_grad_()
    y = ours(x * 1)
    (g1,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad(g1.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"slimgrad\.ops\.\w+: a second derivative"):
        torch.autograd.grad(g2.sum(), x)


@pytest.mark.parametrize("name", list(OPS))
def test_first_order_saves_nothing_more(name):
    # y (shared with the next op) + packed bits + the side table: what the first-order
    # call kept before the double path existed
    _, ours, _ = OPS[name]
    x = torch.randn(64, 97, generator=torch.Generator().manual_seed(5)).requires_grad_()
    ours(x * 1)  # the tables' one-time caches
    m = measure(lambda: ours(x * 1).square().sum())
    node = ours(x * 1).grad_fn
    y, bits, idx, xs = node.saved_tensors
    assert bits.numel() == (x.numel() + 7) // 8
    expect = x.numel() * 4 + bits.numel() + idx.numel() * idx.element_size() + xs.numel() * 4
    assert m.saved_bytes == expect


def test_float16_table_path_still_refuses():
    x = torch.randn(400, 400, dtype=torch.float16).requires_grad_()
    y = silu(x * 1)
    (g1,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
    if y.grad_fn.saved_tensors[0] is None:  # kept x on this device (half on CPU): eager's
        pytest.skip("float16 keeps x here")
    with pytest.raises(RuntimeError, match=r"slimgrad\.ops\.silu: a second derivative"):
        torch.autograd.grad(g1.float().pow(2).sum(), x)

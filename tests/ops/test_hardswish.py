"""slimgrad.ops.hardswish: eager's output bit for bit, eager's gradient at the breakpoints and by
the error rule elsewhere, keeping y + 1 bit/elt + a sparse table near x = -3/2."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import slimgrad
from slimgrad.memory import measure
from slimgrad.nn.hardswish import Hardswish
from slimgrad.ops.hardswish import hardswish, hardswish_
from slimgrad.testing import assert_within_rule

# the module (slimgrad.ops.hardswish the attribute is the function)
H = importlib.import_module("slimgrad.ops.hardswish")

HALF = [torch.float16, torch.bfloat16]
BREAKS = [-3.0, 3.0, -1.5, 0.0, -0.0]
NONFINITE = [float("nan"), float("inf"), -float("inf")]


def _run(fn, x0, g, inplace=False):
    x = x0.detach().clone().requires_grad_()
    h = x * 1  # a non-leaf, so the in-place form is allowed
    y = fn(h, inplace=True) if inplace else fn(h)
    y.backward(g)
    return y.detach(), x.grad


def _check(x0, g, inplace=False):
    """Output bit for bit; gradient by the rule on finite x; non-finite x and breakpoints exact."""
    y, gx = _run(hardswish, x0, g, inplace)
    ye, ge = _run(F.hardswish, x0, g, inplace)
    _, g64 = _run(F.hardswish, x0.double(), g.double())
    torch.testing.assert_close(y, ye, rtol=0, atol=0, equal_nan=True)
    fin = torch.isfinite(x0)
    assert_within_rule([gx[fin]], [g64[fin]], [ge[fin]])
    exact = torch.isinf(x0) | torch.isin(x0.double(), torch.tensor(BREAKS, dtype=torch.float64))
    torch.testing.assert_close(gx[exact], ge[exact], rtol=0, atol=0)
    # NaN x: NaN, as eager's vectorized kernel, or (dense fallback) eager's own result, which is g
    # in its scalar tail (the last few elements of a tensor)
    nan = torch.isnan(x0)
    assert (gx[nan].isnan() | (gx[nan] == ge[nan])).all()


def _around(c: float, k: int, dtype=torch.float32):
    t = torch.tensor(c, dtype=dtype)
    vals, up, dn = [t], t, t
    for _ in range(k):
        up = torch.nextafter(up, torch.tensor(9.0, dtype=dtype))
        dn = torch.nextafter(dn, torch.tensor(-9.0, dtype=dtype))
        vals += [up, dn]
    return torch.stack(vals)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF, torch.float64])
@pytest.mark.parametrize("shape", [(7,), (5, 37), (3, 1, 131)])
@pytest.mark.parametrize("inplace", [False, True])
def test_random_inputs_with_breakpoints(dtype, shape, inplace):
    x0 = torch.randn(shape, dtype=torch.float64) * 3
    x0.view(-1)[:7] = torch.tensor(BREAKS[:4] + NONFINITE, dtype=torch.float64)
    x0 = x0.to(dtype)
    _check(x0, torch.randn(shape, dtype=torch.float64).to(dtype), inplace)


@pytest.mark.parametrize("dtype", HALF)
def test_every_half_precision_value(dtype):
    x0 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x0 = x0[~(x0.float().abs() > 1e4)]  # finite big values: eager's own error dominates the bound
    _check(x0, torch.randn(x0.shape).to(dtype))


def test_float32_breakpoints_and_window_edges():
    # ulps around -3 and 3 (the branch changes), the window edges and the minimum, spread among
    # ordinary values so that the side table stays sparse
    parts = [_around(c, 200) for c in (-3.0, 3.0, -1.5 - H._WINDOW[torch.float32])]
    parts += [_around(-1.5 + H._WINDOW[torch.float32], 200), _around(-1.5, 50)]
    x0 = torch.cat([*parts, torch.randn(40000) * 3])
    _check(x0, torch.randn(x0.shape))


def test_float32_sweep():
    x0 = torch.cat([torch.linspace(-4, 4, 20001), torch.randn(200000) * 3])
    _check(x0, torch.randn(x0.shape))


def _hard(x):
    xf = x.float()
    return int((((xf + 1.5).abs() < H._WINDOW[x.dtype]) | ~torch.isfinite(xf)).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_contract(dtype):
    x0 = (torch.randn(7, 131) * 3).to(dtype)
    n, elt, k = x0.numel(), x0.element_size(), _hard(x0)
    assert 0 < k * H.FALLBACK_DIV <= n

    def step(fn):
        return lambda: fn(x0.clone().requires_grad_() * 1).sum()

    m, me = measure(step(hardswish)), measure(step(F.hardswish))
    assert m.saved_bytes == n * elt + (n + 7) // 8 + k * (4 + elt)
    assert me.saved_bytes == n * elt


def test_crowded_and_float64_keep_x_densely_and_exactly():
    for x0 in (torch.randn(999) * 0.05 - 1.5, torch.randn(99, dtype=torch.float64)):
        g = torch.randn_like(x0)
        m = measure(lambda x0=x0: hardswish(x0.clone().requires_grad_() * 1).sum())
        assert m.saved_bytes == x0.numel() * x0.element_size()
        torch.testing.assert_close(
            _run(hardswish, x0, g)[1], _run(F.hardswish, x0, g)[1], rtol=0, atol=0
        )


def test_peak_between_linears_below_eager():
    fc1, fc2 = torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 64)
    x = torch.randn(96, 64)

    def step(fn):
        return lambda: fc2(fn(fc1(x))).square().sum()

    m, me = measure(step(hardswish)), measure(step(F.hardswish))
    assert m.saved_bytes < me.saved_bytes - 96 * 1024 * 3
    assert m.peak_bytes < me.peak_bytes


def test_gradcheck_float64():
    x = (torch.randn(4, 9, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(hardswish, (x,))


def test_inplace_overwrite_is_seen_by_autograd():
    x = torch.randn(6, requires_grad=True)
    h = x * 1
    k = h * h  # saves h
    hardswish_(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        k.sum().backward()


def test_second_derivative_raises_and_transforms_and_jit():
    # y, bits and a table kept (more than DENSE_MAX elements): refused
    x = torch.randn(600, requires_grad=True)
    w = torch.randn(600, requires_grad=True)  # the incoming gradient depends on w
    (g,) = torch.autograd.grad((hardswish(x * 2) * w).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"slimgrad.ops.hardswish: a second derivative"):
        torch.autograd.grad(g.sum(), w)
    # x kept (a few elements): eager's second derivatives, bit for bit
    x5, w5 = x[:5].detach().requires_grad_(), w[:5].detach().requires_grad_()
    got = []
    for fn in (hardswish, F.hardswish):
        (g,) = torch.autograd.grad((fn(x5 * 2) * w5).sum(), x5, create_graph=True)
        got.append(torch.autograd.grad((g * g).sum(), (x5, w5)))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    f = torch.func.grad(lambda t: hardswish(t).sum())
    torch.testing.assert_close(f(x.detach()), torch.func.grad(lambda t: F.hardswish(t).sum())(x))
    with pytest.raises(RuntimeError, match=r"slimgrad.ops.hardswish: torch.jit.trace"):
        torch.jit.trace(lambda t: hardswish(t), torch.randn(3, requires_grad=True))


def test_module_and_convert():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Hardswish())
    slimgrad.convert_(model)
    assert isinstance(model[1], Hardswish)
    assert Hardswish.from_torch(torch.nn.Hardswish(inplace=True)).inplace
    with pytest.raises(TypeError, match=r"slimgrad.nn.Hardswish.from_torch"):
        Hardswish.from_torch(torch.nn.ReLU())

"""slimgrad.ops.hardsigmoid: eager's output and gradient bit for bit, keeping 1 bit/elt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import slimgrad
from slimgrad.memory import measure
from slimgrad.nn.hardsigmoid import Hardsigmoid
from slimgrad.ops.hardsigmoid import hardsigmoid, hardsigmoid_

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SPECIAL = [3.0, -3.0, 2.9999998, -2.9999998, 3.0000002, -3.0000002, 0.0, -0.0, 6.0]
NONFINITE = [float("nan"), float("inf"), -float("inf")]


def _inputs(dtype, shape=(5, 37)):
    x = torch.randn(shape, dtype=torch.float64) * 4
    x.view(-1)[: len(SPECIAL) + 3] = torch.tensor(SPECIAL + NONFINITE, dtype=torch.float64)
    return x.to(dtype)


def _run(fn, x0, g, inplace=False):
    x = x0.detach().clone().requires_grad_()
    h = x * 1  # a non-leaf, so the in-place form is allowed
    y = fn(h, inplace=True) if inplace else fn(h)
    y.backward(g)
    return y.detach(), x.grad


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (5, 37), (3, 1, 13)])
@pytest.mark.parametrize("inplace", [False, True])
def test_output_and_gradient_are_eagers_bit_for_bit(dtype, shape, inplace):
    x0 = _inputs(dtype, shape) if shape != (7,) else torch.tensor(SPECIAL[:7], dtype=dtype)
    g = torch.randn(x0.shape, dtype=dtype)
    y, gx = _run(hardsigmoid, x0, g, inplace)
    ye, ge = _run(F.hardsigmoid, x0, g, inplace)
    _same(y, ye)
    _same(gx, ge)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_precision_value(dtype):
    x0 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.randn(x0.shape).to(dtype)
    y, gx = _run(hardsigmoid, x0, g)
    ye, ge = _run(F.hardsigmoid, x0, g)
    _same(y, ye)
    _same(gx, ge)


def test_float32_neighbourhood_of_the_breakpoints():
    # float32 y == 1 already a few ulp below 3: the side bit, not y, decides there
    vals = []
    for c in (-3.0, 3.0):
        t = torch.tensor(c)
        vals.append(t)
        up = dn = t
        for _ in range(300):
            up, dn = torch.nextafter(up, torch.tensor(9.0)), torch.nextafter(dn, torch.tensor(-9.0))
            vals += [up, dn]
    x0 = torch.stack(vals)
    g = torch.randn(x0.shape)
    _same(_run(hardsigmoid, x0, g)[1], _run(F.hardsigmoid, x0, g)[1])


def test_gradcheck_float64():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True) * 2
    x = x.detach().requires_grad_()
    assert torch.autograd.gradcheck(hardsigmoid, (x,))


def test_memory_is_one_bit_per_element():
    x0 = torch.randn(15, 37)  # above the small-tensor cutoff (512 elements)

    def step(fn):
        return lambda: fn(x0.clone().requires_grad_() * 1).sum()

    m, me = measure(step(hardsigmoid)), measure(step(F.hardsigmoid))
    assert m.saved_bytes == (x0.numel() + 7) // 8
    assert me.saved_bytes == x0.numel() * 4


def test_peak_between_linears_below_eager():
    fc1, fc2 = torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 64)
    x = torch.randn(96, 64)

    def step(fn):
        return lambda: fc2(fn(fc1(x))).square().sum()

    m, me = measure(step(hardsigmoid)), measure(step(F.hardsigmoid))
    assert m.saved_bytes == me.saved_bytes - 96 * 1024 * 4 + 96 * 1024 // 8
    assert m.peak_bytes < me.peak_bytes


def test_inplace_overwrite_is_seen_by_autograd():
    x = torch.randn(6, requires_grad=True)
    h = x * 1
    kept = h.exp()  # autograd keeps exp's output... and h's version is watched through it
    k2 = h * h  # saves h
    hardsigmoid_(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (k2.sum() + kept.sum()).backward()


def test_second_derivative_raises_and_transforms_and_jit():
    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)  # the incoming gradient depends on w
    (g,) = torch.autograd.grad((hardsigmoid(x * 2) * w).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"slimgrad.ops.hardsigmoid: a second derivative"):
        torch.autograd.grad(g.sum(), w)
    f = torch.func.grad(lambda t: hardsigmoid(t).sum())
    torch.testing.assert_close(f(x.detach()), torch.func.grad(lambda t: F.hardsigmoid(t).sum())(x))
    with pytest.raises(RuntimeError, match=r"slimgrad.ops.hardsigmoid: torch.jit.trace"):
        torch.jit.trace(lambda t: hardsigmoid(t), torch.randn(3, requires_grad=True))


def test_module_and_convert():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Hardsigmoid())
    slim = slimgrad.convert_(torch.nn.Sequential(*[m for m in model]))
    assert isinstance(slim[1], Hardsigmoid)
    assert Hardsigmoid.from_torch(torch.nn.Hardsigmoid(inplace=True)).inplace
    with pytest.raises(TypeError, match=r"slimgrad.nn.Hardsigmoid.from_torch"):
        Hardsigmoid.from_torch(torch.nn.ReLU())


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_non_contiguous_layouts_peak_below_eager_same_bits(layout):
    # a channels_last (or transposed) x is packed, and dx computed, in memory order: no full-size
    # copy of x in forward or of dy in backward (before: channels_last 4x16x7x7 after a 1x1 conv
    # peaked at 50,576 B against eager's 50,184, tests/conformance/test_never_more_than_eager.py);
    # dx has eager's bits and layout
    import copy

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 1), torch.nn.Hardsigmoid())
    slim = copy.deepcopy(eager)
    slimgrad.convert_(slim)
    assert slimgrad.report(slim).converted, slimgrad.report(slim)  # not eager vs eager
    x0 = torch.randn(4, 16, 7, 7, generator=gen)
    w = torch.randn(4, 16, 7, 7, generator=gen)
    if layout == "channels_last":
        x0, w = (t.contiguous(memory_format=torch.channels_last) for t in (x0, w))
    else:
        x0, w = x0.transpose(2, 3), w.transpose(2, 3)

    def step(model):
        return lambda: (model(x0) * w).sum()

    step(slim)().backward()  # warm-up: the bits' unpacking table is built once
    m, me = measure(step(slim)), measure(step(eager))
    assert m.peak_bytes <= me.peak_bytes
    h = eager[0](x0).detach()
    y, gx = _run(hardsigmoid, h, w)
    ye, ge = _run(F.hardsigmoid, h, w)
    _same(y, ye)
    _same(gx, ge)
    assert gx.stride() == ge.stride()


@pytest.mark.parametrize("inplace", [False, True])
def test_an_incoming_gradient_laid_out_unlike_x_gets_eagers_dx_layout(inplace):
    # dx written over the stand-in (NOTE [Hardsigmoid's stand-in is dx's buffer]) only where the
    # stand-in has g's strides: eager's dx takes g's layout, and a reduction over it (here a scale
    # parameter's gradient) is bit-equal only in that layout
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 8, 7, 9, generator=gen) * 4  # > DENSE_MAX elements: the bits path
    g = torch.randn(9, 7, 8, 4, generator=gen).permute(3, 2, 1, 0)
    out = []
    for fn in (hardsigmoid, F.hardsigmoid):
        s = torch.ones((), requires_grad=True)
        h = x0 * s
        seen = {}
        h.register_hook(lambda d, seen=seen: seen.setdefault("dx", d))
        (fn(h, inplace=True) if inplace else fn(h)).backward(g)
        out.append((s.grad, seen["dx"]))
    (gs, dx), (gs_e, dx_e) = out
    _same(dx, dx_e)
    assert dx.stride() == dx_e.stride()
    _same(gs, gs_e)

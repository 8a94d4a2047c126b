"""slimgrad.ops.linear_scale: ``F.linear(x, W, b) * gamma`` that keeps nothing for gamma."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.linear_scale import linear_scale
from slimgrad.testing import assert_within_rule


def _eager(x, w, b, gamma):
    return F.linear(x, w, b).mul(gamma)


def _inputs(shape, out_f, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    in_f = shape[-1]
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(out_f, in_f, generator=g, dtype=torch.float64) / in_f**0.5
    b = torch.randn(out_f, generator=g, dtype=torch.float64) if bias else None
    gamma = torch.rand(out_f, generator=g, dtype=torch.float64) * 2 - 1  # signs and small values
    dy = torch.randn(*shape[:-1], out_f, generator=g, dtype=torch.float64)
    return [x, w, b, gamma], dy


def _run(fn, ins, dy, dtype, wrt=(0, 1, 2, 3)):
    ts = [None if t is None else t.to(dtype).requires_grad_(i in wrt) for i, t in enumerate(ins)]
    y = fn(*ts)
    want = [ts[i] for i in wrt if ts[i] is not None]
    return [y, *torch.autograd.grad(y, want, dy.to(dtype))]


SHAPES = [((7, 13), 11), ((2, 5, 3, 13), 17), ((1, 3, 2, 384), 96), ((129, 48), 192)]


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_float64(bias):
    ins, _ = _inputs((3, 4, 5), 3, bias)
    ins = [t.requires_grad_() if t is not None else None for t in ins]
    assert torch.autograd.gradcheck(linear_scale, ins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, out_f", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_eager_by_the_rule(dtype, shape, out_f, bias):
    ins, dy = _inputs(shape, out_f, bias)
    ref = _run(_eager, ins, dy, torch.float64)
    eager = _run(_eager, ins, dy, dtype)
    got = _run(linear_scale, ins, dy, dtype)
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)  # forward: eager's ops
    torch.testing.assert_close(got[1], eager[1], rtol=0, atol=0)  # dx: eager's
    assert_within_rule(got, ref, eager, names=["y", "dx", "dW", "db", "dgamma"][: len(got)])


@pytest.mark.parametrize("wrt", [(0,), (1,), (2,), (3,), (0, 3), (1, 2)])
def test_needs_input_grad_subsets(wrt):
    ins, dy = _inputs((6, 9), 5, True)
    ref = _run(_eager, ins, dy, torch.float64, wrt)
    eager = _run(_eager, ins, dy, torch.float32, wrt)
    got = _run(linear_scale, ins, dy, torch.float32, wrt)
    assert len(got) == len(eager)
    assert_within_rule(got, ref, eager)


def test_memory_contract_keeps_no_linear_output():
    # the input comes from a ReLU that keeps it anyway: linear_scale adds nothing; eager's mul
    # keeps the Linear's output (rows x out floats) for gamma's gradient
    rows, in_f, out_f = 64, 32, 24
    x0 = torch.randn(rows, in_f, requires_grad=True)
    w = torch.randn(out_f, in_f, requires_grad=True)
    b = torch.randn(out_f, requires_grad=True)
    gamma = torch.randn(out_f, requires_grad=True)

    def step(fn):
        return lambda: fn(torch.relu(x0), w, b, gamma).sum()

    m = measure(step(linear_scale))
    for t in (x0, w, b, gamma):
        t.grad = None  # each step allocates its own gradients
    me = measure(step(_eager))
    assert m.saved_bytes == rows * in_f * 4  # the ReLU output, shared
    assert me.saved_bytes == m.saved_bytes + rows * out_f * 4
    assert m.peak_bytes <= me.peak_bytes


def test_no_grad_autocast_and_bad_gamma():
    ins, _ = _inputs((4, 6), 5, True)
    x, w, b, gamma = (t.float() for t in ins)
    with torch.no_grad():
        torch.testing.assert_close(linear_scale(x, w, b, gamma), _eager(x, w, b, gamma))
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = linear_scale(x, w, b, gamma), _eager(x, w, b, gamma)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="slimgrad.ops.linear_scale: gamma must scale"):
        linear_scale(x, w, b, gamma[:3])


def test_second_order_is_a_clear_error():
    ins, _ = _inputs((4, 6), 5, True)
    ts = [t.float().requires_grad_() for t in ins]
    (dx,) = torch.autograd.grad(linear_scale(*ts).sum(), ts[0], create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad"):
        dx.sum().backward()

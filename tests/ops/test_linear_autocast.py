"""Autocast without kept weight casts (NOTE [Autocast weight casts] in ``ops/linear.py``).

Against eager autocast: outputs and every gradient bit for bit (bf16 and fp16), with a weight used
twice in one region, a non-leaf weight, a frozen weight, no bias, HF GPT-2's Conv1D form, nested
and ``enabled=False`` regions, ``cache_enabled=False``; second derivatives; the bytes kept.
"""

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.linear import conv1d_addmm, linear
from slimgrad.testing import assert_within_rule

DTYPES = [torch.bfloat16, torch.float16]


def _addmm(x, w, b):  # HF GPT-2 Conv1D's forward
    y = (
        torch.addmm(b, x.reshape(-1, x.shape[-1]), w)
        if b is not None
        else x.reshape(-1, x.shape[-1]) @ w
    )
    return y.view(*x.shape[:-1], w.shape[-1])


EAGER = {linear: F.linear, conv1d_addmm: _addmm}


def _leaves(seed, d=12, w_in_out=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, d, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)
    b = torch.nn.Parameter(torch.randn(d, generator=g))
    return x, w, b


def _grads(out, leaves):
    ts = [t for t in leaves if t.requires_grad]
    gs = torch.autograd.grad(out.float().pow(2).sum(), ts, allow_unused=True)
    return [out.detach(), *gs]


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert (u is None) == (v is None)
        if u is not None:
            assert u.dtype == v.dtype
            torch.testing.assert_close(u, v, rtol=0, atol=0)


CASES = {
    "once": lambda f, x, w, b: f(x, w, b),
    "weight_twice": lambda f, x, w, b: f(f(x, w, b).float().tanh(), w, b),
    "no_bias": lambda f, x, w, b: f(x, w, None),
    "non_leaf_weight": lambda f, x, w, b: f(x, w * 0.5, b),
    "frozen_weight": lambda f, x, w, b: f(x, w.detach(), b),
    "input_twice": lambda f, x, w, b: f(x, w, b) + f(x, w.t(), b),
    "shared_bias": lambda f, x, w, b: f(torch.sigmoid(f(x, w, b)), w * 1, b),
}


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("op", [linear, conv1d_addmm])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_identical_to_eager_autocast(dtype, op, case, cache):
    res = []
    for f in (op, EAGER[op]):
        x, w, b = _leaves(0)
        with torch.autocast("cpu", dtype, cache_enabled=cache):
            out = CASES[case](f, x, w, b)
        res.append(_grads(out, (x, w, b)))
    _same(*res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nested_and_disabled_regions(dtype):
    def chain(f, x, w, b):
        with torch.autocast("cpu", dtype):
            h = f(x, w, b)
            with torch.autocast("cpu", enabled=False):
                h = f(h.float(), w, b)  # float32: W is used as is
                with torch.autocast("cpu", dtype):
                    h = f(h, w, b)  # nested region: autocast's cache still holds W's cast
            h = f(h, w, b)  # the outer region again: the same cached cast of W
        with torch.autocast("cpu", dtype):
            h = f(h, w, b)  # a new region: a new cast
        return h

    res = []
    for f in (linear, F.linear):
        x, w, b = _leaves(1)
        res.append(_grads(chain(f, x, w, b), (x, w, b)))
    _same(*res)


def _second(f, x, w, b, dtype):
    with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
        y = f(x, w, b)
    gx, gw = torch.autograd.grad(y.float().pow(2).sum(), (x, w), create_graph=True)
    return list(torch.autograd.grad(gx.pow(2).sum() + gw.pow(2).sum(), (x, w, b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("op", [linear, conv1d_addmm])
def test_double_backward_eager_second_derivatives(op, dtype):
    # x and W are kept: the first derivatives are differentiable torch ops (eager's math; the
    # order of a few sums differs from eager's MmBackward, so judged by the rule)
    out = _second(op, *_leaves(2), dtype)
    eager = _second(EAGER[op], *_leaves(2), dtype)
    ref = _second(EAGER[op], *(t.detach().double().requires_grad_() for t in _leaves(2)), None)
    assert_within_rule(out, ref, eager, names=["ddx", "ddw", "ddb"])


def test_bytes_kept():
    n, d_in, d_out = 37, 24, 40
    x0 = torch.randn(n, d_in, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(d_out, d_in))
    b = torch.nn.Parameter(torch.randn(d_out))

    def step(f, wt):
        def fwd():
            with torch.autocast("cpu", torch.bfloat16):
                return f(x0 * 1, wt(), b).float().sum()

        return measure(fwd)

    # leaf weight: slimgrad keeps x's cast only (2 B/elt); eager also keeps W's cast (2 B/param)
    assert step(linear, lambda: w).saved_bytes == 2 * n * d_in
    assert step(F.linear, lambda: w).saved_bytes == 2 * n * d_in + 2 * d_out * d_in
    # a weight that is not a leaf: eager's behaviour (its cast is kept)
    assert step(linear, lambda: w * 1).saved_bytes == 2 * n * d_in + 2 * d_out * d_in
    m = step(linear, lambda: w)
    assert m.saved_param_bytes == 4 * d_out * d_in  # the float32 Parameter itself, no new bytes


def test_weight_changed_before_backward_raises():
    x, w, b = _leaves(4)
    with torch.autocast("cpu", torch.bfloat16):
        y = linear(x, w, b)
    with torch.no_grad():
        w.mul_(2)  # eager would silently use the old cast; the kept W would give other bits
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()

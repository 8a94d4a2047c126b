"""Autocast without kept weight casts (NOTE [Autocast weight casts] in ``ops/linear.py``).

Against eager autocast: outputs and every gradient bit for bit (bf16 and fp16), with a weight used
twice in one region, a non-leaf weight, a frozen weight, no bias, HF GPT-2's Conv1D form, nested
and ``enabled=False`` regions, ``cache_enabled=False``; second derivatives; the bytes kept.
"""

import sys

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


def test_no_weight_cast_resident_at_the_end_of_forward():
    # k bias-free Linears under autocast, x0 * 1 in float32 (n x d). Eager: autocast's cache holds
    # every weight's bf16 cast (2 d^2 B each) until the region exits, and each mm keeps its own.
    # slimgrad: one cast alive at a time, freed after its matmul, and a cast token per weight that
    # holds no bytes (NOTE [A cast token holds no bytes]); the x casts (2 n d each) are kept as in
    # eager.
    n, d, k = 37, 24, 3

    def step(f):
        torch.manual_seed(0)
        ws = [torch.nn.Parameter(torch.randn(d, d) / d**0.5) for _ in range(k)]
        x0 = torch.randn(n, d, requires_grad=True)

        def fwd():
            with torch.autocast("cpu", torch.bfloat16):
                h = x0 * 1
                for w in ws:
                    h = f(h, w)
                return h.float().sum()

        return measure(fwd)

    ours, eager = step(linear), step(F.linear)
    # the forward peak (the end of forward) without the k casts
    assert eager.forward_peak_bytes - ours.forward_peak_bytes == k * 2 * d * d
    assert eager.saved_bytes == k * 2 * n * d + k * 2 * d * d
    assert ours.saved_bytes == k * 2 * n * d


def test_cast_tokens_live_for_the_region_only():
    lin = sys.modules["slimgrad.ops.linear"]
    x, w, b = _leaves(5)
    with torch.autocast("cpu", torch.bfloat16):
        y = linear(x, w, b)
        tokens = lin._REGIONS.by_device["cpu"][1]
        assert len(tokens) == 1  # one token for w in this region, reused by a second use
        y = linear(y.float(), w, b)
        assert len(tokens) == 1
    assert tokens == {} and "cpu" not in lin._REGIONS.by_device  # dropped at the region's exit
    torch.clear_autocast_cache()
    with torch.autocast("cpu", torch.bfloat16):
        linear(x, w, b)
        first = dict(lin._REGIONS.by_device["cpu"][1])
        torch.clear_autocast_cache()  # eager: a new cast on the next use; slimgrad: a new token
        assert "cpu" not in lin._REGIONS.by_device
        linear(x, w, b)
        again = lin._REGIONS.by_device["cpu"][1]
        assert next(iter(again.values()))[1] is not next(iter(first.values()))[1]

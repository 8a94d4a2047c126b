"""Checks shared by the smooth activations (gelu, silu, mish): dense grids, fallback, memory."""

from __future__ import annotations

import torch

from slimgrad.memory import measure
from slimgrad.ops._output_act import _window, inverse
from tests.ops._output_act_helpers import (
    all_float32_between,
    all_values,
    assert_grid_within_rule,
    grid_errors,
)


def check_hard_window_every_float32(spec, fwd, bwd_exact):
    """Every float32 within x* +- (window + 0.3): the hard window and the ill-conditioned stretch
    beyond it, where y (eager's own float32 output, a few ulp off near x*) pins x least."""
    xs = inverse(spec).x_star
    margin = _window(spec, torch.float32)[0] + 0.3
    x = all_float32_between(xs - margin, xs + margin)
    assert x.numel() > 2_000_000
    ours, eager = grid_errors(spec, fwd, bwd_exact, x)
    assert_grid_within_rule(ours, eager, 1e-6)
    return ours, eager


def check_full_range(spec, fwd, bwd_exact, lo=-40.0, hi=40.0, stride=1009):
    x = all_float32_between(lo, hi, stride)
    ours, eager = grid_errors(spec, fwd, bwd_exact, x)
    assert_grid_within_rule(ours, eager, 1e-6)
    return ours, eager


def check_every_16bit(spec, fwd, bwd_exact, dtype):
    x = all_values(dtype)
    ours, eager = grid_errors(spec, fwd, bwd_exact, x)
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    # grid_errors compares with float64 f'; eager rounds to the dtype, so the rule holds per element
    # too
    assert_grid_within_rule(ours, eager, atol)


def check_random_inputs(slim, eager, scales=(0.3, 1.0, 3.0, 10.0), n=100_000):
    from slimgrad.testing import assert_within_rule

    for s in scales:
        x0 = torch.randn(n) * s
        g = torch.randn(n)
        res = []
        for fn, dt in ((slim, torch.float32), (eager, torch.float32), (eager, torch.float64)):
            x = x0.to(dt).requires_grad_()
            (gx,) = torch.autograd.grad(fn(x), x, g.to(dt))
            res.append(gx)
        assert_within_rule(res[0], res[2], res[1])


def check_adversarial_fallback(slim, eager, spec):
    """All inputs at the minimum: more than 1/16 hard -> keep x densely (eager's bytes), exact
    grads."""
    xs = inverse(spec).x_star
    x0 = torch.full((64, 33), xs) + torch.linspace(-0.01, 0.01, 64 * 33).view(64, 33)
    for inplace in (False, True):
        slim(x0.clone().requires_grad_() * 1, inplace).sum().backward()
        m = measure(lambda ip=inplace: slim(x0.clone().requires_grad_() * 1, ip).sum())
        me = measure(lambda: eager(x0.clone().requires_grad_() * 1).sum())
        assert m.saved_bytes == me.saved_bytes == x0.numel() * 4
    g = torch.randn_like(x0)
    res = []
    for fn in (lambda t: slim(t, False), eager):
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(x), x, g)
        res.append(gx)
    torch.testing.assert_close(res[0], res[1], rtol=0, atol=0)


def check_output_vs_eager(spec, fwd):
    """The output is eager's, bit for bit, everywhere (the forward runs eager's own kernel; near x*
    the inverse's accuracy comes from the hard window, never from a different y): every float32
    within x* +- 0.5, every 7th, and the tail threshold's neighbourhood."""
    from slimgrad.ops._output_act import smooth_fwd

    xs = inverse(spec).x_star
    x = all_float32_between(xs - 0.5, xs + 0.5, 7)
    t = spec.tail.get(torch.float32)
    if t is not None:
        x = torch.cat([x, all_float32_between(t - 0.05, t + 0.05, 7)])
    y = smooth_fwd(spec, x, fwd, fallback=False)[0]
    assert torch.equal(y, fwd(x))


def check_straight_c_path(straight, general, x_star):
    """NOTE [The straight C path of the smooth activations]: ``straight(x)`` (the functional past
    the gate, float32 CPU) keeps the y, saved tensors and gradient bits of ``general(x)`` (the
    Function's general path, through its custom ops), with the incoming gradient granted to the
    backward and not, on random inputs with non-finite and hard elements, 70,001 elements (two
    C blocks) and the dense fallback."""
    from slimgrad import ownership

    torch.manual_seed(0)
    # N(1, 1): some hard elements, far fewer than 1/16 whatever the decided window (AVX2 erf-GELU:
    # 0.104, which puts N(0, 1) at the dense fallback; NOTE [A window from eager's own forward
    # error])
    x = torch.randn(3, 37, 41) + 1.0
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), x_star, -30.0, 0.0])
    big = torch.randn(70_001) + 1.0
    crowded = x_star + torch.randn(4, 300) * 1e-3  # every element hard: x kept densely
    for name, x0, fast in (
        ("randn", x, True),
        ("two blocks", big, True),
        ("fallback", crowded, False),
    ):
        for reuse in (True, False):
            res = []
            for fn in (straight, general):
                xi = x0.clone().requires_grad_()
                # a non-leaf input, as in a model: on a leaf that requires grad both paths keep
                # x (NOTE [An input the graph holds] in slimgrad/ops/_output_act.py)
                y = fn(xi * 1)
                node = y.grad_fn
                assert (node.cpath is not None) == (fast and fn is straight), (name, fn)
                saved = [t.clone() if t is not None else None for t in node.saved_tensors]
                w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
                ownership.reset_reuse_count()
                if reuse:
                    (y * w).sum().backward()  # MulBackward's dy is dead: granted
                else:
                    y.backward(w)  # w is held here: refused
                assert ownership.reuse_count("grad") == (1 if reuse else 0), (name, fn)
                res.append([y.detach(), *saved, xi.grad])
            for a, b in zip(*res, strict=True):
                if a is None or b is None:
                    assert a is None and b is None, name
                else:
                    assert a.dtype == b.dtype and a.stride() == b.stride(), name
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

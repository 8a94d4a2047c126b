"""slimgrad.ops.drop_path: timm's draw, outputs and gradients bit for bit, the mask as bits."""

from __future__ import annotations

import pytest
import torch

from slimgrad.memory import measure
from slimgrad.ops.drop_path import drop_path
from tests.conformance._timm_shim import timm


def _eager_drop_path(x, drop_prob=0.0, training=False, scale_by_keep=True):
    # timm.layers.drop.drop_path (timm 1.0), the reference when timm is not installed
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


REFS = [_eager_drop_path] + ([timm.layers.drop_path] if timm is not None else [])


def _run(fn, x0, g, seed, *args):
    x = x0.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = fn(x * 1, *args)
    after = torch.rand(3)  # the RNG state after the draw
    y.backward(g)
    return y.detach(), x.grad, after


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(13, 5, 3, 3), (9, 7)])
@pytest.mark.parametrize("prob, scale", [(0.3, True), (0.3, False), (0.77, True), (1.0, True)])
def test_draw_output_and_gradient_are_eagers_bit_for_bit(ref, dtype, shape, prob, scale):
    x0 = torch.randn(shape, dtype=dtype)
    g = torch.randn(shape, dtype=dtype)
    for seed in range(2):
        y, gx, after = _run(drop_path, x0, g, seed, prob, True, scale)
        ye, ge, after_e = _run(ref, x0, g, seed, prob, True, scale)
        _same(y, ye)
        _same(gx, ge)
        _same(after, after_e)


def test_channels_last_and_autocast():
    x0 = torch.randn(11, 4, 5, 3).to(memory_format=torch.channels_last)
    g = torch.randn(11, 4, 5, 3)
    _same(_run(drop_path, x0, g, 0, 0.4, True)[1], _run(_eager_drop_path, x0, g, 0, 0.4, True)[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin = torch.nn.Linear(3, 3)
        a = _run(lambda t, *a: drop_path(lin(t), *a), x0, g, 1, 0.4, True)
        b = _run(lambda t, *a: _eager_drop_path(lin(t), *a), x0, g, 1, 0.4, True)
    _same(a[1], b[1])


def test_eval_and_zero_prob_are_identity():
    x = torch.randn(4, 3, requires_grad=True)
    assert drop_path(x, 0.5, training=False) is x
    assert drop_path(x, 0.0, training=True) is x
    with torch.no_grad():
        torch.manual_seed(0)
        y = drop_path(x, 0.5, training=True)
        torch.manual_seed(0)
        _same(y, _eager_drop_path(x, 0.5, True))


def test_memory_is_one_bit_per_sample():
    n = 21
    x = torch.randn(n, 6, 5, 5, requires_grad=True)

    def step(fn):
        return lambda: fn(x * 1, 0.3, True).sum()

    ms = measure(step(drop_path))
    me = measure(step(_eager_drop_path))
    assert ms.saved_bytes == (n + 7) // 8
    assert me.saved_bytes == n * 4


def test_gradcheck_float64():
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)

    def fn(t):
        torch.manual_seed(0)
        return drop_path(t, 0.5, True)

    assert torch.autograd.gradcheck(fn, (x,))

import math

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops._output_act import DENSE_MAX
from slimgrad.ops.elu import TAIL, elu
from slimgrad.testing import DEFAULT_ATOL
from tests.ops._output_act_helpers import Case, OutputActTests, dense_tail


class TestElu(OutputActTests):
    CASES = [
        Case("alpha0.7", lambda x, ip: elu(x, 0.7, ip), lambda x: F.elu(x, 0.7), tail=TAIL),
        Case("default", lambda x, ip: elu(x, inplace=ip), F.elu, tail=TAIL),
        Case(
            "alpha-0.7_bits",
            lambda x, ip: elu(x, -0.7, ip),
            lambda x: F.elu(x, -0.7),
            bits=True,
            tail=TAIL,
        ),
    ]
    COMPILE_CASES = [CASES[0], CASES[2]]


# NOTE [ELU's tail]: the gradient over the whole input range, every dtype, against float64
_U = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float64: 2**-53}


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        x = torch.cat([torch.linspace(-750.0, 0.0, 30001, dtype=dtype), torch.tensor([-1e300])])
    elif dtype == torch.float32:  # every 32771st float32 (all magnitudes, both signs)
        i = torch.arange(-(2**31), 2**31 - 1, 32771, dtype=torch.int64).to(torch.int32)
        x = i.view(torch.float32)
    else:  # every float16 / bfloat16
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    # positive filler keeps the tail table below the dense threshold: the table path is tested
    return torch.cat([x, torch.ones(3 * x.numel(), dtype=dtype)])


def _grad(fn, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(x * 1), x, torch.ones_like(x))
    return g.double()


@pytest.mark.parametrize("dtype", list(_U))
@pytest.mark.parametrize("alpha,inplace", [(0.8, False), (-0.7, False), (2.5, True)])
def test_gradient_over_the_whole_range(dtype, alpha, inplace):
    x = _every_value(dtype)
    assert not dense_tail(TestElu.CASES[0], x)
    ref = _grad(lambda t: F.elu(t, alpha), x.double())
    ours = _grad(lambda t: elu(t, alpha, inplace), x)
    eager = _grad(lambda t: F.elu(t, alpha), x)
    e_ours, e_eager = (ours - ref).abs(), (eager - ref).abs()
    # pointwise: within 9 units of the dtype's rounding of the true gradient of eager's error
    # (measured: at most 8.9 u |ref|, at x just above the tail); before NOTE [ELU's tail], the
    # output's cancellation gave 0 or the wrong sign (bfloat16 alpha 0.8 x = -7: -7.8e-4 vs 7.3e-4)
    excess = e_ours - 2 * e_eager - 9 * _U[dtype] * ref.abs()
    assert float(excess.max()) <= 0, float(x[excess.argmax()])
    # the error rule on every window of width 0.5 (a tensor of inputs of one size)
    w = torch.floor(x.double().clamp(-100, 100) * 2).long() + 200
    mo = torch.zeros(401, dtype=torch.float64).scatter_reduce(0, w, e_ours, "amax")
    me = torch.zeros(401, dtype=torch.float64).scatter_reduce(0, w, e_eager, "amax")
    assert bool((mo <= 2 * me + DEFAULT_ATOL[dtype]).all())


def test_tail_examples_of_the_issue():
    # issue 15: bfloat16 alpha 0.8 x = -7, float16 x = -8.5, float32 x = -20
    for dtype, x0 in ((torch.bfloat16, -7.0), (torch.float16, -8.5), (torch.float32, -20.0)):
        x = torch.tensor([x0, 1.0, 2.0, 3.0, 0.5, 0.25], dtype=dtype)
        got = _grad(lambda t: elu(t, 0.8), x)[0]
        want = 0.8 * math.exp(x0)
        assert got > 0 and abs(got - want) <= 2 * _U[dtype] * want


def test_dense_when_the_table_would_be_as_big_as_x():
    n = 2 * DENSE_MAX  # above NOTE [Few elements]'s size, where the table path runs
    x0 = torch.full((n,), -5.0)
    x0[: n // 8] = 1.0
    m = measure(lambda: elu(x0.clone().requires_grad_() * 1, 0.8).sum())
    assert m.saved_bytes == x0.numel() * 4  # x, as eager: no y, no table
    x1 = x0.clone()
    x1[: n * 5 // 8] = 1.0  # 3/8 of the elements in the tail: y + 8 B each
    m = measure(lambda: elu(x1.clone().requires_grad_() * 1, 0.8).sum())
    assert m.saved_bytes == n * 4 + (n * 3 // 8) * 8
    for x in (x0, x1):
        torch.testing.assert_close(
            _grad(lambda t: elu(t, 0.8), x), _grad(lambda t: F.elu(t, 0.8), x.double())
        )

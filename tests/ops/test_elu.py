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

    @pytest.mark.parametrize("inplace", [False, True])
    def test_memory_contract(self, case, inplace):
        if not inplace or case.bits:
            super().test_memory_contract(case, inplace)
            return
        # NOTE [ELU in place]: alpha > 0 in place keeps y alone, as eager's elu_
        x0 = (torch.randn(23, 41, dtype=torch.float64) * case.scale).float()
        assert int((x0 < TAIL).sum()) > 0  # the out-of-place op would keep a tail table here
        case.slim(x0.clone().requires_grad_() * 1, True).sum().backward()
        m = measure(lambda: case.slim(x0.clone().requires_grad_() * 1, True).sum())
        assert m.saved_bytes == x0.numel() * 4


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
@pytest.mark.parametrize("alpha,inplace", [(0.8, False), (-0.7, False), (-2.5, True)])
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


@pytest.mark.parametrize("dtype", list(_U))
@pytest.mark.parametrize("alpha", [0.8, 1.0, 2.5])
def test_inplace_is_eagers_inplace_over_the_whole_range(dtype, alpha):
    # NOTE [ELU in place]: eager's elu_ gradient (from y) bit for bit, its tail included
    x = _every_value(dtype)
    ours = _grad(lambda t: elu(t, alpha, True), x)
    eager = _grad(lambda t: F.elu(t, alpha, inplace=True), x)
    torch.testing.assert_close(ours, eager, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (1, 1, 1, 1), (3, 8, 5, 7), (23, 41)])
@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_inplace_keeps_and_peaks_as_eagers_inplace(shape, alpha):
    # issue 30, class 7: in place, a few elements kept a copy of x (2x3x1x1: saved 48 B against
    # eager's 24 B) and more kept the tail table (3x8x5x7: peak 8 B above eager's)
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    x0.view(-1)[0] = -3.0  # one element in NOTE [ELU's tail]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7))

    def step(fn):
        return lambda: (fn(x0.clone().requires_grad_() * 1) * w).sum()

    ours, eager = (lambda t: elu(t, alpha, True)), (lambda t: F.elu(t, alpha, inplace=True))
    step(ours)().backward()
    ms, me = measure(step(ours), timeline=False), measure(step(eager), timeline=False)
    assert ms.saved_bytes == me.saved_bytes == x0.numel() * 4  # y alone
    assert ms.peak_bytes <= me.peak_bytes
    grads = []
    for fn in (ours, eager):
        x = x0.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(x * 1), x, w)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


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

"""Shared machinery: bit packing, the f' tables, and random chains of all activations vs eager."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from slimgrad.ops._bits import pack_bits, packed_numel, unpack_bits, unpack_bits_as
from slimgrad.ops._output_act import inverse
from slimgrad.ops.elu import elu
from slimgrad.ops.gelu import SPECS, gelu
from slimgrad.ops.hardtanh import hardtanh, relu6
from slimgrad.ops.leaky_relu import leaky_relu
from slimgrad.ops.mish import SPEC as MISH
from slimgrad.ops.mish import mish
from slimgrad.ops.relu import relu
from slimgrad.ops.sigmoid import sigmoid
from slimgrad.ops.silu import SPEC as SILU
from slimgrad.ops.silu import silu
from slimgrad.ops.tanh import tanh
from slimgrad.testing import assert_within_rule


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (8,), (9,), (3, 5, 17), (64,)])
def test_bits_round_trip(shape):
    m = torch.rand(shape) > 0.5
    p = pack_bits(m)
    assert p.dtype == torch.uint8 and p.numel() == packed_numel(m.numel())
    assert torch.equal(unpack_bits(p, m.numel()).view(shape), m)
    assert torch.equal(unpack_bits_as(p, m.numel(), torch.float32).view(shape), m.float())


def test_bits_layout_and_strides():
    m = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert pack_bits(m).tolist() == [0b10000001, 1]
    base = torch.rand(6, 10) > 0.3
    view = base.t()[::2]  # non-contiguous: packed in logical order
    assert torch.equal(unpack_bits(pack_bits(view), view.numel()).view(view.shape), view)


@pytest.mark.parametrize(
    ("spec", "x_star", "y_min"),
    [
        (SILU, -1.2784645428, -0.2784645428),
        (SPECS["none"], -0.7517915247, -0.1699712075),
        (SPECS["tanh"], -0.7524614221, -0.1700407506),
        (MISH, None, None),
    ],
)
def test_minimum_and_table(spec, x_star, y_min):
    inv = inverse(spec)
    if x_star is not None:  # float64 values from research/selective_inplace.md section 8
        assert abs(inv.x_star - x_star) < 1e-9 and abs(inv.y_min - y_min) < 1e-9
    assert abs(float(spec.df(torch.tensor(inv.x_star, dtype=torch.float64)))) < 1e-12
    # the table reproduces f' on both branches, down to the tail threshold (GELU: kept below it)
    x = torch.linspace(-12.0, 30.0, 400_001, dtype=torch.float64)
    x = x[x >= -3.0] if spec in (SPECS["none"], SPECS["tanh"]) else x
    got = inv.df(spec.f(x), pack_bits(x >= inv.x_star))
    assert float((got - spec.df(x)).abs().max()) < 5e-8


OPS = {
    "relu": (relu, F.relu),
    "sigmoid": (sigmoid, lambda x: torch.sigmoid(x)),
    "tanh": (tanh, lambda x: torch.tanh(x)),
    "hardtanh": (lambda x, ip: hardtanh(x, -0.8, 1.5, ip), lambda x: F.hardtanh(x, -0.8, 1.5)),
    "relu6": (relu6, F.relu6),
    "leaky": (lambda x, ip: leaky_relu(x, 0.1, ip), lambda x: F.leaky_relu(x, 0.1)),
    "leaky_neg": (lambda x, ip: leaky_relu(x, -0.2, ip), lambda x: F.leaky_relu(x, -0.2)),
    "elu": (lambda x, ip: elu(x, 0.9, ip), lambda x: F.elu(x, 0.9)),
    "gelu": (lambda x, ip: gelu(x, inplace=ip), F.gelu),
    "gelu_tanh": (lambda x, ip: gelu(x, "tanh", ip), lambda x: F.gelu(x, approximate="tanh")),
    "silu": (silu, F.silu),
    "mish": (mish, F.mish),
}


@settings(max_examples=30, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=5),
    inplace=st.lists(st.booleans(), min_size=5, max_size=5),
    mix=st.lists(st.booleans(), min_size=5, max_size=5),
    rows=st.integers(1, 9),
    cols=st.sampled_from([1, 3, 7, 16]),
    scale=st.sampled_from([0.5, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_random_chains_match_eager(names, inplace, mix, rows, cols, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale
    ws = [torch.randn(cols, cols, generator=gen, dtype=torch.float64) / cols**0.5 for _ in names]
    g = torch.randn(rows, cols, generator=gen, dtype=torch.float64)

    def run(slim: bool, dtype):
        x = x0.to(dtype).requires_grad_()
        w = [t.to(dtype).requires_grad_() for t in ws]
        h = x
        for i, name in enumerate(names):
            if mix[i]:
                h = h @ w[i]
            if slim:
                # in-place only on a fresh tensor: the previous activation saved its output
                fresh = mix[i] or i == 0
                h = OPS[name][0](h * 1 if h is x else h, inplace[i] and fresh)
            else:
                h = OPS[name][1](h)
        used = [t for i, t in enumerate(w) if mix[i]]
        return torch.autograd.grad(h, [x, *used], g.to(dtype))

    ours = run(True, torch.float32)
    eager = run(False, torch.float32)
    ref = run(False, torch.float64)
    # The activations' own f' error is <= 1e-6 absolute (dense-grid tests); downstream products
    # scale it by the magnitude of the other factors (here up to ~10), so atol is taken relative to
    # the gradient's scale: 1e-6 * max(1, max|ref64|).
    for o, r, e in zip(ours, ref, eager):
        assert_within_rule(o, r, e, atol=1e-6 * max(1.0, float(r.abs().max())))


# Every output-based gradient over the whole input range, every dtype, against float64: the
# error rule on every window of width 0.5 (a tensor of inputs of one size: the tails, the
# saturation of sigmoid/tanh, the minimum of the smooth ones). ELU's tail has its own, pointwise
# test (tests/ops/test_elu.py).
_RANGE_OPS = {
    "silu": (silu, F.silu),
    "mish": (mish, F.mish),
    "gelu": (gelu, F.gelu),
    "gelu_tanh": (lambda t: gelu(t, "tanh"), lambda t: F.gelu(t, approximate="tanh")),
    "sigmoid": (sigmoid, torch.sigmoid),
    "tanh": (tanh, torch.tanh),
}


def _range_values(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        return torch.linspace(-60.0, 60.0, 12001, dtype=dtype)
    if dtype == torch.float32:  # every 131071st float32
        x = torch.arange(-(2**31), 2**31 - 1, 131071, dtype=torch.int64).to(torch.int32)
        x = x.view(torch.float32)
    else:
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x) & (x.double().abs() < 60)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("op", list(_RANGE_OPS))
def test_gradient_over_the_whole_range(op, dtype):
    from slimgrad.testing import DEFAULT_ATOL

    slim, eager = _RANGE_OPS[op]
    x = _range_values(dtype)

    def grad(fn, t):
        t = t.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(t * 1), t, torch.ones_like(t))
        return g.double()

    ref = grad(eager, x.double())
    e_ours, e_eager = (grad(slim, x) - ref).abs(), (grad(eager, x) - ref).abs()
    keep = ~torch.isnan(e_eager)  # bfloat16 tanh-GELU: eager's x^3 overflows to NaN
    w = (torch.floor(x.double() * 2).long() + 120)[keep]
    mo = torch.zeros(241, dtype=torch.float64).scatter_reduce(0, w, e_ours[keep], "amax")
    me = torch.zeros(241, dtype=torch.float64).scatter_reduce(0, w, e_eager[keep], "amax")
    bad = (mo > 2 * me + DEFAULT_ATOL[dtype]).nonzero().view(-1)
    assert bad.numel() == 0, [(int(i) - 120) / 2 for i in bad[:5]]


# torch.func and TorchScript (NOTE [torch.func transforms] in slimgrad/_autograd.py) -------------
_FUNC_OPS = {
    "relu": (relu, F.relu),
    "sigmoid": (sigmoid, torch.sigmoid),
    "tanh": (tanh, torch.tanh),
    "hardtanh": (lambda t: hardtanh(t, -0.5, 0.7), lambda t: F.hardtanh(t, -0.5, 0.7)),
    "relu6": (relu6, F.relu6),
    "leaky_relu": (lambda t: leaky_relu(t, 0.2), lambda t: F.leaky_relu(t, 0.2)),
    "leaky_relu_neg": (lambda t: leaky_relu(t, -0.3), lambda t: F.leaky_relu(t, -0.3)),
    "elu": (lambda t: elu(t, 0.8), lambda t: F.elu(t, 0.8)),
    "elu_neg": (lambda t: elu(t, -0.7), lambda t: F.elu(t, -0.7)),
    "gelu": (gelu, F.gelu),
    "gelu_tanh": (lambda t: gelu(t, "tanh"), lambda t: F.gelu(t, approximate="tanh")),
    "silu": (silu, F.silu),
    "mish": (mish, F.mish),
}


@pytest.mark.parametrize("op", list(_FUNC_OPS))
def test_torch_func_transforms_as_eager(op):
    slim, eager = _FUNC_OPS[op]
    torch.manual_seed(7)
    x = torch.randn(3, 5) * 3
    for transform in (
        lambda f: torch.func.grad(lambda t: f(t).square().sum()),
        torch.func.vmap,
        torch.func.jacrev,
        lambda f: torch.func.vmap(torch.func.grad(lambda t: f(t).sum())),
    ):
        torch.testing.assert_close(transform(slim)(x), transform(eager)(x))
    # a transform over a tensor that requires grad: autograd still works through it
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(torch.func.vmap(slim)(xr).square().sum(), xr)
    (ge,) = torch.autograd.grad(torch.func.vmap(eager)(xr).square().sum(), xr)
    torch.testing.assert_close(g, ge)


@pytest.mark.parametrize("op", list(_FUNC_OPS))
def test_jit_trace_refused(op):
    slim, _ = _FUNC_OPS[op]
    x = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"slimgrad\.ops\.\w+: torch\.jit\.trace cannot"):
        torch.jit.trace(slim, (x,))
    torch.jit.trace(slim, (x.detach(),))  # nothing recorded by autograd: eager's op, traceable

"""Triton kernels of the output-based activations against the PyTorch path (TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import pytest
import torch

from slimgrad.ops import _output_act as ref_act
from slimgrad.testing import assert_within_rule
from tests.kernels._kern_helpers import interpreted

pytest.importorskip("triton")
# numpy warns on the inf/NaN inputs inside the interpreter
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

MONO = {
    "relu": (),
    "leaky_relu": (0.1,),
    "elu": (0.7,),
    "sigmoid": (),
    "tanh": (),
    "hardtanh": (-0.5, 1.5),
}


@pytest.fixture(scope="module")
def K():
    with interpreted(*MONO, "gelu", "silu", "mish") as k:
        yield k


def _ref(stem):
    import importlib

    return importlib.import_module(f"slimgrad.ops.{stem}")


def _x(shape, dtype, layout):
    x = torch.randn(shape) * 3
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1.5, -0.5])
    if layout == "t":  # dense, not contiguous: the kernel runs over memory order
        x = x.t().contiguous().t()
    elif layout == "slice":  # not dense: PyTorch path
        x = x[:, ::2]
    return x.to(dtype)


@pytest.mark.parametrize("stem", list(MONO))
@pytest.mark.parametrize(
    "dtype,shape,layout",
    [
        (torch.float32, (7, 13), "c"),
        (torch.float32, (37, 29), "t"),
        (torch.bfloat16, (5, 211), "c"),
        (torch.float16, (6, 10), "slice"),
    ],
)
def test_mono_matches_torch(K, stem, dtype, shape, layout):
    kern, ref, args = getattr(K, stem), _ref(stem), MONO[stem]
    x = _x(shape, dtype, layout)
    y = kern._fwd_triton(x, *args)
    y_eager = ref._fwd_torch(x, *args)
    y64 = ref._fwd_torch(x.double(), *args)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == y_eager.stride()
    assert_within_rule(y, y64, y_eager)
    if stem in ("relu", "hardtanh"):
        torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    g = torch.randn(x.shape).to(dtype)
    dx = kern._bwd_triton(g, y_eager, *args)
    dx_eager = ref._bwd_torch(g, y_eager, *args)
    dx64 = ref._bwd_torch(g.double(), y_eager.double(), *args)
    assert_within_rule(dx, dx64, dx_eager)


@pytest.mark.parametrize("stem", list(MONO))
def test_mono_inplace_writes_input(K, stem):
    kern, ref, args = getattr(K, stem), _ref(stem), MONO[stem]
    x = _x((3, 17), torch.float32, "c")
    want = ref._fwd_torch(x, *args)
    out = kern._fwd_triton_(x, *args)
    assert out is x
    torch.testing.assert_close(x, want)


def test_mono_nan_and_inf_propagate_like_eager(K):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 2.0])
    for stem, args in MONO.items():
        ref = _ref(stem)
        torch.testing.assert_close(
            getattr(K, stem)._fwd_triton(x, *args), ref._fwd_torch(x, *args), equal_nan=True
        )


# ---------------------------------------------------------------------------------------------
# smooth activations: (y, bits, idx, xs) against ops._output_act.smooth_fwd

SMOOTH = [("silu", None), ("gelu", "none"), ("gelu", "tanh"), ("mish", None)]


def _smooth(K, stem, approx):
    ref = _ref(stem)
    kern = getattr(K, stem)
    if approx is None:
        spec = ref.SPEC
        return spec, ref, (lambda x: kern._fwd_triton(x)), (lambda *a: kern._bwd_triton(*a)), ()
    spec = ref.SPECS[approx]
    return (
        spec,
        ref,
        (lambda x: kern._fwd_triton(x, approx)),
        (lambda *a: kern._bwd_triton(*a, approx)),
        (approx,),
    )


def _same_side_table(idx, xs, ridx, rxs):
    # the same hard elements (the kernel lists them in ascending order, the PyTorch path per chunk
    # window hits first), with their exact x
    assert idx.dtype == ridx.dtype and xs.dtype == rxs.dtype
    o, ro = idx.argsort(), ridx.argsort()
    assert torch.equal(idx[o], ridx[ro])
    torch.testing.assert_close(xs[o], rxs[ro], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(idx, idx.sort().values)


def _hard_inputs(spec, dtype, n):
    # random N(0,1) plus the ill-conditioned places: around x*, the tail, 0, NaN/inf, subnormals
    x_star = ref_act.inverse(spec).x_star
    x = torch.randn(n, dtype=torch.float64)
    k = n // 4
    x[:k] = x_star + torch.linspace(-0.2, 0.2, k, dtype=torch.float64)
    x[k : k + 8] = torch.tensor([-2.6, -3.1, -6.0, -40.0, 0.0, -0.0, 1e-45, -1e-45])
    x[k + 8 : k + 11] = torch.tensor([math.nan, math.inf, -math.inf])
    return x.to(dtype)


@pytest.mark.parametrize("stem,approx", SMOOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_smooth_forward_side_info_bit_identical(K, monkeypatch, stem, approx, dtype):
    # small CHUNK: several chunks of packed bits, each padded, as in the PyTorch path
    monkeypatch.setattr(ref_act, "CHUNK", 1024)
    spec, ref, fwd, _, args = _smooth(K, stem, approx)
    x = _hard_inputs(spec, dtype, 2737).reshape(7, 391)  # 7 * 17 * 23
    y, bits, idx, xs = fwd(x)
    ry, rbits, ridx, rxs = ref_act.smooth_fwd(spec, x, lambda t: ref._fwd_torch(t, *args))
    assert bits.dtype == torch.uint8 and idx.dtype == ridx.dtype
    assert torch.equal(bits, rbits)
    _same_side_table(idx, xs, ridx, rxs)
    assert y.shape == ry.shape and y.dtype == ry.dtype
    y64 = spec.f(x.double())
    fin = torch.isfinite(y64)
    assert_within_rule(y[fin], y64[fin], ry[fin])


@pytest.mark.parametrize("stem,approx", SMOOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_smooth_backward_within_rule(K, monkeypatch, stem, approx, dtype):
    monkeypatch.setattr(ref_act, "CHUNK", 1024)
    spec, ref, fwd, bwd, args = _smooth(K, stem, approx)
    x = _hard_inputs(spec, dtype, 2053)
    x = x[torch.isfinite(x)]
    g = torch.randn(x.shape).to(dtype)
    saved = fwd(x)
    dx = bwd(g, *saved)
    dx_torch = ref._bwd_torch(g, *saved, *args)  # the PyTorch path reads the same side info
    x64 = x.double().requires_grad_()
    (dx64,) = torch.autograd.grad(spec.f(x64), x64, g.double())
    xe = x.detach().requires_grad_()
    (dx_eager,) = torch.autograd.grad(ref._fwd_torch(xe, *args), xe, g)
    assert_within_rule(dx, dx64, dx_eager)
    assert_within_rule(dx_torch, dx64, dx_eager)


def test_smooth_dense_fallback_like_torch(K):
    spec, ref, fwd, bwd, _ = _smooth(K, "silu", None)
    x = torch.full((3, 50), ref_act.inverse(spec).x_star, dtype=torch.float32)
    y, bits, idx, xs = fwd(x)
    assert bits.numel() == 0 and idx.numel() == 0 and torch.equal(xs, x.reshape(-1))
    g = torch.randn_like(x)
    torch.testing.assert_close(bwd(g, y, bits, idx, xs), ref._bwd_exact(g, x))


def test_smooth_noncontiguous_and_empty(K):
    spec, ref, fwd, bwd, _ = _smooth(K, "silu", None)
    # side information in x's memory order, y in empty_like(x)'s layout (NOTE [Eager's output on
    # a strided input] in slimgrad/_math/layout.py), as the ops' PyTorch path
    for x in (torch.randn(9, 31).t(), torch.randn(9, 62)[:, ::2]):
        y, bits, idx, xs = fwd(x)
        ry, rbits, ridx, rxs = ref_act.in_memory_order(
            x, ref._fwd_torch, lambda xm, f: ref_act.smooth_fwd(spec, xm, f)
        )
        assert torch.equal(bits, rbits)
        _same_side_table(idx, xs, ridx, rxs)
        assert y.shape == ry.shape and y.stride() == ry.stride() == torch.empty_like(x).stride()
    e = torch.empty(0, 4)
    assert fwd(e)[0].shape == e.shape


def test_smooth_real_chunk_size(K):
    # the real CHUNK: the PyTorch path packs per chunk, the kernel in one go; same bytes
    spec, ref, fwd, bwd, _ = _smooth(K, "silu", None)
    n = ref_act.CHUNK + 1001
    x = torch.randn(n)
    y, bits, idx, xs = fwd(x)
    r = ref_act.smooth_fwd(spec, x, ref._fwd_torch)
    assert torch.equal(bits, r[1])
    _same_side_table(idx, xs, r[2], r[3])
    g = torch.randn(n)
    torch.testing.assert_close(bwd(g, y, bits, idx, xs), ref._bwd_torch(g, *r))


def test_mono_inplace_bumps_the_version(K):
    x = torch.randn(30)
    v = x._version
    K.relu._fwd_triton_(x)
    assert x._version > v


@pytest.mark.parametrize("stem", ["tanh", "elu", "sigmoid", "silu", "gelu"])
def test_small_inputs_keep_their_relative_accuracy(K, stem):
    # near 0, tanh and elu must not lose digits to 1 - e^{-2x} / e^x - 1 cancellation
    mag = torch.logspace(-7, 0, 301, dtype=torch.float64)
    x = torch.cat([mag, -mag]).float()
    ref = _ref(stem)
    args = MONO.get(stem, ())
    if stem in ("silu", "gelu"):
        y = getattr(K, stem)._fwd_triton(x)[0]
    else:
        y = getattr(K, stem)._fwd_triton(x, *args)
    y64 = ref._fwd_torch(x.double(), *args)
    torch.testing.assert_close(y.double(), y64, rtol=5e-7, atol=0)


@pytest.mark.parametrize("stem", list(MONO))
def test_mono_backward_into_the_gradient_buffer(K, stem):
    # out=g (slimgrad.ownership granted g's buffer): bit-identical to out of place, version bumped
    kern, ref, args = getattr(K, stem), _ref(stem), MONO[stem]
    y = ref._fwd_torch(_x((7, 13), torch.float32, "c"), *args)
    g = torch.randn(7, 13)
    want = kern._bwd_triton(g, y, *args)
    buf = g.clone()
    v = buf._version
    got = kern._bwd_triton(buf, y, *args, out=buf)
    assert got.data_ptr() == buf.data_ptr() and buf._version > v
    torch.testing.assert_close(got, want, rtol=0, atol=0)

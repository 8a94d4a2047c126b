"""Exact-mode stream kernels (kernels/cpu/reversible.c) against the PyTorch path of
slimgrad/ops/reversible.py: the same integers, the same images, the same overflow verdicts, on
whole streams and on strided halves (NOTE [Exact-mode integer stream], NOTE [CPU C kernels])."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

from slimgrad.kernels import _backend as B
from slimgrad.kernels import _cpu
from slimgrad.nn.reversible import AdditiveCoupling, ReversibleSequential
from slimgrad.ops import reversible as R
from tests.nn._reversible_helpers import additive_blocks

needs_cc = pytest.mark.skipif(_cpu.compiler() is None, reason="no C compiler")
SCALE = 2.0**20


def _plan():  # what _image reads; a fresh one per call (it keeps the backend choice)
    return types.SimpleNamespace(
        inv_scale=1 / SCALE, compute_dtype=torch.float32, stream_fns=R._UNSET
    )


@pytest.fixture
def fns(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    with B.set_backend("cpu"):
        got = R._stream_lib(torch.zeros(2, dtype=torch.int32))
    assert got is not None
    return got


def _halves(dtype, split_dim, shape=(3, 6, 5, 7), big=False):
    g = torch.Generator().manual_seed(0)
    u = torch.randint(-(2**30), 2**30, shape, generator=g, dtype=torch.int64)
    if big:
        u = u * 2**20 + 12345  # past int32 and past float32's 24-bit mantissa
    return R.split_halves(u.to(dtype), split_dim)


def _units_input(shape):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(shape, generator=g)
    flat = h.view(-1)
    flat[:6] = torch.tensor([0.5, 1.5, -2.5, 2.5, -0.5, 3.5]) / SCALE  # ties: half to even
    flat[6:9] = torch.tensor([-0.0, 1e-30, 300.0])
    return h


@needs_cc
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("split_dim", [1, -1, 0])
def test_kernels_equal_the_pytorch_path(fns, dtype, split_dim):
    for a in _halves(dtype, split_dim, big=dtype == torch.int64):
        assert R._runs(a) is not None
        h = _units_input(a.shape)
        # image: float32(u) * 2^-b
        with B.set_backend("torch"):
            want = R._image(_plan(), a)
        got = R._image(_plan(), a)
        assert torch.equal(got, want) and got.is_contiguous()
        # max |units|
        assert fns["absmax"](h.data_ptr(), h.numel(), SCALE, 1) == float(
            R._absmax(R._grid_units(h, SCALE))
        )
        # add in place (through the strided half), then sub back, out of place and in place
        q = R._grid_units(h, SCALE).to(dtype)
        u_t, u_c = a.clone(), a
        base = a.clone()
        if dtype == torch.int32:  # keep int32 sums in range
            u_t.copy_(u_t // 4)
            u_c.copy_(u_c // 4)
            base.copy_(u_c)
        u_t.add_(q)
        R._add_units(u_c, h, SCALE, dtype, fns, None)
        assert torch.equal(u_c, u_t)
        out = R._sub_units(u_c, h, SCALE, dtype, False, fns)
        assert out is not u_c and torch.equal(out, base) and torch.equal(u_c, u_t)
        back = R._sub_units(u_c, h, SCALE, dtype, True, fns)
        assert back is u_c and torch.equal(u_c, base)


@needs_cc
@pytest.mark.parametrize("threads", [1, 3])
def test_absmax_special_values_and_threads(fns, threads):
    h = torch.randn(70_001)
    m = float(R._absmax(R._grid_units(h, SCALE)))
    assert fns["absmax"](h.data_ptr(), h.numel(), SCALE, threads) == m
    for bad, want in ((float("inf"), float("inf")), (float("-inf"), float("inf"))):
        hb = h.clone()
        hb[40_000] = bad
        assert fns["absmax"](hb.data_ptr(), hb.numel(), SCALE, threads) == want
    hb = h.clone()
    hb[65_537] = float("nan")
    got = fns["absmax"](hb.data_ptr(), hb.numel(), SCALE, threads)
    assert got != got  # NaN, as the PyTorch path's aminmax gives


def test_runs_layouts():
    t = torch.zeros(4, 6, 5)
    assert R._runs(t) == (1, 120, 120)
    assert R._runs(t.narrow(1, 3, 3)) == (4, 15, 30)
    assert R._runs(t.narrow(2, 0, 2)) == (24, 2, 5)
    assert R._runs(t.narrow(0, 1, 2)) == (1, 60, 60)
    assert R._runs(t[:1].narrow(1, 0, 3)) == (1, 15, 15)
    assert R._runs(t.transpose(0, 1)) is None
    assert R._runs(t[:, ::2]) == (12, 5, 10)  # every other row: still equally spaced runs
    assert R._runs(t.narrow(1, 0, 3).narrow(2, 0, 2)) is None  # two spacings


@needs_cc
@pytest.mark.parametrize("split_dim", [1, -1])
def test_chain_same_bits_on_both_backends_including_int64_promotion(monkeypatch, split_dim):
    # a chain whose stream outgrows int32 (it warns and continues in int64): outputs, gradients and
    # the rebuilt inputs equal bit for bit with and without the C kernels
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    if split_dim == 1:
        blocks = additive_blocks(24, 4, seed=5, scale=2.0)
        x = torch.randn(2, 4, 6, 6)
    else:  # halves along the last dim: strided runs of 3
        torch.manual_seed(5)

        def fn():
            return nn.Sequential(nn.Linear(3, 3), nn.ReLU())

        blocks = [AdditiveCoupling(fn(), fn(), split_dim=-1) for _ in range(24)]
        with torch.no_grad():
            for p in (p for b in blocks for p in b.parameters()):
                p.mul_(2.0)
        x = torch.randn(2, 5, 6)
    r = torch.randn(x.shape)
    got = {}
    for backend in ("torch", "cpu"):
        rev = ReversibleSequential(*copy.deepcopy(blocks), exact=True)
        xl = x.clone().requires_grad_()
        with B.set_backend(backend), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = rev(xl)
            (y * r).sum().backward()
        assert any("continuing in int64" in str(m.message) for m in w)
        assert rev.last_reconstruction.max_abs == 0.0
        got[backend] = [y.detach(), xl.grad, *[p.grad for p in rev.parameters()]]
    for a, b in zip(got["torch"], got["cpu"], strict=True):
        assert torch.equal(a, b)

"""Triton LayerNorm / RMSNorm from the output against the PyTorch paths (TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from slimgrad.testing import assert_within_rule
from tests.kernels._kern_helpers import interpreted

# the submodules (slimgrad.ops re-exports functions under the same names)
ln_ref = importlib.import_module("slimgrad.ops.layer_norm")
rms_ref = importlib.import_module("slimgrad.ops.rms_norm")

pytest.importorskip("triton")
# gamma = 0 fallback columns divide by 0 before being replaced (numpy warns in the interpreter)
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(scope="module")
def K():
    with interpreted("layer_norm", "rms_norm") as k:
        yield k


def _params(shape, dtype, affine, fallback):
    if affine == "none":
        return None, None
    w = (torch.rand(shape) + 0.5) * torch.where(torch.rand(shape) < 0.3, -1.0, 1.0)
    b = torch.randn(shape) * 0.3
    if fallback:
        w.view(-1)[1] = 0.0  # gamma = 0 and a |beta| >> |gamma| channel: kept from the input
        w.view(-1)[-1] = 1e-3
    w, b = w.to(dtype), b.to(dtype)
    return w, (None if affine == "w" else b)


def _ln64(x, ns, w, b, eps):
    return torch.nn.functional.layer_norm(
        x, ns, None if w is None else w.double(), None if b is None else b.double(), eps
    )


CASES = [
    # (batch shape, normalized shape, dtype, affine, fallback)
    ((5, 3), (17,), torch.float32, "wb", False),
    ((7,), (4, 5), torch.float32, "wb", True),
    ((3,), (131,), torch.bfloat16, "wb", True),
    ((2, 2), (33,), torch.float16, "w", False),
    ((6,), (7,), torch.float32, "none", False),
]


@pytest.mark.parametrize("batch,ns,dtype,affine,fallback", CASES)
def test_layer_norm_fwd_bwd_within_rule(K, batch, ns, dtype, affine, fallback):
    x = (torch.randn(*batch, *ns) * 2 + 1).to(dtype)
    w, b = _params(ns, dtype, affine, fallback)
    eps = 1e-5
    y, mean, rstd, idx, xside = K.layer_norm._fwd_triton(x, list(ns), w, b, eps)
    ry, rmean, rrstd, ridx, rxside = ln_ref._fwd_torch(x, list(ns), w, b, eps)
    assert torch.equal(idx, ridx) and torch.equal(xside, rxside)
    assert (fallback and affine != "none") == (idx.numel() > 0)
    assert mean.shape == rmean.shape and rstd.shape == rrstd.shape
    assert mean.dtype == rstd.dtype == torch.float32
    y64 = _ln64(x.double(), ns, w, b, eps)
    assert_within_rule(y, y64, ry)
    x64 = x.double()
    dims = tuple(range(-len(ns), 0))
    rstd64 = (x64.var(dim=dims, unbiased=False, keepdim=True) + eps).rsqrt()
    assert_within_rule(rstd, rstd64, rrstd.float())
    # backward from the PyTorch path's saved tensors; all subsets of the gradients
    dy = torch.randn(x.shape).to(dtype)
    xg = x64.clone().requires_grad_()
    params64 = [t.double().requires_grad_() if t is not None else None for t in (w, b)]
    out64 = torch.nn.functional.layer_norm(xg, ns, *params64, eps)
    wanted = [xg] + [t for t in params64 if t is not None]
    g64 = torch.autograd.grad(out64, wanted, dy.double())
    xe = x.clone().requires_grad_()
    pe = [t.clone().requires_grad_() if t is not None else None for t in (w, b)]
    oute = torch.nn.functional.layer_norm(xe, ns, *pe, eps)
    ge = torch.autograd.grad(oute, [xe] + [t for t in pe if t is not None], dy)
    for mask in [
        (True, True, True),
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]:
        got = K.layer_norm._bwd_triton(dy, ry, rmean, rrstd, ridx, rxside, w, b, list(ns), mask)
        ref = ln_ref._bwd_torch(dy, ry, rmean, rrstd, ridx, rxside, w, b, list(ns), mask)
        for j, (o, r) in enumerate(zip(got, ref)):
            assert (o is None) == (r is None), (mask, j)
            if o is None:
                continue
            assert o.dtype == r.dtype and o.shape == r.shape
            k = [0, 1, 2][j] if w is not None else 0
            assert_within_rule(o, g64[k], ge[k])


@pytest.mark.parametrize("batch,ns,dtype,affine,fallback", CASES)
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_fwd_bwd_within_rule(K, batch, ns, dtype, affine, fallback, eps):
    x = (torch.randn(*batch, *ns) * 2).to(dtype)
    w, _ = _params(ns, dtype, affine, fallback)
    y, rstd, idx, xside = K.rms_norm._fwd_triton(x, list(ns), w, eps)
    ry, rrstd, ridx, rxside = rms_ref._fwd_torch(x, list(ns), w, eps)
    assert torch.equal(idx, ridx) and torch.equal(xside, rxside)
    assert y.dtype == ry.dtype and rstd.shape == rrstd.shape and rstd.dtype == rrstd.dtype
    w64 = w.double() if w is not None else None
    e = torch.finfo(dtype).eps if eps is None else eps
    y64 = torch.nn.functional.rms_norm(x.double(), ns, w64, e)
    assert_within_rule(y, y64, ry)
    dims = tuple(range(-len(ns), 0))
    rstd64 = (x.double().pow(2).mean(dims, keepdim=True) + e).rsqrt()
    assert_within_rule(rstd, rstd64, rrstd)
    dy = torch.randn(x.shape).to(dtype)
    xg = x.double().requires_grad_()
    wg = w64.clone().requires_grad_() if w is not None else None
    g64 = torch.autograd.grad(
        torch.nn.functional.rms_norm(xg, ns, wg, e), [t for t in (xg, wg) if t is not None],
        dy.double(),
    )  # fmt: skip
    xe = x.clone().requires_grad_()
    we = w.clone().requires_grad_() if w is not None else None
    ge = torch.autograd.grad(
        torch.nn.functional.rms_norm(xe, ns, we, e), [t for t in (xe, we) if t is not None], dy
    )
    for mask in [(True, True), (True, False), (False, True)]:
        got = K.rms_norm._bwd_triton(dy, ry, rrstd, ridx, rxside, w, list(ns), mask)
        ref = rms_ref._bwd_torch(dy, ry, rrstd, ridx, rxside, w, list(ns), mask)
        for j, (o, r) in enumerate(zip(got, ref)):
            assert (o is None) == (r is None), (mask, j)
            if o is not None:
                assert o.dtype == r.dtype and o.shape == r.shape
                assert_within_rule(o, g64[j], ge[j])


def test_long_rows_loop_in_forward_and_fall_back_in_backward(K, monkeypatch):
    kln = K.layer_norm
    monkeypatch.setattr(kln, "MAX_D", 64)
    monkeypatch.setattr(kln, "FWD_TILE", 32)  # forward loops over 4 tiles of 32
    x = torch.randn(3, 100)
    w, b = torch.rand(100) + 0.5, torch.randn(100) * 0.1
    y, mean, rstd, idx, xs = K.layer_norm._fwd_triton(x, [100], w, b, 1e-5)
    ry = ln_ref._fwd_torch(x, [100], w, b, 1e-5)[0]
    assert_within_rule(y, _ln64(x.double(), (100,), w, b, 1e-5), ry)
    dy = torch.randn_like(x)
    got = K.layer_norm._bwd_triton(dy, y, mean, rstd, idx, xs, w, b, [100], (True, True, True))
    ref = ln_ref._bwd_torch(dy, y, mean, rstd, idx, xs, w, b, [100], (True, True, True))
    for o, r in zip(got, ref):
        torch.testing.assert_close(o, r)
    assert math.isfinite(float(got[0].abs().max()))


@pytest.mark.parametrize("stem", ["layer_norm", "rms_norm"])
def test_backward_into_the_gradient_buffer(K, stem):
    # out=dy (slimgrad.ownership granted dy's buffer): same gradients as out of place
    x = torch.randn(6, 19)
    w, b = torch.rand(19) + 0.5, torch.randn(19) * 0.1
    dy = torch.randn(6, 19)
    if stem == "layer_norm":
        saved = ln_ref._fwd_torch(x, [19], w, b, 1e-5)
        args = (*saved, w, b, [19], (True, True, True))
    else:
        saved = rms_ref._fwd_torch(x, [19], w, 1e-5)
        args = (*saved, w, [19], (True, True))
    kern = getattr(K, stem)
    want = kern._bwd_triton(dy, *args)
    buf = dy.clone()
    v = buf._version
    got = kern._bwd_triton(buf, *args, out=buf)
    assert got[0].data_ptr() == buf.data_ptr() and buf._version > v
    for o, r in zip(got, want):
        torch.testing.assert_close(o, r, rtol=0, atol=0)

"""Triton softmax part of the fused linear + cross-entropy against the PyTorch path
(TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from slimgrad.testing import assert_within_rule
from tests.kernels._kern_helpers import interpreted

# the submodules (slimgrad.ops re-exports functions under the same names)
ref = importlib.import_module("slimgrad.ops.linear_cross_entropy")

pytest.importorskip("triton")
# masked lanes compute -inf - -inf (discarded by tl.where); numpy warns in the interpreter
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(scope="module")
def K():
    with interpreted("linear_cross_entropy") as k:
        yield k.linear_cross_entropy


def _case(n, h, v, dtype, bias):
    hid = torch.randn(n, h).to(dtype)
    w = (torch.randn(v, h) / h**0.5).to(dtype)
    b = (torch.randn(v) * 0.1).to(dtype) if bias else None
    t = torch.randint(0, v, (n,))
    t[1] = -100
    t[n // 2] = v - 1
    return hid, w, b, t


def _eager(hid, w, b, t, eps, s, need_grad=True):
    hid, w = hid.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    loss = F.cross_entropy(F.linear(hid, w, b), t, label_smoothing=eps, reduction="none")
    grads = torch.autograd.grad(loss, [x for x in (hid, w, b) if x is not None], s)
    return loss.detach(), grads


@pytest.mark.parametrize("block_v", [16, 4096])  # several V tiles per row, or one
@pytest.mark.parametrize(
    "n,h,v,dtype,bias,eps,chunk",
    [
        (7, 5, 37, torch.float32, True, 0.0, 3),
        (11, 8, 29, torch.float32, False, 0.1, 4),
        (6, 16, 41, torch.bfloat16, True, 0.05, 6),
    ],
)
def test_fwd_bwd_within_rule(K, monkeypatch, block_v, n, h, v, dtype, bias, eps, chunk):
    monkeypatch.setattr(K, "_BLOCK_V", block_v)
    hid, w, b, t = _case(n, h, v, dtype, bias)
    loss, lse = K._fwd_triton(hid, w, b, t, -100, eps, chunk)
    rloss, rlse = ref._fwd_torch(hid, w, b, t, -100, eps, chunk)
    assert loss.dtype == rloss.dtype and lse.dtype == rlse.dtype
    assert loss[1] == 0
    s = torch.rand(n) + 0.5
    valid = t != -100
    s_masked = torch.where(valid, s, 0.0)
    h64, w64 = hid.double(), w.double()
    b64 = b.double() if b is not None else None
    loss64, g64 = _eager(h64, w64, b64, t, eps, s.double())
    loss_e, ge = _eager(hid, w, b, t, eps, s.to(dtype))
    lse64 = torch.logsumexp(F.linear(h64, w64, b64), 1)
    assert_within_rule(loss, loss64, loss_e.float())
    assert_within_rule(lse, lse64, rlse)
    for need in [
        (True, True, True),
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]:
        got = K._bwd_triton(hid, w, b, t, lse, s_masked, -100, eps, chunk, need)
        want = ref._bwd_torch(hid, w, b, t, rlse, s_masked, -100, eps, chunk, need)
        for j, (o, r) in enumerate(zip(got, want)):
            if j == 2 and b is None:
                continue
            assert (o is None) == (r is None)
            if o is not None:
                assert o.dtype == r.dtype and o.shape == r.shape
                assert_within_rule(o, g64[j], ge[j])


def test_dh_out_may_alias_hidden(K):
    hid, w, b, t = _case(9, 4, 13, torch.float32, True)
    s = torch.ones(9)
    want = ref._bwd_torch(hid.clone(), w, b, t, ref._fwd_torch(hid, w, b, t, -100, 0.0, 4)[1],
                          s, -100, 0.0, 4, (True, False, False))[0]  # fmt: skip
    lse = K._fwd_triton(hid, w, b, t, -100, 0.0, 4)[1]
    h2 = hid.clone()
    dh = K._bwd_triton(h2, w, b, t, lse, s, -100, 0.0, 4, (True, False, False), dh_out=h2)[0]
    assert dh.data_ptr() == h2.data_ptr()
    torch.testing.assert_close(dh, want)


def test_extreme_logits_stay_finite(K):
    # logits of +-1e4 (exp overflows without the running max) and a -inf logit
    z = torch.tensor([[1e4, -1e4, 0.0, 3.0], [-float("inf"), 1.0, 2.0, 3.0]])
    t = torch.tensor([0, 3])
    loss, lse = K.ce_fwd_chunk(z, t, -100, 0.0)
    torch.testing.assert_close(lse, torch.logsumexp(z, 1))
    torch.testing.assert_close(loss, F.cross_entropy(z, t, reduction="none"))
    dz = K.ce_grad_chunk_(z.clone(), t, lse, torch.ones(2), -100, 0.0)
    zg = z.clone().requires_grad_()
    (want,) = torch.autograd.grad(F.cross_entropy(zg, t, reduction="sum"), zg)
    torch.testing.assert_close(dz, want)


@pytest.mark.parametrize(
    "dtype,eps,bias",
    [(torch.float32, 0.0, True), (torch.float32, 0.1, False), (torch.bfloat16, 0.05, True)],
)
def test_fwd_grad_one_kernel_within_rule(K, monkeypatch, dtype, eps, bias):
    if not hasattr(ref, "_fwd_grad_torch"):
        pytest.skip("no precompute path in ops.linear_cross_entropy")
    monkeypatch.setattr(K, "_BLOCK_V", 16)  # several V tiles per row, both passes
    n, h, v, chunk = 9, 6, 37, 4
    hid, w, b, t = _case(n, h, v, dtype, bias)
    s = torch.where(t != -100, torch.rand(n) + 0.5, 0.0)
    need = (True, True, bias)
    got = K._fwd_grad_triton(hid, w, b, t, s, -100, eps, chunk, need)
    want = ref._fwd_grad_torch(hid, w, b, t, s, -100, eps, chunk, need)
    h64, w64 = hid.double(), w.double()
    b64 = b.double() if b is not None else None
    loss64, g64 = _eager(h64, w64, b64, t, eps, s.double())
    loss_e, ge = _eager(hid, w, b, t, eps, s.to(dtype))
    assert_within_rule(got[0], loss64, loss_e.float())
    for j, (o, r) in enumerate(zip(got[1:], want[1:])):
        assert (o is None) == (r is None)
        if o is not None:
            assert o.dtype == r.dtype and o.shape == r.shape
            assert_within_rule(o, g64[j], ge[j])

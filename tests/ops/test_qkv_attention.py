"""slimgrad.ops.qkv_attention: timm's qkv Linear + SDPA keeping q and k, v recomputed."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from slimgrad.memory import measure
from slimgrad.ops.qkv_attention import _fwd_torch, flash_eligible, qkv_attention
from slimgrad.testing import assert_within_rule


def _inputs(b, n, h, d, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = h * d
    x = torch.randn(b, n, c, generator=g, dtype=torch.float64)
    w = torch.randn(3 * c, c, generator=g, dtype=torch.float64) / c**0.5
    bb = torch.randn(3 * c, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    return [x, w, bb], dy


def _run(fn, ins, dy, dtype, h, d, causal=False, wrt=(0, 1, 2)):
    ts = [None if t is None else t.to(dtype).requires_grad_(i in wrt) for i, t in enumerate(ins)]
    y = fn(*ts, h, d, causal)
    want = [ts[i] for i in wrt if ts[i] is not None]
    return [y, *torch.autograd.grad(y, want, dy.to(dtype))]


CASES = [(2, 7, 3, 4, True, False), (3, 13, 2, 8, False, True), (1, 17, 5, 6, True, True)]


def test_gradcheck_float64():
    (x, w, b), _ = _inputs(2, 5, 2, 3, True)
    assert flash_eligible(x, 2, 3)
    ins = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda *t: qkv_attention(*t, 2, 3), ins)


@pytest.mark.parametrize("b, n, h, d, bias, causal", CASES)
def test_float32_forward_bit_for_bit_eager(b, n, h, d, bias, causal):
    ins, dy = _inputs(b, n, h, d, bias)
    eager = _run(_fwd_torch, ins, dy, torch.float32, h, d, causal)
    got = _run(qkv_attention, ins, dy, torch.float32, h, d, causal)
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, n, h, d, bias, causal", CASES)
def test_matches_eager_by_the_rule(dtype, b, n, h, d, bias, causal):
    ins, dy = _inputs(b, n, h, d, bias)
    ref = _run(_fwd_torch, ins, dy, torch.float64, h, d, causal)
    eager = _run(_fwd_torch, ins, dy, dtype, h, d, causal)
    got = _run(qkv_attention, ins, dy, dtype, h, d, causal)
    assert_within_rule(got, ref, eager, names=["o", "dx", "dW", "db"][: len(got)])


@pytest.mark.parametrize("wrt", [(0,), (1,), (2,), (1, 2)])
def test_needs_input_grad_subsets(wrt):
    ins, dy = _inputs(2, 6, 2, 4, True)
    ref = _run(_fwd_torch, ins, dy, torch.float64, 2, 4, wrt=wrt)
    eager = _run(_fwd_torch, ins, dy, torch.float32, 2, 4, wrt=wrt)
    got = _run(qkv_attention, ins, dy, torch.float32, 2, 4, wrt=wrt)
    assert len(got) == len(eager)
    assert_within_rule(got, ref, eager)


def test_memory_contract_keeps_q_k_not_v():
    b, n, h, d = 2, 16, 2, 8
    c = h * d
    (x, w, bb), _ = _inputs(b, n, h, d, True)
    x, w, bb = x.float(), w.float().requires_grad_(), bb.float().requires_grad_()
    x0 = x.clone().requires_grad_()

    def step(fn):
        # x comes from a ReLU that keeps it anyway (as a norm's output does)
        return lambda: fn(torch.relu(x0), w, bb, h, d).square().sum()

    m = measure(step(qkv_attention))
    for t in (x0, w, bb):
        t.grad = None
    me = measure(step(_fwd_torch))
    rows, lse = b * n, b * h * n * 4
    out = rows * c * 4  # SDPA's output (kept by square too, shared)
    assert m.saved_bytes == rows * c * 4 + 2 * rows * c * 4 + out + lse  # x, q|k, out, lse
    assert me.saved_bytes == rows * c * 4 + 3 * rows * c * 4 + out + lse  # x, q|k|v, out, lse
    # its backward holds q and k until it returns (eager frees qkv's output before the projection's
    # GEMMs, but has assembled a (B*N, 3C) gradient twice by then): at most that above eager
    assert m.peak_bytes <= me.peak_bytes + 2 * rows * c * 4


def test_off_flash_it_runs_eager():
    ins, dy = _inputs(2, 5, 2, 4, True)
    with sdpa_kernel([SDPBackend.MATH]):
        x = ins[0].float()
        assert not flash_eligible(x, 2, 4)
        eager = _run(_fwd_torch, ins, dy, torch.float32, 2, 4)
        got = _run(qkv_attention, ins, dy, torch.float32, 2, 4)
    for e, s in zip(eager, got, strict=True):
        torch.testing.assert_close(s, e, rtol=0, atol=0)
    with pytest.raises(ValueError, match="slimgrad.ops.qkv_attention: weight must hold"):
        qkv_attention(x, ins[1].float()[:5], None, 2, 4)

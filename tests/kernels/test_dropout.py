"""Triton dropout (1-bit packed mask) against the PyTorch path, under TRITON_INTERPRET=1.

The kernel draws its own mask (NOTE [Triton dropout masks] in slimgrad/kernels/dropout.py), so the
forward is checked for consistency with its own bits and for the keep rate's statistics; the
backward, given the same bits, is bit-identical to the PyTorch path.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.kernels._kern_helpers import interpreted

# the submodules (slimgrad.ops re-exports functions under the same names)
ref = importlib.import_module("slimgrad.ops.dropout")

pytest.importorskip("triton")
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(scope="module")
def K():
    with interpreted("dropout") as k:
        yield k.dropout


def _mask(bits, shape):
    return ref.unpack_bits(bits, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape,p", [((7, 13), 0.1), ((1031,), 0.5), ((3, 5, 67), 0.9), ((5,), 0.3)]
)
def test_forward_consistent_with_its_bits(K, dtype, shape, p):
    x = torch.randn(shape).to(dtype)
    x.view(-1)[0] = math.inf
    out, bits = K._fwd_triton(x, p)
    assert bits.dtype == torch.uint8 and bits.shape == (math.ceil(x.numel() / 8),)
    m = _mask(bits, shape)
    # out is x * (m * scale), as native_dropout computes it: an inf dropped gives NaN, like eager
    scale = 1.0 / (1.0 - p)
    want = (x.float() * (m.float() * scale)).to(dtype)
    torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)
    # padding bits of the last byte are 0
    pad = bits.numel() * 8 - x.numel()
    if pad:
        assert int(bits[-1]) >> (8 - pad) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_backward_bit_identical_to_torch_path(K, dtype, fused):
    x = torch.randn(9, 37).to(dtype)
    _, bits = K._fwd_triton(x, 0.3)
    g = torch.randn(9, 37).to(dtype)
    g.view(-1)[:2] = torch.tensor([math.nan, math.inf])
    if fused:  # (the op's fused branch calls torch.native_dropout_backward: not in torch 2.13)
        want = torch.ops.aten.native_dropout_backward(g, _mask(bits, g.shape), 1 / 0.7)
    else:
        want = ref._bwd_torch(g.clone(), bits, 0.3, fused)
    got = K._bwd_triton(g, bits, 0.3, fused)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    # in-place form writes into g
    g2 = g.clone()
    assert K._bwd_triton(g2, bits, 0.3, fused, inplace=True).data_ptr() == g2.data_ptr()
    torch.testing.assert_close(g2, want, equal_nan=True, rtol=0, atol=0)


def test_backward_reads_torch_bits(K):
    # the bit layout is shared: torch-drawn bits work with the Triton backward and vice versa
    x = torch.randn(4, 11)
    out, bits = ref._fwd_torch(x, 0.25)
    g = torch.ones_like(x)
    dx = K._bwd_triton(g, bits, 0.25, False)
    torch.testing.assert_close(dx, ref._bwd_torch(g.clone(), bits, 0.25, False), rtol=0, atol=0)
    torch.testing.assert_close(out, x * dx)


def test_inplace_forward(K):
    x = torch.randn(6, 21)
    x0 = x.clone()
    bits = K._fwd_inplace_triton(x, 0.4)
    m = _mask(bits, x.shape)
    torch.testing.assert_close(x, x0 * (m.float() * (1 / 0.6)), rtol=0, atol=0)


def test_noncontiguous_input_is_the_ops_pytorch_path(K):
    # kernels are leaves (issue 15): the op checks supports() and takes its PyTorch path for a
    # non-contiguous (or float64) input; called directly, the kernel refuses clearly
    x = torch.randn(8, 13).t()
    assert not K.supports(x) and not K.supports(torch.randn(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="slimgrad.kernels.dropout: called on"):
        K._fwd_triton(x, 0.5)
    out, bits = ref._fwd_torch(x, 0.5)
    torch.testing.assert_close(out, x * (_mask(bits, x.shape).float() * 2.0), rtol=0, atol=0)


def test_mask_statistics_and_seeding(K):
    n, p = 1 << 14, 0.3
    x = torch.ones(n)
    torch.manual_seed(1)
    _, b1 = K._fwd_triton(x, p)
    _, b2 = K._fwd_triton(x, p)
    torch.manual_seed(1)
    _, b1_again = K._fwd_triton(x, p)
    assert torch.equal(b1, b1_again)  # follows torch.manual_seed
    assert not torch.equal(b1, b2)  # successive calls draw fresh masks
    m1, m2 = _mask(b1, (n,)).float(), _mask(b2, (n,)).float()
    # keep rate within 5 sigma of 1 - p; the two masks independent (agreement as for independent)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(m1.mean().item() - (1 - p)) < 5 * sigma
    agree = (m1 == m2).float().mean().item()
    want = (1 - p) ** 2 + p**2
    assert abs(agree - want) < 5 * math.sqrt(want * (1 - want) / n)
    # neighbouring elements uncorrelated (lag-1 and lag-8, i.e. across bytes)
    c = m1 - m1.mean()
    for lag in (1, 8):
        r = (c[:-lag] * c[lag:]).mean() / c.pow(2).mean()
        assert abs(r.item()) < 5 / math.sqrt(n)


def test_raw_inplace_writes_bump_the_version(K):
    x = torch.randn(40)
    v = x._version
    K._fwd_inplace_triton(x, 0.5)
    assert x._version > v
    g = torch.randn(40)
    v = g._version
    K._bwd_triton(g, K._fwd_triton(torch.randn(40), 0.5)[1], 0.5, False, inplace=True)
    assert g._version > v


def test_backward_when_the_scale_overflows_the_dtype(K):
    # p near 1: 1/(1-p) is inf in float16; dropped elements stay 0 (not 0 * inf = NaN), as in the
    # PyTorch path
    p = 0.99999
    x = torch.randn(5, 13).half()
    _, bits = K._fwd_triton(x, p)
    bits[:3] = torch.tensor([0b10110001, 0xFF, 0], dtype=torch.uint8)  # some kept elements
    g = torch.randn(5, 13).half()
    want = ref._bwd_torch(g.clone(), bits, p, False)
    got = K._bwd_triton(g, bits, p, False)
    assert torch.isinf(want).any() and not torch.isnan(want).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)

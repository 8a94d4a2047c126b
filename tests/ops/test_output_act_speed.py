"""Output-based smooth activations (GELU, SiLU, Mish): the sped-up forward/backward of
``slimgrad.ops._output_act`` must give bit-identical y, bits, side table and gradients to the
implementation before the speed-up, frozen below (correctness only: no timings here)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from slimgrad._errors import internal_error
from slimgrad._math import smooth
from slimgrad.ops import _output_act as oa
from slimgrad.ops._bits import pack_bits, packed_numel
from slimgrad.ops._output_act import (
    FALLBACK_DIV,
    SmoothSpec,
    _window,
    inverse,
    is_dense_fallback,
)

CHUNK = 1 << 16  # the frozen implementation's chunk

# -------------------------------------------------------------------------------------------------
# Frozen copy of the implementation before the speed-up (the reference; do not edit).


def ref_df(self, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """f'(x) from y (float32 or float64) and its packed branch bits (x >= x*)."""
    tab, byte_scale, byte_offset = self.tables_on(y.device, y.dtype)
    m = y.numel()
    b = bits.to(torch.int32)
    scale = torch.index_select(byte_scale, 0, b).view(-1)[:m]
    pos = torch.index_select(byte_offset, 0, b).view(-1)[:m]
    # s = sqrt(y - y_min), y_min split in two so that y - y_hi is exact; s <= s_r (f' = 1 past)
    y_hi = torch.tensor(self.y_min, dtype=y.dtype).item()
    s = (y - y_hi).sub_(self.y_min - y_hi).clamp_(0.0, self.s_r**2).sqrt_()
    # right: pos = s * sc_r in [0, n-1]; left: n + 1 + s * sc_l in [n+1, 2n]
    pos.addcmul_(s, scale)
    i = pos.to(torch.int32).clamp_(min=0)  # pos >= 0: truncation = floor; NaN (hard) -> 0
    w = pos.sub_(i)
    lo = torch.index_select(tab, 0, i)
    return lo.lerp_(torch.index_select(tab, 0, i.add_(1)), w)


def ref_smooth_fwd(spec: SmoothSpec, x: torch.Tensor, fwd: Callable, fallback: bool = True):
    """Output, branch bits and sparse side table of ``x`` (see NOTE [Gradient from the output]).

    Returns (y, bits, idx, xs): y = fwd(x) (eager's output); bits: [x >= x*] packed, ceil(n / 8)
    bytes; idx (int32, int64 above 2^31 elements) and xs (x's dtype): the hard elements. Dense
    fallback (more than n / FALLBACK_DIV hard, unless ``fallback=False``; float64 always): (y,
    empty uint8, empty idx, x flattened). Under fake tensors (``slimgrad.memory.estimate``) the
    side table, being data-dependent, is taken as empty: the estimate is y + 1 bit/elt, the
    measured figure is that + the few hard elements.
    """
    inv = inverse(spec)
    w, tail = _window(spec, x.dtype)
    flat = x.reshape(-1)
    n = flat.numel()
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    empty_idx = torch.empty(0, dtype=idx_dtype, device=x.device)
    empty_bits = torch.empty(0, dtype=torch.uint8, device=x.device)
    if x.dtype == torch.float64:  # the float32-grade tables would not meet float64's rule: keep x
        return fwd(x), empty_bits, empty_idx, flat.clone()
    if is_fake(x):  # slimgrad.memory.estimate: the side table is data-dependent; count none
        bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
        return fwd(flat).view(x.shape), bits, empty_idx, flat[:0].clone()
    flat = flat.contiguous()
    y = fwd(flat).view(x.shape)  # one vectorized pass
    bits, idx = [], []
    for a in range(0, n, CHUNK):
        c = flat[a : a + CHUNK]
        d = c.float() - inv.x_star
        bits.append(pack_bits(d >= 0))
        t = d.abs_()
        # candidates near x*, then work on that few percent only (full-chunk passes dominate)
        parts = [(t < w).nonzero().view(-1)]
        if tail is not None:
            parts.append((c < tail).nonzero().view(-1))
        if not bool(torch.isfinite(t.sum())):  # NaN/inf in the chunk (or a sum overflow): rare
            parts.append((~(t < math.inf)).nonzero().view(-1))
            parts = [torch.cat(parts).unique()]  # -inf is also below the tail
        hard = torch.cat(parts) if len(parts) > 1 else parts[0]
        idx.append(hard.add_(a).to(idx_dtype))
    idx = torch.cat(idx) if idx else empty_idx
    if fallback and idx.numel() * FALLBACK_DIV > n:
        return y, empty_bits, empty_idx, flat.clone()
    bits = torch.cat(bits) if bits else empty_bits
    return y, bits, idx, flat[idx.long()]


def ref_smooth_grad(
    spec: SmoothSpec,
    g: torch.Tensor,
    y: torch.Tensor | None,
    bits: torch.Tensor,
    idx: torch.Tensor,
    xs: torch.Tensor,
    bwd_exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """dL/dx from the output y, the branch bits and the side table (inverse of :func:`smooth_fwd`).

    ``bwd_exact(g, x)`` is the op's plain-PyTorch backward from x, for the side table and fallback.
    """
    n = g.numel()
    gf = g.reshape(-1)
    if is_dense_fallback(n, bits, idx, xs):
        return bwd_exact(gf, xs).reshape(g.shape)
    if y is None:
        raise internal_error(f"{spec.name}: no saved output outside the dense fallback")
    inv = inverse(spec)
    yf = y.reshape(-1)
    cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
    out = torch.empty(n, dtype=g.dtype, device=g.device)
    if bits.numel() != packed_numel(n):
        raise internal_error(f"{spec.name}: {bits.numel()} packed bytes for {n} elements")
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        df = ref_df(inv, yf[a:b].to(cdt), bits[a // 8 : (b + 7) // 8])
        if g.dtype == cdt:
            torch.mul(gf[a:b], df, out=out[a:b])
        else:
            out[a:b] = (gf[a:b].to(cdt) * df).to(g.dtype)
    if idx.numel():
        i = idx.long()
        out[i] = bwd_exact(gf[i], xs)
    return out.reshape(g.shape)


# -------------------------------------------------------------------------------------------------
# The checks.


def _cases():
    gelu, mish, silu = (
        importlib.import_module(f"slimgrad.ops.{m}") for m in ("gelu", "mish", "silu")
    )

    out = []
    for approx in ("none", "tanh"):
        out.append(
            (
                f"gelu_{approx}",
                gelu.SPECS[approx],
                lambda t, a=approx: gelu._fwd_torch(t, a),
                lambda g, x, a=approx: gelu._bwd_exact(g, x, a),
            )
        )
    out.append(("silu", silu.SPEC, silu._fwd_torch, silu._bwd_exact))
    out.append(("mish", mish.SPEC, mish._fwd_torch, mish._bwd_exact))
    return out


CASES = _cases()
IDS = [c[0] for c in CASES]


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point():
        ib = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(ib), b.contiguous().view(ib)
    assert torch.equal(a, b), f"{what} differs at {int((a != b).sum())} positions"


def _check(case, x: torch.Tensor, fallback: bool = True, seed: int = 0) -> None:
    _, spec, fwd, bwd = case
    got = oa.smooth_fwd(spec, x, fwd, fallback)
    ref = ref_smooth_fwd(spec, x, fwd, fallback)
    for name, a, b in zip(("y", "bits", "idx", "xs"), got, ref, strict=True):
        _same(a, b, name)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
    y, bits, idx, xs = ref
    y = None if is_dense_fallback(x.numel(), bits, idx, xs) else y
    _same(
        oa.smooth_grad(spec, g, y, bits, idx, xs, bwd),
        ref_smooth_grad(spec, g, y, bits, idx, xs, bwd),
        "grad",
    )


# sizes: tiny, not a multiple of 8, one frozen chunk +- 1, several big chunks with a ragged end
SIZES = [1, 7, 13 * 29, CHUNK - 1, CHUNK + 1, 5 * CHUNK + 3, 300_007]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_random_bit_identical(case, dtype):
    gen = torch.Generator().manual_seed(1)
    for i, n in enumerate(SIZES):
        if dtype != torch.float32 and n > CHUNK + 1:
            continue
        scale = (0.577, 1.0, 3.0)[i % 3]
        x = (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)
        _check(case, x, seed=i)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_float32_near_minimum_and_tail(case):
    spec = case[1]
    xs = inverse(spec).x_star
    x = oa_grid = torch.cat(
        [
            _every_f32(xs - 0.08, xs + 0.08, 3),
            _every_f32(-3.1, -2.4, 97),
            _every_f32(-40.0, 40.0, 4099),
        ]
    )
    # shuffled so that the hard elements spread over chunks, with and without the fallback
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))
    _check(case, oa_grid[perm], fallback=False)
    _check(case, oa_grid[perm], fallback=True)


def _every_f32(lo: float, hi: float, stride: int) -> torch.Tensor:
    ia = torch.tensor([lo], dtype=torch.float32).view(torch.int32).item()
    ib = torch.tensor([hi], dtype=torch.float32).view(torch.int32).item()
    return torch.arange(min(ia, ib), max(ia, ib) + 1, stride, dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nonfinite_and_huge_values(case):
    gen = torch.Generator().manual_seed(3)
    n = 5 * CHUNK + 11
    x = torch.randn(n, generator=gen)
    # one frozen chunk with NaN/+-inf, one whose sum of |x - x*| overflows float32, one with a
    # single huge value that does not overflow, and a hard/tail element next to each
    x[100], x[CHUNK + 5], x[CHUNK + 6] = math.nan, math.inf, -math.inf
    x[2 * CHUNK : 2 * CHUNK + 64] = 3e38
    x[2 * CHUNK + 64] = -3e38
    x[3 * CHUNK + 7] = 1e35
    x[101] = x[CHUNK + 7] = x[2 * CHUNK + 65] = inverse(case[1]).x_star
    x[102] = x[2 * CHUNK + 66] = -2.75
    _check(case, x)
    _check(case, x[: n - n % 11].view(-1, 11)[:, :5])  # non-contiguous input


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_crowded_fallback(case):
    xs = inverse(case[1]).x_star
    gen = torch.Generator().manual_seed(4)
    for frac in (0.0, 0.05, 1.0 / FALLBACK_DIV, 0.2, 1.0):
        n = 2 * CHUNK + 5
        x = torch.randn(n, generator=gen)
        k = int(frac * n)
        x[:k] = xs + 0.01 * torch.rand(k, generator=gen) - 0.005
        x = x[torch.randperm(n, generator=gen)]
        _check(case, x, fallback=True)
        _check(case, x, fallback=False)


def _pack_ref(m: torch.Tensor) -> torch.Tensor:
    # the plain definition: byte k = sum_i m[8k + i] 2^i
    flat = torch.cat([m.reshape(-1), m.new_zeros((-m.numel()) % 8)]).view(-1, 8).to(torch.int64)
    return (flat << torch.arange(8)).sum(1).to(torch.uint8)


def test_pack_matches_pack_bits():
    gen = torch.Generator().manual_seed(5)
    for n in (8, 64, 8 * 1001, CHUNK, CHUNK + 3, 13):
        m = torch.rand(n, generator=gen) < 0.5
        _same(pack_bits(m), _pack_ref(m), "packed bits")
    m = torch.ones(8 * 97, dtype=torch.bool)
    _same(pack_bits(m), _pack_ref(m), "packed bits")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_float32_at_the_thresholds(case):
    """Every float32 within 2^-14 of x*, x* +- window and the tail threshold."""
    spec = case[1]
    xs, eps = inverse(spec).x_star, 2.0**-14
    edges = [xs] + [xs + s * spec.window[torch.float32] for s in (-1, 1)]
    edges += [spec.tail[torch.float32]] if torch.float32 in spec.tail else []
    x = torch.cat([_every_f32(e - eps, e + eps, 1) for e in edges])
    _check(case, x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(6))])


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:], ids=IDS[:2] + IDS[3:])
def test_bigger_chunks_keep_the_order(case, monkeypatch):
    """A span > CHUNK (the sorted window/tail merge inside one span) gives the same results (CPU
    tensors take CPU_SPAN, CUDA ones BIG)."""
    monkeypatch.setattr(smooth, "CPU_SPAN", 4 * CHUNK)  # smooth_fwd lives in slimgrad._math.smooth
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9 * CHUNK + 5, generator=gen) * 1.7  # tail hits in most CHUNKs
    x[5 * CHUNK + 3] = math.nan
    x[6 * CHUNK : 6 * CHUNK + 64] = 3e38
    _check(case, x)

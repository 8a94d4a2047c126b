"""Triton kernels of the activations that compute their gradient from their output.

Two families, as in ``slimgrad.ops._output_act`` (NOTE [Gradient from the output] there); the
shared math and reference come from ``slimgrad._math.smooth`` (NOTE [Kernels are leaves]):

* monotone (relu, leaky_relu, elu, sigmoid, tanh, hardtanh): one generic elementwise kernel per
  direction, the activation chosen by a constexpr; forward y = f(x), backward dx = g * f'(y) with
  PyTorch's own ``*_backward(..., is_result=True)`` formulas, in float32 (opmath) for float32,
  float16 and bfloat16. float64 and layouts that are not dense take the PyTorch path.
* smooth with one minimum (silu, gelu erf/tanh, mish): one forward kernel computes y in float32
  (no float64 work per element), packs the branch bits [x >= x*] (8 elements per byte, whole
  bytes per program) and counts the hard elements per block; when there are any, a second
  kernel writes their flat indices and exact x, compacted by rank (block-local prefix sum plus
  the block's offset). No element-sized temporary. Backward is one kernel: unpack the bit, read
  f' from the same float64-built table as the PyTorch path (linear interpolation in
  s = sqrt(y - y_min)), multiply by g; the hard elements are then overwritten by eager's formula
  on their exact x, as in the PyTorch path.

Saved tensors (y, bits, idx, xs) follow the PyTorch path's layout: bits bit for bit, the same hard
elements (listed in ascending order; the PyTorch path lists each chunk's window hits before its tail
hits), the same dense fallback rule. y may differ from torch's float32 kernel by an ulp (different
libm); eager CPU's erf-GELU returns NaN at +inf where the kernel returns +inf (as CUDA eager
does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimgrad._errors import internal_error
from slimgrad._math import smooth as _ref
from slimgrad._math.bits import packed_numel
from slimgrad._math.layout import in_memory_order, memory_order
from slimgrad.kernels._common import BLOCK, add, cast_out, expm1, grid1, pack_tile, tanh, unpack

# ---------------------------------------------------------------------------------------------
# monotone activations

RELU, LEAKY_RELU, ELU, SIGMOID, TANH, HARDTANH = range(6)


@triton.jit
def _mono_fwd_kernel(x_ptr, y_ptr, n, a, b, ACT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        y = tl.where(x > 0, x, 0.0)
        y = tl.where(x != x, x, y)  # NaN propagates, as torch.relu
    elif ACT == 1:
        y = tl.where(x > 0, x, x * a)
    elif ACT == 2:
        # not tl.minimum(x, 0): its NaN result is unspecified (triton 3.9's interpreter gives 0)
        y = tl.where(x > 0, x, a * expm1(tl.where(x > 0, 0.0, x)))
    elif ACT == 3:
        y = 1.0 / (1.0 + tl.exp(-x))
    elif ACT == 4:
        y = tanh(x)
    else:
        y = tl.where(x < a, a, tl.where(x > b, b, x))
    tl.store(y_ptr + i, cast_out(y, y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _mono_bwd_kernel(g_ptr, y_ptr, dx_ptr, n, a, b, ACT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + i, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:  # threshold_backward(g, y, 0)
        dx = tl.where(y <= 0, 0.0, g)
    elif ACT == 1:  # leaky_relu_backward(g, y, slope, is_result=True)
        dx = tl.where(y > 0, g, g * a)
    elif ACT == 2:  # elu_backward(g, alpha, 1, 1, is_result=True, y)
        dx = tl.where(y <= 0, g * (y + a), g)
    elif ACT == 3:  # sigmoid_backward
        dx = g * (1.0 - y) * y
    elif ACT == 4:  # tanh_backward
        dx = g * (1.0 - y * y)
    else:  # hardtanh_backward(g, y, min, max)
        dx = tl.where((y <= a) | (y >= b), 0.0, g)
    tl.store(dx_ptr + i, cast_out(dx, dx_ptr.dtype.element_ty), mask=m)


def _dense(t: torch.Tensor) -> bool:
    # non-overlapping and dense in some dimension order: its memory is numel elements in a row
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1:
            if t.stride(d) != expected:
                return False
            expected *= t.shape[d]
    return True


_FLAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _flat_ok(*ts: torch.Tensor) -> bool:
    # elementwise over memory order: every tensor dense, same strides, float32/16/bf16
    t0 = ts[0]
    if len(ts) == 1:
        return t0.dtype in _FLAT_DTYPES and _dense(t0)
    return all(
        t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and t.dtype == t0.dtype
        and t.shape == t0.shape
        and t.stride() == t0.stride()
        and _dense(t)
        for t in ts
    )


def mono_fwd(x: torch.Tensor, act: int, a: float = 0.0, b: float = 0.0, out=None):
    """y = act(x) (``out``: write there, e.g. x itself for the in-place form), or None when the
    layout/dtype is not supported (the caller then takes the PyTorch path)."""
    if not _flat_ok(x) or (out is not None and not _flat_ok(x, out)):
        return None
    y = torch.empty_like(x) if out is None else out
    n = x.numel()
    if n:
        _mono_fwd_kernel[grid1(n)](x, y, n, float(a), float(b), ACT=act, BLOCK=BLOCK)
    if out is not None:
        torch.autograd.graph.increment_version(out)  # a raw write: autograd must see it
    return y


def mono_bwd(g: torch.Tensor, y: torch.Tensor, act: int, a: float = 0.0, b: float = 0.0, out=None):
    """dx from the output y and its gradient g (``out``: write there, e.g. into g's own buffer
    when ``slimgrad.ownership`` grants it; elementwise, so in place is safe), or None when
    unsupported (the caller then takes the PyTorch path)."""
    if not _flat_ok(y) or (out is not None and not _flat_ok(y, out)):
        return None
    if not _flat_ok(y, g):
        g = torch.empty_like(y).copy_(g) if g.dtype == y.dtype else None
        if g is None:
            return None
    dx = torch.empty_like(y) if out is None else out
    n = y.numel()
    if n:
        _mono_bwd_kernel[grid1(n)](g, y, dx, n, float(a), float(b), ACT=act, BLOCK=BLOCK)
    if out is not None:
        torch.autograd.graph.increment_version(out)  # a raw write: autograd must see it
    return dx


# ---------------------------------------------------------------------------------------------
# smooth activations with one minimum

SILU, GELU_ERF, GELU_TANH, MISH = range(4)


@triton.jit
def _smooth_f32(x, ACT: tl.constexpr):
    if ACT == 0:
        y = x / (1.0 + tl.exp(-x))
    elif ACT == 1:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * u))
    else:
        y = _mish(x)
    return y


@triton.jit
def _mish(x):
    # x tanh(softplus(x)) = x n / (n + 2), n = e^x (e^x + 2); softplus(x) = x above 20, as torch
    e = tl.exp(tl.minimum(x, 20.0))
    n = e * (e + 2.0)
    return tl.where(x > 20.0, x, x * n / (n + 2.0))


@triton.jit
def _hard(x, x_star, window, tail, TAIL: tl.constexpr):
    # elements kept exactly (_math.smooth.smooth_fwd): near x*, the tail, non-finite
    t = tl.abs(x - x_star)
    hard = (t < window) | ~(t < float("inf"))
    if TAIL:
        hard = hard | (x < tail)
    return hard


@triton.jit
def _smooth_fwd_kernel(
    x_ptr, y_ptr, bits_ptr, cnt_ptr, n, x_star, window, tail,
    ACT: tl.constexpr, TAIL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # y, the packed branch bits [x >= x*] (an (R, 8) tile per program: R whole bytes), and the
    # number of hard elements of the block
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    i = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=1.0).to(tl.float32)
    y = _smooth_f32(x, ACT)
    tl.store(y_ptr + i, cast_out(y, y_ptr.dtype.element_ty), mask=m)
    right = ((x >= x_star) & m).to(tl.int32)
    tl.store(bits_ptr + rows, pack_tile(right).to(tl.uint8), mask=rows * 8 < n)
    hard = (_hard(x, x_star, window, tail, TAIL) & m).to(tl.int32)
    tl.store(cnt_ptr + pid, tl.reduce(tl.reduce(hard, 1, add), 0, add))


@triton.jit
def _smooth_side_kernel(
    x_ptr, hoff_ptr, idx_ptr, xs_ptr, n, x_star, window, tail,
    TAIL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # the hard elements' flat index and exact x, compacted: slot hoff[pid] + rank in the block
    # (block-local prefix sum), so ascending
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    xr = tl.load(x_ptr + i, mask=m, other=1.0)
    hard = _hard(xr.to(tl.float32), x_star, window, tail, TAIL) & m
    h = hard.to(tl.int32)
    slot = tl.load(hoff_ptr + pid) + (tl.associative_scan(h, 0, add) - h).to(tl.int64)
    tl.store(idx_ptr + slot, i.to(idx_ptr.dtype.element_ty), mask=hard)
    tl.store(xs_ptr + slot, xr, mask=hard)


@triton.jit
def _smooth_bwd_kernel(
    g_ptr, y_ptr, bits_ptr, tab_ptr, dx_ptr, n, y_hi, y_lo, s2_max, sc_r, sc_l,
    NT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # f'(x) from y and the branch bit, as _math.smooth._Inverse.df: the table is
    # [right (NT) | pad | left (NT) | pad]; right: pos = s sc_r, left: pos = NT + 1 + s sc_l
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    y = tl.load(y_ptr + i, mask=m, other=1.0).to(tl.float32)
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    right = unpack(bits_ptr, i, m) == 1
    s = tl.sqrt(tl.minimum(tl.maximum((y - y_hi) - y_lo, 0.0), s2_max))
    pos = tl.where(right, 0.0, NT + 1.0) + s * tl.where(right, sc_r, sc_l)
    j = tl.where(pos == pos, pos, 0.0).to(tl.int32)  # pos >= 0: truncation = floor; NaN: 0
    j = tl.minimum(tl.maximum(j, 0), 2 * NT)
    w = pos - j.to(tl.float32)
    lo = tl.load(tab_ptr + j, mask=m, other=0.0)
    hi = tl.load(tab_ptr + j + 1, mask=m, other=0.0)
    df = tl.where(w < 0.5, lo + w * (hi - lo), hi - (hi - lo) * (1.0 - w))  # as torch.lerp
    tl.store(dx_ptr + i, cast_out(g * df, dx_ptr.dtype.element_ty), mask=m)


_SMOOTH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def smooth_fwd(spec, act: int, x: torch.Tensor, fwd_torch, fallback: bool = True):
    """``_math.smooth.smooth_fwd`` with Triton kernels: (y, bits, idx, xs). y, bits and the
    fallback rule as the PyTorch path; idx / xs hold the same elements, in ascending order.
    x in any layout: y in ``torch.empty_like(x)``'s, the side information in x's memory order
    (NOTE [Eager's output on a strided input] in slimgrad/_math/layout.py)."""
    if x.dtype not in _SMOOTH_DTYPES or x.numel() == 0 or x.dim() == 0:
        return in_memory_order(x, fwd_torch, lambda xm, f: _ref.smooth_fwd(spec, xm, f, fallback))
    inv = _ref.inverse(spec)
    w, tail = _ref._window(spec, x.dtype, x.device)
    p = memory_order(x)
    # y written through its memory-order view (contiguous), read from x's (a copy if it has gaps)
    y = (
        torch.empty_like(x)
        if p is not None
        else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    )
    xc = x.contiguous() if p is None else x.permute(p)
    yk = y if p is None else y.permute(p)
    n = xc.numel()
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    grid = grid1(n)
    cnt = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    tail_v = float(tail) if tail is not None else 0.0
    _smooth_fwd_kernel[grid](
        xc, yk, bits, cnt, n, inv.x_star, float(w), tail_v,
        ACT=act, TAIL=tail is not None, BLOCK=BLOCK,
    )  # fmt: skip
    flat = xc.view(-1)
    hard_cnt = cnt.to(torch.int64)
    n_hard = int(hard_cnt.sum())
    if fallback and n_hard * _ref.FALLBACK_DIV > n:
        empty_idx = cnt.new_empty(0, dtype=idx_dtype)
        return y, cnt.new_empty(0, dtype=torch.uint8), empty_idx, flat.clone()
    idx = torch.empty(n_hard, dtype=idx_dtype, device=x.device)
    xs = torch.empty(n_hard, dtype=x.dtype, device=x.device)
    if n_hard:
        hoff = hard_cnt.cumsum(0) - hard_cnt
        _smooth_side_kernel[grid](
            xc, hoff, idx, xs, n, inv.x_star, float(w), tail_v,
            TAIL=tail is not None, BLOCK=BLOCK,
        )  # fmt: skip
    return y, bits, idx, xs


def smooth_grad(spec, g, y, bits, idx, xs, bwd_exact):
    """``_math.smooth.smooth_grad`` as one Triton kernel plus the side-table fix-up."""
    n = g.numel()
    if (
        y is None
        or _ref.is_dense_fallback(n, bits, idx, xs)
        or y.dtype not in _SMOOTH_DTYPES
        or n == 0
    ):
        return _ref.smooth_grad(spec, g, y, bits, idx, xs, bwd_exact)
    if bits.numel() != packed_numel(n):
        raise internal_error(f"{spec.name}: {bits.numel()} packed bytes for {n} elements")
    inv = _ref.inverse(spec)
    yc, gc = y.contiguous(), g.contiguous()
    tab = inv.tables_on(y.device, torch.float32)[0]
    y_hi = _ref.round_f32(inv.y_min)
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    sc_r, sc_l = inv.sc
    _smooth_bwd_kernel[grid1(n)](
        gc, yc, bits, tab, out, n, y_hi, inv.y_min - y_hi, inv.s_r**2, sc_r, sc_l,
        NT=_ref._TABLE_N, BLOCK=BLOCK,
    )  # fmt: skip
    if idx.numel():
        i = idx.long()
        out.view(-1)[i] = bwd_exact(gc.view(-1)[i], xs)
    return out

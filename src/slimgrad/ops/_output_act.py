"""Shared machinery of the activations that compute their gradient from their output.

# NOTE [Gradient from the output]
An elementwise activation y = f(x) needs f'(x) in backward. Eager PyTorch keeps x (gelu, silu,
mish, hardtanh, elu, leaky_relu) or y (relu, sigmoid, tanh). The next layer (usually a Linear)
keeps y anyway, so an activation that keeps only y costs nothing extra, while one that keeps x
doubles the activation's share.

Monotone f (relu, leaky_relu with slope >= 0, elu with alpha >= 0, sigmoid, tanh, hardtanh/relu6):
f'(x) is a function of y alone: relu/hardtanh compare y with the thresholds (y <= 0 iff x <= 0),
sigmoid y(1-y), tanh 1-y^2, elu y+alpha on the negative side, leaky_relu y > 0 iff x > 0. These are
PyTorch's own ``*_backward(..., is_result=True)`` formulas, i.e. the gradient eager computes for the
in-place op. Where y does not tell the side (leaky_relu slope < 0, elu alpha < 0, hardtanh in
float16/bfloat16 with a bound the dtype cannot represent) the side is kept as 1 bit/elt.

Smooth non-monotone f (silu, gelu erf/tanh, mish) have one minimum x*: f decreases on (-inf, x*)
and increases on (x*, inf), so (y, b = [x >= x*]) determines x; b is kept bit-packed (1/8 B/elt).
(Keeping b only where y <= 0 would halve it but costs a masked select/scatter per element, 10x the
activation itself on CPU.) Backward reads f' from float64-built
tables against s = sqrt(y - y_min), one per branch (``_Inverse``). The inverse is ill-conditioned
in two places (research/selective_inplace.md section 8, re-measured on every float32 here):
  (a) near x*: y - y_min ~ f''(x*) d^2 / 2 with d = x - x*, so an error dy of the stored y moves
      f'(x) by about dy / |d|. With torch's float32 kernels dy reaches ~2-5 ulp; so within
      |d| < ``zone`` the forward computes y in float64 and rounds it (dy <= 1/2 ulp, the output
      differs from eager's by at most a few ulp there), and within |d| < ``window`` (0.015 for
      GELU, 0.025 for SiLU/Mish) even that is not enough: those elements are "hard";
  (b) erf-GELU for x < -2.5 (tanh-GELU: x < -3): the float32 forward 1 + erf(x / sqrt 2) cancels,
      so y no longer pins x, and y -> 0 leaves the tables too coarse: those elements are hard too.
Hard elements, and non-finite x (so NaN/inf propagate exactly as eager's formula makes them), are
kept exactly in a sparse side table: int32 flat index (int64 above 2^31 elements) + x in its own
dtype; their gradient is eager's formula on the exact x. The tests check every float32 within
x* +- (zone + 0.05) and at the tail thresholds, a strided sweep of [-40, 40], every float16 and
bfloat16 value, and random inputs, against the GUIDE.md rule.

float64 inputs keep x densely (as eager): the tables are float32-grade (~1e-8).

Implementations (NOTE [Kernel backend choice] in ``slimgrad.kernels._backend``): the PyTorch path
(``smooth_fwd`` / ``smooth_grad``, chunked), Triton on CUDA, and on CPU float32 compiled C
(``kernels/cpu/output_act.c``, ``smooth_fwd_c`` / ``smooth_grad_c``): y still comes from eager's
own kernel, then one vectorized pass writes the bits, corrects the zone and counts the hard
elements per 2^16 block, a second collects them (block offsets by prefix sum, so the order is
deterministic and, for finite inputs, the PyTorch path's); the backward is one pass (vector gathers
from the same float32 tables, fused multiply-adds where torch's addcmul_/lerp_ use them). Same
y, bits and side table bit for bit; the gradient within a few float32 ulp of the PyTorch path's
(torch's float32 sqrt is not always correctly rounded, C's is), both within the GUIDE.md rule on
the dense grids. The backward writes dx into the incoming gradient when
``slimgrad.ownership.take`` proves it dead (NOTE [Gradient-buffer ownership]), on either path,
bit for bit as out of place.

Worst case: the side table is data-dependent (about 1-2% of N(0,1) elements). Inputs that crowd the
hard windows (e.g. all at x*) would make it grow to 8 B per element, so when more than 1/16 of the
elements are hard the op falls back to keeping x densely, exactly what eager keeps (4 B/elt in
float32), without bits, table or y: the op never keeps more than eager plus y.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from slimgrad import ownership
from slimgrad._errors import internal_error
from slimgrad.kernels import _backend
from slimgrad.ops._bits import pack_bits, packed_numel

# elements per chunk: bounds the temporaries and keeps them in cache (a multiple of 8)
CHUNK = 1 << 16
# the forward loop runs over BIG chunks (a multiple of CHUNK; the hard elements stay ordered as by
# CHUNK: window hits, then tail hits, chunk after chunk); the backward over CHUNKs. Measured on the
# 4x256x3072 GELU: BIG = 2^17 or 2^18 no faster than 2^16 within the (shared) CPU's noise, and
# 2^17 in the backward raised the GPT-2 MLP block's peak (52.7 vs 51.0 MiB): BIG = CHUNK.
BIG = 1 << 16
_HUGE = 1e30  # |x - x*| below it in a whole BIG chunk: no CHUNK sum of |x - x*| can overflow
FALLBACK_DIV = 16  # fallback to dense x when hard elements > numel / FALLBACK_DIV
_TABLE_N = 1 << 14


def needs_graph(x: torch.Tensor) -> bool:
    """True when autograd will record this call (grad mode on and x requires grad)."""
    return torch.is_grad_enabled() and x.requires_grad


def forward_output_only(ctx, x: torch.Tensor, inplace: bool, fwd: Callable, fwd_: Callable):
    """Forward of a monotone activation that keeps only y (NOTE [Gradient from the output])."""
    if inplace:
        y = fwd_(x)
        ctx.mark_dirty(y)
    else:
        y = fwd(x)
    ctx.save_for_backward(y)
    return y


def no_double_backward(api: str) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"slimgrad.{api}: double backward is not supported; expected create_graph=False, got "
            f"create_graph=True. Use torch.nn.functional.{api.split('.')[-1].rstrip('_')} for "
            f"higher-order gradients."
        )


# -------------------------------------------------------------------------------------------------
# Smooth activations with one minimum: spec, f' tables, forward (bits + side table), backward.


@dataclass(frozen=True)
class SmoothSpec:
    """One smooth activation with a single minimum x* (float64 math in ``f`` / ``df``).

    ``window`` maps a dtype to the half-width of the hard window around x*; ``tail`` maps a dtype to
    a threshold below which x is hard too (None: no tail); ``x_right``: end of the right table
    (beyond it f' = 1 to float32 precision).
    """

    name: str
    f: Callable[[torch.Tensor], torch.Tensor]
    df: Callable[[torch.Tensor], torch.Tensor]
    window: dict
    tail: dict = field(default_factory=dict)
    x_right: float = 20.0
    zone: float = 0.0  # float32: y is computed in float64 and rounded for |x - x*| < zone
    c_act: int = -1  # the activation's number in kernels/cpu/output_act.c (-1: none)
    # (g, x, out) -> out: the op's backward from x (its bwd_exact) written into out, an aten
    # ``.grad_input`` out variant (out may be g itself); None where aten has none (Mish)
    grad_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _bisect(f: Callable, y: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, increasing: bool):
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        up = f(mid) < y if increasing else f(mid) > y
        lo = torch.where(up, mid, lo)
        hi = torch.where(up, hi, mid)
    return 0.5 * (lo + hi)


class _Inverse:
    """f' as a function of (y, branch): float64-built tables, linear interpolation at run time.

    Each branch tabulates f'(x(s)) uniformly in s = sqrt(y - y_min) (2^16 points): x is analytic in
    s at the minimum, so f' is smooth in s there (no square-root singularity), and on the left
    branch f' is a smooth function of y up to y -> 0- (x -> -inf), where f' -> 0. Table values come
    from an 60-step float64 bisection of f, so the run-time error is the interpolation (< 1e-8,
    checked on every float32 by the tests), the float32 rounding of s, and the conditioning of (y,
    bit) -> x near x* (hence the side table). The kernel is branch-free arithmetic on float32
    (``torch.where`` and int64 indices are slow on CPU).
    """

    def __init__(self, spec: SmoothSpec):
        self.spec = spec
        f, df = spec.f, spec.df
        one = torch.ones((), dtype=torch.float64)
        lo, hi = -3.0 * one, 0.0 * one  # x*: root of f' on [-3, 0]
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            neg = df(mid) < 0
            lo, hi = torch.where(neg, mid, lo), torch.where(neg, hi, mid)
        self.x_star = float(0.5 * (lo + hi))
        xs = self.x_star * one
        self.y_min = float(f(xs))
        n = _TABLE_N
        self.s_r = math.sqrt(float(f(spec.x_right * one)) - self.y_min)
        s = torch.linspace(0.0, self.s_r, n, dtype=torch.float64)
        yy = self.y_min + s * s
        x_r = _bisect(f, yy, xs.expand(n).clone(), torch.full_like(yy, spec.x_right + 1), True)
        self.s_l = math.sqrt(-self.y_min)
        s = torch.linspace(0.0, self.s_l, n, dtype=torch.float64)
        yy = self.y_min + s * s
        x_l = _bisect(f, yy, torch.full_like(yy, -60.0), xs.expand(n).clone(), False)
        x_r[0] = x_l[0] = self.x_star
        t_l = df(x_l)
        t_l[-1] = 0.0  # y = 0-: x = -inf
        # [right | pad | left | pad]: each pad repeats its table's last entry, so that a position at
        # (or, by float32 rounding, just past) a table's end interpolates towards the same value
        t_r = df(x_r)
        self.table = torch.cat([t_r, t_r[-1:], t_l, t_l[-1:]])
        self.sc = ((n - 1) / self.s_r, (n - 1) / self.s_l)
        # per-byte lookup tables: a packed byte of branch bits -> 8 scales / 8 offsets (see df)
        byte = torch.arange(256, dtype=torch.int64)
        right = ((byte.unsqueeze(1) >> torch.arange(8)) & 1).double()
        self.byte_scale = self.sc[1] + right * (self.sc[0] - self.sc[1])
        self.byte_offset = (1.0 - right) * (n + 1)
        self._dev: dict = {}

    def tables_on(self, device, dtype):
        t = self._dev.get((device, dtype))
        if t is None:
            with _disable_current_modes():  # a cache: not part of any measured step
                t = tuple(
                    v.to(device=device, dtype=dtype)
                    for v in (self.table, self.byte_scale, self.byte_offset)
                )
            self._dev[(device, dtype)] = t
        return t

    def df(self, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
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
        return lo.lerp_(torch.index_select(self.table_next_on(y.device, y.dtype), 0, i), w)

    def table_next_on(self, device, dtype):
        """``table[1:]`` (contiguous): ``table_next[i] == table[i + 1]`` without an index add."""
        key = ("next", device, dtype)
        t = self._dev.get(key)
        if t is None:
            with _disable_current_modes():
                t = self.tables_on(device, dtype)[0][1:].clone()
            self._dev[key] = t
        return t


_INVERSES: dict[str, _Inverse] = {}


def inverse(spec: SmoothSpec) -> _Inverse:
    inv = _INVERSES.get(spec.name)
    if inv is None:
        # a process-wide cache: built outside any dispatch mode (fake tensors, the memory tracker)
        with _disable_current_modes():
            inv = _Inverse(spec)
        _INVERSES[spec.name] = inv
    return inv


def _window(spec: SmoothSpec, dtype: torch.dtype) -> tuple[float, float | None]:
    w = spec.window.get(dtype)
    if w is None:
        raise NotImplementedError(
            f"slimgrad.{spec.name}: unsupported dtype; expected one of "
            f"{sorted(str(d) for d in spec.window)}, got {dtype}. Cast the input, or use "
            f"torch.nn.functional for this dtype."
        )
    return w, spec.tail.get(dtype)


def smooth_fwd(spec: SmoothSpec, x: torch.Tensor, fwd: Callable, fallback: bool = True):
    """Output, branch bits and sparse side table of ``x`` (see NOTE [Gradient from the output]).

    Returns (y, bits, idx, xs): y = fwd(x) (float32: correctly rounded inside the zone around x*);
    bits: [x >= x*] packed, ceil(n / 8) bytes; idx (int32, int64 above 2^31 elements) and xs (x's
    dtype): the hard elements. Dense fallback (more than n / FALLBACK_DIV hard, unless
    ``fallback=False``; float64 always): (y, empty uint8, empty idx, x flattened). Under fake
    tensors (``slimgrad.memory.estimate``) the side table, being data-dependent, is taken as empty:
    the estimate is y + 1 bit/elt, the measured figure is that + the few hard elements.
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
    zone = spec.zone if x.dtype == torch.float32 else 0.0
    flat = flat.contiguous()
    y = fwd(flat).view(x.shape)  # one vectorized pass; zone elements are then corrected in place
    yf = y.view(-1)
    near = max(zone, w)
    # the window around x* and the tail are disjoint for every spec; were they not, an element in
    # both would be listed twice per chunk: that case takes the CHUNK-by-CHUNK loop
    split = tail is None or tail <= inv.x_star - near
    bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    idx = []
    for a in range(0, n, BIG):
        c = flat[a : a + BIG]
        d = c.float() - inv.x_star
        ge = d >= 0
        bits[a // 8 : a // 8 + packed_numel(ge.numel())] = pack_bits(ge)
        t = d.abs_()
        # finite and small: no CHUNK has a non-finite sum of t, so every CHUNK's hard elements
        # are its window hits then its tail hits (else: the per-CHUNK path, which sorts them)
        if split and bool(t.amax() < _HUGE):
            idx.append(_hard_big(spec, c, t, a, near, w, zone, tail, yf).to(idx_dtype))
        else:
            for a2 in range(0, c.numel(), CHUNK):
                idx.append(
                    _hard_chunk(spec, c[a2 : a2 + CHUNK], a + a2, near, w, zone, tail, yf).to(
                        idx_dtype
                    )
                )
    idx = torch.cat(idx) if len(idx) > 1 else (idx[0] if idx else empty_idx)
    if fallback and idx.numel() * FALLBACK_DIV > n:
        return y, empty_bits, empty_idx, flat.clone()
    return y, bits, idx, flat[idx.long()]


def _hard_big(spec, c, t, a: int, near: float, w: float, zone: float, tail, yf) -> torch.Tensor:
    """Hard elements (int64, absolute) of the chunk ``c`` at offset ``a`` (all finite, small)."""
    m = t < near
    # the tail pass only where some element is below it (a cheap reduction first)
    has_tail = tail is not None and bool(c.amin() < tail)
    if has_tail:
        m.logical_or_(c < tail)
    cand = m.nonzero().view(-1)  # window (and tail) candidates, increasing
    tv = t.index_select(0, cand)
    zi, tl = cand, None
    if has_tail:
        isnear = tv < near
        zi, tv = torch.masked_select(cand, isnear), torch.masked_select(tv, isnear)
        tl = torch.masked_select(cand, isnear.logical_not_())
    hard = zi if near <= w else torch.masked_select(zi, tv < w)
    if zone and zi.numel():  # y correctly rounded here: the inverse's error is ~ dy / |x - x*|
        vals = spec.f(c.index_select(0, zi).double()).to(yf.dtype)
        yf[a : a + c.numel()].index_copy_(0, zi, vals)
    if tl is not None and tl.numel():  # order as by CHUNK: window, then tail hits, per CHUNK
        both = torch.cat([hard, tl])
        key = torch.cat([(hard >> 16) * 2, (tl >> 16) * 2 + 1])
        hard = both[torch.sort(key, stable=True).indices]
    return hard.add_(a)


def _hard_chunk(spec, c, a: int, near: float, w: float, zone: float, tail, yf) -> torch.Tensor:
    """Hard elements (int64, absolute) of one CHUNK ``c`` at offset ``a``: any input."""
    d = c.float() - inverse(spec).x_star
    t = d.abs_()
    # candidates near x*, then work on that few percent only (full-chunk passes dominate)
    zi = (t < near).nonzero().view(-1)
    parts = [zi[t.index_select(0, zi) < w]]
    if zone and zi.numel():
        vals = spec.f(c.index_select(0, zi).double()).to(yf.dtype)
        yf.index_put_((zi + a,), vals)
    if tail is not None:
        parts.append((c < tail).nonzero().view(-1))
    if not bool(torch.isfinite(t.sum())):  # NaN/inf in the chunk (or a sum overflow): rare
        parts.append((~(t < math.inf)).nonzero().view(-1))
        parts = [torch.cat(parts).unique()]  # -inf is also below the tail
    hard = torch.cat(parts) if len(parts) > 1 else parts[0]
    return hard.add_(a)


def is_dense_fallback(n: int, bits, idx, xs) -> bool:
    return n > 0 and xs.numel() == n and idx.numel() == 0 and bits.numel() == 0


def smooth_grad(
    spec: SmoothSpec,
    g: torch.Tensor,
    y: torch.Tensor | None,
    bits: torch.Tensor,
    idx: torch.Tensor,
    xs: torch.Tensor,
    bwd_exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dx from the output y, the branch bits and the side table (inverse of :func:`smooth_fwd`).

    ``bwd_exact(g, x)`` is the op's plain-PyTorch backward from x, for the side table and fallback.
    ``out``: a dead contiguous buffer shaped like ``g`` (maybe ``g`` itself) to write dx into; the
    dense fallback writes eager's kernel's result straight into it where ``spec.grad_into`` exists
    (no gradient-sized temporary), else copies it there.
    """
    n = g.numel()
    gf = g.reshape(-1)
    if is_dense_fallback(n, bits, idx, xs):
        if out is not None and spec.grad_into is not None:
            spec.grad_into(gf, xs, out.view(-1))
            return out
        dx = bwd_exact(gf, xs).reshape(g.shape)
        return dx if out is None else out.copy_(dx)
    if y is None:
        raise internal_error(f"{spec.name}: no saved output outside the dense fallback")
    inv = inverse(spec)
    yf = y.reshape(-1)
    cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
    if bits.numel() != packed_numel(n):
        raise internal_error(f"{spec.name}: {bits.numel()} packed bytes for {n} elements")
    i = idx.long() if idx.numel() else None
    gh = gf[i] if i is not None else None  # read before out (maybe g's buffer) is written
    res = torch.empty(n, dtype=g.dtype, device=g.device) if out is None else out.view(-1)
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        df = inv.df(yf[a:b].to(cdt), bits[a // 8 : (b + 7) // 8])
        if g.dtype == cdt:
            torch.mul(gf[a:b], df, out=res[a:b])
        else:
            res[a:b] = (gf[a:b].to(cdt) * df).to(g.dtype)
    if i is not None:
        res[i] = bwd_exact(gh, xs)
    return res.view(g.shape) if out is None else out


def smooth_forward(ctx, x: torch.Tensor, fwd_out, inplace: bool):
    """Forward of a smooth activation's Function, given its custom op's (y, bits, idx, xs)."""
    y, bits, idx, xs = fwd_out
    if inplace:
        x.copy_(y)
        y = x
        ctx.mark_dirty(x)
    # dense fallback (xs is all of x): y is not needed; not decidable while tracing, so kept then
    fallback = not torch.compiler.is_compiling() and is_dense_fallback(x.numel(), bits, idx, xs)
    ctx.save_for_backward(None if fallback else y, bits, idx, xs)
    if inplace:
        return y
    # The side info is returned too (non-differentiable) so that its data-dependent sizes are
    # outputs of the Function traced by torch.compile; the functional drops it.
    ctx.mark_non_differentiable(bits, idx, xs)
    # no zero gradients for them in backward (it never reads them): on the dense fallback xs is all
    # of x, so autograd would allocate a gradient-sized zeros tensor
    ctx.set_materialize_grads(False)
    return y, bits, idx, xs


def smooth_apply(fn_out, fn_inplace, x: torch.Tensor, inplace: bool, *args) -> torch.Tensor:
    """Apply a smooth activation's Function; in-place under torch.compile: out-of-place + copy_.

    (An in-place Function on a view may return one tensor only, and the traced Function must return
    the side info; so while compiling, ``inplace=True`` costs a temporary y and keeps it:
    documented.)
    """
    if not inplace:
        return fn_out.apply(x, *args)[0]
    if torch.compiler.is_compiling():
        return x.copy_(fn_out.apply(x, *args)[0])
    return fn_inplace.apply(x, *args)


def smooth_fake_side_info(x: torch.Tensor):
    ctx = torch.library.get_ctx()
    idx_dtype = torch.int32 if x.numel() < 2**31 else torch.int64
    nb, k, m = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (
        x.new_empty(nb, dtype=torch.uint8),
        x.new_empty(k, dtype=idx_dtype),
        x.new_empty(m),
    )


def smooth_unary_op(stem: str, spec: SmoothSpec, fwd_torch: Callable, bwd_exact: Callable):
    """Register ``slimgrad::<stem>_fwd`` / ``_bwd`` and build the Function pair of a one-argument
    smooth activation (SiLU, Mish): the forward keeps (y, bits, side table), the backward reads
    the gradient from them (NOTE [Gradient from the output]); Triton kernels on CUDA and C kernels
    on CPU through ``slimgrad.kernels._backend``; the backward writes dx into the incoming
    gradient when ``slimgrad.ownership.take`` proves it dead.

    Args:
        stem: the op's stem (``"silu"``): names the custom ops, the kernels module, the Functions.
        spec: its :class:`SmoothSpec`.
        fwd_torch: ``x -> y``, eager's own forward.
        bwd_exact: ``(g, x) -> dx``, eager's own backward from x (side table and dense fallback).

    Returns:
        ``(fwd_op, bwd_op, Fn, InplaceFn)``.
    """
    from slimgrad.kernels import _backend
    from slimgrad.ops._library import custom_op

    def _fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if _backend.use_triton(x):
            return _backend.kernels(stem)._fwd_triton(x)
        return smooth_fwd_any(spec, x, fwd_torch)

    def _bwd(
        g: torch.Tensor,
        y: torch.Tensor | None,
        bits: torch.Tensor,
        idx: torch.Tensor,
        xs: torch.Tensor,
    ) -> torch.Tensor:
        if y is not None and _backend.use_triton(g):
            return _backend.kernels(stem)._bwd_triton(g, y, bits, idx, xs)
        return smooth_grad_any(spec, g, y, bits, idx, xs, bwd_exact)

    fwd_op = custom_op(f"{stem}_fwd", mutates_args=())(_fwd)
    bwd_op = custom_op(f"{stem}_bwd", mutates_args=())(_bwd)

    @fwd_op.register_fake
    def _(x):
        return (torch.empty_like(x), *smooth_fake_side_info(x))

    @bwd_op.register_fake
    def _(g, y, bits, idx, xs):
        return g.new_empty(g.shape)

    def forward(ctx, x):
        return smooth_forward(ctx, x, fwd_op(x), False)

    def backward(ctx, g, *_side):
        if g is None:  # only the side outputs got a gradient (grads are not materialized)
            return None
        # first use of g: NOTE [Gradient-buffer ownership] (reuse_ok only reads attributes)
        buf = ownership.take(g) if reuse_ok(g) else None
        no_double_backward(stem)
        if buf is not None:  # eager only (take refuses under torch.compile): dx written into g
            return smooth_grad_any(spec, buf, *ctx.saved_tensors, bwd_exact, out=buf)
        return bwd_op(g, *ctx.saved_tensors)

    def forward_inplace(ctx, x):
        return smooth_forward(ctx, x, fwd_op(x), True)

    # named classes: autograd names the nodes after them (``_SiluFnBackward``)
    name = f"_{stem.capitalize()}Fn"
    fn = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    fn_inplace = type(
        f"_{stem.capitalize()}InplaceFn", (fn,), {"forward": staticmethod(forward_inplace)}
    )
    return fwd_op, bwd_op, fn, fn_inplace


# -------------------------------------------------------------------------------------------------
# The same forward and backward as compiled C (kernels/cpu/output_act.c; NOTE [CPU C kernels] in
# slimgrad.kernels._cpu): float32 CPU tensors. y, bits, idx, xs and the gradient are those of
# smooth_fwd / smooth_grad bit for bit (tests/kernels/test_cpu.py), except that a block of 2^16
# elements holding a non-finite x lists its hard elements window-first (the PyTorch path: sorted);
# the saved bytes are the same.

C_STEM = "output_act"


def _c_signatures(C):
    p, i64, f, i = C.c_void_p, C.c_int64, C.c_float, C.c_int
    specs = {
        "smooth_fwd_f32": [p, p, p, p, p, i64, i, f, f, f, i, f, i],
        "smooth_collect_i32": [p, p, p, p, p, p, i64, f, f, i, f, i],
        "smooth_collect_i64": [p, p, p, p, p, p, i64, f, f, i, f, i],
        "smooth_bwd_f32": [p, p, p, p, p, i64, i64, f, f, f, f, f, i],
    }
    return {name: (name, args, None) for name, args in specs.items()}


def _c_fns(lib):
    from slimgrad.kernels._cpu import functions

    return functions(lib, _c_signatures)


def smooth_fwd_c(lib, spec: SmoothSpec, x: torch.Tensor, fwd: Callable, fallback: bool = True):
    """:func:`smooth_fwd` for float32 CPU tensors with the C kernels of ``lib``: y from ``fwd``
    (eager's own kernel), then one pass for bits, zone and hard counts, one to collect them."""
    from slimgrad.kernels._cpu import threads

    if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0 or spec.c_act < 0:
        return smooth_fwd(spec, x, fwd, fallback)
    fns = _c_fns(lib)
    inv = inverse(spec)
    w, tail = _window(spec, x.dtype)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nt = threads()
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    y = fwd(flat).contiguous()
    bits = torch.empty(packed_numel(n), dtype=torch.uint8)
    nb = (n + CHUNK - 1) // CHUNK
    cnt = torch.empty(2 * nb, dtype=torch.int64)
    flags = torch.empty((n + 31) // 32, dtype=torch.uint8)  # 1 byte per 32 elements, transient
    has_tail, tail_v = (0, 0.0) if tail is None else (1, float(tail))
    fns["smooth_fwd_f32"](
        flat.data_ptr(), y.data_ptr(), bits.data_ptr(), cnt.data_ptr(), flags.data_ptr(), n,
        spec.c_act, inv.x_star, spec.zone, w, has_tail, tail_v, nt,
    )  # fmt: skip
    per_block = cnt.view(nb, 2).sum(1)
    n_hard = int(per_block.sum())
    y = y.view(x.shape)
    if fallback and n_hard * FALLBACK_DIV > n:
        empty_bits = torch.empty(0, dtype=torch.uint8)
        return y, empty_bits, torch.empty(0, dtype=idx_dtype), flat.clone()
    idx = torch.empty(n_hard, dtype=idx_dtype)
    xs = torch.empty(n_hard, dtype=x.dtype)
    if n_hard:
        off = per_block.cumsum(0).sub_(per_block)
        collect = fns["smooth_collect_i32" if idx_dtype == torch.int32 else "smooth_collect_i64"]
        collect(
            flat.data_ptr(), cnt.data_ptr(), flags.data_ptr(), off.data_ptr(), idx.data_ptr(),
            xs.data_ptr(), n, inv.x_star, w, has_tail, tail_v, nt,
        )  # fmt: skip
    return y, bits, idx, xs


def smooth_grad_c(
    lib,
    spec: SmoothSpec,
    g: torch.Tensor,
    y: torch.Tensor | None,
    bits: torch.Tensor,
    idx: torch.Tensor,
    xs: torch.Tensor,
    bwd_exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`smooth_grad` with the C kernel of ``lib`` (float32 CPU), into ``out`` if given (a
    dead buffer shaped like ``g``, possibly ``g`` itself: NOTE [Gradient-buffer ownership])."""
    from slimgrad.kernels._cpu import threads

    n = g.numel()
    if (
        y is None
        or is_dense_fallback(n, bits, idx, xs)
        or n == 0
        or g.dtype != torch.float32
        or y.dtype != torch.float32
        or g.device.type != "cpu"
    ):
        return smooth_grad(spec, g, y, bits, idx, xs, bwd_exact, out=out)
    if bits.numel() != packed_numel(n):
        raise internal_error(f"{spec.name}: {bits.numel()} packed bytes for {n} elements")
    inv = inverse(spec)
    gf = g.reshape(-1).contiguous()
    yf = y.reshape(-1).contiguous()
    # the hard elements' g, read before out (maybe g's buffer) is written
    gh = gf.index_select(0, idx) if idx.numel() else None
    if out is None:
        out = torch.empty(g.shape, dtype=g.dtype)
    of = out.view(-1)
    tab, byte_scale, _ = inv.tables_on(g.device, torch.float32)
    y_hi = torch.tensor(inv.y_min, dtype=torch.float32).item()
    sc_r, sc_l = float(byte_scale[255, 0]), float(byte_scale[0, 0])
    _c_fns(lib)["smooth_bwd_f32"](
        gf.data_ptr(), yf.data_ptr(), bits.data_ptr(), tab.data_ptr(), of.data_ptr(), n, _TABLE_N,
        y_hi, inv.y_min - y_hi, inv.s_r**2, sc_r, sc_l, threads(),
    )  # fmt: skip
    if gh is not None:
        of.index_copy_(0, idx.long(), bwd_exact(gh, xs))
    return out


def smooth_fwd_any(spec: SmoothSpec, x: torch.Tensor, fwd: Callable):
    """:func:`smooth_fwd` on the C kernels when ``_backend.use_cpu`` picks them, else PyTorch."""
    lib = _backend.use_cpu(x, C_STEM)
    if lib is not None:
        return smooth_fwd_c(lib, spec, x, fwd)
    return smooth_fwd(spec, x, fwd)


def smooth_grad_any(spec: SmoothSpec, g, y, bits, idx, xs, bwd_exact, out=None) -> torch.Tensor:
    """:func:`smooth_grad` on the C kernels when ``_backend.use_cpu`` picks them, else PyTorch."""
    lib = _backend.use_cpu(g, C_STEM)
    if lib is not None:
        return smooth_grad_c(lib, spec, g, y, bits, idx, xs, bwd_exact, out=out)
    return smooth_grad(spec, g, y, bits, idx, xs, bwd_exact, out=out)


def reuse_ok(g: torch.Tensor) -> bool:
    """Whether a smooth activation's backward can write into ``g`` if ownership grants it: a
    contiguous gradient on the C or PyTorch path (the Triton kernels allocate their own)."""
    return g.is_contiguous() and not _backend.use_triton(g)

"""The smooth activations' math, below both ``slimgrad.ops`` and ``slimgrad.kernels``.

SiLU, GELU (erf and tanh forms) and Mish have one minimum x*, so their input follows from their
output and one branch bit (NOTE [Gradient from the output] in ``slimgrad.ops._output_act``). Here:
each activation's :class:`SmoothSpec` (float64 f and f', hard windows, tails), the float64-built
f' tables (:class:`_Inverse`), and the plain-PyTorch reference of the forward's side information
and of the backward (:func:`smooth_fwd`, :func:`smooth_grad`), which the ops run on CPU and the
Triton and C kernels reproduce. NOTE [Kernels are leaves] in ``slimgrad._math``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from slimgrad._errors import internal_error
from slimgrad._math.bits import pack_bits, packed_numel

# the side table lists its hard elements CHUNK by CHUNK (a multiple of 8; the C kernels' blocks):
# NOTE [The PyTorch path on a GPU] at smooth_fwd
CHUNK = 1 << 16
# the PyTorch path's passes run over spans (NOTE [The PyTorch path on a GPU]), multiples of CHUNK:
# BIG elements on a GPU (a bounded number of whole-tensor ops per call, temporaries of at most
# ~16 B x BIG: 64 MiB in float32); CPU_SPAN on CPU, where an op costs no launch and temporaries
# that stay in cache matter more (1M-element float32, 1 thread: backward 1.7x slower with BIG)
BIG = 1 << 22
CPU_SPAN = CHUNK
# half types on CPU (the C kernels take float32 only, so these run here): the passes compute in
# float32, up to 16 B of temporaries per element of a span in smooth_grad and ~7 B in smooth_fwd
# against the tensor's own 2 B, which one span of CPU_SPAN keeps above eager's peak (bfloat16
# SiLU between two 1x1 convs, 840 to 165,376 elements). There a call runs at most HALF_SPANS
# spans of a power of two elements (HALF_MIN_SPAN at least, CPU_SPAN at most; they divide a CHUNK):
# temporaries of ~16/HALF_SPANS B per element of the tensor, and a bounded number of ops per call
# up to HALF_SPANS * CPU_SPAN elements. At 165,376 elements the peak is 78% of eager's with 16,
# 95% with 8 (tests/ops/test_silu.py)
HALF_SPANS = 16
# ... but a span costs ~20 ops whatever its size, so many small spans cost a small tensor several
# times eager's time (measured: docs/measurements.md). So spans hold HALF_MIN_SPAN elements at
# least, and a half-type CPU tensor of at most HALF_DENSE_MAX elements (too small for HALF_SPANS
# of them) keeps x densely instead, as eager: eager's bytes, bits and time (NOTE [Few elements]
# in ops._output_act; decided from the shape alone)
HALF_MIN_SPAN = 1 << 13
HALF_DENSE_MAX = HALF_SPANS * HALF_MIN_SPAN
FALLBACK_DIV = 16  # fallback to dense x when hard elements > numel / FALLBACK_DIV
# tensors of at most DENSE_MAX elements keep x densely (NOTE [Few elements] in ops._output_act)
DENSE_MAX = 512
_TABLE_N = 1 << 14


# -------------------------------------------------------------------------------------------------
# Smooth activations with one minimum: spec, f' tables, forward (bits + side table), backward.


@dataclass(frozen=True)
class SmoothSpec:
    """One smooth activation with a single minimum x* (float64 math in ``f`` / ``df``).

    ``window`` maps a dtype to the least half-width of the hard window around x* (the width an
    accurate eager forward needs; the width used is :func:`_window`'s, NOTE [A window from eager's
    own forward error]); ``tail`` maps a dtype to a threshold below which x is hard too (None: no
    tail); ``x_right``: end of the right table (beyond it f' = 1 to float32 precision); ``op``:
    eager's forward (the torch function whose output the op keeps), ``op_backward(g, x)`` its
    backward (an aten op: no autograd, so that it runs inside the ops' own kernels too).
    """

    name: str
    f: Callable[[torch.Tensor], torch.Tensor]
    df: Callable[[torch.Tensor], torch.Tensor]
    window: dict
    tail: dict = field(default_factory=dict)
    x_right: float = 20.0
    # (g, x, out) -> out: the op's backward from x (its bwd_exact) written into out, an aten
    # ``.grad_input`` out variant (out may be g itself); None where aten has none (Mish)
    grad_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    op: Callable[[torch.Tensor], torch.Tensor] | None = None
    op_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


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

    def df(self, y: torch.Tensor, bits: torch.Tensor, own: bool = False) -> torch.Tensor:
        """f'(x) from y (float32 or float64) and its packed branch bits (x >= x*); ``own``: y
        is a temporary of the caller's, written over (the same arithmetic, one buffer less)."""
        tab, byte_scale, byte_offset = self.tables_on(y.device, y.dtype)
        m = y.numel()
        b = bits.to(torch.int32)
        scale = torch.index_select(byte_scale, 0, b).view(-1)[:m]
        pos = torch.index_select(byte_offset, 0, b).view(-1)[:m]
        del b  # each temporary is dropped as soon as it is dead: 16 B/elt at most (float32)
        # s = sqrt(y - y_min), y_min split in two so that y - y_hi is exact; s <= s_r (f' = 1 past)
        y_hi = self.y_min if y.dtype == torch.float64 else round_f32(self.y_min)
        s = (y.sub_(y_hi) if own else y - y_hi).sub_(self.y_min - y_hi)
        s = s.clamp_(0.0, self.s_r**2).sqrt_()
        # right: pos = s * sc_r in [0, n-1]; left: n + 1 + s * sc_l in [n+1, 2n]
        pos.addcmul_(s, scale)
        del scale
        # pos >= 0: truncation = floor; NaN (hard) -> 0. float32: into s's buffer (the same cast)
        i = s.view(torch.int32).copy_(pos) if s.dtype == torch.float32 else pos.to(torch.int32)
        del s
        i.clamp_(min=0)
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


def round_f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (ties to even), as a Python float: exactly
    ``torch.tensor(v, dtype=torch.float32).item()``, without a tensor (traceable: no ``.item()``).
    """
    return struct.unpack("f", struct.pack("f", v))[0]


_INVERSES: dict[str, _Inverse] = {}


def inverse(spec: SmoothSpec) -> _Inverse:
    inv = _INVERSES.get(spec.name)
    if inv is None:
        # a process-wide cache: built outside any dispatch mode (fake tensors, the memory tracker)
        with _disable_current_modes():
            inv = _Inverse(spec)
        _INVERSES[spec.name] = inv
    return inv


# NOTE [A window from eager's own forward error]
# Near x* the gradient from (y, bit) moves by dy |f''(x) / f'(x)| ~ dy / |x - x*| for an error dy
# of the kept y, which is eager's own output, so the hard window's width follows from how accurate
# eager's forward is, and that depends on the machine: torch's vectorized erf-GELU is ~1.5 ulp off
# near x* on the machines the fixed widths were set on, ~6 ulp (1.3e-7) with AVX2, where the fixed
# 0.03 put dx 2.9e-6 off at x = -0.7077, twice the error rule's bound. So the width is decided
# once per process and (activation, dtype, device type), at the first call that needs it, and
# kept in _DECIDED (the C path binds it once, in CPath.prepare):
# - a grid of _GRID_N points within x* +- _GRID_R, in the dtype, runs through eager's own op
#   (``spec.op``) and its backward, contiguous (the vectorized loop) and strided (the scalar loop,
#   which a strided input's rows reach); errors against float64 f and f';
# - float32: the grid holds 1 float in ~2^10, and the errors are spiky, so _BLOCKS runs of
#   _BLOCK_N consecutive floats within x* +- _NEAR add their largest error, times
#   _SAMPLE_MARGIN, as a floor there (on AVX2 those runs reach 84-96% of the largest error over
#   every float32 within x* +- 0.25, for each of the four activations);
# - each point's error times |f''/f'| (float64) predicts the gradient's error from y; the width
#   is the largest |x - x*| on the grid where it exceeds the error rule's bound there
#   (2 max|eager's dx - ref64| + atol), and never below ``spec.window[dtype]``, the width the
#   dense grid tests need with an accurate forward: where the forward is that accurate, the
#   width, bytes and time are what they were.
# Measured (AVX2, torch 2.13): erf-GELU float32 0.101 (fixed: 0.03); tanh-GELU, SiLU, Mish and
# every 16-bit dtype keep their fixed widths. float64 keeps x densely and uses no window. A wider
# window means more hard elements (8 B each); past 1/16 of them the op keeps x, as eager.
_GRID_N = 1 << 14
_GRID_R = 0.5
_NEAR = 0.25
_BLOCKS = 8
_BLOCK_N = 1 << 14
_SAMPLE_MARGIN = 1.25
_ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}  # slimgrad.testing's


def _block_err(spec: SmoothSpec, inv: _Inverse, device) -> float:
    # the largest float32 error of eager's forward over _BLOCKS runs of _BLOCK_N consecutive
    # floats spread over x* +- _NEAR (its rounding pattern, which a grid samples too sparsely)
    starts = torch.linspace(-_NEAR, _NEAR - 2 * _NEAR / _BLOCKS, _BLOCKS, dtype=torch.float64)
    xi = (inv.x_star + starts).float().view(torch.int32)
    xb = (xi.unsqueeze(1) + torch.arange(_BLOCK_N, dtype=torch.int32)).view(torch.float32)
    xb = xb.reshape(-1)
    return float((spec.op(xb.to(device)).double().cpu() - spec.f(xb.double())).abs_().max())


def _measured_window(spec: SmoothSpec, inv: _Inverse, dtype: torch.dtype, device) -> float:
    w0 = spec.window[dtype]
    atol = _ATOL.get(dtype)
    if spec.op is None or spec.op_backward is None or atol is None:
        return w0
    with _disable_current_modes():  # a decision, not part of any measured step
        d64 = torch.linspace(-_GRID_R, _GRID_R, _GRID_N, dtype=torch.float64)
        x = (inv.x_star + d64).to(device=device, dtype=dtype)
        xd = x.double().cpu()
        ref, df = spec.f(xd), spec.df(xd)
        err = torch.zeros_like(ref)  # eager's forward error, contiguous and strided
        bwd = torch.zeros_like(ref)  # eager's backward error (g = 1)
        for xe in (x, torch.empty(2 * _GRID_N, dtype=dtype, device=device)[::2].copy_(x)):
            y, gx = spec.op(xe), spec.op_backward(torch.ones_like(xe), xe)
            torch.maximum(err, (y.double().cpu() - ref).abs_(), out=err)
            torch.maximum(bwd, (gx.double().cpu() - df).abs_(), out=bwd)
        if dtype == torch.float32:  # the grid holds 1 float32 in ~2^10: add runs of them
            near = (xd - inv.x_star).abs() <= _NEAR
            err[near] = err[near].clamp_(min=_SAMPLE_MARGIN * _block_err(spec, inv, device))
        h = 1e-6  # f'' by a central difference of the float64 f': relative error ~1e-10 / |f''|
        amp = ((spec.df(xd + h) - spec.df(xd - h)) / (2 * h)).abs_().div_(df.abs())
        budget = atol + 2 * float(bwd.max())  # the error rule's bound on the grid
        d = (xd - inv.x_star).abs_()
        over = d[~(err.mul_(amp) <= budget)]  # NaN (f' = 0 at x*) counts as over
        w = float(over.max()) if over.numel() else 0.0
    return max(w0, w)


# (activation, dtype, device type) -> (window, tail): decided once (_window)
_DECIDED: dict = {}


def _window(spec: SmoothSpec, dtype: torch.dtype, device="cpu") -> tuple[float, float | None]:
    key = (spec.name, dtype, getattr(device, "type", device))
    got = _DECIDED.get(key)
    if got is not None:
        return got
    w = spec.window.get(dtype)
    if w is None:
        raise NotImplementedError(
            f"slimgrad.{spec.name}: unsupported dtype; expected one of "
            f"{sorted(str(d) for d in spec.window)}, got {dtype}. Cast the input, or use "
            f"torch.nn.functional for this dtype."
        )
    # NOTE [A window from eager's own forward error]: once per process
    got = _DECIDED[key] = (
        _measured_window(spec, inverse(spec), dtype, device),
        spec.tail.get(dtype),
    )
    return got


def smooth_fwd(
    spec: SmoothSpec, x: torch.Tensor, fwd: Callable, fallback: bool = True, copy: bool = True
):
    """Output, branch bits and sparse side table of ``x`` (see NOTE [Gradient from the output]).

    Returns (y, bits, idx, xs): y = fwd(x) (eager's output, bit for bit); bits: [x >= x*] packed,
    ceil(n / 8) bytes; idx (int32, int64 above 2^31 elements) and xs (x's dtype): the hard
    elements, CHUNK by CHUNK (NOTE [The PyTorch path on a GPU]). Dense fallback (more than
    n / FALLBACK_DIV hard, unless ``fallback=False``; float64 always): (y, empty uint8, empty idx,
    x flattened; with ``copy=False`` an empty xs, no copy of x: NOTE [The dense fallback without a
    copy of x] in slimgrad/ops/_output_act.py). Under fake tensors (``slimgrad.memory.estimate``)
    the side table, being data-dependent, is taken as empty: the estimate is y + 1 bit/elt, the
    measured figure is that + the few hard elements.

    # NOTE [The PyTorch path on a GPU]
    Every pass is a whole-tensor aten op (over spans of BIG elements on a GPU, CPU_SPAN on CPU;
    half types on CPU: HALF_SPANS spans per call, NOTE [Sums below a CHUNK]; so that the
    temporaries stay bounded: about 10 B/elt of a span here, 16 B/elt in
    :func:`smooth_grad`; plus the 1-byte hard flags of the whole tensor here), never a Python loop
    over 2^16-element chunks, and the only value the host reads is the hard count (one element,
    ``tolist``: one device-to-host copy) after the last pass; the backward reads none. A call
    dispatches O(1 + n / BIG) ops (tests/ops/test_smooth_path_cost.py pins them): a Python
    loop over chunks dispatches ops and host syncs per chunk, which on a GPU costs many times
    eager's whole forward and backward (``docs/measurements.md``).

    Per span: t = |x - x*| in float32, the packed bits, a one-byte hard flag per element (window,
    tail or non-finite) and, with a tail, the float32 sum of t per CHUNK. After the count: one
    ``nonzero_static`` over the flags, sized by the count.

    The side table's order is the one this function always had: CHUNK by CHUNK (2^16 elements,
    as the C kernels' blocks), its window and non-finite hits in increasing order, then
    its tail hits in increasing order; except in a CHUNK whose sum of t is not finite (NaN/inf in
    it, or a float32 overflow of the sum), where all are in increasing order (a stable sort of the
    short list by (CHUNK, tail) restores it). A per-CHUNK sum computed by another reduction order
    could overflow where the former one did not only when it lies within rounding of float32's
    largest value; then only the order of that CHUNK's table would differ, not its contents.
    """
    inv = inverse(spec)
    w, tail = _window(spec, x.dtype, x.device)
    flat = x.reshape(-1)
    n = flat.numel()
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    empty_idx = torch.empty(0, dtype=idx_dtype, device=x.device)
    empty_bits = torch.empty(0, dtype=torch.uint8, device=x.device)
    if x.dtype == torch.float64:  # the float32-grade tables would not meet float64's rule: keep x
        return fwd(x), empty_bits, empty_idx, flat.clone() if copy else flat.new_empty(0)
    if is_fake(x):  # slimgrad.memory.estimate: the side table is data-dependent; count none
        bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
        return fwd(flat).view(x.shape), bits, empty_idx, flat[:0].clone()
    flat = flat.contiguous()
    y = fwd(flat).view(x.shape)  # eager's own kernel, one vectorized pass
    if n == 0:
        return y, empty_bits, empty_idx, flat.clone()
    if tail is not None and tail > inv.x_star - w:  # no spec has it: window and tail disjoint
        raise internal_error(f"{spec.name}: the tail {tail} reaches the window around x*")
    bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    flags = torch.empty(n, dtype=torch.bool, device=x.device)  # hard or not
    nc = (n + CHUNK - 1) // CHUNK
    sums = torch.empty(nc, dtype=torch.float32, device=x.device) if tail is not None else None
    counts = None
    span = _span(flat)
    # spans below a CHUNK (half types on CPU): float64 sums per CHUNK (NOTE [Sums below a CHUNK])
    sums64 = None
    if sums is not None and span < CHUNK:
        sums64, sums = torch.zeros(nc, dtype=torch.float64, device=x.device), None
    for a in range(0, n, span):  # on a GPU: one span for n <= BIG
        c = flat[a : a + span]
        k = _span_flags(c, a, bits, flags, sums, inv.x_star, w, tail, sums64)
        counts = k if counts is None else counts.add_(k)
    if sums64 is not None:
        sums, unsure = _sums_from_f64(sums64)
        counts = torch.cat([counts, unsure.sum(0, keepdim=True)])
    # the one host read (NOTE [The PyTorch path on a GPU])
    kh, *n_unsure = counts.tolist()
    if n_unsure and n_unsure[0]:
        _exact_sums(flat, sums, unsure, inv.x_star)
    # the dense fallback is taken before the indices are made (8 B per hard element) and frees
    # the flags and bits before x's copy; the table path frees the flags once read. Half-type
    # SiLU/Mish past HALF_DENSE_MAX between two Linears under bf16 autocast (524,288 elements)
    # peaked up to 1.52x eager's step (5,468,466 B against 3,604,616) when most elements were
    # hard, and 1.05x at 4% hard; now 0.98x and 0.92x (tests/ops/test_silu_mish_half_peak.py)
    if fallback and kh * FALLBACK_DIV > n:
        del flags, bits
        return y, empty_bits, empty_idx, flat.clone() if copy else flat.new_empty(0)
    hard = torch.nonzero_static(flags, size=kh).view(-1)  # increasing
    del flags
    xs = flat.index_select(0, hard)
    if tail is not None and kh:  # CHUNK by CHUNK: window (and non-finite) hits, then tail hits
        chunk = hard.div(CHUNK, rounding_mode="floor")
        late = (xs < tail).logical_and_((sums < math.inf).index_select(0, chunk))  # sums >= 0
        order = torch.sort(torch.add(late, chunk, alpha=2), stable=True).indices
        hard, xs = hard.index_select(0, order), xs.index_select(0, order)
    return y, bits, hard.to(idx_dtype), xs


def _span(t: torch.Tensor) -> int:
    """The span of the passes over ``t`` (NOTE [The PyTorch path on a GPU], HALF_SPANS)."""
    if t.device.type != "cpu":
        return BIG
    if t.element_size() >= 4:
        return CPU_SPAN
    # a power of two (HALF_MIN_SPAN at least: a multiple of 8 that divides CHUNK when below it)
    return min(CPU_SPAN, max(HALF_MIN_SPAN, 1 << (-(-t.numel() // HALF_SPANS) - 1).bit_length()))


def _span_flags(c, a: int, bits, flags, sums, x_star: float, w: float, tail, sums64=None):
    """One span ``c`` at offset ``a`` of :func:`smooth_fwd`: writes its packed bits, its hard
    flags and, with a tail, its per-CHUNK sums of |x - x*| (``sums64``: the span lies in one
    CHUNK; its float64 sum is added to that CHUNK's); returns its hard count on the device
    (one element)."""
    m = c.numel()
    t = c - x_star if c.dtype == torch.float32 else c.float().sub_(x_star)
    bits[a // 8 : a // 8 + packed_numel(m)] = pack_bits(t >= 0)
    t.abs_()
    if sums64 is not None:
        sums64[a // CHUNK :][:1].add_(t.sum(0, keepdim=True, dtype=torch.float64))
    elif tail is not None:
        full = m // CHUNK
        if full:
            torch.sum(t[: full * CHUNK].view(full, CHUNK), 1, out=sums[a // CHUNK :][:full])
        if full * CHUNK < m:  # the tensor's last, partial CHUNK
            torch.sum(t[full * CHUNK :], 0, keepdim=True, out=sums[-1:])
    h = torch.lt(t.nan_to_num_(0.0, 0.0), w, out=flags[a : a + m])  # window, NaN, +-inf (as 0)
    del t
    if tail is not None:
        h.logical_or_(c < tail)
    return h.sum(0, keepdim=True)


# NOTE [Sums below a CHUNK]
# smooth_fwd's side table orders a CHUNK's tail hits by whether its float32 sum of t = |x - x*|
# (torch.sum over the CHUNK, as one span of CHUNK elements computes it) is finite. Spans below a
# CHUNK (half types on CPU, HALF_SPANS) never hold a CHUNK's t: each adds its t's float64 sum
# (within 2^-40 of the exact sum, relatively) to its CHUNK's. The float32 sum of at most 2^16
# non-negative terms, in any order, lies within a factor (1 + 2^-24)^(2^16) < 1.004 of the exact
# sum, so it is finite where the float64 sum is below float32's largest value / 1.01, and not
# where it is above that times 1.01 (or NaN, or inf). A CHUNK between the two (a sum within 1% of
# 3.4e38) is unsure: its t is built again, one CHUNK at a time, and summed exactly as a CHUNK span
# sums it (_exact_sums), so the side table is the one CHUNK-wide spans give, order included.
_F32_MAX = float(torch.finfo(torch.float32).max)


def _sums_from_f64(sums64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 sums with the float32 sums' finiteness: 0 or inf; unsure CHUNKs, bool)."""
    finite = sums64 < _F32_MAX / 1.01
    unsure = (sums64 <= _F32_MAX * 1.01).logical_and_(finite.logical_not())
    sums = torch.zeros(sums64.shape, dtype=torch.float32, device=sums64.device)
    return sums.masked_fill_(finite.logical_not_(), math.inf), unsure


def _exact_sums(flat: torch.Tensor, sums: torch.Tensor, unsure: torch.Tensor, x_star: float):
    """The unsure CHUNKs' float32 sums of t, as a span of CHUNK elements computes them."""
    for j in unsure.nonzero().view(-1).tolist():
        t = flat[j * CHUNK : (j + 1) * CHUNK].float().sub_(x_star).abs_()
        if t.numel() == CHUNK:
            torch.sum(t.view(1, CHUNK), 1, out=sums[j : j + 1])
        else:  # the tensor's last, partial CHUNK
            torch.sum(t, 0, keepdim=True, out=sums[j : j + 1])
        del t


def is_dense_fallback(n: int, bits, idx, xs) -> bool:
    return n > 0 and xs.numel() == n and idx.numel() == 0 and bits.numel() == 0


def is_fallback_result(n: int, bits, idx, xs) -> bool:
    # a forward's dense fallback, with x's copy or, asked for none (``copy=False``), an empty xs
    return n > 0 and bits.numel() == 0 and idx.numel() == 0 and xs.numel() in (n, 0)


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
    span = _span(g)
    for a in range(
        0, n, span
    ):  # on a GPU: one span for n <= BIG (NOTE [The PyTorch path on a GPU])
        b = min(a + span, n)
        _grad_span(inv, gf[a:b], yf[a:b], cdt, bits[a // 8 : (b + 7) // 8], res[a:b])
    if i is not None:
        res[i] = bwd_exact(gh, xs)
    return res.view(g.shape) if out is None else out


def _grad_span(inv: _Inverse, g: torch.Tensor, y: torch.Tensor, cdt, bits, out) -> None:
    if y.dtype == cdt:
        torch.mul(g, inv.df(y, bits), out=out)
        return
    # half types: y's float32 copy is this span's own (df writes over it), and the product goes
    # into df's buffer: 16 B of float32 temporaries per element at most (the same bits)
    df = inv.df(y.to(cdt), bits, own=True)
    del y
    out.copy_(torch.mul(g.to(cdt), df, out=df))


# -------------------------------------------------------------------------------------------------
# The three activations (eager's own forward and backward from x for the side table and fallback)


# SiLU's and Mish's left tail: there f' -> 0 like x e^x while the left table's last interval (y in
# (-3.4e-5, 0)) interpolates it linearly: the table's absolute error (~1e-7) becomes a large
# relative one (on every 1009th float32: 1.6e-4 on [-10, -6), 2.4e-2 on [-15, -12), 100%
# below -15; eager: 2e-7). Below the tail x is kept exactly (N(0, 1): 1e-9 of the elements).
_LEFT_TAIL = {torch.float32: -6.0, torch.bfloat16: -10.0, torch.float16: -10.0}


def _silu_f(x):
    return x * torch.sigmoid(x)


def _silu_df(x):
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


SILU = SmoothSpec(
    "silu",
    _silu_f,
    _silu_df,
    window={torch.float32: 0.05, torch.float64: 1e-6, torch.bfloat16: 0.15, torch.float16: 0.15},
    tail=_LEFT_TAIL,
    x_right=20.0,
    grad_into=lambda g, x, out: torch.ops.aten.silu_backward.grad_input(g, x, grad_input=out),
    op=torch.nn.functional.silu,
    op_backward=lambda g, x: torch.ops.aten.silu_backward(g, x),
)


def _mish_f(x):
    return x * torch.tanh(torch.nn.functional.softplus(x))


def _mish_df(x):
    t = torch.tanh(torch.nn.functional.softplus(x))
    return t + x * torch.sigmoid(x) * (1.0 - t * t)


MISH = SmoothSpec(
    "mish",
    _mish_f,
    _mish_df,
    window={torch.float32: 0.08, torch.float64: 1e-6, torch.bfloat16: 0.15, torch.float16: 0.15},
    tail=_LEFT_TAIL,
    x_right=20.0,
    op=torch.nn.functional.mish,
    op_backward=lambda g, x: torch.ops.aten.mish_backward(g, x),
)

_K = math.sqrt(2.0 / math.pi)
_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_erf_f(x):
    return x * 0.5 * torch.special.erfc(-x * _SQRT1_2)


def _gelu_erf_df(x):
    return 0.5 * torch.special.erfc(-x * _SQRT1_2) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh_f(x):  # x/2 (1 + tanh u) = x sigmoid(2u), stable in the left tail
    return x * torch.sigmoid(2.0 * _K * (x + 0.044715 * x**3))


def _gelu_tanh_df(x):
    s = torch.sigmoid(2.0 * _K * (x + 0.044715 * x**3))
    return s + x * 2.0 * s * (1.0 - s) * _K * (1.0 + 3.0 * 0.044715 * x * x)


def gelu_bwd_exact(g: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(g, x, approximate=approximate)


def _gelu_grad_into(g, x, out, approximate: str):
    return torch.ops.aten.gelu_backward.grad_input(g, x, approximate=approximate, grad_input=out)


_LOW = {torch.bfloat16: 0.15, torch.float16: 0.15}
GELU = {
    "none": SmoothSpec(
        "gelu",
        _gelu_erf_f,
        _gelu_erf_df,
        window={torch.float32: 0.03, torch.float64: 1e-6, **_LOW},
        tail={torch.float32: -2.5},
        x_right=8.0,
        grad_into=lambda g, x, out: _gelu_grad_into(g, x, out, "none"),
        op=lambda x: torch.nn.functional.gelu(x, approximate="none"),
        op_backward=lambda g, x: gelu_bwd_exact(g, x, "none"),
    ),
    "tanh": SmoothSpec(
        "gelu_tanh",
        _gelu_tanh_f,
        _gelu_tanh_df,
        window={torch.float32: 0.06, torch.float64: 1e-6, **_LOW},
        tail={torch.float32: -3.0},
        x_right=8.0,
        grad_into=lambda g, x, out: _gelu_grad_into(g, x, out, "tanh"),
        op=lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        op_backward=lambda g, x: gelu_bwd_exact(g, x, "tanh"),
    ),
}

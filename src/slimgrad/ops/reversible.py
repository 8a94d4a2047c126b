"""Reversible chains: keep no activations, rebuild every block's input from its output in backward.

Math. A coupling block splits its input along ``split_dim`` into ``(x1, x2)`` (first half
``ceil(n/2)``):

    additive:  y1 = x1 + F(x2)             inverse:  x2 = y2 - G(y1)
               y2 = x2 + G(y1)                       x1 = y1 - F(x2)
    affine:    (r, t) = F(x2),  s = exp(c * tanh(r / c)),  y1 = x1 * s + t,   x1 = (y1 - t) / s

so ``s`` lies in ``[e^-c, e^c]`` and can never reach 0. Backward of one block, given ``(y1, y2)``
and ``(dy1, dy2)``, evaluates G and F exactly once each and uses each evaluation both to invert and
for the vector-Jacobian product (the RevNet algorithm):

    g = G(y1) (with grad): x2 = y2 - g, dy1 += (dg/dy1)^T dy2, dθ_G = (dg/dθ_G)^T dy2
    f = F(x2) (with grad): x1 = y1 - f, dx2 = dy2 + (df/dx2)^T dy1, dθ_F = (df/dθ_F)^T dy1,
        dx1 = dy1

Exact mode (additive couplings): the residual stream is held in fixed point, as int32 integers
counting ``2^-grid_bits`` (NOTE [Exact-mode integer stream]). F and G run in the input's dtype on
the stream's value rounded to it, their outputs are rounded onto the grid (straight-through in
backward: ``round(f) = f`` for the gradient) and added as integers. Then
``x1 = (x1 + round(F(x2))) - round(F(x2))`` holds bit for bit, every block input is rebuilt
exactly, and the gradients (held in the input's dtype) equal plain autograd's on the same network
to the bit (``reversible=False``). A stream that would leave int32 (``|value| >= 2^(31 -
grid_bits)``, 2048 at the default 20) continues in int64 with a RuntimeWarning (exact: the same
integers; 8 B/elt from then on); one that would leave int64 raises a RuntimeError. Nothing
overflows silently.

Cost: backward evaluates every F and G once more than plain autograd: the recompute RevNet cannot
avoid (its inversion and its vector-Jacobian product share that one evaluation; nothing else is
recomputed, copied or zeroed). One no-grad forward of every F and G (``fg_over_plain`` in the
bench records) is therefore the floor of the extra time, undercut only where plain autograd itself
wastes time (zero-filled slice gradients, concatenations, the page faults of its fresh activations:
NOTE [Page faults in CPU step times]). The measured ratios against plain autograd,
``torch.utils.checkpoint``, a hand-written RevNet backward and revlib are in
``benchmarks/results/reversible*.jsonl`` and ``docs/measurements.md``.

Memory: saves the chain output y (float mode: 1x the input, often shared with the next layer; exact
mode: the int32 stream, 4 B/elt; 8 B/elt once promoted to int64) + per block 2 CPU RNG states
(5056 B each) + 64 sampled elements; eager saves every activation of every F and G (and every
block output), growing linearly with depth. Exact mode rebuilds the last block's input into its
saved stream when nothing else holds it and the graph is not kept (``ownership.take_saved``), so
the backward needs no second stream-sized buffer. The bytes of the bench chain at N = 4..64:
``benchmarks/results/reversible.jsonl`` and ``docs/measurements.md``.

# NOTE [Reversible chains: nothing is freed, nothing is kept]
memcnn saves memory by emptying the input's storage (``storage().resize_(0)``) and refilling it in
backward. That storage belongs to the user: views, hooks, residuals and ops that saved it still read
it (segfaults, wrong gradients, "modified by an inplace operation"). Here no storage is ever freed,
resized or swapped. The whole chain is one autograd Function whose forward runs the blocks under
no_grad and saves only its own output; every block input is dropped simply because nothing
references it anymore. Tensors the user still holds (the chain input, a view of it, a tensor
captured by a hook) stay intact because we never write to them. Backward walks the blocks in
reverse, rebuilding inputs from outputs and returning gradients through autograd (parameters are
inputs of the Function, so each gets exactly one AccumulateGrad: DDP hooks and ``autograd.grad``
work, and ``.grad`` is never assigned by hand). State for backward is kept in a plain object on ctx
that references no output tensor, so a graph that is dropped without backward is freed by reference
counting, with no cycle. The one write backward does: a block input it rebuilt itself becomes the
next block's output and is overwritten by that block's rebuild, but only when no other tensor
aliases its storage (a hook inside F or G may hold one); the saved output, the incoming gradient
and every gradient are never written.

Recompute fidelity: per block, the CPU (and device) RNG state is captured right before F and right
before G, and restored for each one's recompute inside ``fork_rng`` (dropout masks repeat bit for
bit, the caller's RNG is untouched); BatchNorm layers in training mode run the recompute with
``track_running_stats`` off (batch statistics as in forward, running statistics updated once per
step, by forward); the forward's autocast state is re-entered for the recompute, and left before the
vector-Jacobian product so backward kernels run as in eager.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimgrad import ownership
from slimgrad._autograd import first_order, refuse_jit, transforms_active
from slimgrad._compile import eager_only
from slimgrad._errors import internal_error
from slimgrad.kernels import _backend

__all__ = ["reversible_sequential"]

_API = "slimgrad.nn.ReversibleSequential"
DIAG_SAMPLES = 32  # elements sampled per half-stream and block for the reconstruction diagnostic


# --------------------------------------------------------------------------------------------- math
def split_halves(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[dim]
    n1 = (n + 1) // 2
    return t.narrow(dim, 0, n1), t.narrow(dim, n1, n - n1)


def affine_scale(raw: torch.Tensor, clamp: float) -> torch.Tensor:
    return torch.exp(torch.tanh(raw / clamp) * clamp)


class _GridRoundFn(torch.autograd.Function):
    # Round onto the grid 2^-bits in float64; straight-through gradient (cast back to the input
    # dtype).
    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.in_dtype = t.dtype
        t64 = t.to(torch.float64)
        t64 = t64 * scale if t64 is t else t64.mul_(scale)  # never write into the caller's t
        return t64.round_().div_(scale)

    @staticmethod
    @first_order("nn.ReversibleSequential", double=lambda ctx, g: (g.to(ctx.in_dtype), None))
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.in_dtype), None


def grid_round(t: torch.Tensor, grid_bits: int) -> torch.Tensor:
    """Round ``t`` onto the grid ``2^-grid_bits`` in float64, with a straight-through gradient."""
    return _GridRoundFn.apply(t, float(2**grid_bits))


# NOTE [Exact-mode integer stream]
# Exact mode holds the residual stream as integers u on the grid 2^-b (value u * 2^-b; b =
# grid_bits, default 20), in int32 (4 B/elt, |value| < 2^(31-b) = 2048 at b = 20) or int64
# (8 B/elt, < 2^(63-b)). Per coupling half: F's input is the "image" of the stream half, its value
# rounded to F's dtype (``_image``: int32 -> float32/float64 is correctly rounded and the scaling
# by 2^-b is exact, so it equals rounding the exact value); F's output is rounded onto the grid,
# ``q = round(F * 2^b)`` (``_grid_units``: scaling by a power of two is exact and rounding a float
# to an integer is exact in its own format, so float32 gives the float64 result); the sum
# ``u + q`` is integer arithmetic, hence exact. Backward re-runs F on the same image (bit-identical
# input, same RNG state) and subtracts the same q: every block input is rebuilt bit for bit.
# Gradients are straight-through, in F's dtype: d(stream) = d(y), d(F out) = d(y); the stream's
# gradient is held in the input's dtype (no float64 pass), so it equals plain autograd of this
# network (``_GridInFn``/``_GridStepFn``, reversible=False) to the bit: the same two-term sums.
# Overflow is never silent: before each sum, max|q| is read (one sync per coupling half) and
# bound + max|q| checked against the dtype's range, where bound >= max|half| is kept in a Python
# float (bound_new = bound + max|q|, tightened to the half's true max when it gets close). A sum
# that could leave int32 first converts the stream to int64 (the same integers: exact) and warns;
# one that could leave int64, or a NaN/inf output, raises a RuntimeError naming grid_bits and
# stream_dtype. Why 2^-20: F's output is perturbed by <= 2^-21 (about 4 float32 ulps at 1), and
# 2^-20 rebuilt bit for bit at N = 8..64 (docs/measurements.md). Its int32 range, +-2048, holds
# chains whose stream stays moderate; not the bench chain (random conv3x3+ReLU couplings without
# normalisation: the stream grows ~1.3x per block, past 2048 at N ~ 28, to 1.5e7 at
# N = 64): that chain needs grid_bits <= 6 to stay in int32, or int64 (what exact mode falls back
# to). On CPU with float32 F/G, the three stream steps (image; max|q| then u += q; u - q in
# backward) run kernels/cpu/reversible.c, one pass each and no temporaries (the PyTorch path takes
# 4-6 passes and two stream-half temporaries per sum): the same integers and images, bit for bit
# (tests/kernels/test_reversible.py); the step time against the PyTorch path: docs/measurements.md.
# The last block's rebuild goes into the saved stream itself when ``ownership.take_saved`` grants
# it (the graph is not kept, nobody else holds the stream): the stream never reaches user code (F
# and G see images), so after that grant every rebuilt half is ours to overwrite.
def _grid_units(f: torch.Tensor, scale: float) -> torch.Tensor:
    # round(f * scale), integer-valued, in float32 (float64 for float64 f)
    rd = torch.float64 if f.dtype == torch.float64 else torch.float32
    return torch.mul(f.to(rd), scale).round_()


def _image(plan: _Plan, u: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    # the stream's value u * 2^-b rounded once to ``dtype`` (default: F's)
    dtype = dtype or plan.compute_dtype
    if dtype == torch.float32 and (fns := _stream_lib(u, plan=plan)) is not None:
        runs = _runs(u)
        if runs is not None:
            from slimgrad.kernels._cpu import threads

            out = torch.empty(u.shape, dtype=dtype)
            fns[u.dtype, "image"](u.data_ptr(), *runs, out.data_ptr(), plan.inv_scale, threads())
            return out
    if dtype == torch.get_default_dtype():  # int * float -> the default dtype, one pass
        return torch.mul(u, plan.inv_scale)
    if dtype in (torch.float32, torch.float64):
        return u.to(dtype).mul_(plan.inv_scale)
    return u.to(torch.float64).mul_(plan.inv_scale).to(dtype)


def _absmax(t: torch.Tensor) -> torch.Tensor:
    # max |t| as a float64 scalar tensor (no sync); NaN propagates
    lo, hi = torch.aminmax(t.detach())
    return torch.maximum(lo.double().neg(), hi.double())


# The stream steps below run kernels/cpu/reversible.c (one pass each) on CPU when F/G compute in
# float32 and the backend allows it (NOTE [Kernel backend choice]); else the PyTorch path. Both
# give the same integers (rounding half to even of an exactly scaled float, an exact conversion);
# images are float32(u) * 2^-b either way, and one process uses one path for a whole step.
C_STEM = "reversible"
_STREAM_DTYPES = (torch.int32, torch.int64)


def _runs(t: torch.Tensor) -> tuple[int, int, int] | None:
    # (rows, len, stride): t's elements as ``rows`` contiguous runs of ``len``, ``stride`` apart
    # (a stream half is a narrow view of the whole stream); None if t has no such layout.
    shape, stride = t.shape, t.stride()
    inner, k = 1, t.dim()
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    rows, step = 1, inner
    for d in range(k - 1, -1, -1):
        if shape[d] == 1:
            continue
        if rows == 1:
            rows, step = shape[d], stride[d]
        elif stride[d] == step * rows:
            rows *= shape[d]
        else:
            return None
    return rows, inner, step


def _stream_lib(u: torch.Tensor, h: torch.Tensor | None = None, plan: _Plan | None = None):
    # the C kernels for stream (half) u and F/G output h, or None (PyTorch path). The backend
    # choice is made once per chain call and kept on ``plan`` (it costs more than a small kernel).
    if u.dtype not in _STREAM_DTYPES or u.numel() == 0 or u.device.type != "cpu":
        return None
    if h is not None and (h.dtype != torch.float32 or h.shape != u.shape or not h.is_contiguous()):
        return None
    if plan is None:
        return _load_stream_fns(u)
    if plan.stream_fns is _UNSET:
        plan.stream_fns = _load_stream_fns(u)
    return plan.stream_fns


_UNSET = object()


def _load_stream_fns(u: torch.Tensor):
    lib = _backend.use_cpu(u, C_STEM, dtypes=_STREAM_DTYPES)
    if lib is None:
        return None
    from slimgrad.kernels._cpu import functions

    return functions(lib, _c_signatures)


def _c_signatures(C):
    # keys: "absmax", and (stream dtype, "add" | "sub" | "image")
    p, i64, f, i = C.c_void_p, C.c_int64, C.c_float, C.c_int
    sigs = {"absmax": ("rev_absmax_units_f32", [p, i64, f, i], C.c_double)}
    for dt, suffix in ((torch.int32, "i32"), (torch.int64, "i64")):
        sigs[dt, "add"] = (f"rev_add_units_{suffix}", [p, i64, i64, i64, p, f, i], None)
        sigs[dt, "sub"] = (f"rev_sub_units_{suffix}", [p, p, i64, i64, i64, i64, p, f, i], None)
        sigs[dt, "image"] = (f"rev_image_{suffix}", [p, i64, i64, i64, p, f, i], None)
    return sigs


def _units_absmax(h: torch.Tensor, scale: float, fns) -> tuple[float, torch.Tensor | None]:
    # (max |round(h * scale)| (NaN if any NaN), the units themselves on the PyTorch path, for
    # _add_units): the one host read per coupling half
    if fns is not None:
        from slimgrad.kernels._cpu import threads

        return fns["absmax"](h.data_ptr(), h.numel(), scale, threads()), None
    q = _grid_units(h, scale)
    return float(_absmax(q)), q


def _add_units(
    t: torch.Tensor, h: torch.Tensor, scale: float, qdt: torch.dtype, fns, q: torch.Tensor | None
) -> None:
    # t += round(h * scale) in place (range checked by the caller); the PyTorch path adds the
    # units ``q`` converted to ``qdt`` (int32 whenever they fit: faster than int64 on CPU)
    runs = _runs(t) if fns is not None else None
    if runs is None:
        t.add_((q if q is not None else _grid_units(h, scale)).to(qdt))
        return
    from slimgrad.kernels._cpu import threads

    fns[t.dtype, "add"](t.data_ptr(), *runs, h.data_ptr(), scale, threads())


def _sub_units(
    y: torch.Tensor, h: torch.Tensor, scale: float, qdt: torch.dtype, inplace: bool, fns
) -> torch.Tensor:
    # y - round(h * scale), into y when ``inplace`` (the subtraction forward's sum undoes)
    runs = _runs(y) if fns is not None else None
    if runs is None:
        q = _grid_units(h, scale).to(qdt)
        return y.sub_(q) if inplace else y - q
    from slimgrad.kernels._cpu import threads

    out = y if inplace else torch.empty(y.shape, dtype=y.dtype)
    out_stride = runs[2] if inplace else runs[1]
    sub = fns[y.dtype, "sub"]
    sub(y.data_ptr(), out.data_ptr(), *runs, out_stride, h.data_ptr(), scale, threads())
    return out


class _ExactStream:
    # The integer stream of one exact-mode forward: ``u`` (the whole stream; ``a``/``b`` are its
    # halves, updated in place), ``bound_a``/``bound_b`` (Python floats >= max |half|) and, in
    # grad mode (reversible=False), the halves' images ``ia``/``ib`` carrying autograd's graph.
    def __init__(self, plan: _Plan, x: torch.Tensor, grad: bool) -> None:
        self.plan = plan
        q = _grid_units(x.detach(), plan.scale)
        m = float(_absmax(q))
        if not m < _LIMIT[plan.stream_dtype]:
            _widen(plan, m)
        self.u = q.to(plan.stream_dtype)
        self.a, self.b = split_halves(self.u, plan.split_dim)
        self.bound_a = self.bound_b = m
        self.ia = self.ib = None
        if grad:
            self.ia, self.ib = split_halves(_GridInFn.apply(x, self.u, plan), plan.split_dim)

    def add(self, half: str, h: torch.Tensor) -> torch.dtype:
        # half += round(h * 2^b), overflow checked first (NOTE [Exact-mode integer stream]).
        # Returns the integer dtype q was converted to: int32 whenever it fits (float -> int64
        # conversion and int64 + int64 are several times slower on CPU than their int32 forms).
        plan = self.plan
        hd = h.detach()
        fns = _stream_lib(getattr(self, half), hd, plan)
        mq, q = _units_absmax(hd, plan.scale, fns)  # the one sync per coupling half
        worst = getattr(self, "bound_" + half) + mq
        if not worst < _LIMIT[plan.stream_dtype]:
            # the running bound is conservative: tighten it with the half's true max first
            worst = float(_absmax(getattr(self, half))) + mq
            if not worst < _LIMIT[plan.stream_dtype]:
                _widen(plan, worst)
                self.u = self.u.to(plan.stream_dtype)
                self.a, self.b = split_halves(self.u, plan.split_dim)
        t = getattr(self, half)
        qdt = torch.int32 if mq < _LIMIT[torch.int32] else t.dtype
        _add_units(t, hd, plan.scale, qdt, fns, q)
        setattr(self, "bound_" + half, worst)
        img = getattr(self, "i" + half)
        if img is not None:
            setattr(self, "i" + half, _GridStepFn.apply(img, h, t, plan))
        return qdt


# |stream| + |units| below these fit the dtype (int64: a margin for the float64 bound's rounding)
_LIMIT = {torch.int32: 2.0**31, torch.int64: 2.0**63 - 2.0**12}


def _widen(plan: _Plan, worst: float) -> None:
    # The stream would leave its dtype: int32 continues in int64 (exact: the same integers) with a
    # warning; int64 (or NaN/inf) raises.
    if plan.stream_dtype == torch.int32 and worst < _LIMIT[torch.int64]:
        warnings.warn(
            f"{_API}: exact mode's int32 stream would overflow (|values| reach "
            f"2^{31 - plan.grid_bits} with grid_bits={plan.grid_bits}); continuing in int64 (8 "
            "B/elt instead of 4, results unchanged). Pass stream_dtype=torch.int64 to skip this "
            "warning, or a smaller grid_bits to stay in int32.",
            RuntimeWarning,
            stacklevel=2,
        )
        plan.stream_dtype = torch.int64
        return
    bits = torch.iinfo(plan.stream_dtype).bits - 1
    dt = str(plan.stream_dtype).replace("torch.", "")
    raise RuntimeError(
        f"{_API}: exact mode's fixed-point stream would overflow its {dt} range; expected "
        f"|stream| + |rounded F/G output| < 2^{bits - plan.grid_bits} with "
        f"grid_bits={plan.grid_bits}, got up to {worst * plan.inv_scale:.4g}. Use a smaller "
        "grid_bits (the range doubles per bit removed), stream_dtype=torch.int64 (8 B/elt, "
        f"range 2^{63 - plan.grid_bits}), or keep activations smaller."
    )


class _GridInFn(torch.autograd.Function):
    # plain-autograd view of the chain input on the grid: value = image(u), gradient to x as is
    @staticmethod
    def forward(ctx, x: torch.Tensor, u: torch.Tensor, plan: _Plan) -> torch.Tensor:
        return _image(plan, u, x.dtype)

    @staticmethod
    @first_order("nn.ReversibleSequential", double=lambda ctx, g: (g, None, None))
    def backward(ctx, g: torch.Tensor):
        return g, None, None


class _GridStepFn(torch.autograd.Function):
    # plain-autograd view of ``u_a + round(h)`` (u_a already updated in place): value = image(u_a),
    # straight-through gradients to the old image and to h (in h's dtype)
    @staticmethod
    def forward(ctx, xa: torch.Tensor, h: torch.Tensor, u: torch.Tensor, plan: _Plan):
        ctx.h_dtype = h.dtype
        return _image(plan, u, xa.dtype)

    @staticmethod
    @first_order(
        "nn.ReversibleSequential", double=lambda ctx, g: (g, g.to(ctx.h_dtype), None, None)
    )
    def backward(ctx, g: torch.Tensor):
        return g, g.to(ctx.h_dtype), None, None


# --------------------------------------------------------------------------------------------- plan
@dataclass
class _Plan:
    # What backward needs besides the saved output. Holds no tensor that references an output: no
    # cycle.
    blocks: list[nn.Module]
    split_dim: int
    exact: bool
    grid_bits: int
    compute_dtype: torch.dtype | None
    preserve_rng_state: bool
    sink: Any  # ``_record_reconstruction(first, errors, scales)`` receives the diagnostic
    flat_params: list[torch.Tensor] = field(default_factory=list)  # Function inputs after x
    block_params: list[list[list[int]]] = field(default_factory=list)  # per block: [F, G] indices
    rng: list[tuple] = field(default_factory=list)  # per block (state before F, state before G)
    samples: list[tuple] = field(default_factory=list)  # per block input: sampled elements
    qdt: list[tuple] = field(default_factory=list)  # exact: per block, F's and G's q dtypes
    autocast: tuple = ()
    device: torch.device | None = None
    stream_dtype: torch.dtype = torch.int32  # exact mode's integer stream
    # id(F, G or block) -> [(submodule, name, parameter)] as seen in forward
    forward_params: dict[int, list] = field(default_factory=dict)
    # (parameter, its version at forward, its name): checked before the backward recompute
    param_versions: list = field(default_factory=list)
    bn_layers: dict[int, list] = field(default_factory=dict)  # id(module) -> BatchNorms inside
    stream_fns: Any = _UNSET  # exact mode: the C stream kernels or None, chosen once (_stream_lib)

    @property
    def scale(self) -> float:
        return float(2**self.grid_bits)

    @property
    def inv_scale(self) -> float:
        return 2.0**-self.grid_bits


def _is_coupling(blk: nn.Module) -> bool:
    return getattr(blk, "_slimgrad_coupling", None) in ("additive", "affine")


def _call(plan: _Plan, fn: nn.Module, xb: torch.Tensor) -> torch.Tensor:
    # F or G on a stream half (exact mode, no grad: on its image)
    return fn(_image(plan, xb) if plan.exact else xb)


def _coupled(plan: _Plan, blk: nn.Module, xa: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    # ya = c(xa, h), h = F(xb) (float mode)
    _check_fg_output(plan, blk, xa, h)
    return _half_fwd(blk, xa, h)


def _check_fg_output(plan: _Plan, blk: nn.Module, xa: torch.Tensor, h: torch.Tensor) -> None:
    # F/G must return the other half's shape (affine: twice it along split_dim, [log-scale,
    # shift]); a broadcastable shape would silently mix elements, another one fail in torch.
    want = list(xa.shape)
    if blk._slimgrad_coupling == "affine":
        want[plan.split_dim] *= 2
    if list(h.shape) != want or not isinstance(h, torch.Tensor):
        raise RuntimeError(
            f"{_API}: a coupling's F or G returned the wrong shape; expected {tuple(want)} "
            f"({blk._slimgrad_coupling} coupling of halves {tuple(xa.shape)} along dim "
            f"{plan.split_dim}), got {tuple(h.shape)}. Make F and G map one half to a tensor "
            "of that shape."
        )


def _uncoupled(
    plan: _Plan, blk: nn.Module, ya: torch.Tensor, h: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    # xa = c^-1(ya, h), no grad; ``inplace`` writes into ya (a rebuilt tensor of ours). Exact
    # mode: integer subtraction of the same grid units forward added.
    if not plan.exact:
        return _half_inv(blk, ya, h, inplace=inplace)
    return _sub_units(ya, h, plan.scale, ya.dtype, inplace, _stream_lib(ya, h, plan))


def _as_in_forward(plan: _Plan, fn: nn.Module):
    # The recompute must use the tensors forward used. Under torch.func.functional_call the module's
    # parameters are swapped only during forward; replay the swap so gradients reach them.
    entries = plan.forward_params.get(id(fn))
    if entries is None or all(sub._parameters.get(n) is p for sub, n, p in entries):
        return fn
    named: list[tuple] = []
    _walk(fn, named, [], "")  # the same walk, now with qualified names
    rec = {e[3]: p for e, (_, _, p) in zip(named, entries, strict=True)}
    return lambda x: torch.func.functional_call(fn, rec, (x,), strict=False)


def _half_fwd(blk: nn.Module, xa: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if blk._slimgrad_coupling == "additive":
        return xa + h
    r, t = h.chunk(2, dim=blk.split_dim)
    return torch.addcmul(t, xa, affine_scale(r, blk.clamp))


def _half_inv(
    blk: nn.Module, ya: torch.Tensor, h: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    if blk._slimgrad_coupling == "additive":
        return ya.sub_(h) if inplace else ya - h
    r, t = h.chunk(2, dim=blk.split_dim)
    if inplace:
        return ya.sub_(t).div_(affine_scale(r, blk.clamp))
    return (ya - t) / affine_scale(r, blk.clamp)


# ------------------------------------------------------------------------------ recompute contexts
def _rng_get(device: torch.device | None) -> tuple:
    dev_state = None
    if device is not None and device.type not in ("cpu", "meta"):
        dev_state = torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), dev_state


def _rng_set(state: tuple, device: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)


def _autocast_state(device: torch.device) -> tuple:
    types = ["cpu"] if device.type == "cpu" else ["cpu", device.type]
    return tuple(
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in types
    ) + (torch.is_autocast_cache_enabled(),)


@contextlib.contextmanager
def _autocast(state: tuple) -> Iterator[None]:
    *per_type, cache = state
    with contextlib.ExitStack() as stack:
        for dt, enabled, dtype in per_type:
            stack.enter_context(
                torch.autocast(device_type=dt, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


def _bn_layers(plan: _Plan | None, module: nn.Module) -> list:
    key = id(module)
    found = plan.bn_layers.get(key) if plan is not None else None
    if found is None:
        found = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if plan is not None:
            plan.bn_layers[key] = found
    return found


@contextlib.contextmanager
def _stats_frozen(module: nn.Module, plan: _Plan | None = None) -> Iterator[None]:
    # Recompute uses batch statistics (as forward did) without updating running stats a second time.
    flipped = [m for m in _bn_layers(plan, module) if m.training and m.track_running_stats]
    for m in flipped:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in flipped:
            m.track_running_stats = True


def _recompute(plan: _Plan, module: nn.Module, rng_state: tuple | None):
    # Context for one recompute: the RNG state as before the forward evaluation, batch statistics
    # without a second running-stat update, the forward's autocast state. Entering torch.autocast
    # and generator-based contexts costs more than a small F, so the common case (no BatchNorm in
    # training mode, autocast as in forward) gets a null context.
    if rng_state is not None:
        _rng_set(rng_state, plan.device)
    has_bn = any(m.training and m.track_running_stats for m in _bn_layers(plan, module))
    same = _autocast_state(plan.device) == plan.autocast
    if not has_bn and same:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(_stats_frozen(module, plan))
    if not same:
        stack.enter_context(_autocast(plan.autocast))
    return stack


# ------------------------------------------------------------------------------------ diagnostics
# NOTE [Reconstruction diagnostic]: forward keeps DIAG_SAMPLES elements of every block input half
# (spread over the tensor, gathered with one ``take`` each: views need no copy); backward gathers
# the same elements of each rebuilt input, and one vectorised pass at the end compares them all.
_SAMPLE_IDX: dict[tuple, torch.Tensor] = {}


def _sample(t: torch.Tensor) -> torch.Tensor:
    key = (tuple(t.shape), t.device)
    idx = _SAMPLE_IDX.get(key)
    if idx is None:
        n, k = t.numel(), min(DIAG_SAMPLES, t.numel())
        idx = torch.arange(k, device=t.device) * (n - 1) // max(k - 1, 1)  # spread, in bounds
        if len(_SAMPLE_IDX) > 64:
            _SAMPLE_IDX.clear()
        _SAMPLE_IDX[key] = idx
    return torch.take(t.detach(), idx)


def _samples(plan: _Plan, stream: tuple) -> tuple:
    # exact mode: the sampled grid units as float64 values
    if plan.exact:
        return tuple(_sample(t).double().mul_(plan.inv_scale) for t in stream)
    return tuple(_sample(t) for t in stream)


def _sample_diffs(plan: _Plan, refs: tuple, rebuilt: tuple) -> tuple:
    # rebuilt samples minus forward samples, per stream part (no extra memory beyond the refs')
    return tuple(t - r for t, r in zip(_samples(plan, rebuilt), refs, strict=True))


def _sample_errors(refs: list[tuple], diffs: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    # Per block: max |rebuilt - ref| and max |ref| over its samples, as float64 vectors.
    inf = float("inf")
    err = torch.stack([e.double() for e in torch._foreach_norm([t for d in diffs for t in d], inf)])
    scale = torch.stack(
        [s.double() for s in torch._foreach_norm([t for r in refs for t in r], inf)]
    )
    parts = {len(r) for r in refs}
    if len(parts) == 1:
        k = parts.pop()
        return err.view(-1, k).amax(1), scale.view(-1, k).amax(1)
    ends = torch.tensor([len(r) for r in refs]).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return (
        torch.stack([err[i:j].amax() for i, j in zip(starts, ends)]),
        torch.stack([scale[i:j].amax() for i, j in zip(starts, ends)]),
    )


# ---------------------------------------------------------------------------------- forward steps
def _to_halves(stream: tuple, dim: int) -> tuple:
    return stream if len(stream) == 2 else split_halves(stream[0], dim)


def _to_full(stream: tuple, dim: int) -> tuple:
    return stream if len(stream) == 1 else (torch.cat(stream, dim=dim),)


def _block_fwd(plan: _Plan, blk: nn.Module, stream: tuple, record: bool) -> tuple:
    # One block forward (float mode); with ``record``, capture what its backward needs (RNG
    # states, samples).
    if _is_coupling(blk):
        a, b = _to_halves(stream, plan.split_dim)
        if record:
            plan.samples.append(_samples(plan, (a, b)))
            rng_f = _rng_get(plan.device) if plan.preserve_rng_state else None
        a = _coupled(plan, blk, a, _call(plan, blk.F, b))
        if record:
            rng_g = _rng_get(plan.device) if plan.preserve_rng_state else None
            plan.rng.append((rng_f, rng_g))
        b = _coupled(plan, blk, b, _call(plan, blk.G, a))
        return a, b
    (x,) = _to_full(stream, plan.split_dim)
    if record:
        plan.samples.append(_samples(plan, (x,)))
        plan.rng.append((_rng_get(plan.device) if plan.preserve_rng_state else None, None))
    return (blk(x),)


def _exact_block_fwd(plan: _Plan, blk: nn.Module, st: _ExactStream, record: bool) -> None:
    # One additive coupling on the integer stream (NOTE [Exact-mode integer stream]): the halves
    # are ours (never handed to F or G, which see images), so the sums go in place.
    if record:
        plan.samples.append(_samples(plan, (st.a, st.b)))
        rng_f = _rng_get(plan.device) if plan.preserve_rng_state else None
    h = blk.F(st.ib if st.ib is not None else _image(plan, st.b))
    _check_fg_output(plan, blk, st.a, h)
    qdt_f = st.add("a", h)
    del h
    if record:
        rng_g = _rng_get(plan.device) if plan.preserve_rng_state else None
        plan.rng.append((rng_f, rng_g))
    h = blk.G(st.ia if st.ia is not None else _image(plan, st.a))
    _check_fg_output(plan, blk, st.b, h)
    qdt_g = st.add("b", h)
    del h
    if record:
        plan.qdt.append((qdt_f, qdt_g))


def _exact_fwd(plan: _Plan, x: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # (the final integer stream, the chain output: its image in x's dtype). With grad enabled the
    # output carries plain autograd's graph of the same network (reversible=False).
    st = _ExactStream(plan, x, torch.is_grad_enabled())
    for blk in plan.blocks:
        _exact_block_fwd(plan, blk, st, record)
    if st.ia is not None:
        return st.u, torch.cat([st.ia, st.ib], dim=plan.split_dim)
    return st.u, _image(plan, st.u, x.dtype)


def _finish(plan: _Plan, stream: tuple) -> torch.Tensor:
    (y,) = _to_full(stream, plan.split_dim)
    return y


# --------------------------------------------------------------------------------- backward steps
def _grad(outs, inputs: list, grads, plan: _Plan) -> list:
    # autograd.grad that tolerates inputs outside the graph and an empty input list.
    _check_captured(plan, outs, inputs)
    live = [i for i, t in enumerate(inputs) if t is not None]
    res: list = [None] * len(inputs)
    if not live:
        return res
    got = torch.autograd.grad(outs, [inputs[i] for i in live], grads, allow_unused=True)
    for i, g in zip(live, got):
        res[i] = g
    return res


def _check_captured(plan: _Plan, outs: torch.Tensor, inputs: list) -> None:
    # The recompute's graph may reach only the block input's leaf and the chain's parameters: a
    # tensor requiring grad that F/G captured otherwise (a closure, a plain attribute, another
    # module's parameter) would silently get no gradient. Walk the graph (depth first, so a
    # captured non-leaf reaches the leaf it came from quickly) and refuse such a tensor.
    allowed = {id(t) for t in inputs if t is not None}
    allowed.update(id(p) for p in plan.flat_params)
    seen: set = set()
    stack = [outs.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf requiring grad
            if id(var) not in allowed:
                raise RuntimeError(
                    f"{_API}: a block's F or G uses a tensor that requires grad but is not a "
                    f"parameter of the chain (shape {tuple(var.shape)}); expected only the block "
                    "input and the blocks' own parameters to require grad, got a captured "
                    "tensor, which the reversible backward could not give a gradient. Register "
                    "it as an nn.Parameter of F or G, detach it, or build the chain with "
                    "reversible=False."
                )
            continue
        stack.extend(n for n, _ in node.next_functions)


def _sole(t: torch.Tensor) -> bool:
    # No other tensor (view, detached alias kept by a hook or a graph) shares t's storage, and
    # nobody holds its storage object or a weak reference to it; asked without making a storage
    # object (NOTE [Storage facts without a storage object] in slimgrad.ownership)
    return ownership._storage_alone(t)


def _add(
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    dtype: torch.dtype | None = None,
    a_own: bool = False,
) -> tuple[torch.Tensor | None, bool]:
    # a + b (b cast to ``dtype`` first) and whether the result is a tensor of ours that nothing
    # else references. Gradients are summed out of place (a hook may hold either operand), except
    # into ``a`` when the caller owns it (a_own) and into b's cast (a fresh copy). Two-term sums:
    # the order is irrelevant.
    if b is None:
        return a, a_own
    if a is not None and a_own and (dtype is None or a.dtype == dtype):
        return a.add_(b), True
    if dtype is not None and b.dtype != dtype:
        b = b.to(dtype)
        return (b if a is None else b.add_(a)), True
    if a is None:
        return b, False
    return a + b, True


def _half_bwd(
    plan: _Plan,
    blk: nn.Module,
    fn: nn.Module,
    ya: torch.Tensor,
    ya_own: bool,
    xb: torch.Tensor,
    dya: torch.Tensor,
    rng_state: tuple | None,
    params: list[torch.Tensor | None],
    need_xb: bool,
    need_xa: bool,
    qdt: torch.dtype | None = None,
) -> tuple:
    # ya = c(xa, fn(xb)): rebuild xa from ya and xb with ONE evaluation of fn, and return
    # (xa, dxa, dxb_part, dparams) where dxb_part is the gradient reaching xb through fn (in fn's
    # input dtype; the caller adds it to the stream's). ya is overwritten with xa when we own it
    # (a tensor we rebuilt ourselves).
    additive = blk._slimgrad_coupling == "additive"
    if plan.exact:
        args = (plan, fn, ya, ya_own, xb, dya, rng_state, params, need_xb, need_xa, qdt)
        return _exact_half_bwd(*args)
    with torch.enable_grad():
        xb_l = xb.detach().requires_grad_(need_xb)
        with _recompute(plan, fn, rng_state):
            h = _as_in_forward(plan, fn)(xb_l)
        with torch.no_grad():
            xa = _uncoupled(plan, blk, ya, h.detach(), inplace=ya_own and _sole(ya))
        del ya
        if additive:
            outs, dxa, gout = h, dya, dya
            inputs = [xb_l if need_xb else None, *params]
        else:
            xa_l = xa.detach().requires_grad_(need_xa)
            outs, dxa, gout = _half_fwd(blk, xa_l, h), None, dya
            inputs = [xb_l if need_xb else None, xa_l if need_xa else None, *params]
        del h
        if outs.requires_grad:
            got = _grad(outs, inputs, gout, plan)
        else:
            got = [None] * len(inputs)
        del outs, inputs, gout
    dxb = got[0]
    if not additive:
        dxa = got[1]
        got = got[1:]
    return xa, (dxa if need_xa else None), dxb, got[1:]


def _exact_half_bwd(
    plan: _Plan,
    fn: nn.Module,
    ya: torch.Tensor,
    ya_own: bool,
    xb: torch.Tensor,
    dya: torch.Tensor,
    rng_state: tuple | None,
    params: list[torch.Tensor | None],
    need_xb: bool,
    need_xa: bool,
    qdt: torch.dtype,
) -> tuple:
    # _half_bwd on the integer stream (NOTE [Exact-mode integer stream]): fn runs on xb's image,
    # its output gradient is dya (straight-through rounding). The vector-Jacobian product comes
    # first, so fn's saved activations are freed before the rebuild's rounding temporaries exist.
    with torch.enable_grad():
        xb_l = _image(plan, xb).requires_grad_(need_xb)
        with _recompute(plan, fn, rng_state):
            h = _as_in_forward(plan, fn)(xb_l)
        inputs = [xb_l if need_xb else None, *params]
        del xb_l
        got = _grad(h, inputs, dya.to(h.dtype), plan) if h.requires_grad else [None] * len(inputs)
        del inputs
    with torch.no_grad():
        # stream halves never reach user code (F and G see images), so ownership is structural
        hd = h.detach()
        fns = _stream_lib(ya, hd, plan)
        if fns is not None and _runs(ya) is not None:  # one pass, no temporary
            del h
            xa = _sub_units(ya, hd, plan.scale, qdt, ya_own, fns)
            del hd
        else:
            # round in place when h is fn's output that no one else holds (no hook kept it, no
            # alias): one stream-half temporary less at the backward's peak; the count only where
            # every holder adds one (NOTE [Reference counts and the interpreter] in ownership.py)
            del hd
            if (
                h.dtype in (torch.float32, torch.float64)
                and ownership.refcounts_ok()
                and sys.getrefcount(h) <= 2
                and _sole(h)
            ):
                q = h.detach().mul_(plan.scale).round_()
            else:
                q = _grid_units(h.detach(), plan.scale)
            del h
            q = q.to(qdt)  # the dtype forward used: int32 whenever it fits
            xa = ya.sub_(q) if ya_own else ya - q
    return xa, (dya if need_xa else None), got[0], got[1:]


def _block_bwd(
    plan: _Plan,
    i: int,
    blk: nn.Module,
    state: list,
    flat_params: Sequence[torch.Tensor],
    need_upstream: bool,
    pgrads: dict[int, torch.Tensor],
) -> None:
    # Rebuild block i's input from its output. ``state`` = [stream, stream_owned, dstream,
    # dstream_owned] is replaced in place, so no caller reference keeps the old tensors alive. Only
    # a stream we rebuilt ourselves (owned) and that nothing else aliases is overwritten by its
    # rebuild. Gradient halves are summed out of place: F and G's backward (and their hooks) see
    # them.
    groups = plan.block_params[i]
    rng_f, rng_g = plan.rng[i]
    ystream, y_own, dstream, _ = state
    state[:] = [None, False, None, (False, False)]
    if _is_coupling(blk):
        y1, y2 = _to_halves(ystream, plan.split_dim)
        dy1, dy2 = _to_halves(dstream, plan.split_dim)
        # float mode owns only halves it rebuilt; exact mode also the saved stream when granted
        y_own = y_own and (plan.exact or len(ystream) == 2)
        own1 = own2 = False
        del ystream, dstream
        f_idx, g_idx = groups
        # G half: y2 = c(x2, G(y1)). y1's gradient is needed upstream and for F's parameters.
        need_y1 = need_upstream or bool(f_idx)
        gp = [flat_params[j] for j in g_idx]
        qdt_f, qdt_g = plan.qdt[i] if plan.exact else (None, None)
        x2, dx2, dz, dg = _half_bwd(
            plan, blk, blk.G, y2, y_own, y1, dy2, rng_g, gp, need_y1, True, qdt_g
        )
        del y2, dy2
        _accumulate(pgrads, g_idx, dg)
        del dg
        dy1, own1 = _add(dy1, dz, None, own1)
        del dz
        # F half: y1 = c(x1, F(x2)).
        fp = [flat_params[j] for j in f_idx]
        x1, dx1, df2, df = _half_bwd(
            plan, blk, blk.F, y1, y_own, x2, dy1, rng_f, fp, need_upstream, need_upstream, qdt_f
        )
        del y1, dy1
        _accumulate(pgrads, f_idx, df)
        del df
        dx2, own2 = _add(dx2, df2, None, own2) if need_upstream else (None, False)
        state[:] = [(x1, x2), True, (dx1, dx2), (own1, own2)]
        return
    (idx,) = groups
    (y,) = _to_full(ystream, plan.split_dim)
    (dy,) = _to_full(dstream, plan.split_dim)
    del ystream, dstream
    with torch.no_grad(), _stats_frozen(blk, plan), _autocast(plan.autocast):
        x = blk.inverse(y)
    del y
    with torch.enable_grad():
        x_l = x.detach().requires_grad_(need_upstream)
        with _recompute(plan, blk, rng_f):
            y_re = _as_in_forward(plan, blk)(x_l)
        inputs = [x_l if need_upstream else None] + [flat_params[j] for j in idx]
        got = _grad(y_re, inputs, dy, plan) if y_re.requires_grad else [None] * len(inputs)
        del y_re, inputs, dy
    _accumulate(pgrads, idx, got[1:])
    state[:] = [(x,), False, (got[0],), (False, False)]


def _accumulate(pgrads: dict[int, torch.Tensor], idx: list[int], grads: Sequence) -> None:
    for j, g in zip(idx, grads, strict=True):
        if g is not None:
            pgrads[j] = g if j not in pgrads else pgrads[j] + g


def _walk(m: nn.Module, entries: list, bns: list, path: str | None = None) -> None:
    # named_parameters(remove_duplicate=False) as (module, name, parameter[, qualified name]) and
    # the BatchNorms, in one plain recursion (the generator-based walkers cost ~5x more).
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        bns.append(m)
    for n, p in m._parameters.items():
        if p is not None:
            entries.append((m, n, p) if path is None else (m, n, p, path + n))
    for name, sub in m._modules.items():
        if sub is not None:
            _walk(sub, entries, bns, None if path is None else f"{path}{name}.")


def _param_table(plan: _Plan) -> list[torch.Tensor]:
    # One walk over every F and G (or non-coupling block): the Function's parameter inputs (those
    # requiring grad, each once), per block the indices of F's and G's, and the parameters as seen
    # now (for _as_in_forward). Walking the modules is the dominant Python cost of a small block,
    # so it happens once per forward.
    flat: list[torch.Tensor] = []
    index: dict[int, int] = {}
    plan.block_params = []
    for blk in plan.blocks:
        groups = []
        for m in (blk.F, blk.G) if _is_coupling(blk) else (blk,):
            entries: list[tuple] = []
            bns: list[nn.Module] = []
            _walk(m, entries, bns)
            plan.forward_params[id(m)] = entries
            plan.bn_layers[id(m)] = bns
            ids: list[int] = []
            for _sub, name, p in entries:
                plan.param_versions.append((p, p._version, name))
                if not p.requires_grad:
                    continue
                j = index.get(id(p))
                if j is None:
                    j = index[id(p)] = len(flat)
                    flat.append(p)
                if j not in ids:
                    ids.append(j)
            groups.append(ids)
        plan.block_params.append(groups)
    return flat


# ------------------------------------------------------------------------ forward and backward
def _fwd_torch(plan: _Plan, x: torch.Tensor, record: bool) -> torch.Tensor:
    # The chain forward (float mode); with ``record`` (no grad), keep per block what the rebuild
    # needs.
    stream: tuple = (x,)
    for blk in plan.blocks:
        stream = _block_fwd(plan, blk, stream, record=record)
    return _finish(plan, stream)


def _bwd_torch(
    plan: _Plan,
    y: torch.Tensor,
    dy: torch.Tensor,
    need_x: bool,
    need_params: Sequence[bool],
    y_own: bool = False,
) -> tuple:
    # Walk the blocks in reverse from the output: returns (dx or None, {param index: grad}).
    # ``y_own``: y may be overwritten by the last block's rebuild (exact mode's saved stream, when
    # ownership.take_saved granted it).
    first_needed = _first_block_needing(plan, need_params)
    pgrads: dict[int, torch.Tensor] = {}
    diffs: list[tuple] = []  # per rebuilt block input: sampled rebuilt - forward values
    state = [(y,), y_own, (dy,), (False, False)]
    del y, dy
    devices = [plan.device] if plan.device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=plan.device.type):
        for i in range(len(plan.blocks) - 1, -1, -1):
            need_upstream = need_x or i > first_needed
            _block_bwd(plan, i, plan.blocks[i], state, plan.flat_params, need_upstream, pgrads)
            diffs.append(_sample_diffs(plan, plan.samples[i], _rebuilt_for(plan, i, state[0])))
            if not need_upstream and i <= first_needed:
                break
    dstream = state[2]
    state.clear()
    if plan.sink is not None and diffs:
        first = len(plan.blocks) - len(diffs)
        errors, scales = _sample_errors(plan.samples[first:], diffs[::-1])
        plan.sink._record_reconstruction(first, errors, scales)
    return (_finish(plan, dstream) if need_x else None), pgrads


class _ReversibleChainFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        plan.autocast = _autocast_state(x.device)
        plan.device = x.device
        ctx.plan = plan
        if plan.exact:
            # keeps the integer stream (4 B/elt in int32), returns its image in x's dtype
            u, y = _exact_fwd(plan, x, record=True)
            ctx.save_for_backward(u)
            return y
        y = _fwd_torch(plan, x, record=True)
        if y is x or y._base is not None:
            y = y.clone()  # a Function output must be a fresh tensor to be saved as an output
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @first_order("nn.ReversibleSequential")
    def backward(ctx, dy: torch.Tensor):
        ownership.check_not_consumed(ctx, _API)
        plan: _Plan = ctx.plan
        _check_param_versions(plan)
        (y,) = ctx.saved_tensors
        # Exact mode saved its own integer stream (never handed out): unless the graph is kept
        # (retain_graph) or someone else holds it, the last block rebuilds its input into it
        # instead of a fresh stream-sized buffer. Float mode saved the chain output, which the
        # user may still read: never overwritten.
        own = plan.exact and ownership.take_saved(ctx, y) is not None
        dx, pgrads = _bwd_torch(
            plan, y, dy, ctx.needs_input_grad[1], ctx.needs_input_grad[2:], y_own=own
        )
        return (None, dx, *[pgrads.get(j) for j in range(len(plan.flat_params))])


def _check_param_versions(plan: _Plan) -> None:
    # The recompute must see the parameters forward saw: an in-place change in between (an
    # optimizer step before backward) raises autograd's error, as eager's saved tensors would.
    for p, v, name in plan.param_versions:
        if p._version != v:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [parameter {name!r} of a block, {tuple(p.shape)}] is at "
                f"version {p._version}; expected version {v} instead. Hint: {_API} recomputes "
                "its blocks in backward from the parameters as they were in forward; do not "
                "modify them (e.g. optimizer.step()) between forward and backward."
            )


def _rebuilt_for(plan: _Plan, i: int, stream: tuple) -> tuple:
    blk = plan.blocks[i]
    if _is_coupling(blk):
        return _to_halves(stream, plan.split_dim)
    return _to_full(stream, plan.split_dim)


def _first_block_needing(plan: _Plan, needs: Sequence[bool]) -> int:
    # Index of the first block with a parameter that needs a gradient (len(blocks) if none).
    for i, groups in enumerate(plan.block_params):
        if any(needs[j] for g in groups for j in g):
            return i
    return len(plan.blocks)


# ----------------------------------------------------------------------------------- functional
def reversible_sequential(
    x: torch.Tensor,
    blocks: Sequence[nn.Module],
    *,
    split_dim: int = 1,
    exact: bool = False,
    grid_bits: int = 20,
    preserve_rng_state: bool = True,
    reversible: bool = True,
    sink: Any = None,
    stream_dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """Run invertible ``blocks`` in sequence, keeping no activation for backward.

    ``y = blocks[-1](...blocks[0](x))``; backward rebuilds each block's input from its output (see
    the module docstring for the math). Blocks are validated by
    :class:`slimgrad.nn.ReversibleSequential`, which is the public entry point; this functional form
    skips validation.

    Args:
        x: input of the first block.
        blocks: couplings (``_slimgrad_coupling`` set) or modules with ``inverse``.
        split_dim: dimension the couplings split along.
        exact: hold the stream in fixed point (integers on the grid ``2^-grid_bits``): bit-exact
            rebuild.
        grid_bits: fixed-point fraction bits in exact mode.
        preserve_rng_state: replay each F/G's RNG state in the recompute (dropout).
        reversible: False runs the same maths with ordinary autograd (keeps activations).
        sink: receives the reconstruction diagnostic after each backward.
        stream_dtype: exact mode's stream, ``torch.int32`` (range ``2^(31-grid_bits)``) or
            ``torch.int64`` (``2^(63-grid_bits)``).

    Returns:
        The chain output, same dtype as ``x``.

    Raises:
        RuntimeError: exact mode's stream would overflow ``stream_dtype``.

    Memory: saves y (exact mode: the integer stream, 4 B/elt in int32) plus 10 KiB of RNG state
    per block; eager saves every activation of every block.
    """
    plan = _Plan(
        blocks=list(blocks),
        split_dim=split_dim,
        exact=exact,
        grid_bits=grid_bits,
        compute_dtype=x.dtype if exact else None,
        preserve_rng_state=preserve_rng_state,
        sink=sink,
        stream_dtype=stream_dtype,
    )
    if transforms_active():
        # NOTE [torch.func transforms] in slimgrad/_autograd.py: ordinary autograd through the
        # blocks (float mode); the fixed-point stream's Functions have no functorch rules
        if exact:
            raise NotImplementedError(
                f"{_API}: exact mode cannot run under torch.func transforms; expected exact="
                "False, got exact=True under grad/vmap/jacrev. Build the chain with exact=False "
                "for torch.func."
            )
        return _fwd_torch(plan, x, record=False)
    flat = _param_table(plan) if torch.is_grad_enabled() and reversible else []
    needs_graph = torch.is_grad_enabled() and (x.requires_grad or bool(flat))
    if reversible and needs_graph and len(plan.blocks) > 0:
        refuse_jit("nn.ReversibleSequential")
        plan.flat_params = flat
        y = _apply(plan, x, flat)
    elif exact:
        y = _exact_fwd(plan, x, record=False)[1]
    else:
        y = _fwd_torch(plan, x, record=False)
    return y


def _apply(plan: _Plan, x: torch.Tensor, flat: list[torch.Tensor]) -> torch.Tensor:
    # torch.compile runs the chain eagerly (one graph break per chain, code around it compiles):
    # the backward calls autograd.grad on module recomputes, which Dynamo cannot trace
    # (NOTE [Eager-only code under torch.compile] in slimgrad/_compile.py).
    return _apply_eager(plan, x, flat)


@eager_only
def _apply_eager(plan: _Plan, x: torch.Tensor, flat: list[torch.Tensor]) -> torch.Tensor:
    return _ReversibleChainFn.apply(plan, x, *flat)


def reconstruction_error(
    blocks: Sequence[nn.Module],
    x: torch.Tensor,
    *,
    split_dim: int = 1,
    exact: bool = False,
    grid_bits: int = 20,
    stream_dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """Largest |x_rebuilt - x| over the block inputs of one forward and its inverse (no grad, no
    stat update).

    Runs ``blocks`` forward from ``x`` with each F/G's RNG state recorded, then inverts block by
    block with the same states, comparing every rebuilt block input with the one seen in forward.
    """
    plan = _Plan(
        blocks=list(blocks),
        split_dim=split_dim,
        exact=exact,
        grid_bits=grid_bits,
        compute_dtype=x.dtype if exact else None,
        preserve_rng_state=True,
        sink=None,
        stream_dtype=stream_dtype,
    )
    plan.device = x.device
    plan.autocast = _autocast_state(x.device)
    worst = torch.zeros((), dtype=torch.float64, device=x.device)
    with (
        torch.no_grad(),
        torch.random.fork_rng(
            devices=[x.device] if x.device.type not in ("cpu", "meta") else [],
            device_type=x.device.type,
        ),
    ):
        stream: tuple = (x,)
        st = _ExactStream(plan, x, grad=False) if exact else None
        inputs = []
        for blk in plan.blocks:
            with _stats_frozen(blk):
                if st is not None:  # the sums go in place: keep copies
                    inputs.append((st.a.clone(), st.b.clone()))
                    _exact_block_fwd(plan, blk, st, record=True)
                else:
                    inputs.append(stream)
                    stream = _block_fwd(plan, blk, stream, record=True)
        if st is not None:
            stream = (st.a, st.b)
            del st
        for i in range(len(plan.blocks) - 1, -1, -1):
            blk = plan.blocks[i]
            rng_f, rng_g = plan.rng[i]
            if _is_coupling(blk):
                y1, y2 = _to_halves(stream, split_dim)
                with _recompute(plan, blk.G, rng_g):
                    x2 = _uncoupled(plan, blk, y2, _call(plan, blk.G, y1))
                with _recompute(plan, blk.F, rng_f):
                    x1 = _uncoupled(plan, blk, y1, _call(plan, blk.F, x2))
                stream = (x1, x2)
                ref = _to_halves(inputs[i], split_dim)
            else:
                with _recompute(plan, blk, rng_f):
                    stream = (blk.inverse(_to_full(stream, split_dim)[0]),)
                ref = _to_full(inputs[i], split_dim)
            for r, s in zip(ref, stream, strict=True):
                if r.shape != s.shape:
                    raise internal_error("rebuilt block input has a different shape")
                err = (s.to(torch.float64) - r.to(torch.float64)).abs()
                if exact:
                    err.mul_(plan.inv_scale)
                worst = torch.maximum(worst, err.max() if err.numel() else worst)
    return worst

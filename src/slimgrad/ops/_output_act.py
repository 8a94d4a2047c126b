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
in two places (checked on every float32):
  (a) near x*: y - y_min ~ f''(x*) d^2 / 2 with d = x - x*, so an error dy of the stored y moves
      f'(x) by about dy / |d|. The output is eager's own (torch's float32 kernels are a few ulp off
      near x*), so within |d| < ``window`` the elements are "hard": the window is decided once per
      process from eager's forward error on this machine (NOTE [A window from eager's own forward
      error] in ``slimgrad._math.smooth``), never below the fixed widths (float32: erf-GELU 0.03,
      tanh-GELU 0.06, SiLU 0.05, Mish 0.08; 1.3-1.7x the |d| below which the dense grid test
      fails with accurate vectorized and scalar CPU kernels). (Computing y in float64 near x*
      instead, a narrower window would do, but the output would differ from eager's by a few ulp
      there: in a network whose BatchNorms see a few values per channel that difference grows
      past the error rule, e.g. timm RepViT at batch 2 on 64x64 images);
  (b) erf-GELU for x < -2.5 (tanh-GELU: x < -3): the float32 forward 1 + erf(x / sqrt 2) cancels,
      so y no longer pins x, and y -> 0 leaves the tables too coarse: those elements are hard too.
Hard elements, and non-finite x (so NaN/inf propagate exactly as eager's formula makes them), are
kept exactly in a sparse side table: int32 flat index (int64 above 2^31 elements) + x in its own
dtype; their gradient is eager's formula on the exact x. The tests check every float32 within
x* +- (window + 0.3) and at the tail thresholds, a strided sweep of [-40, 40], every float16 and
bfloat16 value, and random inputs, against the error rule.

float64 inputs keep x densely (as eager): the tables are float32-grade (~1e-8).

Layout: outputs and gradients have eager's strides (NOTE [Layout of the smooth activations] at
:func:`smooth_forward`). Second derivatives (``create_graph=True``): eager's where x is kept
(float64, the dense fallback; in place under hooks that pack each tensor, eager's own op),
otherwise a ``slimgrad.ops.<op>`` error when the gradient is differentiated
(:func:`smooth_double`); torch.func transforms run eager's op.

Implementations (NOTE [Kernel backend choice] in ``slimgrad.kernels._backend``): the PyTorch path
(``smooth_fwd`` / ``smooth_grad``, whole-tensor passes per span: NOTE [The PyTorch path on a
GPU]; with the specs and tables in ``slimgrad._math.smooth``, below both this module and the
kernels: NOTE [Kernels are leaves] in ``slimgrad._math``), Triton
on CUDA, and on CPU float32 compiled C
(``kernels/cpu/output_act.c``, ``smooth_fwd_c`` / ``smooth_grad_c``): y still comes from eager's
own kernel, then one vectorized pass writes the bits and counts the hard elements per 2^16
block, a second collects them (block offsets by prefix sum, so the order is
deterministic and, for finite inputs, the PyTorch path's); the backward is one pass (vector gathers
from the same float32 tables, fused multiply-adds where torch's addcmul_/lerp_ use them). Same
y, bits and side table bit for bit; the gradient within a few float32 ulp of the PyTorch path's
(torch's float32 sqrt is not always correctly rounded, C's is), both within the error rule on
the dense grids. The backward writes dx into the incoming gradient when
``slimgrad.ownership.take`` proves it dead (NOTE [Gradient-buffer ownership]), on either path,
bit for bit as out of place.

Worst case: the side table is data-dependent (about 1-2% of N(0,1) elements). Inputs that crowd the
hard windows (e.g. all at x*) would make it grow to 8 B per element, so when more than 1/16 of the
elements are hard the op falls back to keeping x densely, exactly what eager keeps (4 B/elt in
float32), without bits, table or y: the op never keeps more than eager plus y.

# NOTE [Few elements]
The gradient from (y, bit) is as exact as y allows, not as exact as eager's formula on x: near x* an
error dy of the stored y (eager's, a few ulp) moves f'(x) by dy / |x - x*| (up to ~1e-6 for g = 1
just outside the window; eager's formula there errs by ~2e-8), and the f' tables' interpolation in
float32 errs by up to ~1.4e-7 (absolute) anywhere;
eager's error is relative to f' and its terms. On a large tensor the error rule's bound,
2 max|eager - ref64|, is set by the elements where eager's own error is largest (f' ~ 1: up to
5e-7 |g|), so the op passes; on a tensor of a few elements, or a reduction over a few of them (a
BatchNorm's parameter gradient at batch 2 and 2x2 spatial size: 8 elements per channel), the bound
can be far below that. Measured before this rule (issue 19): SiLU on tensors of 3 to 3136 elements,
x ~ N(0, 4), |g| ~ 1000 (so that the atol does not hide it): 34 of 240 cases outside the rule, up to
5.05x the bound, all at elements with 0.025 <= |x - x*| < 0.2 or in the table's body; on
efficientnet_b0's real activations at 2x64x64 the per-channel sums of dx reach 1.46x the rule's
bound without atol (2.9x eager's error). So a tensor of at most ``DENSE_MAX`` (512) elements keeps
x densely (eager's bytes, at most 2 KiB in float32; no y, bits or table) and gets eager's gradient
bit for bit: the decision depends on the shape only, so tracers see it too. Larger tensors keep
the table path (its rule check in tests/test_small_shapes.py sweeps batch and spatial sizes).
Half types on CPU keep x the same way up to ``HALF_DENSE_MAX`` (131,072) elements (:func:`keeps_x`):
their table path runs in Python over spans (HALF_SPANS in ``slimgrad._math.smooth``), ~20 ops per
span whatever its size, and a tensor too small for spans of ``HALF_MIN_SPAN`` (8,192) to stay
under eager's peak pays that overhead for no win (several times eager's time; measured in
docs/measurements.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from slimgrad import _autograd, ownership
from slimgrad._errors import check_seen, hooks_top, internal_error, raise_if_written, seen
from slimgrad._library import straight
from slimgrad._math import smooth as smooth_math
from slimgrad._math.bits import packed_numel
from slimgrad._math.layout import eager_output, in_memory_order, memory_order
from slimgrad._math.layout import inverse_perm as _inverse_perm
from slimgrad._math.norms import unseen
from slimgrad._math.smooth import (  # noqa: F401 - re-exported: the ops' and tests' names
    _TABLE_N,
    CHUNK,
    DENSE_MAX,
    FALLBACK_DIV,
    SmoothSpec,
    _window,
    inverse,
    is_dense_fallback,
    is_fallback_result,
    round_f32,
    smooth_fwd,
    smooth_grad,
)
from slimgrad._math.tables import dynamic_size
from slimgrad.kernels import _backend
from slimgrad.ops import _derived
from slimgrad.ops.linear import fresh


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


def record_layout(ctx, x: torch.Tensor) -> None:
    """Keep x's layout (shape and strides, no data) when it is not contiguous: backward returns
    eager's gradient layout (:func:`eager_layout`)."""
    ctx.x_layout = None if x.is_contiguous() else (tuple(x.shape), x.stride())


def eager_layout(ctx, g: torch.Tensor, bwd: Callable) -> tuple[int, ...] | None:
    """The strides of eager's gradient: its backward ``bwd(g, x)`` run on meta tensors with g's
    and x's layouts (eager's elementwise backward picks them from both operands, differently per
    op); None when g and x are contiguous (so is the result) or while tracing."""
    xl = getattr(ctx, "x_layout", None)
    if (xl is None and g.is_contiguous()) or is_fake(g) or torch.compiler.is_compiling():
        return None
    shape, stride = xl if xl is not None else (tuple(g.shape), None)
    xm = (
        torch.empty(shape, dtype=g.dtype, device="meta")
        if stride is None
        else torch.empty_strided(shape, stride, dtype=g.dtype, device="meta")
    )
    gm = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device="meta")
    return bwd(gm, xm).stride()


def as_layout(dx: torch.Tensor, strides: tuple[int, ...] | None) -> torch.Tensor:
    """``dx`` with the given strides (a copy only when they differ)."""
    if strides is None or dx.stride() == strides:
        return dx
    out = torch.empty_strided(dx.shape, strides, dtype=dx.dtype, device=dx.device)
    return out.copy_(dx)


# what an in-place Function's ``top`` argument is when its caller did not ask the saved-tensor hooks
# (smooth_apply asks them once and passes the answer: NOTE [Under hooks that pack each tensor])
UNASKED = object()


def smooth_forward(
    ctx,
    x: torch.Tensor,
    fwd_op: Callable,
    inplace: bool,
    *args,
    single=False,
    kept=None,
    top=UNASKED,
):
    """Forward of a smooth activation's Function: runs its custom op ``fwd_op(x, *args) -> (y,
    bits, idx, xs)`` on x in eager's output memory order and keeps what backward needs.

    # NOTE [Layout of the smooth activations]
    Eager's elementwise ops keep the input's layout (channels_last, transposed) and their backward
    follows the incoming gradient's (or, if that is not dense, the input's). The side information
    (bits, hard indices) is in memory order: the op gets x in its own layout, computes y by eager's
    call on it (eager's bits: NOTE [Eager's output on a strided input] in slimgrad/_math/layout.py)
    and its side information on ``x.permute(p)``, contiguous for a dense x (:func:`memory_order`);
    the output itself is saved (as an output: no reference cycle) and backward reads it through
    ``y.permute(p)``, g in the same order, and returns dx in g's layout (a copy only when g is
    dense with another layout than y).

    The dense fallback (NOTE [Gradient from the output]) keeps x itself, as eager (``xs`` is
    dropped), so its backward is eager's formula on x and a double backward gets eager's second
    derivatives; in place, the copy ``xs`` (x is overwritten).

    ``kept``: eager's ``x -> y``, for an input its producer keeps (NOTE [An input its producer
    keeps]; not while compiling: Dynamo does not read ``grad_fn``) and under hooks that pack each
    tensor (NOTE [Under hooks that pack each tensor]; in place, called as ``kept(copy, out=x)``).
    ``top``: the innermost saved-tensor hooks where the caller asked already (in place).
    """
    compiling = _autograd.compiling()  # NOTE [One-frame compile check]
    if compiling:  # the innermost saved-tensor hooks, asked once (eager only)
        top = None
    if kept is not None and not compiling:
        # NOTE [An input its producer keeps]; NOTE [An input the graph holds] (graph_holds
        # inline: no call); NOTE [Few elements without a copy of x]
        fn, b = x.grad_fn, x._base
        if not inplace and (
            fn.__class__ in INPUT_KEPT_BY
            or (
                x.requires_grad
                if fn is None
                else b is not None and b.grad_fn is None and (b.requires_grad or held_view(x))
            )
            or keeps_x(x)
        ):
            return input_kept_forward(ctx, x, kept, single)
        if top is UNASKED:
            top = hooks_top(False)
        # NOTE [Under hooks that pack each tensor]
        if top is not None and not _derived._checkpoints(top):
            if inplace:
                return input_copied_forward(ctx, x, kept)
            return input_kept_forward(ctx, x, kept, single)
    elif not compiling and top is UNASKED:
        top = hooks_top(False)
    perm = memory_order(x)
    ctx.perm = perm
    ctx.cpath = None  # NOTE [The straight C path of the smooth activations]
    record_layout(ctx, x)
    # x in its own layout: y is eager's call on it, in eager's layout, the side information in
    # x's memory order (NOTE [Eager's output on a strided input] in slimgrad/_math/layout.py);
    # a copy of x on the dense fallback only where x itself cannot be kept (NOTE [The dense
    # fallback without a copy of x]; the op's default, in place and compiling, is the copy)
    if inplace or compiling:
        y, bits, idx, xs = fwd_op(x, *args)
    else:
        y, bits, idx, xs = fwd_op(x, *args, False)
    # fwd_op may return its flat product viewed in x's shape
    out = fresh(y)  # NOTE [Function outputs are not views] in ops/linear.py
    del y
    # dense fallback (xs is all of x): y is not needed; not decidable while tracing (unbacked
    # sizes) except for the few-element rule (NOTE [Few elements]), so kept then
    dense = keeps_x(x) or (
        not compiling and not _unbacked(xs) and is_fallback_result(x.numel(), bits, idx, xs)
    )
    # xs replaced by x itself (NOTE above); not while compiling, where in place runs as this
    # out-of-place Function + copy_ into x (smooth_apply): the copy xs is kept then
    ctx.dense_x = dense and not inplace and not compiling
    ctx.y_is_x = inplace
    # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py: y (or x
    # holding it) recorded under hooks, eager only (``compiling`` read above)
    hooked = not dense and top is not None
    # NOTE [Side tables under torch.utils.checkpoint]: eager only (``top`` is None compiling)
    ctx.held = held = top is not None and _derived._checkpoints(top)
    ctx.side = None
    if inplace:  # x holds y now: kept instead of y (no second copy); read as x.permute(perm)
        if held:  # NOTE [No write into a buffer a policy may cache] in ops/_derived.py
            unseen(x.copy_, out)
        else:
            x.copy_(out)
        ctx.mark_dirty(x)
        if held:
            # x (holding y), or the dense copy of x, in x's shape and layout: one as_strided
            # either way, unseen (NOTE [Side tables under torch.utils.checkpoint])
            a = unseen(_slot0, x, xs, perm, dense)
            save_held(ctx, a, bits, idx, xs, dense)
        else:
            ctx.save_for_backward(None if dense else x, bits, idx, xs)
        ctx.y_seen = seen(x, dirty=True) if hooked else None
        return x
    if held:  # y or the dense x, in x's layout: no op either way
        save_held(ctx, x if dense else out, bits, idx, xs, dense)
    else:
        # the output itself, read in memory order by backward (``y.permute(perm)``): saved as
        # this node's output it unpacks with the node as its grad_fn, so a refused second
        # derivative is tied to it (NOTE [Second derivatives of the smooth activations])
        ctx.save_for_backward(None if dense else out, bits, idx, x if ctx.dense_x else xs)
    ctx.y_seen = seen(out) if hooked else None
    # no zero gradients for them in backward (it never reads them): on the dense fallback xs is all
    # of x, so autograd would allocate a gradient-sized zeros tensor
    ctx.set_materialize_grads(False)
    if single:  # an eager call past the gate: y alone (NOTE [One gate per call])
        return out
    # The side info is returned too (non-differentiable) so that its data-dependent sizes are
    # outputs of the Function traced by torch.compile; the functional drops it.
    ctx.mark_non_differentiable(bits, idx, xs)
    return out, bits, idx, xs


# NOTE [Side tables under torch.utils.checkpoint]
# The smooth activations' case of NOTE [Value-dependent saves under torch.utils.checkpoint] in
# ops/_derived.py: the hard-element table's length and the dense fallback are the values'. Under
# checkpoint's own hooks (the forward's and the recompute's alike; eager only) the op saves its
# four slots "held": slot 0 in x's shape and layout, y (x holding y in place) or, on the dense
# fallback, x (the copy of x in place); bits, idx and xs are held (on the dense fallback xs's slot
# holds the empty bits again: the copy of x is slot 0's or not kept). Backward
# (:func:`side_tensors`) rebuilds them and reads the mode from what came back (no bits: the dense
# fallback), setting ``ctx.dense_x``; the C path's backward hands the recompute's dense fallback to
# the general path. A checkpoint unpacks each saved tensor once, so a backward that hands over
# passes what it unpacked in ``ctx.side``.
# Under selective activation checkpointing the recompute must also issue the forward's aten ops
# (NOTE [The same ops under selective checkpointing] in ops/batch_norm.py), and the forward custom
# op is one dispatched call there (NOTE [Calling a custom op eagerly] in slimgrad/_library.py)
# whose choice may differ between the two runs: so what follows it issues the same ops in either
# mode, slot 0 included (one ``as_strided`` in place, none out of place). GELU on 4,096 values
# whose bf16-packed copy, the recompute's input, has 8 more hard elements (past 1/16: the
# recompute falls back, the forward did not) raised in the recompute (``aten.new_empty`` not
# found; ``aten.view`` in place, ``aten.permute`` on a channels-last input). The held views and
# slot 0's as_strided are made where no mode sees them (a policy saving them had the recompute
# read the forward's: NOTE [Value-dependent saves under torch.utils.checkpoint]).
def save_held(ctx, a, bits, idx, xs, dense: bool) -> None:
    """``save_for_backward`` of a smooth activation's four slots with value-independent metadata
    and ops (NOTE [Side tables under torch.utils.checkpoint]); ``a``: y, or x in its place when
    ``dense`` (bits and idx are then empty, and xs is not kept)."""
    hold = _derived.hold
    ctx.save_for_backward(a, hold(bits), hold(idx), hold(bits if dense else xs))


def side_tensors(ctx) -> tuple:
    """The (y, bits, idx, xs) a smooth activation's forward saved, unpacked once (``ctx.side``
    when another backward path unpacked them); held ones rebuilt, with ``ctx.dense_x`` the
    recompute's (NOTE [Side tables under torch.utils.checkpoint])."""
    side = ctx.side
    if side is not None:
        ctx.side = None
        return side
    if not ctx.held:
        return ctx.saved_tensors
    a, bits, idx, xs = ctx.saved_tensors
    whole = _derived.whole
    bits = whole(bits, torch.uint8)
    idx = whole(idx, torch.int32 if a.numel() < 2**31 else torch.int64)
    perm = ctx.perm
    if bits.numel():  # y in x's layout, as saved unheld (backward reads it permuted)
        ctx.dense_x = False
        return a, bits, idx, whole(xs, a.dtype)
    if ctx.y_is_x:  # in place: the copy of x, flat in memory order (smooth_grad's fallback)
        ctx.dense_x = False
        return None, bits, idx, (a if perm is None else a.permute(perm)).reshape(-1)
    ctx.dense_x = True
    return None, bits, idx, a


def _slot0(x, xs, perm, dense: bool) -> torch.Tensor:
    # slot 0 of an in-place call's held saves: x (holding y), or on the dense fallback the flat copy
    # of x in x's shape and layout
    if dense:
        return xs.as_strided(x.shape, _dense_strides(x.shape, perm))
    return x.as_strided(x.shape, x.stride(), x.storage_offset())


def _dense_strides(shape, perm) -> tuple[int, ...]:
    # the strides of a contiguous tensor in memory order ``perm`` (``shape`` permuted by perm is
    # contiguous): where the flat copy of x in memory order lies in x's shape
    if perm is None:
        perm = range(len(shape))
    strides = [0] * len(shape)
    step = 1
    for d in reversed(perm):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


# NOTE [An output written after forward]
# An op that keeps its output y where eager keeps its input x trains, as eager, through any write
# the model's own forward makes over y: ``convert_`` leaves it unconverted there (NOTE [In-place
# writers after output-saving modules] in convert_handlers/inplace_guard.py), or has it run
# eager's op where y may be the model's output (``keep_y``). A write it cannot see (user code
# calling the module directly and writing its output, a hook added after ``convert_``) bumps y's
# version, and y's old values are gone at backward: autograd's "modified by an inplace operation"
# from ``ctx.saved_tensors`` is re-raised as slimgrad's, naming the op and the fixes (as NOTE [A
# kept tensor written after forward] in ops/_derived.py does for a BatchNorm output). Inside a
# saved-tensor-hooks region autograd checks nothing: NOTE [A kept output written under
# saved-tensor hooks] in slimgrad/_errors.py gives the same error there.


def _public_api(ctx) -> str:
    # "ops.gelu" from the node class ``_GeluFnBackward`` / ``_GeluInplaceFnBackward`` (the
    # classes are named ``_{stem.capitalize()}Fn``): the op's public name, not the private class
    n = type(ctx).__name__.removesuffix("Backward").removeprefix("_").removesuffix("Fn")
    return "ops." + n.removesuffix("Inplace").lower()


def raise_output_written(
    e: RuntimeError, api: str, fix: str = "ConvertConfig(activations=False)"
) -> None:
    """Raise slimgrad's error for autograd's in-place error ``e`` from ``ctx.saved_tensors`` of an
    op that keeps its output (NOTE [An output written after forward]); return for any other
    error (the caller re-raises it)."""
    raise_if_written(e, api, _written_why(fix))


def _written_why(fix: str) -> str:
    return (
        "It keeps its output for backward where eager keeps its input; expected what it keeps "
        "unchanged from forward to backward, got a write over it. Write into a clone "
        "(``y = y.clone()`` first), or leave the module unconverted (convert_'s filter_fn, or "
        f"{fix})."
    )


def check_output_seen(
    ctx, y: torch.Tensor | None, api: str, fix: str = "ConvertConfig(activations=False)"
) -> None:
    """After ``ctx.saved_tensors`` gave y back: raise slimgrad's error where the forward recorded
    y under saved-tensor hooks (``ctx.y_seen``) and a hook handed back y written since (NOTE [A
    kept output written under saved-tensor hooks] in slimgrad/_errors.py)."""
    check_seen(ctx.y_seen, y, api, _written_why(fix))


def smooth_backward(ctx, g, buf, bwd_op: Callable, bwd_any: Callable, bwd_exact: Callable, *args):
    """dx of a smooth activation's Function (after ``buf = ownership.take(g)`` in its backward:
    g's buffer when it is dead and in y's memory order, else None); NOTE [Layout of the smooth
    activations]."""
    try:
        held = ctx.held or ctx.side is not None  # side_tensors(ctx) only where it has work
        y, bits, idx, xs = side_tensors(ctx) if held else ctx.saved_tensors
    except RuntimeError as e:  # NOTE [An output written after forward]
        raise_output_written(e, _public_api(ctx))
        raise
    if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
        check_output_seen(ctx, y, _public_api(ctx))
    if ctx.perm is not None and y is not None:
        y = y.permute(ctx.perm)  # y (in place: x) in x's layout; the side info in memory order
    if ctx.dense_x:  # xs is x itself: eager's formula, eager's layout
        if buf is not None and xs.is_contiguous():
            if bits is None:  # input_kept_forward kept x alone: the dense fallback's side
                bits = xs.new_empty(0, dtype=torch.uint8)
                idx = xs.new_empty(0, dtype=torch.int32 if xs.numel() < 2**31 else torch.int64)
            return bwd_any(buf, None, bits, idx, xs.view(-1), *args, out=buf)
        return bwd_exact(g, xs, *args)
    layout = eager_layout(ctx, g, lambda gm, xm: bwd_exact(gm, xm, *args))
    perm = ctx.perm
    if buf is not None and layout in (None, buf.stride()):  # eager only: dx written into g
        if perm is None:
            return bwd_any(buf, y, bits, idx, xs, *args, out=buf)
        bwd_any(buf.permute(perm), y, bits, idx, xs, *args, out=buf.permute(perm))
        return buf
    if perm is None:
        return as_layout(bwd_op(g, y, bits, idx, xs, *args).view(g.shape), layout)
    gp = g.permute(perm)
    dx = bwd_op(gp if gp.is_contiguous() else gp.contiguous(), y, bits, idx, xs, *args)
    return as_layout(dx.permute(_inverse_perm(perm)), layout)


# NOTE [Second derivatives of the smooth activations]
# Under ``create_graph=True`` eager's gradient of an activation always has history: it is a function
# of x, which requires grad. Where the op keeps x itself (out of place: float64, the dense fallback,
# few elements, an empty x, a leaf the graph holds, an input its producer keeps) its double runs
# eager's formula on that x: eager's second derivatives bit for bit. Where it keeps y, bits and a
# table (f'' is not there) the first derivatives are tied to refusal nodes (NOTE [Second
# derivatives] in slimgrad/_autograd.py) through the saved output, which unpacks with this node as
# its grad_fn: differentiating them raises the ``slimgrad.ops.<op>`` error, whatever else the
# gradient depends on. (A transposed or channels-last input kept a detached alias of y instead: with
# an incoming gradient without history the result had none, and the next differentiation raised
# autograd's "element 0 of tensors does not require grad", or, with allow_unused, gave None where
# eager gives values; the output itself is saved now: NOTE [Layout of the smooth activations].)
# In place, what is kept besides the output (the copy of x on the dense fallback) is made in
# forward outside the graph, so nothing ties the result to x: :func:`refuse_untied` raises at the
# create_graph backward itself, before a result that would differentiate as zero in x is returned.
# A call in place whose dense path is known from its shape and dtype (:func:`keeps_x`: few
# elements, an empty x, a half-type CPU tensor of at most HALF_DENSE_MAX; float64) runs eager's own
# in-place op instead (:func:`smooth_apply`): eager's node, bytes and second derivatives.


def refuse_untied(op: str) -> None:
    """Raise the ``slimgrad.<op>`` second-derivative error now: the call kept nothing with history
    to tie a refusal to (NOTE [Second derivatives of the smooth activations])."""
    raise RuntimeError(
        f"slimgrad.{op}: a backward with create_graph=True reached this op, which ran in place "
        "and kept a copy of its input made outside the graph; expected what it kept to carry the "
        "input's graph, so that its gradient differentiates as eager's, got a copy without one. "
        "Call it out of place (inplace=False), or leave the module unconverted (convert_'s "
        "filter_fn, or ConvertConfig(activations=False))."
    )


def smooth_double(op: str, exact: Callable, extra: Callable = lambda ctx: ()) -> Callable:
    """The ``double=`` of a smooth activation's backward (NOTE [Second derivatives] in
    ``slimgrad._autograd``): on the dense fallback, which keeps x itself, eager's formula
    ``exact(g, x, *extra(ctx))`` with differentiable ops; otherwise (y, bits and a table do not
    give f''), the first derivatives tied to nodes that raise a ``slimgrad.<op>`` error when
    differentiated."""

    def double(ctx, g, *side):
        args = extra(ctx)
        if g is None:
            return (None,) * (1 + len(args)) if args else None
        if ctx.held:  # the mode is the recompute's: NOTE [Side tables under torch.utils.checkpoint]
            ctx.side = side_tensors(ctx)  # for backward below, which unpacks them
        # in place x is a copy made in forward, outside the graph: first derivatives only
        if ctx.dense_x and not ctx.y_is_x:
            x = side_tensors(ctx)[3]
            dx = exact(g, x, *args)
            return (dx, *(None for _ in args)) if args else dx
        # NOTE [Second derivatives of the smooth activations]
        if ctx.y_is_x and not ctx.held and ctx.saved_tensors[0] is None:
            refuse_untied(op)
        return _autograd.refuse_second_order(op, ctx._forward_cls.backward, ctx, (g, *side))

    return double


def eager_double(fwd: Callable) -> Callable:
    """``(g, x) -> dx`` with eager's second derivatives: eager's forward on x, differentiated with
    ``create_graph`` (for ops whose aten backward has no derivative: silu, mish)."""

    def exact(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (dx,) = torch.autograd.grad(fwd(x), x, g, create_graph=True)
        return dx

    return exact


def smooth_apply(fn_out, fn_inplace, x: torch.Tensor, inplace: bool, *args) -> torch.Tensor:
    """Apply a smooth activation's Function; in-place under torch.compile: out-of-place + copy_.

    (An in-place Function on a view may return one tensor only, and the traced Function must return
    the side info; so while compiling, ``inplace=True`` costs a temporary y and keeps it:
    documented.)
    """
    if _autograd.compiling():  # Dynamo traces Function.apply
        if not inplace:
            return fn_out.apply(x, *args)[0]
        return x.copy_(fn_out.apply(x, *args)[0])
    if torch._C._are_functorch_transforms_active():  # the callers take eager's op then; kept safe
        return fn_out.apply(x, *args)[0] if not inplace else fn_inplace.apply(x, *args)
    if inplace:  # NOTE [Under hooks that pack each tensor]: eager's own in-place op there
        top = hooks_top(False)
        n = 1  # x.numel() without a call (the straight path's host calls are counted)
        for d in x.shape:
            n *= d
        dt = x.dtype
        if (
            (top is not None and not _derived._checkpoints(top))
            or dt is _F64
            or n <= DENSE_MAX
            or (n <= smooth_math.HALF_DENSE_MAX and dt in _HALF and x.is_cpu)
        ):
            # also where the dense path is known from the shape and dtype (keeps_x, float64):
            # eager's node keeps the same copy of x, with its graph (NOTE [Second derivatives of
            # the smooth activations])
            return fn_inplace.eager_(x, *args)
        # NOTE [Applying a Function without its Python wrapper] in slimgrad/_autograd.py
        apply = _DIRECT.get(fn_inplace)
        if apply is None:
            apply = _DIRECT[fn_inplace] = _autograd.direct_apply(fn_inplace)
        return apply(_autograd.unwrap_if_dead(x), *args, top)  # the hooks asked once
    apply = _DIRECT.get(fn_out)
    if apply is None:
        apply = _DIRECT[fn_out] = _autograd.direct_apply(fn_out)
    return apply(_autograd.unwrap_if_dead(x), *args)[0]


_DIRECT: dict[type, Callable] = {}  # each smooth Function's C apply, bound once
_F64 = torch.float64
_HALF = (torch.bfloat16, torch.float16)


def _unbacked(t: torch.Tensor) -> bool:
    return not isinstance(t.numel(), int)


def few_elements(x: torch.Tensor) -> bool:
    """True when x has 1 to ``DENSE_MAX`` elements and a float32/16 dtype: the op keeps x densely
    (NOTE [Few elements]); decided from the shape alone."""
    n = x.numel()
    return isinstance(n, int) and 0 < n <= DENSE_MAX and x.dtype != torch.float64


def keeps_x(x: torch.Tensor) -> bool:
    """:func:`few_elements`, or a half-type CPU tensor of at most ``HALF_DENSE_MAX`` elements
    (too small for the PyTorch path's spans to pay: ``HALF_MIN_SPAN`` in slimgrad._math.smooth):
    the smooth activation keeps x densely, as eager; decided from the shape alone. So does an
    empty x (0 bytes either way; kept, it gives eager's second derivatives, where an empty y and
    bits gave a second-derivative error in every dtype)."""
    if few_elements(x):
        return True
    n = x.numel()
    return isinstance(n, int) and (
        n == 0
        or (
            n <= smooth_math.HALF_DENSE_MAX
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.device.type == "cpu"
        )
    )


def dense_side_info(x: torch.Tensor, fwd: Callable):
    """(y, bits, idx, xs) of the dense path: eager's y (on x's layout: NOTE [Eager's output on a
    strided input] in slimgrad/_math/layout.py) and x flattened in memory order (NOTE [Few
    elements])."""
    p = memory_order(x)
    flat = (x if p is None else x.permute(p)).reshape(-1)
    idx_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
    return (
        eager_output(x, fwd),
        torch.empty(0, dtype=torch.uint8, device=x.device),
        torch.empty(0, dtype=idx_dtype, device=x.device),
        flat.clone(),
    )


# NOTE [An input its producer keeps]
# A smooth activation keeps its output y (shared with the next layer) and side information where
# eager keeps x. Where x is the output of a node that keeps that output through save_for_backward
# in every call (slimgrad's GroupNorm keeps y, its output), keeping x costs no byte at all, while
# y and the side information cost the side information: so such a call keeps x, as eager's op
# does, and computes y by eager's call (eager's bits; the dense fallback's backward, eager's
# formula on x). Conv -> GroupNorm -> SiLU -> Conv (4x32x16x16, float32, two blocks) saved
# 689,336 B without hooks (672,256 this way, as with torch's SiLU) and, under hooks that pack
# every tensor as save_on_cpu copies them, 1,038,520 B against eager's 1,021,568 (1,021,440 this
# way): the activation's y went to the hooks twice (its own pack and the next conv's) with the
# side information, where eager packs the norm's output once for the activation and y once for
# the conv. Read from the node's class (``x.grad_fn``, public autograd API; attribute reads, no
# call), registered by the producer's module (INPUT_KEPT_BY); a view of the norm's output, a norm
# that took eager's path (half precision, few elements: aten's node, which keeps its input) or a
# LayerNorm (which keeps x in place of y where every channel falls back) keep y as before.
INPUT_KEPT_BY: set[type] = set()


# NOTE [An input the graph holds]
# A leaf that requires grad (the model's input, a parameter) is held by its gradient accumulator,
# which an op's node links to (directly, or through the view nodes of a view of it), for as long
# as the graph lives: keeping that input (or a view of it) for backward costs no byte, while an
# activation's y and side information (branch bits, a sparse table; Hardsigmoid's bits and its
# backward's stand-in) cost theirs above eager's, which keeps x. So an activation whose eager
# op keeps x keeps x there too, with eager's y and backward formula, and eager's second
# derivatives (Hardsigmoid: eager has none, aten::hardsigmoid_backward is not differentiable):
# :func:`graph_holds`, asked with attribute reads only (``_base``, ``grad_fn``,
# ``requires_grad``: no call on the straight paths). A tensor made inside a fused node's forward
# (GPT-2's MLP: c_fc's output, grad mode off) requires no grad and is no view of such a leaf: the
# node keeps y and the side information, as the per-op path does on c_fc's output (a non-leaf),
# so both paths take one decision and give the same bits. (Taken for ``grad_fn is None`` alone, the
# node kept that h instead, and its gradient's bits left the per-op path's.) SiLU -> Linear on a
# 40x48 leaf saved 8,200 B against eager's 7,680 (peak 19,024 against 18,504); Hardsigmoid on a
# leaf -> sum 240 B against 0 (peak 15,608 against 7,688); eager's bytes this way
# (tests/conformance/test_never_more_than_eager_round34.py).
# Under torch.compile the question is not asked: Dynamo cannot trace ``grad_fn`` (a graph break),
# and it guards a graph input on ``requires_grad`` but not on ``is_leaf`` (a graph traced on a leaf
# is reused for a non-leaf of the same shape: ``is_leaf`` read while tracing would decide for both),
# so nothing it guards on tells whether keeping x costs a byte. A compiled region on a leaf keeps
# what it keeps on any input: over compiled eager's (which keeps nothing of a leaf), the side
# information, measured with the region's saved tensors (SiLU -> Linear, 64x48 leaf, aot_eager:
# 872 B = 1/8 B/elt of bits + 8 B for each of 61 hard elements; Mish 1,128 B; Hardsigmoid and
# LeakyReLU with a negative slope 384 B, the bits; Hardswish and ELU keep x when compiled, nothing
# over), at most 1/8 + 8/16 B/elt; on the smooth activations' dense fallback (more than 1/16 of the
# elements hard: erf-GELU at N(0, 1) inputs on an AVX2 CPU) the compiled op keeps a copy of x,
# 4 B/elt over; LeakyReLU (slope >= 0) and Hardtanh keep y, nothing over where y's consumer keeps
# it (a Linear), y's 4 B/elt where it keeps none of it. tests/conformance/test_held_leaf_round35.py
# pins the bits-only case.
# A view's ``_base`` names the leaf only where the leaf is the root of its storage: a view of a
# tensor subclass's leaf (``class Sub(torch.Tensor)``: ``x.t()`` is ``as_subclass`` of torch's
# view, an alias whose ``_base`` is a plain tensor that requires no grad) and a view of a leaf
# that is itself a view of a tensor that requires no grad (``w = buf.view(...)``,
# ``w.requires_grad_()``: ``w.t()._base`` is ``buf``) have a base with no grad_fn that requires
# no grad, while their grad_fn chain ends at the leaf's gradient accumulator. Only there (a
# view whose base says nothing; no call otherwise) :func:`held_view` walks that chain (one-input
# nodes, public ``next_functions``) to the accumulator and compares the leaf's storage with x's:
# the same storage is memory the graph holds. Hardswish -> Linear on a ``Sub`` leaf's transpose
# (48x40): tests/conformance/test_held_leaf_round35.py.
def graph_holds(x: torch.Tensor) -> bool:
    """True when x is a leaf that requires grad, or a view of one (NOTE [An input the graph
    holds])."""
    if x.grad_fn is None:
        return x.requires_grad
    b = x._base
    return b is not None and b.grad_fn is None and (b.requires_grad or held_view(x))


_HELD_DEPTH = 64  # one-input nodes walked from a view to its leaf's accumulator, at most


def held_view(x: torch.Tensor) -> bool:
    """True when x (a non-leaf view) shares its storage with a leaf that requires grad at the end
    of its grad_fn chain of one-input nodes (NOTE [An input the graph holds])."""
    fn = x.grad_fn
    for _ in range(_HELD_DEPTH):
        nxt = [e for e in fn.next_functions if e[0] is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0][0]
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node's leaf
        if leaf is not None:
            try:
                same = leaf.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass: no storage
                return False
            return same and leaf.requires_grad
    return False


# NOTE [Few elements without a copy of x]
# A call that keeps x densely by its shape alone (:func:`keeps_x`: few elements, or a half-type
# CPU tensor of at most HALF_DENSE_MAX) ran the forward custom op, whose xs is a copy of x (a
# custom op may not return an alias of its input) that the Function then dropped for x itself: a
# transient of x's bytes besides x and y. Under a non-reentrant torch.utils.checkpoint that
# transient is the backward's peak (the recompute holds x, y and the copy): Conv -> GroupNorm ->
# SiLU blocks, bfloat16 autocast, each block checkpointed, 2x8x6x6: 9,736 B against eager's 8,664
# (1.124x). Outside compiling and in place, such a call takes :func:`input_kept_forward` instead:
# eager's y, x kept as the dense fallback keeps it (the same saved tensors and backward), no copy.

# NOTE [The dense fallback without a copy of x]
# Past 1/16 hard elements the forward custom op falls back to keeping x densely (NOTE [Gradient
# from the output]); as a custom op it may not return x itself, so it returned a copy, which an
# out-of-place call outside compiling then dropped for x: a transient of x's bytes while x and y
# are live. Where that copy set the step's peak (torchvision's ViT at its default config, one or
# two layers, erf-GELU on an AVX2 CPU, where the wider window puts more than 1/16 of the elements
# hard: +86,380 B over eager's peak, 3.0%) the step peaked above eager's. So :func:`smooth_forward`
# asks the op for the copy only where x itself cannot be kept (``copy_x``: in place, where x is
# overwritten with y, and while compiling, where the compiled graph keeps the op's outputs); with
# ``copy_x=False`` the fallback returns an empty xs (bits and idx empty too: no other result is
# all empty for a non-empty x) and the Function keeps x itself, as before. The straight C path
# (:func:`c_forward`) never made the copy.


# NOTE [Under hooks that pack each tensor]
# Under saved-tensor hooks other than torch.utils.checkpoint's (save_on_cpu, torchtune-style
# offloading, any hook that copies or moves what it is handed) every pack is its own bytes: the
# hooks see no sharing between two nodes that keep the same tensor. There the activation's y is
# packed twice, by the activation and again by the next layer (a Linear or conv keeps its input),
# so keeping y and the side information packs x's bytes again plus the bits and the table, where
# eager packs x once: the technique cannot win there and is not applied. Such a call (out of
# place, eager only) takes :func:`input_kept_forward`: eager's y, x kept, eager's packs and
# gradient bit for bit. In place :func:`smooth_apply` runs eager's own in-place op instead of the
# Function (``InplaceFn.eager_``): eager's node, packs, gradient and second derivatives. (It kept
# x holding y and the side information, and the hooks' pack of y is not y: Linear ->
# SiLU(inplace=True) -> Linear, 8x37x64 -> 96, under bf16 packs, x's gradient off by 2.05e-3
# against the error rule's 2.19e-5, the y a bf16 pack gives back read through the side
# information. Then the Function kept a copy of x made outside the graph, as eager's node keeps
# one, and refused a gradient penalty's second derivative, which eager's node gives.) The
# in-place Function applied directly (under a torch.func transform) takes
# :func:`input_copied_forward` there: eager's bytes, first derivatives only. LayerNorm ->
# Linear -> GELU -> Linear, 2 blocks at 2x128x256, per pack:
# 10,635,904 B against eager's 10,493,952 before (1.0135x), eager's now; Linear -> SiLU ->
# Linear at 4100x64, bfloat16: 1.024x before. Under torch.utils.checkpoint's own hooks (their pack
# holds no tensor; the recompute keeps each tensor once, by reference) the op keeps y as without
# hooks. Hooks that hand back the very tensor (identity hooks, save_on_cpu on CPU tensors) would
# have let y be kept once; the op cannot tell them from copying ones, so it keeps eager's bytes
# there too (never more than eager, per pack or per storage). The hooks are asked once per call,
# where the call asked them before (the check of NOTE [A kept output written under saved-tensor
# hooks]): the unhooked path makes no extra host call; in place, once more before the Function.
# (torch.utils.checkpoint's hooks are told by their functions' module: _derived._checkpoints.)
def input_kept_forward(ctx, x: torch.Tensor, fwd: Callable, single: bool):
    """Forward of a smooth activation whose input its producer keeps (NOTE [An input its
    producer keeps]): eager's y, x kept as the dense fallback keeps it."""
    ctx.perm = memory_order(x)
    ctx.cpath = None
    record_layout(ctx, x)
    out = fresh(eager_output(x, fwd))
    ctx.dense_x, ctx.y_is_x, ctx.y_seen, ctx.held, ctx.side = True, False, None, False, None
    # x alone, as eager's node: no empty side tensors for saved-tensor hooks to pack (a hook
    # that cannot pack an empty tensor works with eager's op); backward makes them if it needs
    ctx.save_for_backward(None, None, None, x)
    ctx.set_materialize_grads(False)
    if single:
        return out
    idx_dtype = torch.int32 if x.numel() < 2**31 else torch.int64
    bits = x.new_empty(0, dtype=torch.uint8)
    idx = x.new_empty(0, dtype=idx_dtype)
    xs = x.new_empty(0)  # the functional drops the side outputs
    ctx.mark_non_differentiable(bits, idx, xs)
    return out, bits, idx, xs


def input_copied_forward(ctx, x: torch.Tensor, fwd: Callable) -> torch.Tensor:
    """In-place forward of a smooth activation under hooks that pack each tensor (NOTE [Under
    hooks that pack each tensor]), as eager's in-place node: x's copy kept, ``fwd(copy, out=x)``
    (eager's kernel, eager's bits), the backward eager's formula on the copy (first derivatives
    only, as the in-place op's other paths: the copy is made outside the graph)."""
    ctx.perm = memory_order(x)
    ctx.cpath = None
    record_layout(ctx, x)
    xc = x.clone()  # eager's in-place node keeps the original x (a copy, in x's layout)
    fwd(xc, out=x)
    ctx.mark_dirty(x)
    ctx.dense_x, ctx.y_is_x, ctx.y_seen, ctx.held, ctx.side = True, True, None, False, None
    ctx.save_for_backward(None, None, None, xc)
    ctx.set_materialize_grads(False)
    return x


def smooth_fake_side_info(x: torch.Tensor):
    """The fake kernel's (bits, idx, xs) of a smooth activation's forward custom op: sized by
    unbacked sizes (NOTE [Side tables under FakeTensorMode and torch.compile] in
    ``slimgrad._math.tables``); without a ShapeEnv the usual case (bits, no hard element); a few
    elements (NOTE [Few elements]) or float64: x kept densely, static sizes."""
    n = x.numel()
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    if keeps_x(x) or x.dtype == torch.float64:
        return (x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=idx_dtype), x.new_empty(n))
    nbytes = packed_numel(n)
    cap = n if isinstance(n, int) else None  # a symbolic numel (dynamic shapes): no static bound
    ncap = nbytes if isinstance(nbytes, int) else None
    nb = dynamic_size(max=ncap, otherwise=nbytes)  # packed bits, or 0 (dense fallback)
    k = dynamic_size(max=cap)
    m = dynamic_size(max=cap)
    return (
        x.new_empty(nb, dtype=torch.uint8),
        x.new_empty(k, dtype=idx_dtype),
        x.new_empty(m),
    )


def smooth_unary_op(
    stem: str,
    spec: SmoothSpec,
    fwd_torch: Callable,
    bwd_exact: Callable,
    c_fwd_torch: Callable | None = None,
    eager_inplace: Callable | None = None,
):
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
        c_fwd_torch: ``fwd_torch``'s kernel for a plain float32 CPU tensor without its Python
            wrapper (the straight C path), if it has one.
        eager_inplace: eager's in-place op ``x -> x`` (``torch._C._nn.silu_``), run in place of
            the in-place Function under hooks that pack each tensor.

    Returns:
        ``(fwd_op, bwd_op, Fn, InplaceFn)``.
    """
    from slimgrad.kernels import _backend
    from slimgrad.ops._library import custom_op

    def _fwd(
        x: torch.Tensor, copy_x: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if keeps_x(x):  # NOTE [Few elements]
            return dense_side_info(x, fwd_torch)
        if _backend.use_triton(x):
            return _backend.kernels(stem)._fwd_triton(x)
        # NOTE [The dense fallback without a copy of x]
        return smooth_fwd_any(spec, x, fwd_torch, copy_x)

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
    def _(x, copy_x=True):
        return (torch.empty_like(x), *smooth_fake_side_info(x))

    @bwd_op.register_fake
    def _(g, y, bits, idx, xs):
        return g.new_empty(g.shape)

    def bwd_any(g, y, bits, idx, xs, out=None):
        return smooth_grad_any(spec, g, y, bits, idx, xs, bwd_exact, out=out)

    cp = CPath(spec)
    c_fwd = c_fwd_torch or fwd_torch

    def forward(ctx, x, direct=False):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py);
        # y alone is returned then
        if direct:  # never while compiling (the gate)
            # NOTE [An input its producer keeps]; NOTE [An input the graph holds] (inline: no call)
            fn, b = x.grad_fn, x._base
            if fn.__class__ in INPUT_KEPT_BY or (
                x.requires_grad
                if fn is None
                else b is not None and b.grad_fn is None and (b.requires_grad or held_view(x))
            ):
                return input_kept_forward(ctx, x, fwd_torch, True)
            y = c_forward(ctx, x, c_fwd, cp)  # NOTE [The straight C path of the smooth activations]
            if y is not None:
                return y
            return smooth_forward(ctx, x, fwd_op.impl, False, single=True, kept=fwd_torch)
        return smooth_forward(ctx, x, fwd_op, False, kept=fwd_torch)

    second = smooth_double(f"ops.{stem}", eager_double(fwd_torch))

    def double(ctx, g, *side):  # backward's (dx, None): the second for ``direct``
        out = second(ctx, g, *side)
        return out if isinstance(out, tuple) else (out, None)

    @_autograd.first_order(f"ops.{stem}", double=double)
    def backward(ctx, g, *_side):
        if g is None:  # only the side outputs got a gradient (grads are not materialized)
            return None, None
        # forward's choice: NOTE [The straight C path of the smooth activations]
        if ctx.cpath is not None:
            # first use of g: NOTE [Gradient-buffer ownership]
            # c_backward reads g flat: a transposed g (the caller permuted y) takes the
            # general path below
            flat = g.is_contiguous()
            buf = ownership.take(g) if flat else None
            if buf is not None or (flat and straight()):
                dx = c_backward(ctx, g, buf, bwd_exact)
                if dx is not None:
                    return dx, None
        else:
            buf = ownership.take(g) if reuse_ok(g, ctx.perm) else None
        bwd = bwd_op.impl if buf is None and straight() else bwd_op
        return smooth_backward(ctx, g, buf, bwd, bwd_any, bwd_exact), None

    def forward_inplace(ctx, x, top=UNASKED):
        # top: the saved-tensor hooks smooth_apply asked (in ``direct``'s slot: backward's None)
        return smooth_forward(ctx, x, fwd_op, True, kept=c_fwd_torch, top=top)

    # named classes: autograd names the nodes after them (``_SiluFnBackward``)
    name = f"_{stem.capitalize()}Fn"
    fn = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    fn_inplace = type(
        f"_{stem.capitalize()}InplaceFn",
        (fn,),
        # eager_: eager's in-place op (NOTE [Under hooks that pack each tensor])
        {"forward": staticmethod(forward_inplace), "eager_": staticmethod(eager_inplace)},
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
        "smooth_fwd_f32": [p, p, p, p, i64, f, f, i, f, i],
        "smooth_fwd_off_f32": [p, p, p, p, p, i64, f, f, i, f, i],
        "smooth_collect_i32": [p, p, p, p, p, p, i64, f, f, i, f, i],
        "smooth_collect_i64": [p, p, p, p, p, p, i64, f, f, i, f, i],
        "smooth_bwd_f32": [p, p, p, p, p, i64, i64, f, f, f, f, f, i],
    }
    res = {"smooth_fwd_off_f32": i64}
    return {name: (name, args, res.get(name)) for name, args in specs.items()}


def _c_fns(lib):
    fns = getattr(lib, "_slimgrad_fns", None)  # bound once per library (kernels/_cpu.functions)
    if fns is None:
        from slimgrad.kernels._cpu import functions

        fns = functions(lib, _c_signatures)
    return fns


def smooth_fwd_c(
    lib,
    spec: SmoothSpec,
    x: torch.Tensor,
    fwd: Callable,
    fallback: bool = True,
    copy: bool = True,
):
    """:func:`smooth_fwd` for float32 CPU tensors with the C kernels of ``lib``: y from ``fwd``
    (eager's own kernel), then one pass for bits and hard counts, one to collect them."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
        return smooth_fwd(spec, x, fwd, fallback, copy)
    fns = getattr(lib, "_slimgrad_fns", None) or _c_fns(lib)  # bound once per library
    inv = inverse(spec)
    w, tail = _window(spec, x.dtype, x.device)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nt = torch.get_num_threads()  # kernels/_cpu.threads(): torch's count, never below 1
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    y = fwd(flat)
    bits = torch.empty(packed_numel(n), dtype=torch.uint8)
    nb = (n + CHUNK - 1) // CHUNK
    # transient: per block two counts and an offset (int64), then 1 byte per 32 elements
    ws = torch.empty(24 * nb + (n + 31) // 32, dtype=torch.uint8)
    cnt = ws.data_ptr()
    off, flags = cnt + 16 * nb, cnt + 24 * nb
    has_tail, tail_v = (0, 0.0) if tail is None else (1, float(tail))
    xp = flat.data_ptr()
    n_hard = fns["smooth_fwd_off_f32"](
        xp, bits.data_ptr(), cnt, flags, off, n, inv.x_star, w, has_tail, tail_v, nt
    )
    y = y.view(x.shape)
    if fallback and n_hard * FALLBACK_DIV > n:
        # bits and the workspace freed before x's copy, as smooth_fwd does: held through it they
        # put erf-GELU's step 10,256 B (0.16 B/elt) above eager's peak at 256x256 under the
        # tracker (the registered op's path, whose copy the straight C path does not make)
        del bits, ws
        empty_bits = torch.empty(0, dtype=torch.uint8)
        # NOTE [The dense fallback without a copy of x]
        xs = flat.clone() if copy else flat.new_empty(0)
        return y, empty_bits, torch.empty(0, dtype=idx_dtype), xs
    idx = torch.empty(n_hard, dtype=idx_dtype)
    xs = torch.empty(n_hard, dtype=x.dtype)
    if n_hard:
        collect = fns["smooth_collect_i32" if idx_dtype == torch.int32 else "smooth_collect_i64"]
        collect(
            xp, cnt, flags, off, idx.data_ptr(), xs.data_ptr(), n, inv.x_star, w, has_tail,
            tail_v, nt,
        )  # fmt: skip
    return y, bits, idx, xs


_SCALES: dict[int, tuple] = {}


def _byte_scales(inv, byte_scale: torch.Tensor) -> tuple[float, float]:
    # the right and left branches' position scales as float32 values (the table's), read once per
    # inverse: two .item() per backward otherwise (NOTE [Host syncs] in slimgrad.testing)
    hit = _SCALES.get(id(inv))
    if hit is None or hit[0] is not inv:
        hit = _SCALES[id(inv)] = (inv, float(byte_scale[255, 0]), float(byte_scale[0, 0]))
    return hit[1], hit[2]


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
    y_hi = round_f32(inv.y_min)
    sc_r, sc_l = _byte_scales(inv, byte_scale)
    (getattr(lib, "_slimgrad_fns", None) or _c_fns(lib))["smooth_bwd_f32"](
        gf.data_ptr(), yf.data_ptr(), bits.data_ptr(), tab.data_ptr(), of.data_ptr(), n, _TABLE_N,
        y_hi, inv.y_min - y_hi, inv.s_r**2, sc_r, sc_l, torch.get_num_threads(),
    )  # fmt: skip
    if gh is not None:
        of.index_copy_(0, idx.long(), bwd_exact(gh, xs))
    return out


def smooth_fwd_any(spec: SmoothSpec, x: torch.Tensor, fwd: Callable, copy: bool = True):
    """:func:`smooth_fwd` on the C kernels when ``_backend.use_cpu`` picks them, else PyTorch;
    x itself for a few elements (NOTE [Few elements]); ``copy``: NOTE [The dense fallback without
    a copy of x]."""
    if keeps_x(x):  # NOTE [Few elements]
        return dense_side_info(x, fwd)
    # y by eager's call on x's own layout, the rest on its memory order: NOTE [Eager's output on
    # a strided input] in slimgrad/_math/layout.py
    return in_memory_order(x, fwd, lambda xm, f: _smooth_fwd_on(spec, xm, f, copy))


def _smooth_fwd_on(spec: SmoothSpec, x: torch.Tensor, fwd: Callable, copy: bool = True):
    lib = _backend.use_cpu(x, C_STEM)
    if lib is not None:
        return smooth_fwd_c(lib, spec, x, fwd, copy=copy)
    if x.dtype == torch.float32 and _backend._is_fake(x):  # NOTE [Fake tensors model the C kernels]
        fake = _fake_c(x, fwd)
        if fake is not None:
            return fake
    return smooth_fwd(spec, x, fwd, copy=copy)


def smooth_grad_any(spec: SmoothSpec, g, y, bits, idx, xs, bwd_exact, out=None) -> torch.Tensor:
    """:func:`smooth_grad` on the C kernels when ``_backend.use_cpu`` picks them, else PyTorch."""
    lib = _backend.use_cpu(g, C_STEM)
    if lib is not None:
        return smooth_grad_c(lib, spec, g, y, bits, idx, xs, bwd_exact, out=out)
    if g.dtype == torch.float32 and _backend._is_fake(g):  # NOTE [Fake tensors model the C kernels]
        fake = _fake_c(g, None, y, is_dense_fallback(g.numel(), bits, idx, xs), out)
        if fake is not None:
            return fake
    return smooth_grad(spec, g, y, bits, idx, xs, bwd_exact, out=out)


# NOTE [Fake tensors model the C kernels]
# use_cpu never picks the C kernels for a fake tensor (no memory to run them on), so under
# slimgrad.memory.estimate the smooth activations would run their PyTorch path, whose span
# temporaries (about 10 B/elt of a span forward, 16 B/elt backward, and index_select of the byte
# tables) the real CPU step never allocates. A fake float32 tensor the C kernels would take
# (kernels/_backend.cpu_kernel_would_run) allocates what smooth_fwd_c (``fwd`` given) or
# smooth_grad_c allocates, with the side table empty: fake values cannot say which elements are
# hard; the real step keeps 8 B more per hard element (1.8% of the elements after a default-
# initialised Linear with N(0, 1) inputs; none where GELU's inputs stay away from its minimum, as
# with GPT-2's init). With the backward's buffer reuse modelled too (NOTE [Ownership under fake
# tensors] in slimgrad/ownership.py), Linear-GELU-Linear at 8x64x16 (128 hidden) is estimated at
# 573,512 B, its real peak less its 1,192 hard elements' 9,536 B (1,851,464 B, 3.2x, without
# either); tests/test_estimate_models_c_kernels.py.
def _fake_c(t: torch.Tensor, fwd, y=None, dense: bool = False, out=None):
    if not _backend.cpu_kernel_would_run(t, C_STEM) or t.numel() == 0:
        return None
    if fwd is not None:  # smooth_fwd_c with no hard element
        flat = t.reshape(-1).contiguous()
        n = flat.numel()
        idx_dtype = torch.int32 if n < 2**31 else torch.int64
        yf = fwd(flat)
        bits = torch.empty(packed_numel(n), dtype=torch.uint8)
        nb = (n + CHUNK - 1) // CHUNK
        cnt = torch.empty(2 * nb, dtype=torch.int64)
        flags = torch.empty((n + 31) // 32, dtype=torch.uint8)  # transient
        del cnt, flags
        return (
            yf.view(t.shape),
            bits,
            torch.empty(0, dtype=idx_dtype),
            torch.empty(0, dtype=t.dtype),
        )
    if y is None or dense or y.dtype != torch.float32:  # smooth_grad_c's own conditions
        return None
    t.reshape(-1).contiguous(), y.reshape(-1).contiguous()  # smooth_grad_c's (views if dense)
    return torch.empty(t.shape, dtype=t.dtype) if out is None else out


def reuse_ok(g: torch.Tensor, perm: tuple[int, ...] | None = None) -> bool:
    """Whether a smooth activation's backward can write into ``g`` if ownership grants it: a
    gradient contiguous in y's memory order (``perm``, NOTE [Layout of the smooth activations]) on
    the C or PyTorch path (the Triton kernels allocate their own)."""
    gp = g if perm is None else g.permute(perm)
    return gp.is_contiguous() and not _backend.use_triton(g)


# -------------------------------------------------------------------------------------------------
# NOTE [The straight C path of the smooth activations]
# An eager call past the gate (NOTE [One gate per call] in slimgrad/_library.py) on a contiguous
# float32 CPU tensor of more than DENSE_MAX elements, with the C kernels chosen ("auto" or "cpu")
# and built, runs :func:`c_forward` inside its Function: what :func:`smooth_forward` and
# :func:`smooth_fwd_c` do for that case, with what depends only on the activation (x*, window,
# tail, the f' tables and their scales, the bound C functions) read from its :class:`CPath`,
# prepared once per process. The Function then returns y alone (the side outputs exist for
# torch.compile's tracing). ``ctx.cpath`` records the choice, so backward runs :func:`c_backward`
# without deciding again: after ``ownership.take`` and, when nothing was granted, the gate again (a
# mode may have been entered since forward). Same y, bits, side table, saved tensors and gradient
# bits as the general path (the ops' tests compare both); everything else takes the general path.

_F32 = torch.float32
_U8 = torch.uint8
_I32 = torch.int32
_I64 = torch.int64
_C_BACKENDS = ("auto", "cpu")  # process-wide backends under which use_cpu may pick the C kernels
_num_threads = torch.get_num_threads


class CPath:
    """The C path's constants of one :class:`SmoothSpec` (NOTE [The straight C path of the smooth
    activations]); ``ready`` once :meth:`prepare` found the library."""

    __slots__ = (
        "spec", "ready", "fwd", "collect32", "collect64", "fwd_args", "bwd", "tab", "bwd_args",
    )  # fmt: skip

    def __init__(self, spec: SmoothSpec) -> None:
        self.spec = spec
        self.ready = False

    def prepare(self, x: torch.Tensor) -> bool:
        """Bind the C functions and constants if ``_backend.use_cpu`` picks the C kernels for x."""
        lib = _backend.use_cpu(x, C_STEM)
        if lib is None:
            return False
        fns = _c_fns(lib)
        inv = inverse(self.spec)
        w, tail = _window(self.spec, _F32)
        has_tail, tail_v = (0, 0.0) if tail is None else (1, float(tail))
        tab, byte_scale, _ = inv.tables_on(x.device, _F32)  # cached on inv: kept alive there
        y_hi = round_f32(inv.y_min)
        sc_r, sc_l = _byte_scales(inv, byte_scale)
        self.fwd = fns["smooth_fwd_off_f32"]
        self.collect32, self.collect64 = fns["smooth_collect_i32"], fns["smooth_collect_i64"]
        self.fwd_args = (inv.x_star, w, has_tail, tail_v)
        self.bwd = fns["smooth_bwd_f32"]
        self.tab = tab.data_ptr()
        self.bwd_args = (_TABLE_N, y_hi, inv.y_min - y_hi, inv.s_r**2, sc_r, sc_l)
        self.ready = True
        return True


def c_forward(ctx, x: torch.Tensor, fwd: Callable, cp: CPath) -> torch.Tensor | None:
    """y = fwd(x) with the bits and side table of :func:`smooth_fwd_c`, saved as
    :func:`smooth_forward` saves them; None (nothing done) unless x is a float32 CPU tensor of more
    than DENSE_MAX elements, contiguous, with the C kernels chosen (``cp`` prepared at its first
    such call)."""
    if not (
        x.dtype is _F32
        and x.is_cpu
        and (
            (_backend._resolved[0] or _backend.get_backend()) in _C_BACKENDS
            if cp.ready
            else cp.prepare(x)
        )
    ):
        return None
    n = x.numel()
    if n <= DENSE_MAX or not x.is_contiguous():
        return None
    top = hooks_top(False)  # asked once: here and for the check of y_seen below
    # NOTE [Under hooks that pack each tensor]: the general path decides
    if top is not None and not _derived._checkpoints(top):
        return None
    y = fwd(x)
    nb = (n + CHUNK - 1) // CHUNK
    # transient: per block two counts and an offset (int64), then 1 byte per 32 elements
    ws = torch.empty(24 * nb + ((n + 31) >> 5), dtype=_U8)
    bits = torch.empty((n + 7) >> 3, dtype=_U8)  # packed_numel(n)
    cnt = ws.data_ptr()
    xp = x.data_ptr()
    nt = 1 if nb == 1 else _num_threads()  # one block: one thread does all the work anyway
    k = cp.fwd(xp, bits.data_ptr(), cnt, cnt + 24 * nb, cnt + 16 * nb, n, *cp.fwd_args, nt)
    ctx.perm = ctx.x_layout = None
    ctx.y_is_x = False
    ctx.set_materialize_grads(False)
    big = n >= 2**31
    # NOTE [Side tables under torch.utils.checkpoint]
    ctx.held = held = top is not None
    ctx.side = None
    if k * FALLBACK_DIV > n:  # dense fallback: x itself, as eager (NOTE [Gradient from the output])
        ctx.dense_x, ctx.cpath, ctx.y_seen = True, None, None
        empty_idx = torch.empty(0, dtype=_I64 if big else _I32)
        if held:  # the C path's backward finds the mode in what the recompute saved
            ctx.cpath, ctx.n = cp, n
            save_held(ctx, x, torch.empty(0, dtype=_U8), empty_idx, None, True)
        else:
            ctx.save_for_backward(None, torch.empty(0, dtype=_U8), empty_idx, x)
        return y
    idx = torch.empty(k, dtype=_I64 if big else _I32)
    xs = torch.empty(k, dtype=_F32)
    if k:
        (cp.collect64 if big else cp.collect32)(
            xp, cnt, cnt + 24 * nb, cnt + 16 * nb, idx.data_ptr(), xs.data_ptr(), n,
            *cp.fwd_args, nt,
        )  # fmt: skip
    ctx.dense_x = False
    ctx.cpath, ctx.n = cp, n
    if held:
        save_held(ctx, y, bits, idx, xs, False)
    else:
        ctx.save_for_backward(y, bits, idx, xs)
    # NOTE [A kept output written under saved-tensor hooks]; past the gate: not compiling
    ctx.y_seen = None if top is None else seen(y)
    return y


def c_backward(ctx, g: torch.Tensor, buf, exact: Callable, *args) -> torch.Tensor | None:
    """dx of a Function whose forward ran :func:`c_forward` (``ctx.cpath``), for a contiguous g;
    into ``buf`` (g itself, granted by ``ownership.take``) if given. None (nothing done) when the
    saved tensors come back other than saved (a saved-tensor hook's layout, dtype or device)."""
    try:
        # side_tensors(ctx) where it has work (held, or handed over): no call otherwise
        saved = side_tensors(ctx) if ctx.held or ctx.side is not None else ctx.saved_tensors
        y, bits, idx, xs = saved
    except RuntimeError as e:  # NOTE [An output written after forward]
        raise_output_written(e, _public_api(ctx))
        raise
    if y is None:  # the recompute's dense fallback: the general path takes it (NOTE [Side
        ctx.side = saved  # tables under torch.utils.checkpoint])
        return None
    if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
        check_output_seen(ctx, y, _public_api(ctx))
    if not (
        y.dtype is _F32
        and y.is_cpu
        and y.shape == g.shape
        and y.is_contiguous()
        and bits.is_contiguous()
    ):
        ctx.side = saved  # unpacked once (a checkpoint's unpack gives each tensor once)
        return None
    cp = ctx.cpath
    gp = g.data_ptr()
    gf = g.view(-1)
    of = gf if buf is not None else torch.empty_like(gf)
    k = idx.shape[0]
    if k:  # the hard elements' g, read before out (maybe g's buffer) is written
        gh = gf.index_select(0, idx)
    cp.bwd(
        gp, y.data_ptr(), bits.data_ptr(), cp.tab, gp if buf is not None else of.data_ptr(),
        ctx.n, *cp.bwd_args, _num_threads(),
    )  # fmt: skip
    if k:
        of.index_put_((idx,), exact(gh, xs, *args))
    return buf if buf is not None else of.view(g.shape)

"""Hardswish that keeps its output, 1 branch bit per element and a sparse table of exact inputs.

Math: y = x relu6(x + 3) / 6. Eager's gradient (``hardswish_backward``) is 0 for x <= -3,
x / 3 + 1/2 for -3 < x < 3 and 1 for x >= 3. On (-3, 3) y = (d^2 - 9/4) / 6 with d = x + 3/2, so
the slope x / 3 + 1/2 = d / 3 = +-sqrt(6 y + 9/4) / 3, the sign being the branch b = [x >= -3/2]
(one minimum, y = -3/8 at x = -3/2). The other pieces follow from y and b: b = 0 and y == 0 is
x <= -3 (no x in (-3, -3/2) rounds to y == 0, in any dtype); b = 1 and y >= 3 is x >= 3 (checked on
every float16/bfloat16 value and the float32 neighbourhoods of the breakpoints by the tests).
Near the minimum the inverse is ill-conditioned (an error dy of the stored y moves the slope by
dy / |d|), so elements with |d| < ``_WINDOW[dtype]`` are kept exactly in a side table (int32 flat
index + x), as are non-finite x (-inf gives y = NaN); their gradient is eager's formula on x (NaN
for NaN x, as eager's vectorized kernel gives; its scalar tail gives g). See NOTE [Gradient from
the output] in ``slimgrad.ops._output_act``. The rest is within eager's own error (error rule;
dense float grids in the tests). The slope is computed in float32 from y + 3/8, exact near the
minimum, so only y's own rounding enters.

Memory (float32): saves y (the output, shared with the next layer) + 1/8 B/elt (branch bits) + 8 B
per element within 0.1 of -3/2 (0.2-0.3 B/elt at N(0, 1)-like inputs); eager saves x (4 B/elt).
float16/bfloat16: y + 1/8 B/elt + 6 B per element within 0.15 of -3/2; eager 2 B/elt. When more than
1/16 of the elements are in the table, for float64, under torch.compile and for tensors of at most
``DENSE_MAX`` (512) elements (NOTE [Few elements] in ``ops._output_act``), and out of place on a
leaf that requires grad or a view of one (NOTE [An input the graph holds] there), keeps x
densely, as eager does (no y, bits or table). Backward writes dx into the incoming gradient's
buffer when ``slimgrad.ownership.take`` proves it dead (NOTE [Gradient-buffer ownership]).
Second derivatives: eager's, bit for bit, where x is kept out of place (its dense path; in place
where that path is known from the shape and dtype, eager's own in-place op runs); otherwise they
raise (NOTE [Second derivatives] in ``slimgrad._autograd``, NOTE [Second derivatives of the smooth
activations] in ``ops._output_act``); under torch.func transforms this is eager's op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from slimgrad import _dtensor, ownership
from slimgrad._autograd import eager_op, first_order, refuse_jit, refuse_second_order
from slimgrad._math.tables import index_table
from slimgrad.ops._bits import pack_bits, packed_numel, unpack_bits
from slimgrad.ops._monotone import hooks_active
from slimgrad.ops._output_act import (
    DENSE_MAX,
    _inverse_perm,
    graph_holds,
    memory_order,
    needs_graph,
    refuse_untied,
)

__all__ = ["hardswish", "hardswish_"]

CHUNK = 1 << 14  # elements per chunk (a multiple of 8): bounds the temporaries (~12 B/elt)
FALLBACK_DIV = 16  # keep x densely when more than numel / FALLBACK_DIV elements are hard
# half-width of the hard window around x = -3/2, per dtype (from the stored y's rounding:
# float32 y is eager's, within ~1.5 ulp; half types within 1/2 ulp)
_WINDOW = {torch.float32: 0.1, torch.bfloat16: 0.15, torch.float16: 0.15}


def _fwd_torch(x: Tensor) -> Tensor:
    return F.hardswish(x)


def _slope_into(s: Tensor, y: Tensor, b: Tensor) -> Tensor:
    # dy/dx from y (float32) and the branch b = [x >= -3/2] (bool), away from -3/2, into s (float32,
    # like y). y + 3/8 is exact where it matters (Sterbenz: |y| in [3/16, 3/4]), so the float32
    # slope carries only y's own rounding, amplified by 1 / |d| (hence the window).
    torch.add(y, 0.375, out=s).mul_(6.0).clamp_(min=0.0).sqrt_().div_(3.0)
    s.mul_(b.to(s.dtype).mul_(2.0).sub_(1.0))  # left branch: negative slope
    s.masked_fill_(y >= 3.0, 1.0)  # x >= 3 (then b = 1)
    return s.masked_fill_((y == 0.0).logical_and_(b.logical_not()), 0.0)  # x <= -3


def _bwd_table(g: Tensor, x: Tensor) -> Tensor:
    # eager's formula for the side table, as its vectorized CPU kernel evaluates it (in float32
    # for half types): 0 for x <= -3, g for x >= 3, g (x / 3 + 1/2) otherwise; NaN for NaN x (the
    # kernel's scalar tail returns g there instead: the table is short, so it follows the result
    # eager gives that element inside a whole tensor)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, gf = x.to(cdt), g.to(cdt)
    out = torch.where(xf >= 3.0, gf, gf * (xf / 3.0 + 0.5))
    return out.masked_fill_(xf <= -3.0, 0.0).to(g.dtype)


def _side_info(x: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    # (bits, idx, xs), or None when too many elements are hard (then x is kept densely)
    flat = x.reshape(-1)
    n = flat.numel()
    w = _WINDOW[x.dtype]
    if is_fake(x):  # no values: one table op of symbolic (or 0) length, no dense decision
        # NOTE [Side tables under FakeTensorMode and torch.compile] in slimgrad/_math/tables.py
        c = flat.float()
        d = (c + 1.5).abs_()
        idx = index_table((d < w) | ~torch.isfinite(c), torch.int32 if n < 2**31 else torch.int64)
        return pack_bits(c >= -1.5), idx, flat.index_select(0, idx)
    bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    hard = []
    # pieces as _bwd_torch's (at most CHUNK and ~1/4 of the tensor, a multiple of 8): the float32
    # temporaries (4 B per element of a piece, 2x a half-type x) stay below x's own size
    step = min(CHUNK, max(8, -(-n // 32) * 8))
    for a in range(0, n, step):
        c = flat[a : a + step].float()
        bits[a // 8 : (a + c.numel() + 7) // 8] = pack_bits(c >= -1.5)
        # |x + 3/2| < w, or x non-finite (|x + 3/2| NaN or inf, set to 0 first): one float
        # temporary (c's buffer where c is a copy, not x itself) and one bool (isfinite's
        # decomposition would add three more)
        d = (c + 1.5 if c.dtype == x.dtype else c.add_(1.5)).abs_().nan_to_num_(0.0, 0.0, 0.0)
        hard.append(torch.lt(d, w).nonzero().view(-1).add_(a))
        del c, d
    idx = torch.cat(hard) if hard else torch.empty(0, dtype=torch.int64, device=x.device)
    if idx.numel() * FALLBACK_DIV > n:
        return None
    xs = flat.index_select(0, idx)
    return bits, idx.to(torch.int32 if n < 2**31 else torch.int64), xs


def _bwd_torch(g: Tensor, y: Tensor, bits: Tensor, idx: Tensor, xs: Tensor, out=None) -> Tensor:
    """dL/dx from y, the branch bits and the side table (``out``: a dead buffer like g, or None)."""
    n = g.numel()
    gf = g.reshape(-1)
    yf = y.reshape(-1)
    gh = (
        gf.index_select(0, idx.long()) if is_fake(idx) or idx.numel() else None
    )  # read before out is written
    res = torch.empty(n, dtype=g.dtype, device=g.device) if out is None else out.view(-1)
    # pieces of at most CHUNK and at most ~1/4 of the tensor: the temporaries (~12 B per element
    # of a piece) stay below the tensor's own size on small tensors too
    step = min(CHUNK, max(8, -(-n // 32) * 8))
    s = torch.empty(min(n, step), dtype=torch.float32, device=g.device)
    for a in range(0, n, step):
        b = min(a + step, n)
        sc = _slope_into(
            s[: b - a], yf[a:b].float(), unpack_bits(bits[a // 8 : (b + 7) // 8], b - a)
        )
        if g.dtype == torch.float32:  # one rounding, as eager's g * slope
            torch.mul(gf[a:b], sc, out=res[a:b])
        else:  # half types: in float32, rounded once (eager's opmath)
            res[a:b] = gf[a:b].float().mul_(sc)
    if gh is not None:
        res.index_copy_(0, idx.long(), _bwd_table(gh, xs))
    return res.view(g.shape)


def _double(ctx, g: Tensor):
    # create_graph=True (NOTE [Second derivatives] in slimgrad._autograd): where x itself is kept
    # (out of place on the dense path), eager's backward on it, differentiable: eager's second
    # derivatives bit for bit; otherwise (y, bits and a table) refused, tied to the saved output
    if g is None:
        return None, None
    if ctx.dense and not ctx.inplace:
        return torch.ops.aten.hardswish_backward(g, ctx.saved_tensors[0]), None
    if ctx.dense:  # in place: a copy of x made in forward, outside the graph
        refuse_untied("ops.hardswish")
    return refuse_second_order("ops.hardswish", _HardswishFn.backward, ctx, (g,))


class _HardswishFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool) -> Tensor:
        # under torch.compile x is kept densely: the table's length, and with it the choice
        # between table and x, depend on values (NOTE [Side tables under FakeTensorMode and
        # torch.compile] in slimgrad/_math/tables.py)
        compiling = torch.compiler.is_compiling()
        # a few elements keep x, as eager (NOTE [Few elements] in slimgrad.ops._output_act): y,
        # bits and table cost more than x there (1 element: saved 5 B, peak 34,841 B on the first
        # call, against eager's 4 B and 20 B)
        # so does a leaf that requires grad, or a view of one, out of place: the graph holds it
        # anyway (NOTE [An input the graph holds] in ops/_output_act.py)
        few = x.numel() <= DENSE_MAX or (not inplace and not compiling and graph_holds(x))
        # the side information in y's memory order (x permuted by memory_order), so that
        # backward reads y and g in place, without a reshaped copy of either
        ctx.perm = memory_order(x)
        xp = x if ctx.perm is None else x.permute(ctx.perm)
        side = _side_info(xp) if x.dtype in _WINDOW and not compiling and not few else None
        del xp
        dense = None
        if side is None:  # float64, or crowded near -3/2: keep x as eager does
            dense = x.detach().clone() if inplace else x
        if inplace:
            y = F.hardswish(x, inplace=True)
            ctx.mark_dirty(y)
        else:
            y = _fwd_torch(x)
        ctx.inplace = inplace
        if side is None:
            ctx.dense = True
            ctx.save_for_backward(dense)
        else:
            ctx.dense = False
            ctx.save_for_backward(y, *side)
        return y

    @staticmethod
    @first_order("ops.hardswish", double=lambda ctx, g: _double(ctx, g))
    def backward(ctx, g: Tensor):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:  # y written: NOTE [An output written after forward]
            if not ctx.dense:  # (x kept, as eager: eager's own error)
                from slimgrad.ops._output_act import raise_output_written  # (only when raising)

                raise_output_written(e, "ops.hardswish")
            raise
        if ctx.dense:  # eager's own kernel on x
            return torch.ops.aten.hardswish_backward(g, saved[0]), None
        p = ctx.perm
        y, side = saved[0], saved[1:]
        yp = y if p is None else y.permute(p)
        bp = None if buf is None else buf if p is None else buf.permute(p)
        if bp is not None and bp.is_contiguous() and yp.is_contiguous():
            _bwd_torch(bp, yp, *side, out=bp)
            return buf, None
        gp = g if p is None else g.permute(p)
        dx = _bwd_torch(gp.contiguous(), yp, *side)
        return (dx if p is None else dx.permute(_inverse_perm(p))), None


def hardswish(input: Tensor, inplace: bool = False) -> Tensor:
    """Hardswish ``y = x relu6(x + 3) / 6`` that keeps y + 1 bit/elt (+ a sparse exact table).

    Output as ``torch.nn.functional.hardswish``; the gradient is eager's at the breakpoints and
    within eager's own error elsewhere (error rule).

    Memory: saves y (shared with the next layer) + 1 bit/elt + 8 B per element within 0.1 of
    -3/2 (float32; ~0.2 B/elt at N(0, 1)); eager saves x (4 B/elt). Crowded inputs and float64:
    x densely, as eager.

    Args:
        input: a floating tensor.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Raises:
        RuntimeError: double backward (``create_graph=True``, differentiated again) through this
            op where it kept y, bits and a table, or a ``torch.jit.trace`` of it.

    Example:
        >>> y = hardswish(torch.randn(4, 8, requires_grad=True))
    """
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input):
        return _dtensor.pointwise("slimgrad.ops.hardswish", hardswish, input, inplace=inplace)
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    # NOTE [Output and side information under saved-tensor hooks] (ops/_monotone.py)
    # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if not needs_graph(input) or eager_op(inplace) or hooks_active() or input.is_meta:
        return F.hardswish(input, inplace=inplace)
    refuse_jit("ops.hardswish")
    if inplace and (input.numel() <= DENSE_MAX or input.dtype not in _WINDOW):
        # x kept densely, known from the shape and dtype: eager's in-place node keeps the same
        # copy of x, with its graph: eager's second derivatives (NOTE [Second derivatives of the
        # smooth activations] in ops/_output_act.py)
        return F.hardswish(input, inplace=True)
    return _HardswishFn.apply(input, inplace)


def hardswish_(input: Tensor) -> Tensor:
    """In-place :func:`hardswish`; keeps no copy of x (eager's in-place op keeps x's clone)."""
    return hardswish(input, inplace=True)

"""ELU that keeps its output (plus 1 bit/elt for alpha < 0) and the few inputs its output loses.

Math: y = x if x > 0 else alpha (e^x - 1),  dy/dx = 1 if x > 0 else alpha e^x = y + alpha.
For alpha > 0, x <= 0 iff y <= 0, so backward is ``elu_backward(g, alpha, 1, 1, is_result=True, y)``
(eager's in-place formula). For alpha < 0 the sign of y no longer tells the side; we keep [x > 0] as
1 bit/elt and use y + alpha on the negative side (eager's ``elu_`` refuses a negative alpha in
backward). See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

# NOTE [ELU's tail]
y + alpha = alpha e^x is a difference of two numbers near alpha once x << 0: the output, rounded to
its dtype, keeps only about e^x of alpha's significant bits (bfloat16, alpha 0.8, x = -7: y + alpha
= -7.8e-4 where alpha e^x = +7.3e-4; float16 x = -8.5: 0; float32 from x = -17 on: 0). Eager's
out-of-place backward reads x and has no such loss (its in-place ``elu_`` has it too). So below
``TAIL`` (x < -2: alpha e^x < 0.14 alpha, at most ~3 bits lost; 2.3% of N(0, 1) inputs) x is kept
exactly, as a sparse side table (flat index + x, as the smooth activations' hard elements), and
backward uses eager's formula on it; -inf falls there too. When that table would hold as many bytes
as x itself (more than elt / (4 + elt) of the elements), x is kept densely instead: exactly what
eager keeps, and then neither y nor the table. alpha = 0 needs no table (the gradient is 0). Under
torch.compile (data-dependent sizes) x is kept densely too; on fake tensors outside torch.compile
the table comes from ``slimgrad::select_table`` with a symbolic length, or 0 without a ShapeEnv
(NOTE [Side tables under FakeTensorMode and torch.compile] in ``slimgrad/_math/tables.py``).
tests/ops/test_elu.py checks every float16/bfloat16 value and a float32 sweep of the whole range
against float64.

# NOTE [ELU in place]
Eager's in-place ``elu_`` (alpha > 0) keeps its output alone and differentiates it as
``g (y + alpha)``: the tail's loss above is eager's own there. ``inplace=True`` with alpha > 0 does
the same (y, no tail table, no copy of x at few elements): eager's bytes and eager's in-place
gradient bit for bit, so it never keeps more than the module it replaces (the table or the copy of
x would: issue 30, ``tests/conformance/test_never_more_than_eager_sweep.py``); backward still
writes dx into a dead incoming gradient (below). The out-of-place op keeps the table. alpha < 0 in
place keeps what the out-of-place op keeps (eager's ``elu_`` refuses it in backward).

Memory: alpha > 0: saves y (the output, shared with the next layer) + (4 + elt) B per element with
x < -2; alpha < 0: the same + 1 bit/elt. Eager saves x (4 B/elt float32). Dense case: x, as eager;
so is a tensor of at most ``DENSE_MAX`` (512) elements (NOTE [Few elements] in ``ops._output_act``)
and, out of place, a leaf that requires grad or a view of one (NOTE [An input the graph holds]).
In place with alpha > 0: y alone, as eager's ``elu_`` (NOTE [ELU in place]).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from slimgrad import _dtensor, ownership
from slimgrad._autograd import eager_op, first_order, refuse_jit
from slimgrad._math.tables import select_table
from slimgrad.kernels import _backend
from slimgrad.ops._bits import pack_bits, unpack_bits
from slimgrad.ops._monotone import hooks_active
from slimgrad.ops._output_act import (
    DENSE_MAX,
    _inverse_perm,
    as_layout,
    eager_layout,
    graph_holds,
    memory_order,
    needs_graph,
    raise_output_written,
    record_layout,
)

__all__ = ["elu", "elu_"]

TAIL = -2.0  # NOTE [ELU's tail]


def _fwd_torch(x: Tensor, alpha: float = 1.0) -> Tensor:
    return torch.nn.functional.elu(x, alpha)


def _bwd_torch(g: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
    """dx from y alone (eager's in-place formula; the Triton kernels' reference)."""
    return torch.ops.aten.elu_backward(g, alpha, 1.0, 1.0, True, y)


def _bwd_exact(g: Tensor, x: Tensor, alpha: float) -> Tensor:
    return torch.ops.aten.elu_backward(g, alpha, 1.0, 1.0, False, x)


def _neg_side(g: Tensor, y: Tensor, alpha: float) -> Tensor:
    # eager's g (y + alpha) in opmath, computed in place (the same roundings), in g's dtype
    opmath = torch.float64 if g.dtype == torch.float64 else torch.float32  # as eager
    neg = torch.add(y, alpha) if y.dtype == opmath else y.to(opmath).add_(alpha)
    return neg.mul_(g if g.dtype == opmath else g.to(opmath)).to(g.dtype)


def _bwd_bits(
    g: Tensor, y: Tensor, bits: Tensor, alpha: float, out: Tensor | None = None
) -> Tensor:
    """dx from y and the bits [x > 0], all in the bits' order (y's memory order, as
    ``_EluFn.forward`` packs them); out: g itself when g's buffer is dead
    (slimgrad.ownership.take), else None."""
    n = g.numel()
    if n and y.is_contiguous() and g.is_contiguous() and (out is None or out.is_contiguous()):
        # in 4 pieces: the temporaries (g (y + alpha), the unpacked bits: 5.5 B per element of a
        # piece) stay below one tensor of g's size, and the loop's op count stays small
        res = torch.empty_like(y, dtype=g.dtype) if out is None else out
        gf, yf, rf = g.view(-1), y.view(-1), res.view(-1)
        step = max(8, -(-n // 32) * 8)  # a multiple of 8: each piece starts on a whole byte
        for a in range(0, n, step):
            b = min(a + step, n)
            pos = unpack_bits(bits[a // 8 : (b + 7) // 8], b - a)
            torch.where(pos, gf[a:b], _neg_side(gf[a:b], yf[a:b], alpha), out=rf[a:b])
        return res
    neg = _neg_side(g, y, alpha)  # one gradient-sized temporary; it takes the result too
    pos = unpack_bits(bits, n).view(g.shape)
    return torch.where(pos, g, neg, out=neg if out is None else out)


def _tail_table(x: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(idx, xs, dense): logical flat indices and values of x < TAIL, or dense when the table would
    hold as many bytes as x (NOTE [ELU's tail])."""
    mask = x < TAIL
    idx_dtype = torch.int32 if x.numel() < 2**31 else torch.int64
    if is_fake(x):  # no values: the table's length is symbolic (or 0), no dense decision
        # NOTE [Side tables under FakeTensorMode and torch.compile] in slimgrad/_math/tables.py
        return (*select_table(x, mask, idx_dtype), False)
    k = int(mask.sum())
    if k and k * (torch.iinfo(idx_dtype).bits // 8 + x.element_size()) >= x.numel() * (
        x.element_size()
    ):
        return x.new_empty(0, dtype=idx_dtype), x.new_empty(0), True
    idx = mask.reshape(-1).nonzero().view(-1).to(idx_dtype)
    return idx, torch.masked_select(x, mask), False


def _unpack_as(bits: Tensor, y: Tensor, perm) -> Tensor:
    # [x > 0] shaped like y, from bits packed in y's memory order (as _EluFn.forward packs them)
    if perm is None:
        return unpack_bits(bits, y.numel()).view(y.shape)
    pos = unpack_bits(bits, y.numel()).view(y.permute(perm).shape)
    return pos.permute(_inverse_perm(perm))


def _positions(idx: Tensor, shape) -> tuple[Tensor, ...]:
    return torch.unravel_index(idx.long(), shape)


def _double(ctx, g):
    # create_graph=True: the same first derivatives with differentiable ops. From y: d(y + alpha) =
    # dy, and autograd continues through y's node (alpha e^x): eager's second derivative. The tail
    # table's values are exact; their derivative w.r.t. x is taken through y (straight through).
    alpha = ctx.alpha
    if ctx.dense:
        if ctx.inplace:  # the copy of x taken before the overwrite has no history
            raise RuntimeError(
                "slimgrad.ops.elu: a second derivative through an in-place ELU that kept a copy "
                "of its input was requested; expected create_graph=False here, got "
                "create_graph=True. Use inplace=False (it keeps x itself) or "
                "torch.nn.functional.elu for double backward."
            )
        (x,) = ctx.saved_tensors
        return _bwd_exact(g, x, alpha), None, None
    if ctx.bits:
        y, bits, idx, xs = ctx.saved_tensors
        pos = _unpack_as(bits, y, ctx.perm)
        dx = torch.where(pos, g, g * (y + alpha))
    else:
        y, idx, xs = ctx.saved_tensors
        dx = _bwd_torch(g, y, alpha)
    if is_fake(idx) or idx.numel():
        p = _positions(idx, y.shape)
        gh, yh = g[p], y[p]
        via_y = gh.detach() * (yh + alpha)
        exact = gh * (alpha * torch.exp(xs.to(yh.dtype)))
        dx = dx.index_put(p, exact + (via_y - via_y.detach()))
    return dx, None, None


class _EluFn(torch.autograd.Function):
    # alpha != 0 (alpha == 0 keeps y only: its gradient is 0 on the negative side, exactly)
    @staticmethod
    def forward(ctx, x: Tensor, alpha: float, inplace: bool):
        ctx.alpha, ctx.inplace = alpha, inplace
        record_layout(ctx, x)
        ctx.bits = alpha < 0
        # in place with alpha > 0: eager's elu_ keeps y alone (NOTE [ELU in place]): so does this
        as_eager_ = inplace and alpha > 0
        # a few elements keep x, as eager (NOTE [Few elements] in slimgrad.ops._output_act): the
        # bits, the tail table and their temporaries cost more than x there (1 element, alpha < 0:
        # peak 33 B, 34,829 B on the first call (the unpacking table), against eager's 12-20 B)
        # so does a leaf that requires grad, or a view of one, out of place: the graph holds it
        # anyway (NOTE [An input the graph holds] in ops/_output_act.py)
        ctx.dense = (
            alpha != 0
            and not as_eager_
            and (
                torch.compiler.is_compiling()
                or x.numel() <= DENSE_MAX
                or (not inplace and graph_holds(x))
            )
        )
        if alpha == 0 or as_eager_:
            idx, xs = x.new_empty(0, dtype=torch.int32), x.new_empty(0)
        elif not ctx.dense:
            idx, xs, ctx.dense = _tail_table(x)
        if ctx.dense:  # x, as eager (a copy when it is overwritten)
            keep = x.clone() if inplace else x
        # the bits [x > 0] in the output's memory order (x permuted by memory_order), so that
        # backward reads y, g and the bits in the same order, in pieces
        ctx.perm = memory_order(x) if ctx.bits and not ctx.dense else None
        xp = x if ctx.perm is None else x.permute(ctx.perm)
        bits = pack_bits(~(xp <= 0)) if ctx.bits and not ctx.dense else None  # NaN: positive
        del xp
        if inplace:
            y = _fwd_inplace(x, alpha)
            ctx.mark_dirty(y)
        else:
            y = _fwd(x, alpha)
        if ctx.dense:
            ctx.save_for_backward(keep)
        elif ctx.bits:
            ctx.save_for_backward(y, bits, idx, xs)
        else:
            ctx.save_for_backward(y, idx, xs)
        return y

    @staticmethod
    @first_order("ops.elu", double=_double)
    def backward(ctx, g):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        alpha = ctx.alpha
        # the layout of eager's CPU elu_backward: a binary elementwise kernel like silu_backward
        # (the meta kernel of elu_backward picks x's layout, the CPU kernel g's). The dense path
        # asks only when it would write into g's buffer: out of place it is eager's own call
        if ctx.dense:
            (x,) = ctx.saved_tensors
            if (
                buf is not None
                and buf.shape == x.shape
                and eager_layout(ctx, g, torch.ops.aten.silu_backward) in (None, buf.stride())
            ):
                dx = torch.ops.aten.elu_backward.grad_input(
                    buf, alpha, 1.0, 1.0, False, x, grad_input=buf
                )
                return dx, None, None
            return _bwd_exact(g, x, alpha), None, None
        layout = eager_layout(ctx, g, torch.ops.aten.silu_backward)
        if buf is not None and layout not in (None, buf.stride()):
            buf = None
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:  # y written: NOTE [An output written after forward]
            if not (ctx.inplace and alpha > 0):  # (eager's elu_ keeps y too: eager's own error)
                raise_output_written(e, "ops.elu")
            raise
        if ctx.bits:
            y, bits, idx, xs = saved
        else:
            (y, idx, xs), bits = saved, None
        pos = _positions(idx, y.shape) if is_fake(idx) or idx.numel() else None
        gh = g[pos] if pos is not None else None  # read before g's buffer may be written
        own = buf is not None and buf.shape == y.shape and buf.dtype == y.dtype
        if bits is not None:  # in the bits' order (y's memory order)
            p = ctx.perm
            o = buf if own else None
            if p is None:
                dx = _bwd_bits(g, y, bits, alpha, out=o)
            else:
                op = None if o is None else o.permute(p)
                dx = _bwd_bits(g.permute(p), y.permute(p), bits, alpha, out=op)
                dx = o if o is not None else dx.permute(_inverse_perm(p))
        elif _backend.use_triton(y):  # NOTE [Kernel backend choice]
            dx = _backend.kernels("elu")._bwd_triton(g, y, alpha, out=buf if own else None)
        elif own:
            dx = torch.ops.aten.elu_backward.grad_input(
                buf, alpha, 1.0, 1.0, True, y, grad_input=buf
            )
        else:
            dx = _bwd_torch(g, y, alpha)
        if pos is not None:
            dx.index_put_(pos, _bwd_exact(gh, xs, alpha))
        return as_layout(dx, layout), None, None


def _fwd(x: Tensor, alpha: float) -> Tensor:
    if _backend.use_triton(x):
        return _backend.kernels("elu")._fwd_triton(x, alpha)
    return _fwd_torch(x, alpha)


def _fwd_inplace(x: Tensor, alpha: float) -> Tensor:
    if _backend.use_triton(x):
        return _backend.kernels("elu")._fwd_triton_(x, alpha)
    return torch.nn.functional.elu_(x, alpha)


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """ELU ``y = x if x > 0 else alpha (exp(x) - 1)`` that keeps y (+ 1 bit/elt if alpha < 0) and
    x where y loses it (x < -2, NOTE [ELU's tail]).

    Memory: saves y (shared with the next layer) + (4 + elt) B per element with x < -2
    (``alpha < 0``: + 1 bit/elt); as many bytes as x at most: then x, as eager. Eager saves x
    (4 B/elt float32). ``inplace`` with alpha > 0: y alone, as eager's ``elu_`` (its gradient).

    Args:
        input: any floating tensor.
        alpha: scale of the negative side (any sign).
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = elu(torch.randn(4, 8, requires_grad=True), alpha=0.5)
    """
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input):
        return _dtensor.pointwise("slimgrad.ops.elu", elu, input, alpha=alpha, inplace=inplace)
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    # NOTE [Output and side information under saved-tensor hooks] (ops/_monotone.py)
    # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if eager_op(inplace) or not needs_graph(input) or hooks_active() or input.is_meta:
        if inplace and alpha < 0 and needs_graph(input):
            # eager's in-place op refuses a negative alpha in backward; this op accepts it
            return input.copy_(torch.nn.functional.elu(input.clone(), alpha))
        return torch.nn.functional.elu(input, alpha, inplace=inplace)
    refuse_jit("ops.elu")
    return _EluFn.apply(input, float(alpha), inplace)


def elu_(input: Tensor, alpha: float = 1.0) -> Tensor:
    """In-place :func:`elu`; works for a negative alpha too (eager's refuses in backward)."""
    return elu(input, alpha, inplace=True)

"""LeakyReLU that keeps only its output (slope >= 0) or only 1 bit per element (slope < 0).

Math: y = x if x > 0 else slope * x,  dy/dx = 1 if x > 0 else slope.
For slope >= 0, x > 0 iff y > 0, so backward is eager's in-place formula
``leaky_relu_backward(g, y, slope, self_is_result=True)``. For slope < 0, y does not tell the sign
of x; we keep [x > 0] as 1 bit/elt, which is all the gradient needs (eager's ``leaky_relu_``
refuses a negative slope in backward).
See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

Memory: slope >= 0: saves y (the output, shared with the next layer); slope < 0: saves 1 bit/elt
only (in x's memory order), or x itself (as eager) for a tensor of at most ``DENSE_MAX`` (512)
elements. Any slope, out of place on a leaf that requires grad or a view of one (NOTE [An input the
graph holds] in ``ops._output_act``): x itself, as eager. Eager saves x (4 B/elt float32).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad import ownership
from slimgrad._autograd import FxTraceError, eager_op, first_order, refuse_jit
from slimgrad.ops._bits import unpack_bits
from slimgrad.ops._monotone import (
    apply_with_anchor,
    forward_with_bits,
    output_only_function,
    same_layout,
    unpack_side,
    zero_tie,
)
from slimgrad.ops._output_act import (
    as_layout,
    eager_layout,
    few_elements,
    graph_holds,
    needs_graph,
    record_layout,
)

__all__ = ["leaky_relu", "leaky_relu_"]


def _fwd_torch(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    return torch.nn.functional.leaky_relu(x, negative_slope)


def _bwd_bits(
    g: Tensor,
    bits: Tensor,
    negative_slope: float,
    out: Tensor | None = None,
    pos: Tensor | None = None,
) -> Tensor:
    # out: g itself when g's buffer is dead (slimgrad.ownership.take), else None (a fresh result);
    # pos: the unpacked side in the forward input's layout (unpack_side), else bits in g's order
    if pos is None:
        pos = unpack_bits(bits, g.numel()).view(g.shape)
    if out is not None:
        return torch.where(pos, g, g * negative_slope, out=out)
    return torch.where(pos, g, g * negative_slope)


_LeakyReluFn, _bwd_torch = output_only_function(
    "leaky_relu",
    "_LeakyReluFn",
    _fwd_torch,
    torch.nn.functional.leaky_relu_,
    torch.ops.aten.leaky_relu_backward,
    lambda g, y, negative_slope=0.01: (g, y, negative_slope, True),
)


def _double_bits(ctx, g: Tensor) -> Tensor:
    # create_graph=True: differentiable in g; the second derivative in x is 0, as eager's, also
    # when g has no history (zero_tie: NOTE in slimgrad.ops._monotone)
    (bits,) = ctx.saved_tensors
    pos = unpack_side(ctx, bits, g)
    return zero_tie(ctx, torch.where(pos, g, g * ctx.slope))


class _LeakyReluBitsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, negative_slope: float, inplace: bool):
        ctx.slope = negative_slope
        record_layout(ctx, x)
        return forward_with_bits(
            ctx,
            x,
            inplace,
            lambda t: t > 0,
            lambda t: torch.nn.functional.leaky_relu(t, negative_slope),
            lambda t: torch.nn.functional.leaky_relu_(t, negative_slope),
        )

    @staticmethod
    @first_order("ops.leaky_relu", double=lambda ctx, g: (_double_bits(ctx, g), None, None))
    def backward(ctx, g):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        (bits,) = ctx.saved_tensors
        slope = ctx.slope
        layout = (
            None
            if same_layout(ctx, g)
            else eager_layout(
                ctx, g, lambda gm, xm: torch.ops.aten.leaky_relu_backward(gm, xm, slope, False)
            )
        )
        if buf is not None and layout not in (None, buf.stride()):
            buf = None
        pos = unpack_side(ctx, bits, g)
        return as_layout(_bwd_bits(g, bits, slope, out=buf, pos=pos), layout), None, None


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """LeakyReLU ``y = x if x > 0 else negative_slope * x`` that keeps y (or 1 bit/elt) for
    backward.

    Memory: ``negative_slope >= 0``: saves y (shared with the next layer); ``< 0``: saves 1 bit/elt.
    Eager saves x (4 B/elt float32).

    Args:
        input: any floating tensor.
        negative_slope: slope for x <= 0 (any sign).
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = leaky_relu(torch.randn(4, 8, requires_grad=True), 0.2)
    """
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    try:
        eager = eager_op(inplace) or not needs_graph(input)
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        return torch.nn.functional.leaky_relu(input, negative_slope, inplace=inplace)
    if eager:
        if inplace and negative_slope < 0 and needs_graph(input):
            # eager's in-place op refuses a negative slope in backward; this op accepts it
            return input.copy_(torch.nn.functional.leaky_relu(input.clone(), negative_slope))
        return torch.nn.functional.leaky_relu(input, negative_slope, inplace=inplace)
    if negative_slope < 0 and not inplace and few_elements(input):
        # NOTE [Few elements] (ops/_output_act.py): the bits' unpacking temporaries cost more
        # than x on a tensor this small (2 elements: peak 34 B, eager's 32); keep x, as eager
        return torch.nn.functional.leaky_relu(input, negative_slope)
    refuse_jit("ops.leaky_relu")
    if (
        negative_slope < 0
        and not inplace
        and not torch.compiler.is_compiling()
        and graph_holds(input)
    ):
        # so does a leaf that requires grad, or a view of one: the graph holds it anyway (NOTE
        # [An input the graph holds] in ops/_output_act.py)
        return torch.nn.functional.leaky_relu(input, negative_slope)
    if negative_slope >= 0:
        return _LeakyReluFn.apply(input, float(negative_slope), inplace)
    return apply_with_anchor(_LeakyReluBitsFn, input, float(negative_slope), inplace)


def leaky_relu_(input: Tensor, negative_slope: float = 0.01) -> Tensor:
    """In-place :func:`leaky_relu`; works for a negative slope too (eager's refuses in backward)."""
    return leaky_relu(input, negative_slope, inplace=True)

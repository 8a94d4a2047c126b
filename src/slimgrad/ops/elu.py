"""ELU that keeps only its output (alpha >= 0), or its output plus 1 bit per element (alpha < 0).

Math: y = x if x > 0 else alpha (e^x - 1),  dy/dx = 1 if x > 0 else alpha e^x = y + alpha.
For alpha > 0, x <= 0 iff y <= 0, so backward is ``elu_backward(g, alpha, 1, 1, is_result=True, y)``
(eager's in-place formula). For alpha < 0 the sign of y no longer tells the side; we keep [x > 0] as
1 bit/elt and use y + alpha on the negative side (eager's ``elu_`` refuses a negative alpha in
backward). See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

Memory: alpha >= 0: saves y (the output, shared with the next layer); alpha < 0: y + 1 bit/elt.
Eager saves x (4 B/elt float32).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad import ownership
from slimgrad.ops._bits import unpack_bits
from slimgrad.ops._monotone import forward_with_bits, output_only_function
from slimgrad.ops._output_act import needs_graph

__all__ = ["elu", "elu_"]


def _fwd_torch(x: Tensor, alpha: float = 1.0) -> Tensor:
    return torch.nn.functional.elu(x, alpha)


def _bwd_bits(
    g: Tensor, y: Tensor, bits: Tensor, alpha: float, out: Tensor | None = None
) -> Tensor:
    # out: g itself when g's buffer is dead (slimgrad.ownership.take), else None (a fresh result)
    pos = unpack_bits(bits, g.numel()).view(g.shape)
    opmath = torch.float64 if g.dtype == torch.float64 else torch.float32  # as eager
    neg = g.to(opmath) * (y.to(opmath) + alpha)
    if out is not None:
        return torch.where(pos, g, neg.to(g.dtype), out=out)
    return torch.where(pos, g, neg.to(g.dtype))


_EluFn, _bwd_torch = output_only_function(
    "elu",
    "_EluFn",
    _fwd_torch,
    torch.nn.functional.elu_,
    torch.ops.aten.elu_backward,
    lambda g, y, alpha=1.0: (g, alpha, 1.0, 1.0, True, y),
)


class _EluBitsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, alpha: float, inplace: bool):
        ctx.alpha = alpha
        return forward_with_bits(
            ctx,
            x,
            inplace,
            lambda t: ~(t <= 0),  # NaN counts as positive, as in eager's backward
            lambda t: torch.nn.functional.elu(t, alpha),
            lambda t: torch.nn.functional.elu_(t, alpha),
            keep_y=True,
        )

    @staticmethod
    def backward(ctx, g):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        y, bits = ctx.saved_tensors
        return _bwd_bits(g, y, bits, ctx.alpha, out=buf), None, None


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """ELU ``y = x if x > 0 else alpha (exp(x) - 1)`` that keeps y (+ 1 bit/elt if alpha < 0).

    Memory: ``alpha >= 0``: saves y (shared with the next layer); ``alpha < 0``: y + 1 bit/elt.
    Eager saves x (4 B/elt float32).

    Args:
        input: any floating tensor.
        alpha: scale of the negative side (any sign).
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = elu(torch.randn(4, 8, requires_grad=True), alpha=0.5)
    """
    if not needs_graph(input):
        return torch.nn.functional.elu(input, alpha, inplace=inplace)
    fn = _EluFn if alpha >= 0 else _EluBitsFn
    return fn.apply(input, float(alpha), inplace)


def elu_(input: Tensor, alpha: float = 1.0) -> Tensor:
    """In-place :func:`elu`; works for a negative alpha too (eager's refuses in backward)."""
    return elu(input, alpha, inplace=True)

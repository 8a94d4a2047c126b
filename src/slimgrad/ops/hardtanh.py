"""Hardtanh and ReLU6 that keep only their output.

Math: y = clamp(x, min_val, max_val),  dy/dx = [min_val < x < max_val] = [min_val < y < max_val]
(``hardtanh_backward(g, y, min_val, max_val)``: eager's formula, fed y instead of x; y == min_val
exactly iff x <= min_val, so the two agree everywhere, NaN included). relu6 = hardtanh(0, 6).
See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

For float16/bfloat16 with a bound that the dtype cannot represent (e.g. 0.7), y == round(bound) for
x on both sides of the bound, so y no longer tells the side; then we keep [min_val < x < max_val] as
1 bit/elt, which is all the gradient needs.

Memory: saves y (the output, shared with the next layer), or 1 bit/elt only for a low-precision
input with an unrepresentable bound; eager saves x (4 B/elt float32). Out of place on a leaf that
requires grad or a view of one (NOTE [An input the graph holds] in ``ops._output_act``): x, as
eager (the graph holds it anyway), with eager's output and gradient.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad import _dtensor, ownership
from slimgrad._autograd import eager_op, first_order, refuse_jit
from slimgrad.ops._monotone import (
    apply_with_anchor,
    forward_with_bits,
    output_only_function,
    same_layout,
    unpack_side,
    zero_tie,
)
from slimgrad.ops._output_act import eager_layout, graph_holds, needs_graph, record_layout

__all__ = ["hardtanh", "hardtanh_", "relu6", "relu6_"]


def _fwd_torch(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    return torch.nn.functional.hardtanh(x, min_val, max_val)


_HardtanhFn, _bwd_torch = output_only_function(
    "hardtanh",
    "_HardtanhFn",
    _fwd_torch,
    torch.nn.functional.hardtanh_,
    torch.ops.aten.hardtanh_backward,
    lambda g, y, min_val=-1.0, max_val=1.0: (g, y, min_val, max_val),
)


def _double_bits(ctx, g: Tensor) -> Tensor:
    # create_graph=True: differentiable in g; the second derivative in x is 0, as eager's, also
    # when g has no history (zero_tie: NOTE in slimgrad.ops._monotone)
    (bits,) = ctx.saved_tensors
    return zero_tie(ctx, g * unpack_side(ctx, bits, g).to(g.dtype))


class _HardtanhBitsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, min_val: float, max_val: float, inplace: bool):
        ctx.bounds = (min_val, max_val)
        record_layout(ctx, x)
        return forward_with_bits(
            ctx,
            x,
            inplace,
            lambda t: _inside_low(t, *_bounds_in(t.dtype, min_val, max_val)),
            lambda t: torch.nn.functional.hardtanh(t, min_val, max_val),
            lambda t: torch.nn.functional.hardtanh_(t, min_val, max_val),
        )

    @staticmethod
    @first_order("ops.hardtanh", double=lambda ctx, g: (_double_bits(ctx, g), None, None, None))
    def backward(ctx, g):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        (bits,) = ctx.saved_tensors
        lo, hi = ctx.bounds
        layout = (
            None
            if same_layout(ctx, g)
            else eager_layout(
                ctx, g, lambda gm, xm: torch.ops.aten.hardtanh_backward(gm, xm, lo, hi)
            )
        )
        # The bool mask multiplies directly (g * True, g * False: the bits of g * 1, g * 0), and
        # dx is written in eager's layout at once: no mask in g's dtype and no layout copy, which
        # held g, the mask, g * mask and its copy together (channels_last g from a frozen 1x1
        # conv, bfloat16 (3, 8, 5, 7): peak 6,811 B against eager's 6,724; now 5,902).
        keep = unpack_side(ctx, bits, g)
        if buf is not None and layout in (None, buf.stride()):  # g * 1, g * 0: exact, in place
            return buf.mul_(keep), None, None, None
        if layout is None or layout == g.stride():
            return g * keep, None, None, None
        out = torch.empty_strided(g.shape, layout, dtype=g.dtype, device=g.device)
        return torch.mul(g, keep, out=out), None, None, None


def _inside(xo: Tensor, min_val: float, max_val: float) -> Tensor:
    # compared in opmath (float32), as eager's backward does; NaN passes the gradient
    return ~((xo <= min_val) | (xo >= max_val))


def _bounds_in(dtype: torch.dtype, min_val: float, max_val: float) -> tuple[float, float]:
    # The largest value of ``dtype`` <= float32(min_val) and the smallest >= float32(max_val)
    # (+-inf past its range): for x of that dtype, x <= lo iff float32(x) <= float32(min_val) (and
    # >= alike), so _inside's float32 comparisons run in x's own dtype without a float32 copy of x
    # (2 B/elt more than eager's peak in float16/bfloat16); a Python scalar that the dtype holds
    # exactly is compared exactly
    out = []
    for v, toward in ((min_val, -float("inf")), (max_val, float("inf"))):
        v32 = torch.tensor(v, dtype=torch.float32)
        r = v32.to(dtype)
        if (r.float() > v32) if toward < 0 else (r.float() < v32):
            r = torch.nextafter(r, torch.tensor(toward, dtype=dtype))
        out.append(r.item())
    return out[0], out[1]


def _inside_low(x: Tensor, lo: float, hi: float) -> Tensor:
    # _inside(x.float(), min_val, max_val) for lo, hi = _bounds_in(x.dtype, min_val, max_val),
    # with one bool temporary (NaN passes the gradient)
    m = x <= lo
    m |= x >= hi
    return m.logical_not_()


def _representable(v: float, dtype: torch.dtype) -> bool:
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(v, dtype=dtype).item() == torch.tensor(v, dtype=opmath).item()


def _check(min_val: float, max_val: float, api: str) -> None:
    if not max_val >= min_val:
        raise ValueError(
            f"slimgrad.{api}: max_val must be >= min_val; expected max_val >= {min_val}, got "
            f"{max_val}. Swap the bounds."
        )


def hardtanh(
    input: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
) -> Tensor:
    """Hardtanh ``y = clamp(x, min_val, max_val)`` that keeps only y for backward.

    Memory: saves y (shared with the next layer), or 1 bit/elt for float16/bfloat16 with a bound the
    dtype cannot represent; eager saves x (4 B/elt float32).

    Args:
        input: any floating tensor.
        min_val, max_val: the clamp bounds (``max_val >= min_val``).
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Raises:
        ValueError: ``max_val < min_val``.

    Example:
        >>> y = hardtanh(torch.randn(4, 8, requires_grad=True), -2.0, 2.0)
    """
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input):
        return _dtensor.pointwise(
            "slimgrad.ops.hardtanh",
            hardtanh,
            input,
            min_val=min_val,
            max_val=max_val,
            inplace=inplace,
        )
    _check(min_val, max_val, "hardtanh")
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    if eager_op(inplace) or not needs_graph(input):
        return torch.nn.functional.hardtanh(input, min_val, max_val, inplace=inplace)
    refuse_jit("ops.hardtanh")
    exact = _representable(min_val, input.dtype) and _representable(max_val, input.dtype)
    if exact:  # on a leaf the graph holds: x kept, as eager (output_only_function's forward)
        return _HardtanhFn.apply(input, float(min_val), float(max_val), inplace)
    if not inplace and not torch.compiler.is_compiling() and graph_holds(input):
        # a leaf that requires grad, or a view of one: eager's x costs no byte there, while the
        # bits cost theirs (NOTE [An input the graph holds] in ops/_output_act.py)
        return torch.nn.functional.hardtanh(input, min_val, max_val)
    return apply_with_anchor(_HardtanhBitsFn, input, float(min_val), float(max_val), inplace)


def hardtanh_(input: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """In-place :func:`hardtanh`."""
    return hardtanh(input, min_val, max_val, inplace=True)


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    """ReLU6 ``y = clamp(x, 0, 6)`` (hardtanh(0, 6)) that keeps only y for backward.

    Memory: saves y (shared with the next layer); eager saves x (4 B/elt float32).

    Args:
        input: any floating tensor.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = relu6(torch.randn(4, 8, requires_grad=True))
    """
    return hardtanh(input, 0.0, 6.0, inplace)


def relu6_(input: Tensor) -> Tensor:
    """In-place :func:`relu6`."""
    return relu6(input, inplace=True)

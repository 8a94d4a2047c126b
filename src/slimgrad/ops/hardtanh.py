"""Hardtanh and ReLU6 that keep only their output.

Math: y = clamp(x, min_val, max_val),  dy/dx = [min_val < x < max_val] = [min_val < y < max_val]
(``hardtanh_backward(g, y, min_val, max_val)``: eager's formula, fed y instead of x; y == min_val exactly iff
x <= min_val, so the two agree everywhere, NaN included). relu6 = hardtanh(0, 6).
See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

Memory: saves y (the output, shared with the next layer); eager saves x (4 B/elt float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.ops._output_act import forward_output_only, needs_graph

__all__ = ["hardtanh", "hardtanh_", "relu6", "relu6_"]


def _fwd_torch(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    return torch.nn.functional.hardtanh(x, min_val, max_val)


def _bwd_torch(g: Tensor, y: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    return torch.ops.aten.hardtanh_backward(g, y, min_val, max_val)


class _HardtanhFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, min_val: float, max_val: float, inplace: bool):
        ctx.bounds = (min_val, max_val)
        return forward_output_only(
            ctx,
            x,
            inplace,
            lambda t: torch.nn.functional.hardtanh(t, min_val, max_val),
            lambda t: torch.nn.functional.hardtanh_(t, min_val, max_val),
        )

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _bwd_torch(g, y, *ctx.bounds), None, None, None


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

    Memory: saves y (shared with the next layer); eager saves x (4 B/elt float32).

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
    _check(min_val, max_val, "hardtanh")
    if not needs_graph(input):
        return torch.nn.functional.hardtanh(input, min_val, max_val, inplace=inplace)
    return _HardtanhFn.apply(input, float(min_val), float(max_val), inplace)


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

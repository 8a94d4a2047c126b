"""Sigmoid that keeps only its output.

Math: y = 1 / (1 + e^-x),  dy/dx = y (1 - y)  (``sigmoid_backward(g, y)``, eager's own formula).
See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

Memory: saves y (the output, shared with the next layer); eager saves y too. ``sigmoid_`` overwrites
x.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad._autograd import FxTraceError, eager_op, refuse_jit
from slimgrad.ops._monotone import output_only_function
from slimgrad.ops._output_act import needs_graph

__all__ = ["sigmoid", "sigmoid_"]


def _fwd_torch(x: Tensor) -> Tensor:
    return torch.sigmoid(x)


_SigmoidFn, _bwd_torch = output_only_function(
    "sigmoid",
    "_SigmoidFn",
    _fwd_torch,
    torch.sigmoid_,
    torch.ops.aten.sigmoid_backward,
    lambda g, y: (g, y),
)


def sigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    """Sigmoid ``y = 1 / (1 + exp(-x))`` that keeps only y for backward.

    Memory: saves y (shared with the next layer); eager saves y too.

    Args:
        input: any floating tensor.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = sigmoid(torch.randn(4, 8, requires_grad=True))
    """
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    try:
        if eager_op(inplace) or not needs_graph(input):
            return torch.sigmoid_(input) if inplace else torch.sigmoid(input)
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        return torch.sigmoid_(input) if inplace else torch.sigmoid(input)
    refuse_jit("ops.sigmoid")
    return _SigmoidFn.apply(input, inplace)


def sigmoid_(input: Tensor) -> Tensor:
    """In-place :func:`sigmoid`."""
    return sigmoid(input, inplace=True)

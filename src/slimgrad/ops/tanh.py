"""Tanh that keeps only its output.

Math: y = tanh(x),  dy/dx = 1 - y^2  (``tanh_backward(g, y)``, eager's own formula).
See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

Memory: saves y (the output, shared with the next layer); eager saves y too. ``tanh_`` overwrites x.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad._autograd import FxTraceError, eager_op, refuse_jit
from slimgrad.ops._monotone import output_only_function
from slimgrad.ops._output_act import needs_graph

__all__ = ["tanh", "tanh_"]


def _fwd_torch(x: Tensor) -> Tensor:
    return torch.tanh(x)


_TanhFn, _bwd_torch = output_only_function(
    "tanh", "_TanhFn", _fwd_torch, torch.tanh_, torch.ops.aten.tanh_backward, lambda g, y: (g, y)
)


def tanh(input: Tensor, inplace: bool = False) -> Tensor:
    """Tanh ``y = tanh(x)`` that keeps only y for backward.

    Memory: saves y (shared with the next layer); eager saves y too.

    Args:
        input: any floating tensor.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = tanh(torch.randn(4, 8, requires_grad=True))
    """
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    try:
        if eager_op(inplace) or not needs_graph(input):
            return torch.tanh_(input) if inplace else torch.tanh(input)
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        return torch.tanh_(input) if inplace else torch.tanh(input)
    refuse_jit("ops.tanh")
    return _TanhFn.apply(input, inplace)


def tanh_(input: Tensor) -> Tensor:
    """In-place :func:`tanh`."""
    return tanh(input, inplace=True)

"""ReLU that keeps only its output (eager does the same; the in-place form is exact too).

Math: y = max(x, 0),  dy/dx = [x > 0] = [y > 0]  (``threshold_backward(g, y, 0)``, eager's own
formula). See NOTE [Gradient from the output] in ``slimgrad.ops._output_act``.

Memory: saves y (the output, shared with the next layer): 0 extra B/elt when the next layer keeps y;
eager saves y too. ``relu_`` overwrites x and keeps nothing else.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad._autograd import FxTraceError, eager_op, refuse_jit
from slimgrad.ops._monotone import output_only_function
from slimgrad.ops._output_act import needs_graph

__all__ = ["relu", "relu_"]


def _fwd_torch(x: Tensor) -> Tensor:
    return torch.relu(x)


_ReluFn, _bwd_torch = output_only_function(
    "relu",
    "_ReluFn",
    _fwd_torch,
    torch.relu_,
    torch.ops.aten.threshold_backward,
    lambda g, y: (g, y, 0),
)


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """ReLU ``y = max(x, 0)`` that keeps only y for backward.

    Memory: saves y (shared with the next layer); eager saves y too.

    Args:
        input: any floating tensor.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Example:
        >>> y = relu(torch.randn(4, 8, requires_grad=True))
    """
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    try:
        if eager_op(inplace) or not needs_graph(input):
            return torch.relu_(input) if inplace else torch.relu(input)
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        return torch.relu_(input) if inplace else torch.relu(input)
    refuse_jit("ops.relu")
    return _ReluFn.apply(input, inplace)


def relu_(input: Tensor) -> Tensor:
    """In-place :func:`relu`."""
    return relu(input, inplace=True)

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

from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.ops._output_act import forward_output_only, needs_graph

__all__ = ["tanh", "tanh_"]


def _fwd_torch(x: Tensor) -> Tensor:
    return torch.tanh(x)


def _bwd_torch(g: Tensor, y: Tensor) -> Tensor:
    return torch.ops.aten.tanh_backward(g, y)


class _TanhFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool):
        if _backend.use_triton(x):
            k = _backend.kernels("tanh")
            return forward_output_only(
                ctx, x, inplace, lambda t: k._fwd_triton(t), lambda t: k._fwd_triton_(t)
            )
        return forward_output_only(ctx, x, inplace, torch.tanh, torch.tanh_)

    @staticmethod
    def backward(ctx, g):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        (y,) = ctx.saved_tensors
        if _backend.use_triton(y):  # NOTE [Kernel backend choice]; owned: dx into g
            own = buf is not None and buf.shape == y.shape and buf.dtype == y.dtype
            k = _backend.kernels("tanh")
            return k._bwd_triton(g, y, out=buf if own else None), None
        # eager only (take refuses under torch.compile): dx is written into g's dead buffer
        if buf is not None and buf.shape == y.shape and buf.dtype == y.dtype:
            return torch.ops.aten.tanh_backward.grad_input(buf, y, grad_input=buf), None
        return _bwd_torch(g, y), None


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
    if not needs_graph(input):
        return torch.tanh_(input) if inplace else torch.tanh(input)
    return _TanhFn.apply(input, inplace)


def tanh_(input: Tensor) -> Tensor:
    """In-place :func:`tanh`."""
    return tanh(input, inplace=True)

"""Matrix product that keeps only what the requested gradients need.

Math: ``y = a @ b`` with ``torch.matmul`` semantics (1-D operands, broadcast batch dims). Backward:
``da = sum_to(a.shape, dy @ b^T)`` (needs b only), ``db = sum_to(b.shape, a^T @ dy)`` (needs a
only).

Memory: saves a only if b needs a gradient and b only if a needs one; eager ``bmm``/``mm`` have the
same guard, but eager ``matmul`` on broadcast operands keeps the expanded copies it makes. Both
operands are matmul inputs and count in the tracker's floor (``_slimgrad_floor``)."""

from __future__ import annotations

import math

import torch

from slimgrad._autograd import first_order, refuse_jit, transforms_active
from slimgrad.ops.linear import autocast_matmul_inputs, fresh

__all__ = ["matmul"]


def _fwd_torch(a, b):
    return torch.matmul(a, b)


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return t if t.shape == shape else t.sum_to_size(shape)


def _bwd_torch(dy, a, b, a_shape, b_shape, output_mask):
    # A 2-D operand against a batched one: fold the batch into the matmul (as eager's matmul does),
    # so its gradient is reduced inside one GEMM with float accumulation, not summed afterwards.
    da = db = None
    if output_mask[0]:
        if len(a_shape) == 2 and dy.dim() > 2:
            # Explicit sizes, not -1: a reshape of 0 elements cannot infer one (empty dims).
            m, n = dy.shape[-2:]
            batch = math.prod(dy.shape[:-2])
            dy_f = dy.movedim(-2, 0).reshape(m, batch * n)
            bt = b.expand(*dy.shape[:-2], *b.shape[-2:]).mT
            da = dy_f @ bt.reshape(batch * n, b.shape[-2])
        else:
            da = _sum_to(dy @ b.mT, a_shape)
    if output_mask[1]:
        if len(b_shape) == 2 and dy.dim() > 2:
            rows = math.prod(dy.shape[:-1])
            a_f = a.expand(*dy.shape[:-2], *a.shape[-2:]).reshape(rows, a.shape[-1])
            db = a_f.mT @ dy.reshape(rows, dy.shape[-1])
        else:
            db = _sum_to(a.mT @ dy, b_shape)
    return da, db


class _MatmulFn(torch.autograd.Function):
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, a, b):
        ctx.a_shape, ctx.b_shape = a.shape, b.shape
        ctx.save_for_backward(
            a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None
        )
        return fresh(_fwd_torch(a, b))  # NOTE [Function outputs are not views] in ops/linear.py

    @staticmethod
    def _backward(ctx, dy):
        # Differentiable torch ops on the kept operands (unpacked with their graphs under
        # create_graph): also the double backward, with eager's second derivatives.
        a, b = ctx.saved_tensors
        return _bwd_torch(dy, a, b, ctx.a_shape, ctx.b_shape, ctx.needs_input_grad)

    backward = staticmethod(
        first_order("ops.matmul", double=_backward.__func__)(_backward.__func__)
    )


def matmul(input: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``input @ other`` (as ``torch.matmul``) keeping only what the requested gradients need.

    Memory: saves input only if other needs grad, other only if input needs grad.

    Args:
        input, other: tensors with ``torch.matmul``'s shape rules.

    Returns:
        The product.

    Raises:
        RuntimeError: a 0-d operand (as torch).

    Example:
        >>> y = matmul(torch.randn(2, 3, 4), torch.randn(4, 5, requires_grad=True))
    """
    if input.dim() == 0 or other.dim() == 0:
        raise RuntimeError(
            "slimgrad.ops.matmul: both arguments must have at least 1 dimension; expected "
            "tensors of "
            f"dim >= 1, got dims {input.dim()} and {other.dim()}. Use torch.mul for scalars."
        )
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta:
        return torch.matmul(input, other)
    dev = input.device.type
    if torch.is_autocast_enabled(dev):
        input, other = autocast_matmul_inputs(input, other)
        with torch.autocast(dev, enabled=False):
            return matmul(input, other)
    squeeze_a, squeeze_b = input.dim() == 1, other.dim() == 1
    a = input.unsqueeze(0) if squeeze_a else input
    b = other.unsqueeze(-1) if squeeze_b else other
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        refuse_jit("ops.matmul")
    y = _MatmulFn.apply(a, b)
    # in place, as eager's matmul: the result is no view (a view made under no_grad would refuse
    # a later in-place write under grad mode, which eager's result takes)
    if squeeze_a:
        y = y.squeeze_(-2)
    if squeeze_b:
        y = y.squeeze_(-1)
    return y

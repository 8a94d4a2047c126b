"""DropPath (stochastic depth) that keeps its per-sample mask as bits.

Math: y = x * m with m of shape ``(N, 1, ..., 1)``, m = bernoulli(keep_prob) / keep_prob (or the
bare 0/1 draw without ``scale_by_keep``, or when keep_prob is 0); dx = grad * m. The mask is drawn
exactly as timm's ``drop_path`` draws it (``x.new_empty(shape).bernoulli_(keep_prob)``, then
``div_(keep_prob)``): the same RNG consumption and the same values, so outputs and gradients are
eager's bit for bit. Backward rebuilds m from the bits with the same two ops (0/1 in x's dtype,
then the same ``div_``).

Memory: saves 1 bit per sample (``ceil(N / 8)`` bytes); eager saves m (N elements of x's dtype).
Eval or ``drop_prob == 0``: x itself (identity), as eager. Under torch.func transforms,
torch.compile and for DTensors it is eager's multiply after the same draw. Second derivatives
raise (NOTE [Second derivatives] in ``slimgrad._autograd``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad import _dtensor
from slimgrad._autograd import first_order, refuse_jit, transforms_active
from slimgrad.ops._bits import pack_bits, unpack_bits_as

__all__ = ["drop_path"]


def _mask_torch(x: Tensor, keep_prob: float, scale_by_keep: bool) -> Tensor:
    # timm.layers.drop.drop_path's draw, op for op
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    m = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        m.div_(keep_prob)
    return m


def _rebuild(bits: Tensor, shape, dtype, keep_prob: float, scale: bool) -> Tensor:
    m = unpack_bits_as(bits, shape[0], dtype).view(shape)
    if keep_prob > 0.0 and scale:
        m.div_(keep_prob)
    return m


def _bwd(ctx, grad: Tensor):
    # grad * m: torch ops, linear in grad, so under create_graph=True (first_order's double) the
    # result carries grad's history and eager's second derivatives follow exactly
    (bits,) = ctx.saved_tensors
    m = _rebuild(bits, *ctx.meta)
    return grad * m, None, None, None, None  # eager: mul_tensor_backward(grad, m)


class _DropPathFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, m: Tensor, bits: Tensor, keep_prob: float, scale: bool) -> Tensor:
        ctx.meta = (tuple(m.shape), m.dtype, keep_prob, scale)
        ctx.save_for_backward(bits)
        return x * m

    backward = staticmethod(first_order("ops.drop_path", double=_bwd)(_bwd))


def drop_path(
    input: Tensor, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True
) -> Tensor:
    """timm's ``drop_path``: drop whole samples with probability ``drop_prob`` (training only).

    Same draw, outputs and gradients as ``timm.layers.drop.drop_path`` bit for bit.

    Memory: saves 1 bit per sample; eager saves the mask (N elements of ``input``'s dtype).

    Args:
        input: ``(N, ...)`` tensor.
        drop_prob: probability of dropping a sample.
        training: apply only when True (else ``input`` is returned).
        scale_by_keep: divide the kept samples by ``1 - drop_prob``.

    Returns:
        ``input * mask`` (``input`` itself when not training or ``drop_prob == 0``).

    Raises:
        RuntimeError: double backward through this op, or a ``torch.jit.trace`` of it.

    Example:
        >>> y = drop_path(torch.randn(4, 8, requires_grad=True), 0.2, training=True)
    """
    if drop_prob == 0.0 or not training:
        return input
    keep_prob = 1 - drop_prob
    m = _mask_torch(input, keep_prob, scale_by_keep)
    if (
        not (torch.is_grad_enabled() and input.requires_grad)
        or transforms_active()  # NOTE [torch.func transforms]
        or torch.compiler.is_compiling()
        or _dtensor.any_dtensor(input)
        or input.ndim == 0
    ):
        return input * m
    refuse_jit("ops.drop_path")
    bits = pack_bits(m != 0)
    return _DropPathFn.apply(input, m, bits, keep_prob, bool(scale_by_keep))

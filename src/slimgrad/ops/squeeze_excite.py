"""Squeeze-excite gating ``y = x * g`` that keeps what another node keeps anyway, plus the gate.

Math: g = gate(s) has one value per sample and channel (shape ``(N, C, 1, ..., 1)``), broadcast
over the spatial dims of x. Eager's ``MulBackward0``: dx = grad * g, dg = sum_to(grad * x, g.shape)
(the sum over the broadcast dims, keepdim). So x is needed only for dg, and g (N*C elements) for
dx. Eager keeps both, and the next layer (a 1x1 conv in every SE block of timm and torchvision)
keeps y as well: two full-size tensors per block besides the norm's.

This op keeps, instead of x, what x is rebuilt from: when x = act(b) is a derived tensor (the
activation right after a slimgrad BatchNorm, NOTE [Derived saved inputs] in ``ops/_derived.py``) it
keeps b (the norm keeps b anyway: 0 bytes) and recomputes x = act(b) in backward with the forward's
kernel, bit for bit; otherwise it keeps x as eager. It then registers y as derived from the same
base, ``y = act(b) * g`` (or ``x * g``), so a following slimgrad conv keeps b (or x) and the gate
instead of y and rebuilds y in its backward (the same multiply, the same bits). Every kept tensor
is a ``detach()`` alias that shares its version counter: an in-place change of b, x or g before
backward raises autograd's "modified by an inplace operation" error, as eager's would.

Memory: saves g (N*C elements) + nothing when x is derived from a kept norm output, else x (as
eager); a following slimgrad conv keeps b or x (already kept) instead of y. Eager saves x and g,
and the conv keeps y. Backward recomputes act(b) once for this node and the next conv (NOTE
[Rebuilt once per backward] in ``ops/_derived.py``: one full-size temporary, written over by
grad * x when the layouts agree and no other node will be handed it) and writes dx into the
incoming gradient's buffer when ``slimgrad.ownership.take`` proves it dead (NOTE
[Gradient-buffer ownership]). Plain ``x * g`` (eager) under no_grad, torch.func transforms,
torch.compile, DTensor, and for any other shapes or mixed dtypes/devices. Second derivatives
raise (NOTE [Second derivatives] in ``slimgrad._autograd``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad import _dtensor, ownership
from slimgrad._autograd import first_order, refuse_jit, transforms_active
from slimgrad.ops import _derived

__all__ = ["squeeze_excite"]


def _fwd_torch(x: Tensor, g: Tensor, gate_first: bool) -> Tensor:
    return g * x if gate_first else x * g


def _gate_shape_ok(x: Tensor, g: Tensor) -> bool:
    return (
        x.ndim >= 3
        and g.ndim == x.ndim
        and tuple(g.shape) == tuple(x.shape[:2]) + (1,) * (x.ndim - 2)
        and g.dtype == x.dtype
        and g.device == x.device
        and x.dtype.is_floating_point
        and not x.is_complex()
    )


def _reduce_dims(g_shape, grad_shape) -> list[int]:
    # autograd's sum_to (the engine reduces a broadcast input's gradient this way)
    return [i for i, (a, b) in enumerate(zip(g_shape, grad_shape)) if a == 1 and b != 1]


def _dense(t: Tensor) -> bool:
    if t.is_contiguous():
        return True
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.ndim)
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def _bwd_gate(grad: Tensor, x: Tensor, g_shape, fresh: bool) -> Tensor:
    # eager: mul_tensor_backward(grad, x) = grad * x, then sum_to(g.shape)
    if fresh and x.stride() == grad.stride() and _dense(x):
        p = torch.mul(grad, x, out=x)  # same layout as eager's fresh product: same bits
    else:
        p = grad * x
    dims = _reduce_dims(g_shape, grad.shape)
    return p.sum(dims, keepdim=True) if dims else p


class _SqueezeExciteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, g: Tensor, gate_first: bool, holder: list) -> Tensor:
        y = _fwd_torch(x, g, gate_first)
        need_x, need_g = ctx.needs_input_grad[:2]
        ctx.act = ctx.rebuild = ctx.pack = None
        ctx.g_shape = tuple(g.shape)
        kept = None
        if need_g:
            d = _derived.lookup(x)
            if d is not None:
                ctx.act, kept = d.act, d.base
                ctx.rebuild = d.consumer()  # NOTE [Rebuilt once per backward]
                # b's one pack under saved-tensor hooks (NOTE [One pack per shared tensor])
                ctx.pack = None if d.pack is None else _derived.shared(d.pack)
            else:
                kept = x
        if ctx.pack is None:
            ctx.save_for_backward(kept, g if need_x else None)
        else:
            ctx.pack[1].users += 1
            ctx.save_for_backward(None, g if need_x else None)
        if kept is not None:
            holder.append((kept, ctx.act, ctx.rebuild, ctx.pack))
        return y

    @staticmethod
    @first_order("ops.squeeze_excite")
    def backward(ctx, grad: Tensor):
        buf = ownership.take(grad)  # first use of grad: NOTE [Gradient-buffer ownership]
        try:
            kept, g = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A kept tensor written after forward] in ops/_derived.py
            if ctx.act is not None:
                _derived.raise_written(e, "ops.squeeze_excite")
            raise
        if ctx.pack is not None:  # NOTE [One pack per shared tensor] in ops/_derived.py
            kept = _derived.read_pack(ctx.pack, "batch_norm output")
            ctx.pack = _derived.release_pack(ctx.pack)
        need_x, need_g = ctx.needs_input_grad[:2]
        dg = dx = None
        if need_g:
            if ctx.act is not None:
                # x = act(b), rebuilt or taken from this backward's store (NOTE [Rebuilt once per
                # backward]); written over only when no other node will be handed it
                x, exclusive = ctx.rebuild(kept)
                dg = _bwd_gate(grad, x, ctx.g_shape, exclusive)
                del x
            else:
                dg = _bwd_gate(grad, kept, ctx.g_shape, False)
        if need_x:
            # eager: mul_tensor_backward(grad, g) = grad * g
            if buf is not None and _dense(buf):
                dx = torch.mul(buf, g, out=buf)
            else:
                dx = grad * g
        return dx, dg, None, None


def squeeze_excite(input: Tensor, gate: Tensor, gate_first: bool = False) -> Tensor:
    """Squeeze-excite gating ``input * gate`` that keeps no copy of ``input`` where one is kept.

    ``gate`` has one value per sample and channel (``(N, C, 1, ..., 1)``, e.g. a sigmoid or
    hardsigmoid of the squeezed features). Output and gradients are eager's bit for bit.

    Memory: saves ``gate`` (N*C elements) and, when ``input = act(b)`` follows a slimgrad
    BatchNorm, b (kept by the norm: 0 bytes), else ``input`` (as eager); a following slimgrad conv
    keeps that same tensor instead of the result. Eager saves ``input`` and ``gate``, and the
    conv keeps the result.

    Args:
        input: ``(N, C, *spatial)`` tensor.
        gate: ``(N, C, 1, ..., 1)`` tensor of the same dtype and device (other shapes: eager's
            broadcast multiply).
        gate_first: compute ``gate * input`` (torchvision's ``SqueezeExcitation``) instead of
            ``input * gate``.

    Returns:
        The gated tensor.

    Raises:
        RuntimeError: double backward (``create_graph=True``, differentiated again) through this
            op, or a ``torch.jit.trace`` of it.

    Example:
        >>> x = torch.randn(2, 8, 5, 5, requires_grad=True)
        >>> y = squeeze_excite(x, torch.sigmoid(x.mean((2, 3), keepdim=True)))
    """
    if (
        not torch.is_grad_enabled()
        or not (input.requires_grad or gate.requires_grad)
        or transforms_active()  # NOTE [torch.func transforms]
        or torch.compiler.is_compiling()
        or _dtensor.any_dtensor(input, gate)
        or not _gate_shape_ok(input, gate)
    ):
        return _fwd_torch(input, gate, gate_first)
    refuse_jit("ops.squeeze_excite")
    holder: list = []
    y = _SqueezeExciteFn.apply(input, gate, gate_first, holder)
    if holder:
        kept, act, handle, pack = holder[0]
        store = handle.store if handle is not None else None
        _derived.register_gated(y, kept, act, gate, gate_first, store, pack)
    return y

"""RMSNorm that keeps its output, not its input.

Math: over the trailing ``normalized_shape`` dims (D elements per row), ``rstd = 1 / sqrt(mean(x^2)
+ eps)``, ``xhat = x * rstd``, ``y = xhat * gamma``. Backward with ``g = dy * gamma``: ``dx = rstd *
(g - xhat * mean(g * xhat))``, ``dgamma = sum_rows(dy * xhat)``, with ``xhat = y / gamma`` rebuilt
from the output. ``eps=None`` means ``torch.finfo(x.dtype).eps``, as ``F.rms_norm``.

Memory: saves y (the output, shared with the next layer) + rstd (4 B/row, fp32) + the input columns
of fallback channels (gamma = 0 or subnormal, see NOTE [Normalization from its output: the fallback
channels] in ``ops/layer_norm.py``); eager (composite ``F.rms_norm``) saves x, x**2's rstd chain and
x * rstd (about 8 B/elt fp32 plus 4 B/row).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.ops._library import custom_op
from slimgrad.ops.layer_norm import (
    CHUNK_ELEMS,
    _acc_dtype,
    _rowdot,
    autocast_inputs,
    fallback_channels,
    no_double_backward,
    owns_layout,
    rebuild_xhat,
)

__all__ = ["rms_norm"]


def _fwd_torch(x, normalized_shape, weight, eps):
    y, rstd = torch.ops.aten._fused_rms_norm(x, normalized_shape, weight, eps)
    idx = fallback_channels(weight, None, y.dtype).to(x.device)
    xside = x.reshape(-1, math.prod(normalized_shape)).index_select(1, idx)
    return y, rstd, idx, xside


def _bwd_torch(dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, out=None):
    # Same chunked scheme as ops/layer_norm.py's backward; out: dy itself when its buffer is dead
    # (slimgrad.ownership.take), dx then overwrites each chunk of it after the chunk's last read.
    acc = _acc_dtype(y.dtype)
    d = math.prod(normalized_shape)
    n = math.prod(y.shape[: y.dim() - len(normalized_shape)])
    dy2, y2, r = dy.reshape(n, d), y.reshape(n, d), rstd.reshape(n, 1).to(acc)
    w = weight.reshape(d).to(acc) if weight is not None else None
    need_dx, need_dw = output_mask[0], weight is not None and output_mask[1]
    dx = None
    if need_dx:
        dx = out.view(n, d) if out is not None else y.new_empty((n, d))
    dw = torch.zeros(d, dtype=torch.float64, device=y.device) if need_dw else None
    step = max(1, max(CHUNK_ELEMS, (n * d) // 16) // max(d, 1))
    for i in range(0, n, step):
        sl = slice(i, i + step)
        xh = rebuild_xhat(y2[sl], w, None, acc)
        if idx.numel():
            xh.index_copy_(1, idx, xside[sl].to(acc) * r[sl])
        dyc = dy2[sl].to(acc)
        if need_dw:
            dw += (dyc * xh).sum(0, dtype=torch.float64)
        if need_dx:
            g = dyc * w if w is not None else dyc.clone()
            c2 = _rowdot(g, xh).div_(d)  # no chunk-sized temporary
            dx[sl] = g.sub_(xh.mul_(c2)).mul_(r[sl])
            del g
        del xh, dyc  # free this chunk's temporaries before the next one
    if need_dx:
        dx = dx.reshape(y.shape)
    if need_dw:
        dw = dw.to(weight.dtype).reshape(weight.shape)
    return dx, dw


def _bwd_impl(t: torch.Tensor):
    # NOTE [Kernel backend choice] in slimgrad/kernels/_backend.py
    return _backend.kernels("rms_norm")._bwd_triton if _backend.use_triton(t) else _bwd_torch


@custom_op("rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _backend.use_triton(x):
        return _backend.kernels("rms_norm")._fwd_triton(x, list(normalized_shape), weight, eps)
    return _fwd_torch(x, list(normalized_shape), weight, eps)


@_rms_norm_fwd.register_fake
def _(x, normalized_shape, weight, eps):
    k = torch.library.get_ctx().new_dynamic_size()
    nd = len(normalized_shape)
    stat_shape = tuple(x.shape[: x.dim() - nd]) + (1,) * nd
    n = math.prod(x.shape[: x.dim() - nd])
    y_dtype = torch.promote_types(x.dtype, weight.dtype) if weight is not None else x.dtype
    return (
        torch.empty_like(x, dtype=y_dtype, memory_format=torch.contiguous_format),
        x.new_empty(stat_shape, dtype=_acc_dtype(x.dtype)),
        x.new_empty((k,), dtype=torch.int64),
        x.new_empty((n, k)),
    )


@custom_op("rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    idx: torch.Tensor,
    xside: torch.Tensor,
    weight: torch.Tensor | None,
    normalized_shape: Sequence[int],
    output_mask: Sequence[bool],
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _bwd_impl(y)(dy, y, rstd, idx, xside, weight, list(normalized_shape), output_mask)
    empty = y.new_empty(0)
    return (dx.to(x_dtype) if dx is not None else empty, dw if dw is not None else empty.clone())


@_rms_norm_bwd.register_fake
def _(dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, x_dtype):
    dx = torch.empty_like(y, dtype=x_dtype) if output_mask[0] else y.new_empty(0)
    dw = torch.empty_like(weight) if weight is not None and output_mask[1] else y.new_empty(0)
    return dx, dw


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        y, rstd, idx, xside = _rms_norm_fwd(x, normalized_shape, weight, eps)
        ctx.normalized_shape, ctx.x_dtype = normalized_shape, x.dtype
        ctx.save_for_backward(y, rstd, idx, xside, weight)
        ctx.mark_non_differentiable(rstd, idx, xside)
        return y, rstd, idx, xside

    @staticmethod
    def backward(ctx, dy, *_):
        buf = ownership.take(dy)  # first use of dy: NOTE [Gradient-buffer ownership]
        y, rstd, idx, xside, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
        if torch.is_grad_enabled():
            raise no_double_backward("rms_norm")
        # eager only (take refuses under torch.compile); dx in y's dtype must be x's dtype too
        if mask[0] and y.dtype == ctx.x_dtype and owns_layout(buf, y):
            dx, dw = _bwd_impl(y)(
                buf, y, rstd, idx, xside, weight, ctx.normalized_shape, mask, out=buf
            )
        else:
            dx, dw = _rms_norm_bwd(
                dy, y, rstd, idx, xside, weight, ctx.normalized_shape, mask, ctx.x_dtype
            )
        return (dx if mask[0] else None, None, dw if weight is not None and mask[1] else None, None)


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """RMS normalization (as ``F.rms_norm``) that keeps its output instead of its input.

    ``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims.

    Memory: saves y (shared with the next layer) + 4 B/row (rstd) + fallback input columns
    (weight = 0); eager saves x and intermediates (about 8 B/elt fp32).

    Args:
        input: ``(*, *normalized_shape)``.
        normalized_shape: trailing shape to normalize over.
        weight: optional ``normalized_shape`` scale.
        eps: added to mean(x^2); None means ``torch.finfo(input.dtype).eps``.

    Returns:
        Tensor like ``input``.

    Example:
        >>> y = rms_norm(torch.randn(4, 8, requires_grad=True), (8,))
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = [int(s) for s in normalized_shape]
    eps = None if eps is None else float(eps)
    dev = input.device.type
    if torch.is_autocast_enabled(dev):
        probe = F.rms_norm(input.new_empty((0, *normalized_shape)), normalized_shape)
        if probe.dtype != input.dtype:
            input, weight = autocast_inputs(probe.dtype, input, weight)
        with torch.autocast(dev, enabled=False):
            return _RMSNormFn.apply(input, normalized_shape, weight, eps)[0]
    return _RMSNormFn.apply(input, normalized_shape, weight, eps)[0]

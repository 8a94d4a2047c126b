"""RMSNorm that keeps its output, not its input (float32/float64; half precision keeps x).

Math: over the trailing ``normalized_shape`` dims (D elements per row), ``rstd = 1 / sqrt(mean(x^2)
+ eps)``, ``xhat = x * rstd``, ``y = xhat * gamma``. Backward with ``g = dy * gamma``: ``dx = rstd *
(g - xhat * mean(g * xhat))``, ``dgamma = sum_rows(dy * xhat)``, with ``xhat = y / gamma`` rebuilt
from the output. ``eps=None`` means ``torch.finfo(x.dtype).eps``, as ``F.rms_norm``.

Memory, per input dtype:
- float32/float64: saves y (the output, shared with the next layer) + rstd (4 B/row, fp32; 8 B/row
  in float64) + the input columns of fallback channels (gamma = 0 or subnormal, see NOTE
  [Normalization from its output: the fallback channels] in ``ops/layer_norm.py``) and their int64
  indices (8 B each); eager (composite ``F.rms_norm``) saves x and x * rstd (8 B/elt fp32) + rstd.
- bfloat16/float16: saves x (2 B/elt) + rstd (4 B/row, fp32), not y; eager saves the same float32
  chain as above, 8 B/elt + 4 B/row (NOTE [RMSNorm and GroupNorm in half precision]).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.

# NOTE [RMSNorm and GroupNorm in half precision]
An 8-bit (bf16) or 11-bit (fp16) output pins xhat = y / gamma only to half an ulp, and dgamma =
sum_rows(dy * xhat) then rounds a second time; eager computes xhat in fp32 from x and rounds once.
Measured on a seeded grid (25 seeds; 7 RMSNorm shapes from (1, 64) to (64, 512) and 6 GroupNorm
shapes up to (8, 32, 16, 16); 3 weight kinds; bf16 and fp16): rebuilding from the output broke the
GUIDE.md rule in 33 of 1,950 cases, all dgamma, by up to 1.73x the bound, from a single row
(RMSNorm (1, 64), 1.50x) to GroupNorm (8, 32, 16, 16) (1.56x). The excess is a double rounding
spread over every element, not confined to ill-conditioned rows or channels, so a per-row or
per-channel fallback cannot catch it; only more bits of every element can: x itself, or a residual
of y's rounding (a prototype, not wired in, that kept q = round(16 (y32 - y) / ulp(y)), 4 bits/elt,
and rebuilt xhat = (y + q ulp / 16) / gamma passed all 350 RMSNorm bf16/fp16 cases of the grid at
<= 0.47x the bound; 2 bits: 0.69x). ``tests/ops/test_rms_norm.py`` and ``test_group_norm.py``
keep a fast subset of that grid which finds the old failures. Hence, in half precision:
- RMSNorm keeps x (2 B/elt) and rstd and computes xhat = x * rstd in fp32 as eager does: 2 B/elt
  against eager's 8 B/elt (its composite keeps two fp32 copies), still 4x less, and exact.
- GroupNorm runs eager's ``F.group_norm``: it keeps x (2 B/elt) + its statistics, which is what
  keeping x in a Function of ours would cost too. The cost: keeping y saved 2 B/elt only where the
  next layer keeps y anyway (bench case group_norm, conv -> GN -> conv, small, bf16: 0.67x of
  eager's saved bytes before, 1.00x now); a residual of y's rounding could win part of it back.
LayerNorm (``ops/layer_norm.py``) rebuilds xhat the same way and shares the mechanism: on the
RMSNorm shapes of the grid above (with a bias; 1,050 bf16/fp16 cases) its dgamma exceeded the bound
in 4, by up to 1.78x ((1, 64) fp16), so in half precision it runs eager's ``F.layer_norm`` too.
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
    HALF_DTYPES,
    _acc_dtype,
    _rowdot,
    autocast_inputs,
    fallback_channels,
    grads_or_empty,
    no_double_backward,
    owns_layout,
    rebuild_xhat,
)

__all__ = ["HALF_DTYPES", "rms_norm"]


def _fwd_torch(x, normalized_shape, weight, eps):
    y, rstd = torch.ops.aten._fused_rms_norm(x, normalized_shape, weight, eps)
    idx = fallback_channels(weight, None, y.dtype).to(x.device)
    xside = x.reshape(-1, math.prod(normalized_shape)).index_select(1, idx)
    return y, rstd, idx, xside


def _bwd_torch(
    dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, out=None, from_input=False
):
    # Same chunked scheme as ops/layer_norm.py's backward; out: dy itself when its buffer is dead
    # (slimgrad.ownership.take), dx then overwrites each chunk of it after the chunk's last read.
    # from_input: ``y`` is the input x (half precision, NOTE [RMSNorm and GroupNorm in half
    # precision]) and xhat = x * rstd, as eager computes it.
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
        if from_input:
            xh = y2[sl].to(acc, copy=True).mul_(r[sl])
        else:
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
    return grads_or_empty(y, dx.to(x_dtype) if dx is not None else None, dw)


@_rms_norm_bwd.register_fake
def _(dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, x_dtype):
    dx = torch.empty_like(y, dtype=x_dtype) if output_mask[0] else None
    dw = torch.empty_like(weight) if weight is not None and output_mask[1] else None
    return grads_or_empty(y, dx, dw)


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


def _bwd_from_input(dy, x, rstd, weight, normalized_shape, output_mask, out=None):
    # no fallback channels: x is kept whole
    no_idx = torch.empty(0, dtype=torch.int64, device=x.device)
    ns = list(normalized_shape)
    return _bwd_torch(
        dy, x, rstd, no_idx, x.new_empty(0), weight, ns, output_mask, out=out, from_input=True
    )


@custom_op("rms_norm_bwd_from_input", mutates_args=())
def _rms_norm_bwd_from_input(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    normalized_shape: Sequence[int],
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _bwd_from_input(dy, x, rstd, weight, normalized_shape, output_mask)
    return grads_or_empty(x, dx, dw)


@_rms_norm_bwd_from_input.register_fake
def _(dy, x, rstd, weight, normalized_shape, output_mask):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None
    dw = torch.empty_like(weight) if weight is not None and output_mask[1] else None
    return grads_or_empty(x, dx, dw)


class _RMSNormFromInputFn(torch.autograd.Function):
    # Half precision: keeps x and rstd (NOTE [RMSNorm and GroupNorm in half precision]).
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, normalized_shape, weight, eps)
        ctx.normalized_shape = normalized_shape
        ctx.save_for_backward(x, rstd, weight)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, *_):
        buf = ownership.take(dy)  # first use of dy: NOTE [Gradient-buffer ownership]
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
        if torch.is_grad_enabled():
            raise no_double_backward("rms_norm")
        if mask[0] and owns_layout(buf, x):  # eager only (take refuses under torch.compile)
            dx, dw = _bwd_from_input(buf, x, rstd, weight, ctx.normalized_shape, mask, out=buf)
        else:
            dx, dw = _rms_norm_bwd_from_input(dy, x, rstd, weight, ctx.normalized_shape, mask)
        return (dx if mask[0] else None, None, dw if weight is not None and mask[1] else None, None)


def _apply(x, normalized_shape, weight, eps):
    fn = _RMSNormFromInputFn if x.dtype in HALF_DTYPES else _RMSNormFn
    return fn.apply(x, normalized_shape, weight, eps)[0]


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """RMS normalization (as ``F.rms_norm``) that keeps its output instead of its input.

    ``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims.

    Memory: fp32: saves y (shared with the next layer) + 4 B/row (rstd) + fallback input
    columns (weight = 0); bf16/fp16: saves x (2 B/elt) + 4 B/row; eager saves x and x * rstd in
    fp32 (8 B/elt) + 4 B/row in every one of these dtypes.

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
            return _apply(input, normalized_shape, weight, eps)
    return _apply(input, normalized_shape, weight, eps)

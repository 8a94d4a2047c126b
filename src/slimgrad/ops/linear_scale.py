"""Linear followed by a per-channel scale (layer scale) that keeps nothing for the scale.

Math: ``z = x W^T + b`` (``torch.nn.functional.linear``), ``y = z * gamma`` (gamma over the last
dim: ConvNeXt's and CaiT's layer scale after the MLP's second Linear). Backward, with ``g = dy``
flattened to rows and ``M = g^T x`` (out_features x in_features, one GEMM):

    dz = g * gamma,  dx = dz W,  db = sum_rows dz,
    dW = gamma[:, None] * M              (= dz^T x),
    dgamma = sum_j W[:, j] M[:, j] + b * sum_rows g      (= sum_rows g * z).

``dgamma`` is read off ``M``, which the weight gradient needs anyway, so ``z`` (the Linear's
output, an activation-sized tensor eager's ``mul`` keeps for gamma's gradient) is not kept. The
forward computes eager's ops (``linear``, then ``mul`` by gamma) bit for bit; ``dx`` and ``db`` are
eager's; ``dW`` and ``dgamma`` are sums in another order, within the error rule (``dgamma``'s
sum over in_features is a batched GEMV, so backward allocates nothing of (out, in) but dW).

Memory: saves x (the Linear's input, usually shared with the activation before it), W, b and
gamma (parameters); eager saves x, W and z (one more output-sized tensor) and gamma.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad._autograd import first_order, refuse_jit, transforms_active
from slimgrad._math.norms import rowdot
from slimgrad.ops.linear import fresh

__all__ = ["linear_scale"]


def _fwd_torch(x: Tensor, weight: Tensor, bias: Tensor | None, gamma: Tensor) -> Tensor:
    return F.linear(x, weight, bias).mul(gamma)


def _bwd_torch(g, x, weight, bias, gamma, needs):
    # g: dy as (rows, out); x: (rows, in). Returns dx (rows, in), dW, db, dgamma.
    need_x, need_w, need_b, need_gamma = needs
    dz = g * gamma if (need_x or need_b) else None
    dx = dz.mm(weight) if need_x else None
    db = dz.sum(0) if need_b else None
    dw = dgamma = None
    if need_w or need_gamma:
        m = g.t().mm(x)
        if need_gamma:
            dgamma = rowdot(weight, m).view(-1)  # batched GEMV: no (out, in) product tensor
            if bias is not None:
                dgamma = dgamma.addcmul_(bias, g.sum(0))
        if need_w:
            dw = m.mul_(gamma.unsqueeze(1))
    return dx, dw, db, dgamma


class _LinearScaleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gamma):
        need_x, need_w, need_b, need_gamma = ctx.needs_input_grad
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.save_for_backward(
            x if (need_w or need_gamma) else None,
            weight if (need_x or need_gamma) else None,
            bias if need_gamma else None,
            gamma if (need_x or need_w or need_b) else None,
        )
        z = F.linear(x, weight, bias)
        # z is this Function's own tensor: eager's mul, without a copy; not a view of it (NOTE
        # [Function outputs are not views] in ops/linear.py)
        return fresh(z.mul_(gamma))

    @staticmethod
    @first_order("ops.linear_scale")
    def backward(ctx, dy):
        x, weight, bias, gamma = ctx.saved_tensors
        out_f = dy.shape[-1]
        g = dy.reshape(-1, out_f)
        x2 = x.reshape(-1, x.shape[-1]) if x is not None else None
        needs = list(ctx.needs_input_grad)
        needs[2] = needs[2] and ctx.has_bias
        dx, dw, db, dgamma = _bwd_torch(g, x2, weight, bias, gamma, needs)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return dx, dw, db, dgamma


def linear_scale(input: Tensor, weight: Tensor, bias: Tensor | None, gamma: Tensor) -> Tensor:
    """``F.linear(input, weight, bias) * gamma``, keeping nothing for gamma's gradient.

    Math: ``y = (x W^T + b) * gamma``; backward reads ``dgamma`` off ``dy^T x``, the product the
    weight gradient is made from (module docstring).

    Memory: saves input (for the weight's and gamma's gradients), weight, bias and gamma; eager
    also keeps the Linear's output for gamma's gradient.

    Args:
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        gamma: ``(out_features,)``, the scale of each output channel.

    Returns:
        ``(*, out_features)``, bit for bit eager's ``F.linear(...).mul(gamma)``.

    Raises:
        ValueError: gamma is not ``(out_features,)``.

    Example:
        >>> y = linear_scale(torch.randn(4, 8), torch.randn(3, 8), None, torch.ones(3))
    """
    if gamma.dim() != 1 or gamma.shape[0] != weight.shape[0]:
        raise ValueError(
            "slimgrad.ops.linear_scale: gamma must scale each output channel; expected shape "
            f"({weight.shape[0]},), got {tuple(gamma.shape)}. Pass a 1-D gamma of out_features."
        )
    needs_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, weight, bias, gamma)
    )
    dev = input.device.type
    if (
        not needs_graph
        or transforms_active()  # NOTE [torch.func transforms] in slimgrad/_autograd.py
        or torch.compiler.is_compiling()  # the compiler's memory plan: eager's ops
        or input.is_meta  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
        or torch.is_autocast_enabled(dev)  # eager's mixed-dtype promotion: eager's ops
        or input.shape[-1] != weight.shape[1]
        or not (input.dtype == weight.dtype == gamma.dtype)
        or (bias is not None and bias.dtype != input.dtype)
    ):
        return _fwd_torch(input, weight, bias, gamma)
    refuse_jit("ops.linear_scale")
    return _LinearScaleFn.apply(input, weight, bias, gamma)

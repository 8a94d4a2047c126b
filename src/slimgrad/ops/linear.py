"""Linear layers that keep only what the requested gradients need.

Math: ``y = x W^T + b`` (``F.linear``, W is ``(out, in)``) or ``y = x W + b`` (HF GPT-2 ``Conv1D``,
W is ``(in, out)``, an ``addmm``). Backward: ``dx = dy W`` (needs W only), ``dW = dy^T x`` (needs x
only), ``db = sum(dy)``.

Memory: saves x only if W needs a gradient and W only if x needs one (frozen W: x is not kept; x
without grad: W is not referenced); eager (torch 2.13) ``linear``/``mm``/``addmm`` have the same
guard (measured), so this matches eager byte for byte and makes the contract explicit and tested.
x is a matmul input: it counts in the tracker's floor (``_slimgrad_floor``).
"""

from __future__ import annotations

import torch

__all__ = ["conv1d_addmm", "linear"]


def _fwd_torch(x, weight, bias, w_in_out: bool):
    if w_in_out:
        y2 = x.reshape(-1, x.shape[-1])
        y2 = torch.addmm(bias, y2, weight) if bias is not None else y2 @ weight
        return y2.view(*x.shape[:-1], weight.shape[-1])
    return torch.nn.functional.linear(x, weight, bias)


def _bwd_torch(dy, x, weight, has_bias: bool, w_in_out: bool, output_mask):
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dw = db = None
    if output_mask[0]:
        # dx allocated in its final shape (a base, not a view of the 2-D product), so the next
        # backward may reuse its buffer (NOTE [Gradient-buffer ownership] refuses views)
        w = weight.t() if w_in_out else weight
        if torch.is_grad_enabled():  # differentiable (gradcheck of this path): no out=
            dx2 = dy2 @ w
            dx = dx2.view(*dy.shape[:-1], dx2.shape[-1])
        else:
            dx = dy2.new_empty((*dy.shape[:-1], w.shape[1]))
            torch.mm(dy2, w, out=dx.view(-1, w.shape[1]))
    if output_mask[1]:
        x2 = x.reshape(-1, x.shape[-1])
        dw = x2.t() @ dy2 if w_in_out else dy2.t() @ x2
    if has_bias and output_mask[2]:
        db = dy2.sum(0)
    return dx, dw, db


class _LinearFn(torch.autograd.Function):
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, x, weight, bias, w_in_out):
        ctx.w_in_out, ctx.has_bias = w_in_out, bias is not None
        ctx.save_for_backward(
            x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None
        )
        return _fwd_torch(x, weight, bias, w_in_out)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        mask = ctx.needs_input_grad[:3]
        dx, dw, db = _bwd_torch(dy, x, weight, ctx.has_bias, ctx.w_in_out, mask)
        return dx, dw, db, None


def autocast_matmul_inputs(*tensors):
    """Cast tensors as eager autocast casts the inputs of a lower-precision op (linear, mm, bmm)."""
    t0 = next(t for t in tensors if t is not None)
    dev = t0.device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(
        t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def _apply(x, weight, bias, w_in_out):
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        x, weight, bias = autocast_matmul_inputs(x, weight, bias)
        with torch.autocast(dev, enabled=False):
            return _LinearFn.apply(x, weight, bias, w_in_out)
    return _LinearFn.apply(x, weight, bias, w_in_out)


def _check(api: str, x: torch.Tensor, weight: torch.Tensor, in_dim: int) -> None:
    if x.dim() == 0 or x.shape[-1] != weight.shape[in_dim]:
        raise ValueError(
            f"slimgrad.ops.{api}: input features do not match the weight; expected "
            f"input.shape[-1] == {weight.shape[in_dim]}, got input of shape {tuple(x.shape)}. "
            "Pass an input whose last dimension is the layer's in_features."
        )


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = input @ weight.T + bias`` (as ``F.linear``) keeping only what requested grads need.

    Memory: saves input only if weight needs grad, weight only if input needs grad (eager: same).

    Args:
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: optional ``(out_features,)``.

    Returns:
        ``(*, out_features)``.

    Raises:
        ValueError: ``input.shape[-1] != in_features``.

    Example:
        >>> y = linear(torch.randn(4, 8), torch.randn(3, 8, requires_grad=True))
    """
    _check("linear", input, weight, 1)
    return _apply(input, weight, bias, False)


def conv1d_addmm(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """HF GPT-2 ``Conv1D``: ``y = input @ weight + bias`` with weight ``(in, out)`` (an ``addmm``).

    Memory: saves input only if weight needs grad, weight only if input needs grad (eager: same).

    Args:
        input: ``(*, in_features)``.
        weight: ``(in_features, out_features)``.
        bias: optional ``(out_features,)``.

    Returns:
        ``(*, out_features)``.

    Raises:
        ValueError: ``input.shape[-1] != in_features``.
    """
    _check("conv1d_addmm", input, weight, 0)
    return _apply(input, weight, bias, True)

"""Linear layers that keep only what the requested gradients need.

Math: ``y = x W^T + b`` (``F.linear``, W is ``(out, in)``) or ``y = x W + b`` (HF GPT-2 ``Conv1D``,
W is ``(in, out)``, an ``addmm``). Backward: ``dx = dy W`` (needs W only), ``dW = dy^T x`` (needs x
only), ``db = sum(dy)``.

Memory: saves x only if W needs a gradient and W only if x needs one (frozen W: x is not kept; x
without grad: W is not referenced); eager (torch 2.13) ``linear``/``mm``/``addmm`` have the same
guard (measured), so this matches eager byte for byte and makes the contract explicit and tested.
x is a matmul input: it counts in the tracker's floor (``_slimgrad_floor``).

Under autocast, a weight that is a leaf (a Parameter, frozen or not) is kept as itself, not as its
low-precision cast, and re-cast in backward (NOTE [Autocast weight casts]): eager keeps the cast,
2 B/param in bf16/fp16 per weight, for the whole backward.

# NOTE [Autocast weight casts]
Eager ``F.linear`` under autocast casts x, W and b to the autocast dtype (W's cast comes from
autocast's cache for an fp32 leaf that requires grad: one cast, one ``ToCopyBackward`` node, per
weight per outermost autocast region) and ``mm``'s backward keeps the cast W16 for dx = dy W16.
W itself is resident anyway, and fp32 -> bf16/fp16 rounding is deterministic, so slimgrad keeps W
and computes ``W.to(dtype)`` again in backward: the same bits. The graph keeps eager's shape: the
Function takes autocast's own cast of W as an input (fetched from the cache through a zero-row
probe matmul that saves it, ``_autocast_cast``), not saved, so its gradient still reaches W
through autocast's ``ToCopyBackward``: a weight used twice in one region sums its two gradients
in the autocast dtype before the cast to fp32, exactly as eager; nested regions,
``autocast(enabled=False)`` and ``cache_enabled=False`` behave as eager's cache does. The cast
itself lives only as long as autocast's cache (until the outermost region exits), not until
backward. A weight that is not a leaf (computed, e.g. a merged adapter) keeps eager's behaviour
(its cast is kept). Under torch.compile the eager path runs (dynamo cannot read saved tensors).
Caveat: W is a saved tensor, so changing W in place between forward and backward raises autograd's
"modified by an inplace operation" error; eager would silently use the old cast.
"""

from __future__ import annotations

import torch

from slimgrad._autograd import first_order, refuse_jit, transforms_active

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


def _linear_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    mask = ctx.needs_input_grad[:3]
    dx, dw, db = _bwd_torch(dy, x, weight, ctx.has_bias, ctx.w_in_out, mask)
    return dx, dw, db, None


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
    @first_order("ops.linear", double=_linear_backward)  # differentiable: eager's 2nd derivatives
    def backward(ctx, dy):
        return _linear_backward(ctx, dy)


def _autocast_linear_backward(ctx, dy):
    x, master = ctx.saved_tensors
    w = master.to(ctx.cast_dtype) if master is not None else None  # eager's cast, same bits
    mask = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
    dx, dw, db = _bwd_torch(dy, x, w, ctx.has_bias, ctx.w_in_out, mask)
    return dx, dw, None, db, None


class _AutocastLinearFn(torch.autograd.Function):
    # NOTE [Autocast weight casts]: keeps the leaf weight ``master``, not its cast ``w_cast``
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, x, w_cast, master, bias, w_in_out):
        ctx.w_in_out, ctx.has_bias, ctx.cast_dtype = w_in_out, bias is not None, w_cast.dtype
        ctx.save_for_backward(
            x if ctx.needs_input_grad[1] else None, master if ctx.needs_input_grad[0] else None
        )
        return _fwd_torch(x, w_cast, bias, w_in_out)

    @staticmethod
    @first_order("ops.linear", double=_autocast_linear_backward)
    def backward(ctx, dy):
        return _autocast_linear_backward(ctx, dy)


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


def _probe(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor | None:
    # A zero-row matmul under autocast: autocast casts ``t`` through its cache and the matmul's
    # node saves that very cast; read it back (NOTE [Autocast weight casts]).
    z = torch.empty(
        (0, t.shape[0]) if t.dim() < 3 else (t.shape[0], 0, t.shape[1]),
        dtype=dt,
        device=t.device,
        requires_grad=True,
    )
    if t.dim() == 1:  # vecdot = sum(z * t): its mul keeps the cast as ``other``
        node = torch.linalg.vecdot(z, t).grad_fn
        mul = node.next_functions[0][0] if node is not None and node.next_functions else None
        return getattr(mul, "_saved_other", None)
    if t.dim() == 2:
        return getattr(torch.mm(z, t).grad_fn, "_saved_mat2", None)
    if t.dim() == 3:
        return getattr(torch.bmm(z, t).grad_fn, "_saved_mat2", None)
    return None


def _autocast_cast(t: torch.Tensor | None, dev: str, dt: torch.dtype) -> torch.Tensor | None:
    """``t`` as eager autocast hands it to a lower-precision op: the cached cast of an fp32 leaf
    that requires grad (the same tensor and node for every use in the region), else ``t.to(dt)``
    for floating tensors other than float64."""
    if t is None or not t.is_floating_point() or t.dtype in (torch.float64, dt):
        return t
    cacheable = (
        t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
        and t.dim() <= 3
    )
    if cacheable:
        with torch.enable_grad():
            cast = _probe(t, dt)
        if (
            cast is not None
            and cast.dtype == dt
            and cast.shape == t.shape
            and cast.grad_fn is not None
            and getattr(cast.grad_fn.next_functions[0][0], "variable", None) is t
        ):
            return cast
    return t.to(dt)


def _cast_input(x, dev, dt, w_in_out):
    # HF's Conv1D reshapes x before its addmm: autocast casts that view, never a cached leaf
    return (
        x.to(dt)
        if w_in_out and x.is_floating_point() and x.dtype != torch.float64
        else (_autocast_cast(x, dev, dt))
    )


def _apply(x, weight, bias, w_in_out):
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x = _cast_input(x, dev, dt, w_in_out)
        master = (
            weight.grad_fn is None
            and weight.is_floating_point()
            and weight.dtype not in (dt, torch.float64)
            and not torch.compiler.is_compiling()
        )
        if master:  # NOTE [Autocast weight casts]
            w_cast, bias = (_autocast_cast(t, dev, dt) for t in (weight, bias))
            with torch.autocast(dev, enabled=False):
                return _AutocastLinearFn.apply(x, w_cast, weight, bias, w_in_out)
        weight, bias = (_autocast_cast(t, dev, dt) for t in (weight, bias))
        with torch.autocast(dev, enabled=False):
            return _LinearFn.apply(x, weight, bias, w_in_out)
    return _LinearFn.apply(x, weight, bias, w_in_out)


def _refuse_jit_if_recorded(api, *tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        refuse_jit(api)


def _check(api: str, x: torch.Tensor, weight: torch.Tensor, in_dim: int) -> None:
    # RuntimeError: the type eager's linear/addmm raise for mismatched shapes
    if x.dim() == 0 or x.shape[-1] != weight.shape[in_dim]:
        raise RuntimeError(
            f"slimgrad.ops.{api}: input features do not match the weight; expected "
            f"input.shape[-1] == weight.shape[{in_dim}], got input of shape "
            f"{tuple(x.shape)} and weight of shape {tuple(weight.shape)}. "
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
        RuntimeError: ``input.shape[-1] != in_features`` (eager raises RuntimeError too).

    Example:
        >>> y = linear(torch.randn(4, 8), torch.randn(3, 8, requires_grad=True))
    """
    if transforms_active() or weight.dim() != 2:  # torch.func (NOTE [torch.func transforms]),
        return torch.nn.functional.linear(input, weight, bias)  # or a 1-D weight: eager's op
    _check("linear", input, weight, 1)
    _refuse_jit_if_recorded("ops.linear", input, weight, bias)
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
        RuntimeError: ``input.shape[-1] != in_features`` (eager raises RuntimeError too).
    """
    if transforms_active():  # NOTE [torch.func transforms]
        return _fwd_torch(input, weight, bias, True)
    _check("conv1d_addmm", input, weight, 0)
    _refuse_jit_if_recorded("ops.conv1d_addmm", input, weight, bias)
    return _apply(input, weight, bias, True)

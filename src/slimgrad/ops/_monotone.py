"""One factory for the activations whose gradient follows from their output alone.

relu, sigmoid, tanh, leaky_relu (slope >= 0), elu (alpha >= 0) and hardtanh (bounds the dtype
represents) keep y and nothing else: eager's own backward formula, fed y, is exact (NOTE [Gradient
from the output] in ``slimgrad.ops._output_act``). Their Functions differed only in the forward,
the Triton kernels' stem and the aten backward op; :func:`output_only_function` builds them.
Where y does not tell the side (leaky_relu slope < 0, elu alpha < 0, hardtanh with a bound the
dtype cannot represent), the side is kept as 1 bit/elt: :func:`forward_with_bits`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from slimgrad import ownership
from slimgrad._autograd import compiling, first_order
from slimgrad._errors import hooks_top, seen
from slimgrad.kernels import _backend
from slimgrad.ops._bits import pack_bits, unpack_bits
from slimgrad.ops._output_act import (
    check_output_seen,
    forward_output_only,
    held_view,
    memory_order,
    raise_output_written,
)

__all__ = [
    "apply_with_anchor",
    "forward_with_bits",
    "hooks_active",
    "output_only_function",
    "same_layout",
    "unpack_side",
    "zero_tie",
]


# the output_only_function activations whose eager op keeps x (out of place); ELU has its own
# Function (ops/elu.py), not this factory's, and runs eager's op (keeping x) under saved-tensor
# hooks (NOTE [Output and side information under saved-tensor hooks] below)
_EAGER_KEEPS_X = frozenset({"leaky_relu", "hardtanh"})


def output_only_function(
    stem: str,
    name: str,
    fwd: Callable[..., Tensor],
    fwd_: Callable[..., Tensor],
    bwd_op: torch._ops.OpOverloadPacket,
    bwd_args: Callable[..., tuple],
) -> tuple[type[torch.autograd.Function], Callable[..., Tensor]]:
    """The Function of a monotone activation that keeps only y, and its plain-PyTorch backward.

    ``Fn.apply(x, *params, inplace)`` runs ``fwd(x, *params)`` (``fwd_`` in place; Triton's
    ``_fwd_triton``/``_fwd_triton_`` from ``slimgrad.kernels.<stem>`` on CUDA) and saves y. Backward
    is ``bwd_op(*bwd_args(g, y, *params))``, written into g's buffer (``bwd_op.grad_input``) when
    ``slimgrad.ownership.take`` proves it dead (NOTE [Gradient-buffer ownership]); under
    torch.compile, out of place.

    Args:
        stem: the op's stem (``"relu"``): names the kernels module.
        name: the Function's class name (``"_ReluFn"``): autograd names the node after it.
        fwd, fwd_: ``(x, *params) -> y``, out of place and in place (eager's own forward).
        bwd_op: eager's backward op taking y (e.g. ``torch.ops.aten.threshold_backward``).
        bwd_args: ``(g, y, *params) -> bwd_op``'s positional arguments.

    Returns:
        ``(Fn, bwd_torch)``, ``bwd_torch(g, y, *params) -> dx`` (the kernels' reference).
    """

    def bwd_torch(g: Tensor, y: Tensor, *params) -> Tensor:
        return bwd_op(*bwd_args(g, y, *params))

    # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py: only where
    # eager keeps x; eager's relu, sigmoid, tanh and every in-place call keep y as this op does
    # (under identity hooks eager reads a written y too: the same gradient, no check)
    check = stem in _EAGER_KEEPS_X

    def forward(ctx, x: Tensor, *args):
        *params, inplace = args
        ctx.params = params
        asked = check and not inplace and not compiling()  # eager keeps x, out of place
        if asked:
            # NOTE [An input the graph holds] in ops/_output_act.py (graph_holds inline: no call
            # on the straight path; Dynamo does not read grad_fn): x kept, as eager; eager's
            # backward formula reads x as it reads y (the same side of every threshold)
            fn, b = x.grad_fn, x._base
            if fn is None or (
                b is not None and b.grad_fn is None and (b.requires_grad or held_view(x))
            ):
                ctx.save_for_backward(x)
                ctx.y_seen = None
                return fwd(x, *params)
        if _backend.use_triton(x):
            k = _backend.kernels(stem)
            y = forward_output_only(
                ctx,
                x,
                inplace,
                lambda t: k._fwd_triton(t, *params),
                lambda t: k._fwd_triton_(t, *params),
            )
        else:
            y = forward_output_only(
                ctx, x, inplace, lambda t: fwd(t, *params), lambda t: fwd_(t, *params)
            )
        ctx.y_seen = seen(y) if asked and hooks_top(False) is not None else None
        return y

    def double(ctx, g):
        # create_graph=True: eager's formula from y with differentiable ops; autograd continues
        # through y's node (NOTE [Second derivatives] in slimgrad._autograd): eager's result
        (y,) = ctx.saved_tensors
        if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
            check_output_seen(ctx, y, f"ops.{stem}")
        return bwd_torch(g, y, *ctx.params), *((None,) * (len(ctx.params) + 1))

    @first_order(f"ops.{stem}", double=double)
    def backward(ctx, g):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        try:
            (y,) = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [An output written after forward] in ops/_output_act.py
            raise_output_written(e, f"ops.{stem}")
            raise
        if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
            check_output_seen(ctx, y, f"ops.{stem}")
        params, nones = ctx.params, (None,) * (len(ctx.params) + 1)
        own = buf is not None and buf.shape == y.shape and buf.dtype == y.dtype
        if _backend.use_triton(y):  # NOTE [Kernel backend choice]; owned: dx into g
            k = _backend.kernels(stem)
            return k._bwd_triton(g, y, *params, out=buf if own else None), *nones
        if own:  # eager only (take refuses under torch.compile): dx into g's dead buffer
            return bwd_op.grad_input(*bwd_args(buf, y, *params), grad_input=buf), *nones
        return bwd_torch(g, y, *params), *nones

    fn = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    return fn, bwd_torch


def forward_with_bits(
    ctx,
    x: Tensor,
    inplace: bool,
    side: Callable,
    fwd: Callable,
    fwd_: Callable,
    keep_y: bool = False,
) -> Tensor:
    """Forward that keeps ``side(x)`` (bool, like x) packed to 1 bit/elt, and y if ``keep_y``.

    The mask is packed (and freed) before ``fwd_`` overwrites x, in x's memory order (a
    channels_last x packs its bits in channels_last order), so that :func:`unpack_side` gives it
    back with x's strides and backward's elementwise ops need no copy into eager's layout.
    """
    p = memory_order(x)
    ctx.bits_perm = p
    bits = pack_bits(side(x if p is None else x.permute(p)))
    if inplace:
        y = fwd_(x)
        ctx.mark_dirty(y)
    else:
        y = fwd(x)
    ctx.save_for_backward(*((y, bits) if keep_y else (bits,)))
    return y


def unpack_side(ctx, bits: Tensor, like: Tensor) -> Tensor:
    """The bool mask :func:`forward_with_bits` packed, with the forward input's shape and layout
    (its memory order; ``like``'s shape)."""
    p = getattr(ctx, "bits_perm", None)
    if p is None:
        return unpack_bits(bits, like.numel()).view(like.shape)
    shape = [like.shape[d] for d in p]
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return unpack_bits(bits, like.numel()).view(shape).permute(inv)


def hooks_active() -> bool:
    """True inside a ``saved_tensors_hooks`` region (``save_on_cpu``, checkpointing, offloading).

    # NOTE [Output and side information under saved-tensor hooks]
    A hook packs every saved tensor on its own: y packed by this op and again by the next layer
    are two copies (``save_on_cpu`` does not share them), so keeping y instead of x frees nothing
    there and the side information (ELU's tail table and sign bits, Hardswish's bits and table)
    is extra: the pack hook saw 137,072 B for ELU on a 4x32x16x16 float32 tensor (alpha < 0:
    141,168 B; Hardswish 142,248 B) against eager's 131,072. Inside such a region those ops keep
    x through eager's op; ops that keep y alone (relu, leaky_relu slope >= 0, hardtanh) or bits
    alone (leaky_relu slope < 0, hardsigmoid) keep no more than eager and stay.
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace this builtin: the lean path
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def same_layout(ctx, g: Tensor) -> bool:
    """True when g has the forward input's shape and strides (``record_layout``): eager's
    elementwise backward of g and x then returns that layout, and so does one computed from g and
    :func:`unpack_side`'s mask, so no layout needs working out (nor any meta tensor made)."""
    xl = getattr(ctx, "x_layout", None)
    if xl is None:
        return g.is_contiguous()
    return xl[0] == tuple(g.shape) and xl[1] == g.stride()


# The 1-bit paths (leaky_relu slope < 0, hardtanh with a bound the dtype cannot represent) keep
# no tensor with history, so their create_graph gradient where(bit, g, g * slope) had no history
# when g had none, and differentiating it in x raised (or gave None with allow_unused) where
# eager's ``*_backward(g, x)`` gives zeros (its derivative in x is zeros_like(grad)). The forward
# leaves an empty anchor on x (``slimgrad.ops.layer_norm.make_anchor``: 0 bytes, NOTE [Second
# derivatives of an op that keeps its output]) and the double ties its result to it with a zero
# derivative: eager's zeros, whatever g.


class _ZeroTie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dx: Tensor, anchor: Tensor, box: list) -> Tensor:
        ctx.box = box
        return dx.view_as(dx)

    @staticmethod
    def backward(ctx, gg):
        from slimgrad.ops.layer_norm import list_box

        # d dx / d x = 0 (eager's zeros_like(grad)), handed to the anchor (NOTE [A second-order
        # pass's gradient handed to its node] in ops/layer_norm.py)
        list_box(ctx.box).put(torch.zeros_like(gg))
        return gg, gg.new_empty(0), None


def zero_tie(ctx, dx: Tensor) -> Tensor:
    """``dx`` (a view) whose derivative in the forward's input is zeros, when the forward left an
    anchor (:func:`apply_with_anchor`); else ``dx``."""
    anchor = getattr(ctx, "_slimgrad_anchor", None)
    if anchor is None:
        return dx
    return _ZeroTie.apply(dx, *anchor)


def apply_with_anchor(fn, x: Tensor, *args) -> Tensor:
    """``fn.apply(x, *args)`` with an empty anchor on x handed to its node (read by
    :func:`zero_tie`; not for an in-place write on a view)."""
    from slimgrad.ops.layer_norm import make_anchor

    if torch.compiler.is_compiling():  # no anchors under torch.compile (as make_anchor)
        return fn.apply(x, *args)
    anchor = make_anchor(x)
    out = fn.apply(x, *args)
    node = out.grad_fn
    # fn's own node only (in place on a view, out's node is autograd's view rebase: no tie there)
    if anchor is not None and node is not None and getattr(type(node), "_forward_cls", None) is fn:
        node._slimgrad_anchor = anchor
    return out

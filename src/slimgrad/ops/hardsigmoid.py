"""Hardsigmoid that keeps 1 bit per element.

Math: y = clamp(x / 6 + 1/2, 0, 1),  dy/dx = [-3 < x < 3] / 6 (eager's ``hardsigmoid_backward``:
``g * (1/6)`` inside the open interval, 0 outside and at the breakpoints; NaN gives 0).
The gradient needs the side of x only, not y: float32 y == 1 already for x a few ulp below 3, so y
would not tell the side there; the side is kept as 1 bit/elt and the backward runs eager's own
kernel on a stand-in input (0 inside, -3 outside), so dx has eager's bits in every dtype.

Memory: saves 1 bit/elt (the side); eager saves x (4 B/elt float32, 2 B/elt bfloat16/float16).
A tensor of at most ``DENSE_MAX`` (512) elements keeps x, as eager (NOTE [Few elements] in
``ops._output_act``), and so does a leaf that requires grad or a view of one (NOTE [An input the
graph holds] there).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise out of place. Second derivatives raise
(NOTE [Second derivatives] in ``slimgrad._autograd``); under torch.func transforms this is eager's
op (NOTE [torch.func transforms]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad import _dtensor, ownership
from slimgrad._autograd import FxTraceError, eager_op, first_order, refuse_jit
from slimgrad.ops import _derived
from slimgrad.ops._bits import pack_bits, packed_numel, unpack_mask
from slimgrad.ops._output_act import DENSE_MAX, graph_holds, needs_graph

__all__ = ["hardsigmoid", "hardsigmoid_"]

CHUNK = 1 << 16  # elements per chunk of the forward's side test (a multiple of 8)


def _fwd_torch(x: Tensor) -> Tensor:
    return F.hardsigmoid(x)


def _side(x: Tensor) -> Tensor:
    # eager's test, in opmath (float32 for half types: -3 and 3 are exact in every float dtype)
    return (x > -3) & (x < 3)


def _memory_order(t: Tensor) -> tuple[int, ...] | None:
    # The permutation that lists a dense tensor's dims from outermost to innermost in memory
    # (channels_last: (0, 2, 3, 1)), so that t.permute(perm) is contiguous; None for a
    # contiguous tensor or one whose elements do not fill its memory (then a copy is made, as
    # before). The side bits are packed, and dx computed, in that order: no full-size copy of a
    # channels_last x in forward or of its gradient in backward (those copies peaked above
    # eager's, (4, 16, 7, 7) channels_last: 50,576 B against 50,184 after a BatchNorm).
    if t.is_contiguous():
        return None
    perm = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _in_order(t: Tensor, perm: tuple[int, ...] | None) -> Tensor:
    return t if perm is None else t.permute(perm)


def _pack_side(x: Tensor) -> Tensor:
    # chunked: the comparison temporaries stay below 4 B per element of a chunk
    flat = x.reshape(-1)
    n = flat.numel()
    if _derived.under_checkpoint():
        # NOTE [No write into a buffer a policy may cache] in ops/_derived.py: each chunk's bytes
        # made by pack_bits and joined, no write into a buffer made before
        if n <= CHUNK:
            return pack_bits(_side(flat))
        return torch.cat([pack_bits(_side(flat[a : a + CHUNK])) for a in range(0, n, CHUNK)])
    bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    for a in range(0, n, CHUNK):
        c = flat[a : a + CHUNK]
        bits[a // 8 : (a + c.numel() + 7) // 8] = pack_bits(_side(c))
    return bits


def _stand_in(bits: Tensor, n: int, like: Tensor) -> Tensor:
    # 0 where -3 < x < 3, -3 elsewhere: eager's kernel takes the same branch as on x. Built in
    # one buffer of g's dtype through a 1 B/elt mask (NOTE [Hardsigmoid's stand-in is dx's buffer])
    z = torch.empty(n, dtype=like.dtype, device=like.device)
    return z.copy_(unpack_mask(bits, n)).sub_(1).mul_(3)


def _dx_over(g: Tensor, z: Tensor) -> Tensor:
    # dx over z where z has g's strides: the layout eager's dx takes from g, so its bits and every
    # reduction over it are eager's; elsewhere (g laid out unlike x) a tensor of its own
    # (NOTE [Hardsigmoid's stand-in is dx's buffer])
    if z.stride() == g.stride():
        return torch.ops.aten.hardsigmoid_backward.grad_input(g, z, grad_input=z)
    return torch.ops.aten.hardsigmoid_backward(g, z)


def _bwd_torch(g: Tensor, bits: Tensor) -> Tensor:
    return _dx_over(g, _stand_in(bits, g.numel(), g).view(g.shape))


# NOTE [Hardsigmoid's stand-in is dx's buffer]
# Without a dead incoming gradient to write into, the backward builds the stand-in input z (0 or
# -3, one element of g's dtype per element) and eager's ``hardsigmoid_backward`` then writes dx
# over z (an elementwise kernel reading and writing the same element): the step holds g, the bits,
# the 1 B/elt mask they unpack to and one full-size tensor, where eager holds g, x and dx. With z
# and dx apart the backward held one full-size tensor more than eager's minus x, the bits above
# eager's peak wherever eager's x is not held for the whole step: under a non-reentrant checkpoint
# x is recomputed just before this backward (Linear -> Hardsigmoid(inplace=True) -> Linear,
# 8x64x64 -> 256: peak 2,703,624 B against eager's 2,687,240). Only where z has g's strides: dx
# written into z takes z's layout, and eager's dx has g's (a permuted incoming gradient), so a
# reduction over dx would leave eager's bits; there dx is a tensor of its own, as before.


class _HardsigmoidFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool) -> Tensor:
        # a few elements keep x, as eager (NOTE [Few elements] in slimgrad.ops._output_act): the
        # bits' packing and unpacking temporaries peak above eager's there (1 element: 34 B
        # against 20 B); so does a leaf that requires grad, or a view of one, out of place: the
        # graph holds it anyway (NOTE [An input the graph holds] in ops/_output_act.py)
        ctx.dense = x.numel() <= DENSE_MAX or (
            not inplace and not torch.compiler.is_compiling() and graph_holds(x)
        )
        ctx.perm = None
        if ctx.dense:
            keep = x.detach().clone() if inplace else x
        else:
            ctx.perm = _memory_order(x)
            keep = _pack_side(_in_order(x, ctx.perm))  # packed before x may be overwritten
        if inplace:
            y = F.hardsigmoid(x, inplace=True)
            ctx.mark_dirty(y)
        else:
            y = _fwd_torch(x)
        ctx.save_for_backward(keep)
        return y

    @staticmethod
    @first_order("ops.hardsigmoid")
    def backward(ctx, g: Tensor):
        buf = ownership.take(g)  # first use of g: NOTE [Gradient-buffer ownership]
        (bits,) = ctx.saved_tensors
        if ctx.dense:  # x itself: eager's own kernel
            return torch.ops.aten.hardsigmoid_backward(g, bits), None
        perm = ctx.perm
        if perm is None:
            z = _stand_in(bits, g.numel(), g).view(g.shape)
        else:  # in x's memory order, viewed with x's strides (no copy of g whatever its layout)
            inv = [0] * len(perm)
            for i, d in enumerate(perm):
                inv[d] = i
            z = _stand_in(bits, g.numel(), g).view([g.shape[d] for d in perm])
            z = z.permute(inv)
        # dx over g's dead buffer, else over z (NOTE [Hardsigmoid's stand-in is dx's buffer])
        if buf is not None:
            return torch.ops.aten.hardsigmoid_backward.grad_input(buf, z, grad_input=buf), None
        return _dx_over(g, z), None


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    """Hardsigmoid ``y = clamp(x / 6 + 1/2, 0, 1)`` that keeps 1 bit/elt for backward.

    Output and gradient are eager's bit for bit (``torch.nn.functional.hardsigmoid``).

    Memory: saves 1 bit/elt (``-3 < x < 3``); eager saves x (4 B/elt float32).

    Args:
        input: any floating tensor.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Raises:
        RuntimeError: double backward (``create_graph=True``, differentiated again) through this
            op, or a ``torch.jit.trace`` of it.

    Example:
        >>> y = hardsigmoid(torch.randn(4, 8, requires_grad=True))
    """
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input):
        return _dtensor.pointwise("slimgrad.ops.hardsigmoid", hardsigmoid, input, inplace=inplace)
    # NOTE [torch.func transforms], NOTE [In-place Functions under torch.compile]
    try:
        if not needs_graph(input) or eager_op(inplace):
            return F.hardsigmoid(input, inplace=inplace)
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        return F.hardsigmoid(input, inplace=inplace)
    refuse_jit("ops.hardsigmoid")
    return _HardsigmoidFn.apply(input, inplace)


def hardsigmoid_(input: Tensor) -> Tensor:
    """In-place :func:`hardsigmoid`."""
    return hardsigmoid(input, inplace=True)

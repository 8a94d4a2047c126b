"""Mish that keeps its output, 1 branch bit per element and a sparse table of exact inputs.

Math: y = x tanh(sp),  sp = log(1 + e^x),  dy/dx = tanh(sp) + x sigmoid(x) (1 - tanh^2(sp)).
One minimum at x* = -1.19237 (y_min = -0.30884), so x follows from (y, [x >= x*]); where that
inverse is ill-conditioned x is kept exactly (NOTE [Gradient from the output] in
``slimgrad.ops._output_act``). The output is eager's, bit for bit.

Memory (float32): saves y (the output, shared with the next layer) + 1/8 B/elt (branch bits) + 8 B
per hard element (int32 index + x; |x - x*| < 0.08, x < -6, non-finite): 0.376 B/elt at
N(0, 1) and 0.232 B/elt at N(0, 0.577) besides y; eager saves x (4 B/elt), and eager ``mish_`` a
clone of x. Worst case (more than 1/16 of the elements hard), float64, and tensors of at most 512
elements (NOTE [Few elements] in ``slimgrad.ops._output_act``): keeps x densely, as eager does, and
neither y, bits nor table. float16/bfloat16: y + 1/8 B/elt + 6 B per element with |x - x*| < 0.15 or
x < -10; eager 2 B/elt. After slimgrad's GroupNorm where the norm keeps its output (float32/64,
contiguous, groups large enough): keeps x, that output, which the norm keeps anyway, and no bits
or table: no byte besides the norm's (NOTE [An input its producer keeps] in ``_output_act``).
So does a leaf that requires grad, or a view of one, which the graph holds anyway (NOTE [An
input the graph holds] there).
Half types on CPU up to HALF_DENSE_MAX elements keep x with no copy of it (NOTE [Few elements
without a copy of x]).
Under saved-tensor hooks other than torch.utils.checkpoint's (offloading): keeps x (in place, a
copy of x), as eager, and nothing else (NOTE [Under hooks that pack each tensor] in
``_output_act``).

Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); on CPU float32 both passes run as compiled C
(``kernels/cpu/output_act.c``, NOTE [CPU C kernels]), else PyTorch (or Triton on CUDA).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad import _dtensor
from slimgrad._autograd import direct_apply, refuse_jit, transforms_active, unwrap_if_dead
from slimgrad._library import straight
from slimgrad._math.smooth import MISH
from slimgrad.ops._output_act import (
    needs_graph,
    smooth_apply,
    smooth_grad,
    smooth_unary_op,
)

__all__ = ["mish", "mish_"]


SPEC = MISH  # slimgrad._math.smooth (NOTE [Kernels are leaves])


def _fwd_torch(x: Tensor) -> Tensor:
    return torch.nn.functional.mish(x)


def _bwd_exact(g: Tensor, x: Tensor) -> Tensor:
    return torch.ops.aten.mish_backward(g, x)


def _bwd_torch(g, y, bits, idx, xs) -> Tensor:
    return smooth_grad(SPEC, g, y, bits, idx, xs, _bwd_exact)


_mish_fwd, _mish_bwd, _MishFn, _MishInplaceFn = smooth_unary_op(
    "mish", SPEC, _fwd_torch, _bwd_exact, torch._C._nn.mish, torch._C._nn.mish_
)
_MISH_APPLY = direct_apply(_MishFn)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_grad_on = torch._C.is_grad_enabled


def mish(input: Tensor, inplace: bool = False) -> Tensor:
    """Mish ``y = x tanh(softplus(x))`` that keeps its output + 1 bit/elt (+ a sparse exact table).

    Output as ``torch.nn.functional.mish``; the gradient is within eager's own error
    (the error rule).

    Memory: saves y (shared with the next layer) + 1 bit/elt + 8 B per hard element (float32;
    0.15-0.25 B/elt besides y at N(0, 1)-like inputs); eager saves x (4 B/elt; eager
    ``inplace=True`` saves a clone of x). More than 1/16 hard elements, float64, or at most 512
    elements: keeps x densely, as eager does.

    Args:
        input: tensor of float32, float16, bfloat16 or float64.
        inplace: write the result into ``input``.

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Raises:
        RuntimeError: when its gradient (``create_graph=True``) is differentiated again while
            the op kept y, bits and a table (float32/16: f'' is not there); float64 and the
            dense fallback keep x and give eager's second derivatives.

    Example:
        >>> y = mish(torch.randn(4, 8, requires_grad=True))
    """
    if (  # the straight path: NOTE [One gate per call] in slimgrad/_library.py
        not inplace
        and type(input) in _PLAIN
        and input.requires_grad
        and not input.is_meta
        and _grad_on()
        and straight()
    ):
        return _MISH_APPLY(unwrap_if_dead(input), True)
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input):
        return _dtensor.pointwise("slimgrad.ops.mish", mish, input, inplace=inplace)
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or not needs_graph(input) or input.is_meta:
        return torch.nn.functional.mish(input, inplace=inplace)
    refuse_jit("ops.mish")
    return smooth_apply(_MishFn, _MishInplaceFn, input, inplace)


def mish_(input: Tensor) -> Tensor:
    """In-place :func:`mish`; unlike eager ``mish_`` it keeps no copy of x."""
    return mish(input, inplace=True)

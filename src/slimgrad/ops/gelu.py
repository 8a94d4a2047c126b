"""GELU (erf and tanh forms) that keeps its output, 1 branch bit per element and a sparse table.

Math: erf form  y = x Phi(x) = x/2 (1 + erf(x/sqrt 2)),  dy/dx = Phi(x) + x phi(x);
tanh form (HF ``gelu_new``, ``gelu_fast``)  y = x/2 (1 + tanh u),  u = sqrt(2/pi) (x + 0.044715
x^3), dy/dx = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
Both have one minimum (x* = -0.75179 erf, -0.75246 tanh), so x follows from (y, [x >= x*]);
where that inverse is ill-conditioned x is kept exactly (NOTE [Gradient from the output] in
``slimgrad.ops._output_act``). The output is eager's, bit for bit.

Memory (float32): saves y (the output, shared with the next layer) + 1/8 B/elt (branch bits) + 8 B
per hard element (int32 index + x; |x - x*| < w, x < -2.5 erf / x < -3 tanh, non-finite), where
the window w is decided once per process from eager's own forward error on this machine, never
below 0.03 erf / 0.06 tanh (NOTE [A window from eager's own forward error] in
``slimgrad._math.smooth``): at those widths 0.319 B/elt (erf) and 0.423 B/elt (tanh) besides y at
N(0, 1) inputs, 0.267 and 0.411 B/elt at N(0, 0.577) (GPT-2 MLP pre-activations); each 0.01 of w
adds ~0.05 B/elt at N(0, 1) (torch's AVX2 erf-GELU: w = 0.104, past 1/16 hard at N(0, 1), so
such inputs keep x, as eager); eager saves x (4 B/elt). Worst case (more than
1/16 of the elements hard), float64, and tensors of at most 512 elements (NOTE [Few elements] in
``slimgrad.ops._output_act``): keeps x densely, as eager does, and neither y, bits nor table.
float16/bfloat16: y + 1/8 B/elt + 6 B per element with |x - x*| < 0.15; eager 2 B/elt. About
9% of N(0, s) inputs (s from 0.577 to 1) lie in that window, more than 1/16: such inputs keep x
densely, as eager, at every size (NOTE [GPT-2's MLP under autocast] in ops/gpt2_mlp.py).
A leaf that requires grad, or a view of one, keeps x: the graph holds it anyway (NOTE [An input
the graph holds] in ``_output_act``).
Kept x (few elements, half types on CPU, an input its producer keeps) is x itself, no copy
(NOTE [Few elements without a copy of x] in ``_output_act``). Under saved-tensor hooks other
than torch.utils.checkpoint's (offloading): keeps x (in place, a copy of x), as eager, and nothing
else (NOTE [Under hooks that pack each tensor] in ``_output_act``).

Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); on CPU float32 both passes run as compiled C
(``kernels/cpu/output_act.c``, NOTE [CPU C kernels]), else PyTorch (or Triton on CUDA).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from slimgrad import _dtensor, ownership
from slimgrad._autograd import (
    compiling,
    direct_apply,
    refuse_jit,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._library import straight
from slimgrad._math.smooth import GELU, gelu_bwd_exact
from slimgrad.kernels import _backend
from slimgrad.ops._library import custom_op
from slimgrad.ops._output_act import (
    INPUT_KEPT_BY,
    UNASKED,
    CPath,
    c_backward,
    c_forward,
    dense_side_info,
    held_view,
    input_kept_forward,
    keeps_x,
    needs_graph,
    reuse_ok,
    smooth_apply,
    smooth_backward,
    smooth_double,
    smooth_fake_side_info,
    smooth_forward,
    smooth_fwd_any,
    smooth_grad,
    smooth_grad_any,
)

__all__ = ["gelu", "gelu_", "gelu_fast", "gelu_new"]

_APPROX = ("none", "tanh")
SPECS = GELU  # slimgrad._math.smooth (NOTE [Kernels are leaves])


class ApproximateError(ValueError, RuntimeError):
    """A bad ``approximate``: a ValueError (a bad value) that is also eager's RuntimeError, so code
    written against ``torch.nn.functional.gelu`` (``except RuntimeError``) keeps working."""


def _check_approximate(approximate: str) -> None:
    if approximate not in _APPROX:
        raise ApproximateError(
            f"slimgrad.gelu: unknown approximate; expected 'none' or 'tanh', got {approximate!r}. "
            f"Use approximate='tanh' for HF gelu_new/gelu_fast."
        )


def _fwd_torch(x: Tensor, approximate: str = "none") -> Tensor:
    return torch.nn.functional.gelu(x, approximate=approximate)


def _bwd_exact(g: Tensor, x: Tensor, approximate: str) -> Tensor:
    return gelu_bwd_exact(g, x, approximate)


def _bwd_exact_into(g: Tensor, x: Tensor, out: Tensor, approximate: str) -> Tensor:
    return torch.ops.aten.gelu_backward.grad_input(g, x, approximate=approximate, grad_input=out)


def _bwd_torch(g, y, bits, idx, xs, approximate: str = "none") -> Tensor:
    return smooth_grad(
        SPECS[approximate], g, y, bits, idx, xs, lambda g_, x_: _bwd_exact(g_, x_, approximate)
    )


@custom_op("gelu_fwd", mutates_args=())
def _gelu_fwd(
    x: Tensor, approximate: str, copy_x: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if keeps_x(x):  # NOTE [Few elements] in slimgrad.ops._output_act
        return dense_side_info(x, lambda t: _fwd_torch(t, approximate))
    if _backend.use_triton(x):
        return _backend.kernels("gelu")._fwd_triton(x, approximate)
    # NOTE [The dense fallback without a copy of x] in slimgrad/ops/_output_act.py
    return smooth_fwd_any(SPECS[approximate], x, lambda t: _fwd_torch(t, approximate), copy_x)


@_gelu_fwd.register_fake
def _(x, approximate, copy_x=True):
    return (torch.empty_like(x), *smooth_fake_side_info(x))


@custom_op("gelu_bwd", mutates_args=())
def _gelu_bwd(
    g: Tensor, y: Tensor | None, bits: Tensor, idx: Tensor, xs: Tensor, approximate: str
) -> Tensor:
    if y is not None and _backend.use_triton(g):
        return _backend.kernels("gelu")._bwd_triton(g, y, bits, idx, xs, approximate)
    return _bwd_any(g, y, bits, idx, xs, approximate)


def _bwd_any(g, y, bits, idx, xs, approximate: str, out: Tensor | None = None) -> Tensor:
    return smooth_grad_any(
        SPECS[approximate],
        g,
        y,
        bits,
        idx,
        xs,
        lambda g_, x_: _bwd_exact(g_, x_, approximate),
        out=out,
    )


@_gelu_bwd.register_fake
def _(g, y, bits, idx, xs, approximate):
    return g.new_empty(g.shape)


def _bwd_exact_differentiable(g: Tensor, x: Tensor, approximate: str) -> Tensor:
    return torch.ops.aten.gelu_backward(g, x, approximate=approximate)  # has a derivative


_SMOOTH_DOUBLE = smooth_double(
    "ops.gelu", _bwd_exact_differentiable, lambda ctx: (ctx.approximate,)
)


def _double(ctx, g, *side):
    out = _SMOOTH_DOUBLE(ctx, g, *side)
    return (*out, None) if len(out) == 2 else out  # the last: forward's ``direct``


# NOTE [The straight C path of the smooth activations] in slimgrad/ops/_output_act.py: per
# approximate, the C path's constants and eager's forward kernel without F.gelu's keyword parsing
_CPATH = {a: CPath(SPECS[a]) for a in _APPROX}
_C_FWD = {a: functools.partial(torch._C._nn.gelu, approximate=a) for a in _APPROX}
_C_BWD = {  # the hard elements' dx
    a: functools.partial(torch.ops.aten.gelu_backward.default, approximate=a) for a in _APPROX
}


class _GeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, approximate: str, direct: bool = False):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py);
        # y alone is returned then
        ctx.approximate = approximate
        kept = _C_FWD[approximate]  # eager's x -> y (smooth_forward's ``kept``)
        if direct:
            # NOTE [An input its producer keeps]; NOTE [An input the graph holds] in
            # ops/_output_act.py (inline: no call on the straight path)
            fn, b = x.grad_fn, x._base
            if fn.__class__ in INPUT_KEPT_BY or (
                x.requires_grad
                if fn is None
                else b is not None and b.grad_fn is None and (b.requires_grad or held_view(x))
            ):
                return input_kept_forward(ctx, x, kept, True)
            # NOTE [The straight C path of the smooth activations]
            y = c_forward(ctx, x, kept, _CPATH[approximate])
            if y is not None:
                return y
            return smooth_forward(
                ctx, x, _gelu_fwd.impl, False, approximate, single=True, kept=kept
            )
        # NOTE [Few elements without a copy of x]: kept
        return smooth_forward(ctx, x, _gelu_fwd, False, approximate, kept=kept)

    @staticmethod
    def backward(ctx, g, *_side):
        # first_order("ops.gelu", _double) inline, one frame fewer (NOTE [Second derivatives] in
        # slimgrad/_autograd.py): autograd turns grad mode on only for create_graph=True
        if _grad_on():
            return _double(ctx, g, *_side)
        if g is None:  # only the side outputs got a gradient (grads are not materialized)
            return None, None, None
        # forward's choice: NOTE [The straight C path of the smooth activations]
        if ctx.cpath is not None:
            # first use of g: NOTE [Gradient-buffer ownership] (ownership.take in one frame, after
            # take's compile check, as LayerNorm's and dropout's backward); c_backward reads g
            # flat: a transposed g (the caller permuted y) takes the general path below
            flat = g.is_contiguous()
            buf = g if flat and not compiling() and ownership.grant(g, ownership.PROBE) else None
            if buf is not None or (flat and straight()):
                dx = c_backward(ctx, g, buf, _C_BWD[ctx.approximate])
                if dx is not None:
                    return dx, None, None
        else:
            # first use of g: NOTE [Gradient-buffer ownership] (reuse_ok only reads attributes)
            buf = ownership.take(g) if reuse_ok(g, ctx.perm) else None
        a = ctx.approximate
        # the op's implementation past the gate: NOTE [One gate per call]
        bwd = _gelu_bwd.impl if buf is None and straight() else _gelu_bwd
        return smooth_backward(ctx, g, buf, bwd, _bwd_any, _bwd_exact, a), None, None


class _GeluInplaceFn(_GeluFn):
    @staticmethod
    def forward(ctx, x: Tensor, approximate: str, top=UNASKED):
        # top: the saved-tensor hooks smooth_apply asked (in ``direct``'s slot: backward's None)
        ctx.approximate = approximate
        kept = _C_FWD[approximate]
        return smooth_forward(ctx, x, _gelu_fwd, True, approximate, kept=kept, top=top)

    @staticmethod
    def eager_(x: Tensor, approximate: str) -> Tensor:
        # eager's in-place op (NOTE [Under hooks that pack each tensor] in ops/_output_act.py)
        return torch._C._nn.gelu_(x, approximate=approximate)


_GELU_APPLY = direct_apply(_GeluFn)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_grad_on = torch._C.is_grad_enabled


def gelu(input: Tensor, approximate: str = "none", inplace: bool = False) -> Tensor:
    """GELU that keeps its output + 1 bit/elt (+ a sparse exact table) instead of its input.

    ``y = x Phi(x)`` (``approximate='none'``) or ``x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))``
    (``'tanh'``). Output as ``torch.nn.functional.gelu``; the gradient is within eager's own
    error (error rule), tested on every float32 of the ill-conditioned windows.

    Memory: saves y (shared with the next layer) + 1 bit/elt + 8 B per hard element (float32;
    0.15-0.25 B/elt besides y at N(0, 1)-like inputs); eager saves x (4 B/elt). More than 1/16
    hard elements, float64, or at most 512 elements: keeps x densely, as eager does.

    Args:
        input: tensor of float32, float16, bfloat16 or float64.
        approximate: ``'none'`` (erf) or ``'tanh'``.
        inplace: write the result into ``input`` (it must not be needed elsewhere).

    Returns:
        The activation, ``input`` itself when ``inplace``.

    Raises:
        ValueError: unknown ``approximate``.
        RuntimeError: when its gradient (``create_graph=True``) is differentiated again while
            the op kept y, bits and a table (float32/16: f'' is not there); float64 and the
            dense fallback keep x and give eager's second derivatives.

    Example:
        >>> y = gelu(torch.randn(4, 8, requires_grad=True), approximate="tanh")
    """
    if (  # the straight path: NOTE [One gate per call] in slimgrad/_library.py
        not inplace
        and type(input) in _PLAIN
        and approximate in _APPROX
        and input.requires_grad
        and not input.is_meta
        and _grad_on()
        and straight()
    ):
        return _GELU_APPLY(unwrap_if_dead(input), approximate, True)
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input):
        return _dtensor.pointwise(
            "slimgrad.ops.gelu", gelu, input, approximate=approximate, inplace=inplace
        )
    _check_approximate(approximate)
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or not needs_graph(input) or input.is_meta:
        y = _fwd_torch(input, approximate)
        return input.copy_(y) if inplace else y
    refuse_jit("ops.gelu")
    return smooth_apply(_GeluFn, _GeluInplaceFn, input, inplace, approximate)


def gelu_(input: Tensor, approximate: str = "none") -> Tensor:
    """In-place :func:`gelu`: ``input`` is overwritten by the output (kept: the bits and table)."""
    return gelu(input, approximate, inplace=True)


def gelu_new(input: Tensor) -> Tensor:
    """HF ``gelu_new`` (``NewGELUActivation``): the tanh form, see :func:`gelu`."""
    return gelu(input, approximate="tanh")


def gelu_fast(input: Tensor) -> Tensor:
    """HF ``gelu_fast`` (``FastGELUActivation``): the tanh form rearranged; see :func:`gelu`."""
    return gelu(input, approximate="tanh")

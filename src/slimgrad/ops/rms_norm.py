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
On a seeded grid (25 seeds; 7 RMSNorm shapes from (1, 64) to (64, 512) and 6 GroupNorm
shapes up to (8, 32, 16, 16); 3 weight kinds; bf16 and fp16): rebuilding from the output broke the
error rule in 33 of 1,950 cases, all dgamma, by up to 1.73x the bound, from a single row
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
  eager's saved bytes keeping y, 1.00x keeping x); a residual of y's rounding could win part of
  it back.
LayerNorm (``ops/layer_norm.py``) rebuilds xhat the same way and shares the mechanism: on the
RMSNorm shapes of the grid above (with a bias; 1,050 bf16/fp16 cases) its dgamma exceeded the bound
in 4, by up to 1.78x ((1, 64) fp16), so in half precision it runs eager's ``F.layer_norm`` too.

# NOTE [HF RMSNorm cast orders]
HF's RMSNorms compute float32 statistics whatever the input dtype, and differ in where they cast
back and scale: Llama (and ~140 classes: Mistral, Qwen2/3, Phi-3, ...) ``w * (x32 * rstd).to(dt)``
(scale after the cast; the product promotes); OLMo-2 ``(w * xhat32).to(dt)``; Gemma ``(xhat32 *
(1.0 + w.float())).type_as(x)``; T5LayerNorm ``x * rstd`` (float32) cast to half weights only;
Gemma3n ``torch.pow(ms, -0.5)``; Llama4 ``xhat32.type_as(x) * w``. ``hf_rms_norm(x, w, eps,
variant)`` runs the variant's own ops in HF's order (``HF_VARIANTS``), so its forward is HF's bit
for bit in every dtype and under autocast, and keeps:
- a float32 input whose output is float32 (every variant but T5 with half weights): y = xhat *
  gamma, gamma = w, w.float(), 1 + w.float(), ... in float32, so xhat = y / gamma as for
  F.rms_norm: saves y (the next layer keeps it too) + rstd + the columns of channels whose gamma is
  0 or subnormal; dgamma flows back through gamma(w) with autograd (eager's cast / ``1 +``);
- every other dtype: x alone (2 B/elt in bf16/fp16), and backward recomputes HF's forward from x
  (under the forward's autocast state) and differentiates it: eager's gradient bits (tested bit for
  bit), eager's second derivatives under create_graph. Eager keeps a float32 copy of x (4 B/elt)
  and the normalized tensor (2 B/elt) + rstd. Keeping y instead of x would need side bits: the
  cast then scale loses the normalized tensor's bits where |w| < 1, and eager's dw uses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from slimgrad import _dtensor, _ext, ownership
from slimgrad._autograd import (
    CTX_FIELDS,
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._compile import recompute_in_backward
from slimgrad._errors import hooks_top, seen
from slimgrad._library import straight
from slimgrad._math import norms as _norms
from slimgrad._math.norms import (  # noqa: F401 (CHUNK_ELEMS: tests)
    CHUNK_ELEMS,
    fallback_channels,
    fallback_or_none,
    rebuild_xhat,
    side_columns,
)
from slimgrad._math.norms import acc_dtype as _acc_dtype
from slimgrad._math.norms import rms_norm_bwd_torch as _bwd_torch
from slimgrad._math.norms import rms_norm_fwd_torch as _fwd_torch
from slimgrad._math.tables import dynamic_size
from slimgrad.kernels import _backend
from slimgrad.ops._library import custom_op
from slimgrad.ops._output_act import check_output_seen, raise_output_written
from slimgrad.ops.layer_norm import (
    _NORM_FIX,
    HALF_DTYPES,
    GradBox,
    _OutputBridge,
    autocast_inputs,
    bridged_backward,
    ctx_box,
    grads_or_empty,
    owns_layout,
    y_written,
)

__all__ = ["HALF_DTYPES", "rms_norm"]


def _bwd_impl(t: torch.Tensor):
    # NOTE [Kernel backend choice] in slimgrad/kernels/_backend.py; use_triton(t) only where it
    # may answer True
    if not t.is_cuda and _backend._resolved[0] in _NO_TRITON:
        return _bwd_torch
    return _backend.kernels("rms_norm")._bwd_triton if _backend.use_triton(t) else _bwd_torch


_NO_TRITON = _backend.NO_TRITON_OFF_CUDA
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, type(None))
_any_autocast = torch._C._is_any_autocast_enabled
_grad_on = torch._C.is_grad_enabled
# the C++ extension's rms_norm_bwd, once it is loaded (NOTE [Backward bodies from C++])
_EXT_BWD = None
# and its RMSNorm node (NOTE [The RMSNorm node in C++])
_EXT_NODE = None


def _use_extension(mod) -> None:
    global _EXT_BWD, _EXT_NODE
    _EXT_BWD = getattr(mod, "rms_norm_bwd", None)
    if hasattr(mod, "hf_rms_norm_node"):
        mod.set_norm_fallbacks(_node_fallback, _node_double, _node_written, GradBox)
        # the node grants dy's buffer only where ownership.py's own facts hold (NOTE [dy's
        # ownership asked by the C++ node] in slimgrad/_ext/norm_node.cpp)
        mod.set_norm_grants(
            ownership.storage_facts_available() and ownership.refcount_problem() is None
        )
        _EXT_NODE = mod.hf_rms_norm_node


_ext.when_loaded(_use_extension)


@custom_op("rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # use_triton(x) only where it may answer True (NOTE [Kernel backend choice])
    if (x.is_cuda or _backend._resolved[0] not in _NO_TRITON) and _backend.use_triton(x):
        return _backend.kernels("rms_norm")._fwd_triton(x, list(normalized_shape), weight, eps)
    return _fwd_torch(x, list(normalized_shape), weight, eps)


@_rms_norm_fwd.register_fake
def _(x, normalized_shape, weight, eps):
    # NOTE [Side tables under FakeTensorMode and torch.compile] in slimgrad/_math/tables.py
    k = dynamic_size(max=math.prod(normalized_shape))
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
    impl, ns = _bwd_impl(y), list(normalized_shape)
    if output_mask[0] and dy.dtype == y.dtype and dy.shape == y.shape and not dy.is_contiguous():
        # copied into dx's buffer (the row view of dy would copy it anyway) and dx written over
        # the copy, chunk by chunk: one buffer of dy's size, not two
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        out.copy_(dy)
        dx, dw = impl(out, y, rstd, idx, xside, weight, ns, output_mask, out=out)
    else:
        dx, dw = impl(dy, y, rstd, idx, xside, weight, ns, output_mask)
    return grads_or_empty(y, dx.to(x_dtype) if dx is not None else None, dw)


@_rms_norm_bwd.register_fake
def _(dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, x_dtype):
    dx = torch.empty_like(y, dtype=x_dtype) if output_mask[0] else None
    dw = torch.empty_like(weight) if weight is not None and output_mask[1] else None
    return grads_or_empty(y, dx, dw)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, direct=False):
        # direct=_TORCH: the straight path (NOTE [One gate per call] in slimgrad/_library.py) on
        # the PyTorch forward; NOTE [An empty side table is saved as None] in ops/layer_norm.py
        ctx.normalized_shape, ctx.x_dtype, ctx.eps = normalized_shape, x.dtype, eps
        ctx.box = None  # NOTE [RMSNorm's second derivatives through its own node]
        # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
        ctx.materialize_grads = False
        if direct is _TORCH:
            comp = False  # past the gate
            y, rstd = _fused_rms_norm(x, normalized_shape, weight, eps)
            idx = fallback_or_none(weight, None, y.dtype) if weight is not None else None
            if idx is not None:
                if idx.device != x.device:
                    idx = idx.to(x.device)
                xside = side_columns(x, math.prod(normalized_shape), idx)
        else:
            y, rstd, idx, xside = _rms_norm_fwd(x, normalized_shape, weight, eps)
            k = idx.shape[0]
            # NOTE [An empty side table is saved as None]; eager only (a traced table has a
            # symbolic length)
            comp = compiling()
            if not comp and type(k) is int and k == 0:
                idx = None
        # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py (eager)
        ctx.y_seen = seen(y) if not comp and hooks_top(False) is not None else None
        if idx is None:
            # NOTE [A weight-only backward keeps no rstd]
            kept = rstd
            if not x.requires_grad and not comp and _bwd_impl(y) is _bwd_torch:
                kept = rstd.new_empty(0)
            if direct is _TORCH and CTX_FIELDS:  # NOTE [Saving through ctx's fields]
                ctx.to_save = (y, kept, None, None, weight)
                ctx.non_differentiable = (rstd,)
                return y, rstd
            ctx.save_for_backward(y, kept, None, None, weight)
            ctx.mark_non_differentiable(rstd)
            return y, rstd
        ctx.save_for_backward(y, rstd, idx, xside, weight)
        ctx.mark_non_differentiable(rstd, idx, xside)
        return y, rstd, idx, xside

    @staticmethod
    def backward(ctx, dy, *_, boxed=False):
        # first_order("ops.rms_norm", _rms_double) inline, one frame fewer (NOTE [Second
        # derivatives] in slimgrad/_autograd.py)
        if ctx.box and not boxed:  # NOTE [A second-order pass's gradient handed to its node]
            return bridged_backward(ctx, dy, _RMSNormFn.backward)
        if _grad_on():
            return _rms_double(ctx, dy)
        if dy is None:  # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
            return None, None, None, None, None
        # take(dy) in this frame, one call fewer (layer_norm's form): the first use of dy, NOTE
        # [Gradient-buffer ownership]; grant asks that the backward itself asked compiling()
        buf = dy if not compiling() and ownership.grant(dy, ownership.PROBE) else None
        try:
            y, rstd, idx, xside, weight = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, "ops.rms_norm")
            raise
        if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
            check_output_seen(ctx, y, "ops.rms_norm", "ConvertConfig(norms=False)")
        need = ctx.needs_input_grad
        mask = [need[0], need[2]]
        if (
            _EXT_BWD is not None
            and mask[0]
            and idx is None
            and weight is not None
            and y.dtype == ctx.x_dtype
            and (
                (not y.is_cuda and _backend._resolved[0] in _NO_TRITON)
                or _bwd_impl(y) is _bwd_torch
            )
        ):
            # NOTE [Backward bodies from C++] in slimgrad/_ext: rms_norm_bwd_torch's one-chunk
            # body, on dy's own buffer when it is dead (else the op's implementation, past the
            # gate); None where that body does not apply
            own = buf is not None
            r = _EXT_BWD(
                buf if own else dy,
                y,
                rstd,
                weight,
                ctx.normalized_shape,
                mask[1],
                own,
                _norms.CHUNK_ELEMS,
                not own,
            )
            if r is not None:
                return r[0], None, r[1], None, None
        # eager only (take refuses under torch.compile); dx in y's dtype must be x's dtype too;
        # a weight-only backward on the PyTorch path takes dy too (NOTE [A weight-only backward
        # sums into the dead dy] in slimgrad/_math/norms.py)
        if (  # owns_layout(buf, y), inline
            (mask[0] or (not y.is_cuda and _backend._resolved[0] in _NO_TRITON))
            and buf is not None
            and y.dtype == ctx.x_dtype
            and buf.shape == y.shape
            and buf.dtype == y.dtype
            and buf.is_contiguous()
        ):
            # _bwd_impl(y), inline where it cannot pick Triton
            if not y.is_cuda and _backend._resolved[0] in _NO_TRITON:
                impl = _bwd_torch
            else:
                impl = _bwd_impl(y)
                if idx is None:
                    idx, xside = _no_side(y, ctx.normalized_shape)
            dx, dw = impl(buf, y, rstd, idx, xside, weight, ctx.normalized_shape, mask, out=buf)
        else:
            if idx is None:  # the op's schema takes tensors
                idx, xside = _no_side(y, ctx.normalized_shape)
            dx, dw = _rms_norm_bwd(
                dy, y, rstd, idx, xside, weight, ctx.normalized_shape, mask, ctx.x_dtype
            )
        dw = dw if weight is not None and mask[1] else None
        return (dx if mask[0] else None), None, dw, None, None


# NOTE [A weight-only backward keeps no rstd]
# rstd is needed for dx (and to rebuild x where fallback channels hold x's columns); the weight's
# gradient needs xhat alone, ``y / gamma``. Where the input needs no gradient (a norm on the
# model's input: a batch of data) and no channel falls back, the Function keeps an empty tensor
# in rstd's place: eager keeps xhat there (its weight product's operand), so y + rstd was above
# it wherever the next layer does not keep y itself (float32, a Linear after a channels_last
# input copies y: saved 7,200 B against eager's 6,720 at (3, 8, 5, 7)). Only where the backward
# is PyTorch's (rms_norm_bwd_torch reads no rstd without dx; Triton's kernel reads it per row)
# and not under torch.compile; the second derivatives (weight only) take xhat for x, which the
# detached correction makes exact, x not being differentiated.
def _no_side(y: torch.Tensor, normalized_shape=None) -> tuple[torch.Tensor, torch.Tensor]:
    # the empty index table and input columns of a forward without fallback channels
    d = math.prod(normalized_shape) if normalized_shape is not None else y.shape[-1]
    return y.new_empty(0, dtype=torch.int64), y.new_empty((y.numel() // d if d else 0, 0))


# NOTE [RMSNorm's second derivatives through its own node]
# Under create_graph=True the from-output Functions (and the C++ node) compute their first
# derivatives in differentiable torch ops of x and the weight (:func:`_second_order`): x's values
# are rebuilt from what was kept, x = (y / gamma) / rstd, the fallback channels' columns copied
# from their kept input columns; rstd and xhat are eager's functions of that x (rsqrt of the mean
# of squares, x * rstd) carrying the forward's own values (rstd as kept, xhat = y / gamma), and
# dx = rstd (g - xhat mean(g xhat)), g = dy * gamma(w), dw = sum_rows(dy xhat): autograd
# differentiates them, eager's second derivatives up to the rounding of the rebuild (gradgradcheck
# in float64; a gradient penalty within the error rule, tests/test_second_derivatives.py). The
# rebuilt x reaches the real x through :class:`_OutputBridge` on y as the node saved it
# (NOTE [LayerNorm's second derivatives through its own node] in ops/layer_norm.py), whose
# backward puts its gradient in the node's box; the node's backward adds its pass's gradient from
# the box to dx (NOTE [A second-order pass's gradient handed to its node] there). y alone cannot
# carry it: y is invariant to x's scale as eps -> 0, so rstd's share has no well-conditioned path
# through y. The formula, not a reentrant ``autograd.grad`` of eager's ops: the C++ node runs its
# Python tail inside the engine, and a nested backward from there hung (the second call in a
# process). The C++ node keeps its box in a slot it saves in forward (an empty pointer until a
# double through it makes the box); its backward takes the box's entry for its pass, where there
# is a box, then runs as without one (the C++ body where it applies) and adds it to dx. First
# order costs nothing new: an attribute set in forward and read in backward (no call), and one
# atomic load in the C++ node.


def _saved_checked(ctx):
    try:
        saved = ctx.saved_tensors
    except RuntimeError as e:  # NOTE [A norm's output written after forward]
        y_written(e, ctx, "ops.rms_norm")
        raise
    if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
        check_output_seen(ctx, saved[0], "ops.rms_norm", _NORM_FIX)
    return saved


def _rebuild_rms_input(y, rstd, idx, xside, gamma, d, x_dtype):
    # (x, xhat): x's values rebuilt, x = xhat / rstd, and xhat = y / gamma as the forward made y
    # from it (the fallback columns from x itself)
    acc = _acc_dtype(y.dtype)
    n = y.numel() // max(d, 1)
    g = gamma.detach().reshape(d).to(acc) if gamma is not None else None
    xh = rebuild_xhat(y.reshape(n, d), g, None, acc)
    if rstd.numel() == 0 and n:  # NOTE [A weight-only backward keeps no rstd]: x is not needed
        return xh.to(x_dtype).reshape(y.shape), xh.reshape(y.shape)
    r = rstd.reshape(n, 1).to(acc)
    if idx is not None and idx.numel():
        xh.index_copy_(1, idx, xside.to(acc) * r)
    x = xh / r
    if idx is not None and idx.numel():
        x.index_copy_(1, idx, xside.to(acc))
    return x.to(x_dtype).reshape(y.shape), xh.reshape(y.shape)


def _second_order(dy, y, rstd, idx, xside, weight, eps, variant, need_x, need_w, box, ns, x_dtype):
    # the first derivatives in differentiable torch ops of x rebuilt from (y, rstd, the fallback
    # columns) and of the weight (NOTE [RMSNorm's second derivatives through its own node]);
    # variant None: F.rms_norm over ns (gamma = weight), else an HF variant's float32 lean case
    # (y = xhat * gamma(weight) in float32, NOTE [HF RMSNorm cast orders])
    need_w = weight is not None and need_w
    if not (need_x or need_w):
        return None, None
    gamma_of = None if variant is None or weight is None else HF_VARIANTS[variant][1]
    with torch.no_grad():
        gamma0 = gamma_of(weight.detach()) if gamma_of is not None else weight
        x, xh0 = _rebuild_rms_input(y.detach(), rstd, idx, xside, gamma0, math.prod(ns), x_dtype)
    if need_x:
        x = _OutputBridge.apply(x, y, box)
    dims = tuple(range(-len(ns), 0))
    with torch.enable_grad():
        # eager's rstd and xhat as functions of x (F.rms_norm's eps=None: the dtype's eps), with
        # the forward's own values (rstd kept, xhat = y / gamma): the rebuild's rounding enters
        # the derivatives of the first derivatives only
        e = torch.finfo(x.dtype).eps if eps is None else eps
        r = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + e)
        xh = x * r
        if rstd.numel() or not r.numel():  # NOTE [A weight-only backward keeps no rstd]
            r = r + (rstd.to(r.dtype) - r).detach()
        xh = xh + (xh0.to(xh.dtype) - xh).detach()
        gamma = weight if gamma_of is None else gamma_of(weight)
        g = dy if gamma is None else dy * gamma
        dx = r * (g - xh * (g * xh).mean(dims, keepdim=True)) if need_x else None
        dw = None
        if need_w:
            dw = (dy * xh).reshape(-1, *weight.shape).sum(0)
            if dw.dtype != weight.dtype:
                dw = dw.to(weight.dtype)
    if dx is not None and dx.dtype != x_dtype:
        dx = dx.to(x_dtype)
    return dx, dw


def _double(ctx, dy, variant, w_at, shape, x_dtype):
    # the first derivative under create_graph from what either Function kept (NOTE [RMSNorm's
    # second derivatives through its own node]); w_at: the weight's place in needs_input_grad;
    # shape None: the last dimension of y
    y, rstd, idx, xside, weight = _saved_checked(ctx)
    need = ctx.needs_input_grad
    shape = [y.shape[-1]] if shape is None else shape
    return _second_order(
        dy,
        y,
        rstd,
        idx,
        xside,
        weight,
        ctx.eps,
        variant,
        need[0],
        need[w_at],
        ctx_box(ctx),
        shape,
        x_dtype,
    )


def _rms_double(ctx, dy):
    # _RMSNormFn's backward under create_graph
    if dy is None:  # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
        return None, None, None, None, None
    dx, dw = _double(ctx, dy, None, 2, ctx.normalized_shape, ctx.x_dtype)
    return dx, None, dw, None, None


def _hf_double(ctx, dy):
    # _HFRMSNormFromOutputFn's backward under create_graph
    if dy is None:  # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
        return None, None, None, None, None
    dx, dw = _double(ctx, dy, ctx.variant, 1, None, torch.float32)
    return dx, dw, None, None, None


_TORCH = object()  # _RMSNormFn's ``direct`` for the straight path's PyTorch forward
_fused_rms_norm = getattr(torch, "_fused_rms_norm", None) or (
    lambda *a: torch.ops.aten._fused_rms_norm(*a)
)
_RMS_APPLY = direct_apply(_RMSNormFn)


def _rms_norm_straight(input, normalized_shape, weight, eps) -> torch.Tensor:
    # rms_norm past the gate and eager's shape checks: no transform, trace, compile, mode or
    # autocast; plain float32/float64 tensors
    if type(weight) is not torch.nn.Parameter and weight is not None:
        weight = unwrap_if_dead(weight)
    x = unwrap_if_dead(input)
    # the PyTorch forward where use_triton cannot answer True (NOTE [Kernel backend choice])
    backend = _backend._resolved[0] or _backend.get_backend()
    direct = _TORCH if not x.is_cuda and backend in _NO_TRITON else False
    return _RMS_APPLY(x, normalized_shape, weight, eps, direct)[0]


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
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        ctx.materialize_grads = False  # NOTE [Norm backward without materialized gradients]
        ctx.save_for_backward(x, rstd, weight)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    @first_order("ops.rms_norm", double=lambda ctx, dy, *_: _from_input_double(ctx, dy))
    def backward(ctx, dy, *_):
        if dy is None:  # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
            return None, None, None, None
        buf = ownership.take(dy)  # first use of dy: NOTE [Gradient-buffer ownership]
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
        if mask[0] and owns_layout(buf, x):  # eager only (take refuses under torch.compile)
            dx, dw = _bwd_from_input(buf, x, rstd, weight, ctx.normalized_shape, mask, out=buf)
        else:
            dx, dw = _rms_norm_bwd_from_input(dy, x, rstd, weight, ctx.normalized_shape, mask)
        return (dx if mask[0] else None, None, dw if weight is not None and mask[1] else None, None)


def _from_input_double(ctx, dy):
    # x is kept: differentiate eager's F.rms_norm from it (eager's second derivatives)
    if dy is None:  # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
        return None, None, None, None
    x, _, weight = ctx.saved_tensors
    need = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
    with torch.enable_grad():
        xr = x.view_as(x) if x.requires_grad else x.detach().requires_grad_(need[0])
        wr = weight
        if weight is not None and not weight.requires_grad:
            wr = weight.detach().requires_grad_(need[1])
        y = F.rms_norm(xr, ctx.normalized_shape, wr, ctx.eps)
        leaves = [t for t, n in zip((xr, wr), need, strict=True) if n]
        grads = iter(torch.autograd.grad(y, leaves, dy, create_graph=True))
    return (next(grads) if need[0] else None), None, (next(grads) if need[1] else None), None


def _check_shapes(x, normalized_shape, weight):
    # eager's checks, eager's exception types (RuntimeError; ValueError for too few dims)
    ns = list(normalized_shape)
    if not ns:
        raise RuntimeError(
            "slimgrad.ops.rms_norm: normalized_shape is empty; expected at least one dimension, "
            "got []. Pass the trailing shape to normalize over, e.g. (x.shape[-1],)."
        )
    if x.dim() < len(ns):
        raise ValueError(
            f"slimgrad.ops.rms_norm: input has too few dimensions; expected at least {len(ns)}, "
            f"got {x.dim()}. Pass an input of shape (*, *normalized_shape)."
        )
    if list(x.shape[x.dim() - len(ns) :]) != ns:
        raise RuntimeError(
            f"slimgrad.ops.rms_norm: input's trailing shape does not match normalized_shape; "
            f"expected input of shape [*, {', '.join(map(str, ns))}], got {list(x.shape)}. "
            "Pass normalized_shape=input.shape[-k:]."
        )
    if weight is not None and list(weight.shape) != ns:
        raise RuntimeError(
            f"slimgrad.ops.rms_norm: weight's shape does not match normalized_shape; expected "
            f"{ns}, got {list(weight.shape)}. Pass a weight of shape normalized_shape."
        )


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

    Raises:
        RuntimeError: ``normalized_shape`` empty or not the input's trailing shape, or a weight of
            another shape (as eager); ValueError: fewer input dims than ``normalized_shape``.

    Example:
        >>> y = rms_norm(torch.randn(4, 8, requires_grad=True), (8,))
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if (  # the straight path: NOTE [One gate per call] in slimgrad/_library.py
        type(input) in _PLAIN
        and type(weight) in _PLAIN_OR_NONE
        and input.dtype not in HALF_DTYPES
        and not input.is_meta
        and not _any_autocast()
        and straight()
    ):
        normalized_shape = [int(s) for s in normalized_shape]
        _check_shapes(input, normalized_shape, weight)
        return _rms_norm_straight(
            input, normalized_shape, weight, None if eps is None else float(eps)
        )
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input, weight):
        return _dtensor.rowwise(
            "slimgrad.ops.rms_norm",
            rms_norm,
            input,
            {"weight": weight},
            len(normalized_shape),
            normalized_shape=normalized_shape,
            eps=eps,
        )
    normalized_shape = [int(s) for s in normalized_shape]
    eps = None if eps is None else float(eps)
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta:
        return F.rms_norm(input, normalized_shape, weight, eps)
    _check_shapes(input, normalized_shape, weight)
    if torch.is_grad_enabled() and (
        input.requires_grad or (weight is not None and weight.requires_grad)
    ):
        refuse_jit("ops.rms_norm")
    dev = input.device.type
    if torch.is_autocast_enabled(dev):
        probe = F.rms_norm(input.new_empty((0, *normalized_shape)), normalized_shape)
        if probe.dtype != input.dtype:
            input, weight = autocast_inputs(probe.dtype, input, weight)
        with torch.autocast(dev, enabled=False):
            return _apply(input, normalized_shape, weight, eps)
    return _apply(input, normalized_shape, weight, eps)


# ---------------------------------------------------------------------------------------------
# HF RMSNorms: HF's own cast order (NOTE [HF RMSNorm cast orders])


def _norm_rsqrt(h, eps):
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * r, r


def _norm_pow(h, eps):  # Gemma3n-style ``_norm``: torch.pow(mean(x^2) + eps, -0.5)
    r = torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return h * r, r


def _hf_llama(x, w, eps):
    # _norm_rsqrt inline; the casts only where they are not the tensor itself (a float32 x)
    f32 = x.dtype == torch.float32
    h = x if f32 else x.to(torch.float32)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    n = h * r
    return w * (n if f32 else n.to(x.dtype)), r


def _hf_scale_then_cast(x, w, eps):
    n, r = _norm_rsqrt(x.to(torch.float32), eps)
    return (w * n).to(x.dtype), r


def _hf_fp32_scale_then_cast(x, w, eps):
    n, r = _norm_rsqrt(x.to(torch.float32), eps)
    return (w.to(torch.float32) * n).to(x.dtype), r


def _hf_t5(x, w, eps):
    r = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    h = x * r
    if w.dtype in HALF_DTYPES:
        h = h.to(w.dtype)
    return w * h, r


def _hf_gemma(x, w, eps, norm=_norm_rsqrt):
    n, r = norm(x.float(), eps)
    return (n * (1.0 + w.float())).type_as(x), r


def _hf_centered(x, w, eps):  # (1.0 + weight) in the weight's dtype, then float
    n, r = _norm_rsqrt(x.float(), eps)
    return (n * (1.0 + w).float()).type_as(x), r


def _hf_float_scale(x, w, eps, norm=_norm_rsqrt):  # Moshi; Gemma3n with_scale (norm=_norm_pow)
    n, r = norm(x.float(), eps)
    if w is not None:
        n = n * w.float()
    return n.type_as(x), r


def _hf_cast_then_scale(x, w, eps):  # Llama4
    n, r = _norm_rsqrt(x.float(), eps)
    return n.type_as(x) * w, r


def _hf_unweighted(x, w, eps):
    n, r = _norm_rsqrt(x.float(), eps)
    return n.type_as(x), r


def _float(w):
    return w.float()


# {variant: (forward(x, weight, eps) -> (y, rstd), gamma(weight) -> the float32 scale y = xhat *
# gamma of a float32 input, or None: no weight)}
HF_VARIANTS = {
    "llama": (_hf_llama, _float),
    "scale_then_cast": (_hf_scale_then_cast, _float),
    "fp32_scale_then_cast": (_hf_fp32_scale_then_cast, _float),
    "t5": (_hf_t5, _float),
    "gemma": (_hf_gemma, lambda w: 1.0 + w.float()),
    "centered": (_hf_centered, lambda w: (1.0 + w).float()),
    "float_scale": (_hf_float_scale, _float),
    "float_scale_pow": (lambda x, w, eps: _hf_float_scale(x, w, eps, _norm_pow), _float),
    "cast_then_scale": (_hf_cast_then_scale, _float),
    "unweighted": (_hf_unweighted, None),
}


def _autocast_state(dev: str):
    return torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


@custom_op("hf_rms_norm_side", mutates_args=())
def _hf_side(
    x: torch.Tensor, gamma: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # the fallback channels of y = xhat * gamma and x's columns there (a custom op: tracers see a
    # table of data-dependent length, NOTE [Side tables under FakeTensorMode and torch.compile])
    d = x.shape[-1]
    if type(gamma) in _PLAIN and type(x) in _PLAIN:
        # real plain tensors (the op's implementation never sees a fake one): the cache's lean
        # lookup, None where no channel falls back (NOTE [Fallback channels, once per weight
        # version]): then no gather, the empty table made directly (the same values)
        idx = fallback_or_none(gamma, None, out_dtype)
        if idx is None:
            return (
                torch.empty(0, dtype=torch.int64, device=x.device),
                x.new_empty((x.numel() // d if d else 0, 0)),
            )
    else:
        idx = fallback_channels(gamma, None, out_dtype)
    if idx.device != x.device:
        idx = idx.to(x.device)
    return idx, x.reshape(-1, d).index_select(1, idx)


@_hf_side.register_fake
def _(x, gamma, out_dtype):
    d = x.shape[-1]
    k = dynamic_size(max=d)
    return x.new_empty((k,), dtype=torch.int64), x.new_empty((x.numel() // max(d, 1), k))


class _HFRMSNormFromOutputFn(torch.autograd.Function):
    # float32 input and output: y = xhat * gamma, rebuilt from y (as _RMSNormFn)
    @staticmethod
    def forward(ctx, x, weight, eps, variant, direct=False):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py)
        fwd, gamma_of = HF_VARIANTS[variant]
        if direct and fwd is _hf_llama and weight is not None:
            # _hf_llama inline for the gate's float32 input (its casts are x itself): its ops
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            y = weight * (x * rstd)
        else:
            y, rstd = fwd(x, weight, eps)
        # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py (eager;
        # ``direct``: past the gate)
        ctx.y_seen = (
            seen(y) if (direct or not compiling()) and hooks_top(False) is not None else None
        )
        ctx.variant, ctx.eps = variant, eps
        ctx.box = None  # NOTE [RMSNorm's second derivatives through its own node]
        # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
        ctx.materialize_grads = False
        if direct and weight is not None:
            # the fallback channels once per weight version (None: there is none)
            idx = fallback_or_none(weight, None, y.dtype, _SCALE_CHANNELS[variant])
            if idx is not None:
                if idx.device != x.device:
                    idx = idx.to(x.device)
                xside = x.reshape(-1, x.shape[-1]).index_select(1, idx)
        else:
            gamma = gamma_of(weight) if weight is not None else None
            idx, xside = (_hf_side.impl if direct else _hf_side)(x, gamma, y.dtype)
            k = idx.shape[0]
            # eager only (a traced table has a symbolic length)
            if not compiling() and type(k) is int and k == 0:
                idx = None
        if idx is None:  # NOTE [An empty side table is saved as None] in ops/layer_norm.py
            if direct and CTX_FIELDS:  # NOTE [Saving through ctx's fields]
                ctx.to_save = (y, rstd, None, None, weight)
                return (y,)
            ctx.save_for_backward(y, rstd, None, None, weight)
            return (y,)
        ctx.save_for_backward(y, rstd, idx, xside, weight)
        # the table is returned too: a traced forward must return every tensor of data-dependent
        # size it creates (torch.compile's unbacked sizes)
        ctx.mark_non_differentiable(idx, xside)
        return y, idx, xside

    @staticmethod
    def backward(ctx, dy, *_, boxed=False):
        # first_order("ops.rms_norm", _hf_double) inline, one frame fewer (NOTE [Second
        # derivatives] in slimgrad/_autograd.py)
        if ctx.box and not boxed:  # NOTE [A second-order pass's gradient handed to its node]
            return bridged_backward(ctx, dy, _HFRMSNormFromOutputFn.backward)
        if _grad_on():
            return _hf_double(ctx, dy)
        if dy is None:  # NOTE [Norm backward without materialized gradients] in ops/layer_norm.py
            return None, None, None, None, None
        # take(dy) in this frame, one call fewer (layer_norm's form): the first use of dy, NOTE
        # [Gradient-buffer ownership]; grant asks that the backward itself asked compiling()
        buf = dy if not compiling() and ownership.grant(dy, ownership.PROBE) else None
        try:
            y, rstd, idx, xside, weight = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, "ops.rms_norm")
            raise
        if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
            check_output_seen(ctx, y, "ops.rms_norm", "ConvertConfig(norms=False)")
        need = ctx.needs_input_grad
        dx, dw = _from_output_bwd(
            dy, buf, y, rstd, idx, xside, weight, ctx.variant, need[0], need[1]
        )
        return dx, dw, None, None, None


def _from_output_bwd(dy, buf, y, rstd, idx, xside, weight, variant, need_x, need_w):
    # _HFRMSNormFromOutputFn's backward past the ownership question (buf: dy, granted, or None),
    # and the C++ node's Python tail (NOTE [The RMSNorm node in C++]): (dx or None, dw or None)
    need_w = weight is not None and need_w
    mask = [need_x, need_w]
    gamma = None
    if weight is not None:
        gamma_of = HF_VARIANTS[variant][1]
        # a float32 weight's w.float() is w itself (no grad mode in backward)
        if gamma_of is _float and weight.dtype == torch.float32:
            gamma = weight
        else:
            gamma = gamma_of(weight.detach())
    if (
        _EXT_BWD is not None
        and mask[0]
        and idx is None
        and gamma is not None
        and ((not y.is_cuda and _backend._resolved[0] in _NO_TRITON) or _bwd_impl(y) is _bwd_torch)
    ):
        # NOTE [Backward bodies from C++] in slimgrad/_ext: rms_norm_bwd_torch's one-chunk
        # body, on dy's own buffer when it is dead (else _rms_norm_bwd's implementation, past
        # the gate); None where that body does not apply
        own = buf is not None
        r = _EXT_BWD(
            buf if own else dy,
            y,
            rstd,
            gamma,
            y.shape[-1],
            need_w,
            own,
            _norms.CHUNK_ELEMS,
            not own,
        )
        if r is not None:
            dg = r[1]
            if need_w and dg.dtype != weight.dtype:
                dg = dg.to(weight.dtype)
            return r[0], dg
    ns = [y.shape[-1]]
    if (  # owns_layout(buf, y), inline; eager only (take refuses under torch.compile)
        mask[0]
        and buf is not None
        and buf.shape == y.shape
        and buf.dtype == y.dtype
        and buf.is_contiguous()
    ):
        # _bwd_impl(y), inline where it cannot pick Triton
        if not y.is_cuda and _backend._resolved[0] in _NO_TRITON:
            impl = _bwd_torch
        else:
            impl = _bwd_impl(y)
            if idx is None:
                idx, xside = _no_side(y)
        dx, dg = impl(buf, y, rstd, idx, xside, gamma, ns, mask, out=buf)
    else:  # the custom op (its table has a data-dependent length under tracers), or its
        # implementation past the gate (NOTE [One gate per call] in slimgrad/_library.py)
        if idx is None:  # the op's schema takes tensors
            idx, xside = _no_side(y)
        dx, dg = (_rms_norm_bwd.impl if straight() else _rms_norm_bwd)(
            dy, y, rstd, idx, xside, gamma, ns, mask, y.dtype
        )
    # through gamma(weight) (HF_VARIANTS: w.float(), 1.0 + w.float() or (1 + w).float()):
    # autograd's backward of each is the cast of dg to the weight's dtype, exactly
    dw = None
    if need_w:
        dw = dg if dg.dtype == weight.dtype else dg.to(weight.dtype)
    return (dx if mask[0] else None), dw


#: {variant: what fallback_or_none takes as gamma_of}: None where gamma(w) = w.float() has w's
#: fallback channels (found in float32 from w itself, _find_fallback_channels)
_SCALE_CHANNELS = {v: (None if g is _float else g) for v, (_, g) in HF_VARIANTS.items()}


_HF_RMS_APPLY = direct_apply(_HFRMSNormFromOutputFn)


# NOTE [The RMSNorm node in C++]
# A Python autograd Function's call costs host time inside a model whatever its body (cold
# instruction caches along torch's Python-Function path; issue 32). The Llama RMSNorm's
# from-output path, the common case of a converted Llama-family model on CPU, is therefore a C++
# autograd node (``slimgrad/_ext/norm_node.cpp``, a ``torch::autograd::Function``): its forward
# issues _HFRMSNormFromOutputFn's straight Llama ops (pow, mean, add, rsqrt, mul, mul) and saves
# what that Function saves (y, rstd, the weight: the same SavedVariables, so saved-tensor hooks
# and checkpointing see the same tensors), and its backward issues rms_norm_bwd_torch's one-chunk
# body (NOTE [Backward bodies from C++] in slimgrad/_ext), writing dx over dy where the node
# proves dy dead from its TensorImpl's and storage's counts (NOTE [dy's ownership asked by the
# C++ node] there; each grant counts in ``ownership.reuse_count("grad")``): the same bits and
# buffers. ``_hf_node`` takes it on hf_rms_norm's straight path (nothing watching, no compile)
# for the "llama" variant with a float32 weight without fallback channels and the PyTorch
# backward (no Triton); the node's entry also asks for plain tensors (Tensor or Parameter), no
# forward-mode tangent and a one-chunk backward. Everything else applies the Python Function. In
# backward, where the C++ body does not run (a watcher entered since forward, a body whose case
# fails, no dx needed) the node calls ``_node_fallback``: _HFRMSNormFromOutputFn's backward past
# the ownership question, with the node's answer; under create_graph, ``_node_double``: that
# Function's double (NOTE [RMSNorm's second derivatives through its own node]). The memory
# tracker and the fake-tensor estimate run under a dispatch mode, so they see the Python
# Function, whose saved set is the node's.


def _hf_node(x, weight, eps):
    # y through the C++ node, or None (NOTE [The RMSNorm node in C++]); x and weight past
    # hf_rms_norm's straight gate, unwrapped
    node = _EXT_NODE
    if (
        node is None
        or weight is None
        or weight.dtype != torch.float32
        or x.is_cuda
        or (_backend._resolved[0] or _backend.get_backend()) not in _NO_TRITON
        or fallback_or_none(weight, None, torch.float32) is not None
    ):
        return None
    return node(x, weight, eps, _norms.CHUNK_ELEMS)


def _node_fallback(dy, y, rstd, weight, own, need_x, need_w):
    # the node's backward in Python (NOTE [The RMSNorm node in C++]); own: the node's grant
    return _from_output_bwd(
        dy, dy if own else None, y, rstd, None, None, weight, "llama", need_x, need_w
    )


def _node_written(message: str) -> None:
    # autograd's error from the node's saved tensors (NOTE [A norm's output written after
    # forward] in ops/layer_norm.py): slimgrad's where the node's output y was written; else
    # returns and the node re-raises autograd's
    if "output 0 of torch::autograd::CppNode<" in message and "HFRMSNormNode>," in message:
        raise_output_written(
            RuntimeError(message), "ops.rms_norm", fix="ConvertConfig(norms=False)"
        )


def _node_double(dy, y, rstd, weight, eps, need_x, need_w, box):
    # create_graph through the node: _HFRMSNormFromOutputFn's double, its bridge on the node's box
    # (NOTE [RMSNorm's second derivatives through its own node])
    return _second_order(
        dy,
        y,
        rstd,
        None,
        None,
        weight,
        eps,
        "llama",
        need_x,
        need_w,
        box,
        [y.shape[-1]],
        torch.float32,
    )


# NOTE [RMSNorm's backward traced under torch.compile]
# Compiled, a converted HF RMSNorm is HF's own ops inside a non-reentrant
# ``torch.utils.checkpoint`` (:func:`_hf_rms_norm_checkpointed`): forward and backward are compiled
# eager's, and the checkpoint only tells inductor's min-cut partitioner what to keep. Under
# torch.compile what a Function saves is no constraint (NOTE [slimgrad ops under torch.compile] in
# slimgrad/_compile.py); the partitioner keeps what the joint graph's backward reads and cannot
# recompute. HF's ops alone (compiled eager) keep x for the norm's backward *and* y: y feeds the
# next linears, whose weight gradient (an mm) reads it in backward, and the partitioner never
# recomputes a value an op outside a fusion reads there ("materialized in backward"). So compiled
# eager keeps x, y and rstd per norm (tiny HF Llama: 163,840 B more than the converted model,
# 5 norms x 128 rows x 64 x 4 B). Inside a checkpoint every op is tagged "recompute": the
# partitioner keeps the checkpoint's input x alone and makes rstd and y again in backward, for
# the norm's backward and the linears' (inductor fuses them with their consumers). Kept: x (4
# B/elt) where the uncompiled converted model keeps y + rstd + the fallback channels' columns
# (NOTE [HF RMSNorm cast orders]): the same N x D floats, less rstd
# (``tests/test_compile_rms_norm.py``, ``tests/test_compile_saved.py``).
#
# The backward is HF's own ops differentiated by autograd from x, so no channel needs anything
# else: a weight with zeros, subnormals or 1e-42 gets eager's gradient, with no data-dependent
# table, side op or guard on the weight's values. The compiled path before this one traced
# ``_HFRMSNormFromOutputFn``'s from-output backward with the fallback table, of data-dependent
# length, from the ``hf_rms_norm_side`` custom op: a custom-op call per norm per step (tiny HF
# Llama: 5 of its 8) and index kernels around inductor's fused row sums; same-process interleaved
# CPU time at 1 thread (load ~20 on 2 cores, 300 pairs): 1.27x compiled eager's step, this path
# 1.17x (HF's ops left unconverted: 1.15x, keeping x, y and rstd). A guard on the weight's fallback
# channels instead (branch cllama27) asked the weight seen while tracing, not the one a later call
# receives: a second model's zero weight reused the first one's graph (NaN gradients,
# ``tests/test_compile_rms_norm_zero_weights.py``). Here nothing depends on the weight's values,
# so no guard is needed and no weight recompiles. What that path taught LayerNorm's traced backward
# (NOTE [LayerNorm's backward traced under torch.compile] in ops/layer_norm.py): a tensor made
# from saved tensors alone and of fixed size would be kept by the partitioner, N x D, instead of
# the table, so each patch there stays inside a product with dy.


def _hf_forward_y(x, weight, eps, variant):
    return HF_VARIANTS[variant][0](x, weight, eps)[0]


def _hf_rms_norm_checkpointed(x, weight, eps, variant):
    # NOTE [RMSNorm's backward traced under torch.compile]; no RNG inside, so none is restored
    return recompute_in_backward(_hf_forward_y, x, weight, eps, variant)


def _hf_recompute(ctx, dy, create_graph):
    x, weight = ctx.saved_tensors
    need = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
    enabled, dtype = ctx.autocast
    with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
        if create_graph:  # differentiable in x and weight themselves: eager's 2nd derivatives
            xr = x.view_as(x) if x.requires_grad else x.detach().requires_grad_(need[0])
            wr = weight if weight is None or weight.requires_grad else weight.detach()
        else:
            xr = x.detach().requires_grad_(need[0])
            wr = weight.detach().requires_grad_(need[1]) if weight is not None else None
        y, _ = HF_VARIANTS[ctx.variant][0](xr, wr, ctx.eps)
        leaves = [t for t, n in zip((xr, wr), need, strict=True) if n]
        grads = iter(torch.autograd.grad(y, leaves, dy, create_graph=create_graph))
    return (next(grads) if need[0] else None), (next(grads) if need[1] else None), None, None


class _HFRMSNormRecomputeFn(torch.autograd.Function):
    # every other dtype: keeps x, recomputes HF's forward in backward (eager's gradient bits)
    @staticmethod
    def forward(ctx, x, weight, eps, variant):
        y, _ = HF_VARIANTS[variant][0](x, weight, eps)
        ctx.variant, ctx.eps = variant, eps
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    @first_order("ops.rms_norm", double=lambda ctx, dy: _hf_recompute(ctx, dy, True))
    def backward(ctx, dy):
        return _hf_recompute(ctx, dy, False)


# NOTE [What a compiled HF RMSNorm reads]
# Dynamo guards every global, module attribute and function code object that the code it traces
# reads, and every compiled call checks all of them: host time per call that grows with their number
# (after a training step the guard tree's objects are out of cache). So while Dynamo traces,
# ``hf_rms_norm`` first asks :func:`_hf_rms_norm_compiling` whether its lean case holds, on facts
# the trace sees as constants (the tensors' types, dtypes, shapes and requires_grad, which the
# tensors' own guards already hold, the variant, grad mode, torch.func transforms), and runs
# :func:`_hf_rms_norm_checkpointed` at once (NOTE [RMSNorm's backward traced under torch.compile]).
# Everything else (DTensor, other dtypes, no grad) takes the general path below. What the trace
# does not read: the straight path's gate, ``_dtensor``'s registry, ``refuse_jit`` (no TorchScript
# trace runs inside a Dynamo trace), any slimgrad custom op or weight-dependent table
# (``tests/test_compile_rms_norm_guards.py``).


def _hf_rms_norm_compiling(input, weight, eps, variant):
    # hf_rms_norm's lean case while Dynamo traces (NOTE [What a compiled HF RMSNorm reads]), or
    # None: the general path decides
    if (
        type(input) in _PLAIN
        and type(weight) in _PLAIN_OR_NONE
        and input.dtype == torch.float32
        and input.numel() > 0
        and variant in HF_VARIANTS
        and (
            weight is None
            or (
                weight.shape == input.shape[-1:]
                and weight.dtype != torch.float64
                and not (variant == "t5" and weight.dtype in HALF_DTYPES)
            )
        )
        and (input.requires_grad or (weight is not None and weight.requires_grad))
        and _grad_on()
        and not transforms_active()
    ):
        return _hf_rms_norm_checkpointed(input, weight, float(eps), variant)
    return None


def hf_rms_norm(
    input: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str = "llama"
) -> torch.Tensor:
    """An HF RMSNorm's forward, bit for bit, keeping less for backward.

    ``variant`` names HF's code (``HF_VARIANTS``; NOTE [HF RMSNorm cast orders]), e.g. ``"llama"``:
    ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``; ``"gemma"``:
    ``(xhat * (1.0 + weight.float())).type_as(x)``; ``"t5"``: T5LayerNorm's.

    Memory: float32 input and output: saves y (shared with the next layer) + rstd (4 B/row) + the
    input columns of channels whose scale is 0 or subnormal; every other dtype: saves x (2 B/elt in
    bf16/fp16), and backward recomputes HF's forward (eager's gradient bits). Eager saves a
    float32 copy of x and the normalized tensor (bf16: 4 + 2 B/elt; fp32: 8 B/elt) + 4 B/row.

    Args:
        input: ``(*, D)``.
        weight: ``(D,)`` or None (variant ``"unweighted"``, or Gemma3n's ``with_scale=False``).
        eps: added to mean(x^2), as HF adds it.
        variant: a key of ``HF_VARIANTS``.

    Returns:
        HF's output (its dtype: HF's promotion, e.g. bf16 x with fp32 weights gives fp32 for
        ``"llama"``).

    Example:
        >>> y = hf_rms_norm(torch.randn(4, 8, requires_grad=True), torch.ones(8), 1e-6)
    """
    if compiling():  # a constant to Dynamo (NOTE [What a compiled HF RMSNorm reads])
        y = _hf_rms_norm_compiling(input, weight, eps, variant)
        if y is not None:
            return y
    if (  # the straight path of the lean case below: NOTE [One gate per call]
        type(input) in _PLAIN
        and type(weight) in _PLAIN_OR_NONE
        and input.dtype == torch.float32
        and input.shape
        and 0 not in input.shape
        and variant in HF_VARIANTS
        and (
            weight is None
            or (
                weight.shape == input.shape[-1:]
                and weight.dtype != torch.float64
                and not (variant == "t5" and weight.dtype in HALF_DTYPES)
            )
        )
        and (input.requires_grad or (weight is not None and weight.requires_grad))
        and not input.is_meta
        and _grad_on()
        and straight()
    ):
        if type(weight) is not torch.nn.Parameter and weight is not None:
            weight = unwrap_if_dead(weight)
        x = unwrap_if_dead(input)
        if variant == "llama":  # NOTE [The RMSNorm node in C++]
            y = _hf_node(x, weight, float(eps))
            if y is not None:
                return y
        return _HF_RMS_APPLY(x, weight, float(eps), variant, True)[0]
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input, weight):
        return _dtensor.rowwise(
            "slimgrad.ops.hf_rms_norm",
            hf_rms_norm,
            input,
            {"weight": weight},
            1,
            eps=eps,
            variant=variant,
        )
    if variant not in HF_VARIANTS:
        raise ValueError(
            f"slimgrad.ops.rms_norm.hf_rms_norm: unknown variant; expected one of "
            f"{sorted(HF_VARIANTS)}, got {variant!r}. Pass a key of HF_VARIANTS."
        )
    grads = input.requires_grad or (weight is not None and weight.requires_grad)
    d = input.shape[-1] if input.dim() else 0
    # y = xhat * gamma(weight) in float32 (NOTE [HF RMSNorm cast orders])
    lean = (
        input.dtype == torch.float32
        and input.numel() > 0
        and (weight is None or (weight.shape == (d,) and weight.dtype != torch.float64))
        and not (variant == "t5" and weight is not None and weight.dtype in HALF_DTYPES)
    )
    if (
        not (torch.is_grad_enabled() and grads)
        or transforms_active()
        or input.is_meta  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
        # the recompute path calls autograd.grad in backward, which Dynamo cannot trace
        or (torch.compiler.is_compiling() and not lean)
    ):
        return HF_VARIANTS[variant][0](input, weight, eps)[0]
    refuse_jit("ops.rms_norm.hf_rms_norm")
    if lean:
        if torch.compiler.is_compiling():  # NOTE [RMSNorm's backward traced under torch.compile]
            return _hf_rms_norm_checkpointed(input, weight, float(eps), variant)
        return _HFRMSNormFromOutputFn.apply(input, weight, float(eps), variant)[0]
    return _HFRMSNormRecomputeFn.apply(input, weight, float(eps), variant)

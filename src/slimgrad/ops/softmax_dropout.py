"""Attention's ``softmax -> dropout -> matmul with V``, keeping softmax's output and mask bits only.

Math: ``P = softmax(S, dim)``, ``D = dropout(P, p)`` (``D = P * m / (1 - p)``), ``O = D @ V``;
``causal=True`` first sets ``S[..., i, j] = -inf`` for ``j > i`` (as ``S.masked_fill(~tril, -inf)``,
inside the op: no masked copy of S and no masked_fill backward pass over dS, whose masked entries
are ``P * (...) = 0`` already).
Backward: ``dV = D^T dO`` with D rebuilt from P and the bits (bit-identical to the forward's D, see
NOTE [Dropout masks: drawn like eager, kept as bits] in ``ops/dropout.py``), ``dD = dO V^T``, ``dP =
dD * m / (1 - p)``, ``dS = P * (dP - sum(dP * P, dim))`` (``torch._softmax_backward_data``, as
eager).

``scores_softmax_dropout_matmul(q, k_t, V)`` is the same with ``S = q @ k_t`` inside: it keeps q,
k_t (which S's matmul keeps anyway), V and the bits, and recomputes S and P in backward (NOTE
[Attention probabilities recomputed in backward]); HF's attention uses it (NOTE [SDPA's math path
in half precision and under autocast] in ``convert_handlers/hf_attention.py``).

``eager_attention(q, k, V, p, scaling=..., softcap=..., biases=..., softmax_dtype=...,
probs_dtype=...)`` is HF's eager attention (scale, softcap, additive biases, softmax in a given
dtype, cast back, dropout, ``@ V``) keeping q, k, V, the biases (by reference) and the bits, and
running the same ops again in backward (NOTE [HF eager attention, recomputed in backward]).

Memory: saves P (4 B/elt fp32 of S) + the mask bits (1/8 B/elt) + V; eager saves P (softmax), the
float mask (4 B/elt on CPU, 1 B/elt bool on CUDA), the dropped D (4 B/elt, the bmm input) and V. P
plays the part of D in the tracker's floor (``_slimgrad_floor``): saved - floor = 1/8 B/elt of S.
Backward holds P + one S-sized buffer: dS is written into the dP temporary (the CPU softmax
kernels read each row before writing it, so ``_softmax_backward_data(dP, P, out=dP)`` is the
out-of-place result bit for bit; tested). When ``slimgrad.ownership.take_saved`` proves P dead
(NOTE [Gradient-buffer ownership]) the dropped D for dV is rebuilt in P's own buffer after dS is
done, instead of in a fresh S-sized one (bitwise the same D); then a second backward raises a
clear error (``retain_graph=True`` keeps P intact: no reuse).
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from slimgrad import _dtensor, ownership
from slimgrad._autograd import (
    CTX_FIELDS,
    autocast_free,
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    refuse_second_order,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._library import custom_op, straight
from slimgrad.ops.dropout import _check_p

# the module (the package attribute slimgrad.ops.dropout is the function)
_dropout = importlib.import_module("slimgrad.ops.dropout")

__all__ = ["eager_attention", "scores_softmax_dropout_matmul", "softmax_dropout_matmul"]

_API = "slimgrad.ops.softmax_dropout_matmul"
_grad_on = torch._C.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_API_QK = "slimgrad.ops.scores_softmax_dropout_matmul"
_QK_OP = "ops.scores_softmax_dropout_matmul"
_Tensor = torch.Tensor
_dispatch_stack_len = torch._C._len_torch_dispatch_stack


# NOTE [Attention matmuls as bmm]
# torch.matmul(a, b) on operands with the same batch dims (>= 3 dims each) expands both to the
# common batch shape (a view op each, no-ops here), reshapes them to (batch, m, n) (a view, or a
# contiguous copy where the batch dims do not fold) and runs one bmm. _matmul runs the same
# reshapes and the same bmm, without the two expands: the same operands with the same strides
# for the same kernel, so the same bits; two dispatcher calls fewer per product (six products per
# attention layer and step). Other shapes (broadcast batch dims, fewer dims) go to torch.matmul.
# For 4-D operands the product is a view of bmm's 3-D result, where torch.matmul returns an
# _unsafe_view (not a view): a Function that returns it detaches it first (NOTE [Function outputs
# are not views] in ops/linear.py), or an in-place write on the attention output would raise.
# HF's straight path (NOTE [HF attention's straight path] in convert_handlers/hf_attention.py)
# folds its fresh q * root and k^T * root and its contiguous v to (B·H, T, d) before the scores
# op, with the same reshapes (autograd records them), and passes ``bmm=True``: the op saves the
# folded operands (a copy where q or k^T does not fold, as torch.matmul's bmm saves it; the
# 4-D product it was folded from is freed, so the same bytes) and each of its seven products is
# one torch.bmm call, with no reshape of q and k^T again in backward. Backward's dq and dk take
# k^T and q transposed, as eager's bmm backward does.


def _matmul(a, b):
    nd = a.ndim
    if nd != b.ndim or nd < 3 or a.shape[:-2] != b.shape[:-2]:
        return torch.matmul(a, b)
    if nd == 3:  # torch.matmul's own 3-d case
        return torch.bmm(a, b)
    out = torch.bmm(
        a.reshape(-1, a.shape[-2], a.shape[-1]), b.reshape(-1, b.shape[-2], b.shape[-1])
    )
    return out.view(a.shape[:-2] + out.shape[1:])


# NOTE [Attention operands folded before the op]
# torch.matmul's bmm keeps its operands folded to (batch, m, n): where the batch dims of an
# operand do not fold (HF's q, k^T and v: ``view(B, T, H, d).transpose(1, 2)`` of a projection),
# that is a contiguous copy, and eager keeps the copy; the projection's output dies with the
# forward. An op that kept the operand unfolded kept the projection's output instead (the same
# bytes) and copied it again in backward, each time it recomputed a product from it: one more
# operand-sized copy per product alive in backward than eager's. Under gradient checkpointing,
# at the recomputed layer's backward, those copies were the peak (HF Speech2Text: 1.026x eager's).
# So ``eager_attention`` folds q, k^T and v first, with the same reshape torch.matmul runs (a view
# where the dims fold, else the same contiguous copy), recorded by autograd outside the Function
# and viewed back to the operand's shape: the Function keeps what eager's bmm keeps, and its
# products (forward and the backward's recompute) fold them again as views, no copy: the same 3-D
# operands for the same bmm, the same bits. Only operands of one batch shape fold (matmul
# broadcasts others first), and only where autocast casts none of them (it casts before it
# folds). The scores op keeps its operands as they come: its HF caller's straight path folds them
# already (NOTE [Attention matmuls as bmm]), and folding on its general path (a mask) kept the
# copy next to the unfolded scaled q in forward, a higher forward peak than before.
def _folded(t: torch.Tensor) -> torch.Tensor:
    if t.ndim < 4:
        return t
    f = t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])
    return t if f._is_view() else f.view(t.shape)


# NOTE [Causal masks built once]
# The causal mask ``ones(T_q, T_k, bool).triu_(1)`` depends only on the two lengths and the device.
# Where the scores op runs straight on plain tensors (its gate passed: no dispatch mode, not
# compiling; backward asks the same of its incoming gradient), it is built once per (T_q, T_k,
# device) and kept: the same bool tensor, read only by ``masked_fill``, so the same bits, two ops
# and two Python calls fewer per use (forward and the backward's recompute). Only small masks are
# kept (at most 2**20 elements, 8 of them): a bigger one costs little next to its T_q x T_k
# products. The compiled custom ops' folded implementations (real tensors, no dispatch mode: NOTE
# [The compiled attention's products folded]) read the same cache; every other path (fake
# tensors, modes) builds the mask as before.
_CAUSAL: dict[tuple, torch.Tensor] = {}
_CAUSAL_MAX = 1 << 20


def _causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    drop = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu_(1)
    if q_len * kv_len <= _CAUSAL_MAX:
        if len(_CAUSAL) >= 8:
            _CAUSAL.clear()
        _CAUSAL[(q_len, kv_len, device)] = drop
    return drop


# NOTE [Causal fill by where]
# Where S is the op's own product (q @ k_t: a fresh contiguous matmul result) and no dispatch mode
# watches, the causal fill is ``torch.where(drop, -inf, S)``: element for element what
# ``S.masked_fill(drop, -inf)`` gives (the same selection, NaN and inf included), a new tensor of
# S's shape, dtype and (contiguous) layout as masked_fill's copy, so the same softmax input and
# bits; on CPU its kernel is cheaper than masked_fill's with the broadcast (T_q, T_k) mask, on
# CUDA it is one kernel where masked_fill is a copy and a fill. It costs one more dispatcher call
# (the -inf becomes a 0-dim tensor first) and 4 transient bytes, so under a dispatch mode (the
# memory tracker, fake tensors, op counters) the op keeps masked_fill: the same op counts and
# bytes as before. A caller's S (softmax_dropout_matmul) keeps masked_fill, whose copy keeps S's
# own strides. Compiled, the custom ops' implementations run with no mode: they take where.


def _softmax_fwd(s, dim, causal, mask=None, plain=False, own=False):
    # plain: the caller's straight path (NOTE [Causal masks built once]); own: s is the op's own
    # contiguous product (NOTE [Causal fill by where])
    if not causal and mask is None:
        return torch.softmax(s, dim)
    t = s
    if causal:
        q_len, kv_len = s.shape[-2], s.shape[-1]
        if plain:
            key = (q_len, kv_len, s.device)
            drop = _CAUSAL[key] if key in _CAUSAL else _causal_mask(q_len, kv_len, s.device)
        else:
            drop = torch.ones(q_len, kv_len, dtype=torch.bool, device=s.device).triu_(1)
        # our own copy either way: softmax may overwrite it
        if own and not _dispatch_stack_len() and s.is_contiguous():
            t = torch.where(drop, float("-inf"), t)
        else:
            t = t.masked_fill(drop, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            t = torch.where(mask, t, float("-inf"))
        else:
            t = t + mask
        # SDPA's safe softmax: a row with no finite score gives P = 0, not NaN
        dead = t.amax(dim, keepdim=True) == float("-inf")
    # the aliased softmax kernels (here and in _softmax_bwd) were checked bit for bit on CPU only
    # (plain tensors: fake ones under slimgrad.memory.estimate allocate nothing anyway)
    if t.device.type == "cpu" and t.is_contiguous():
        probs = torch._softmax(t, dim, False, out=t)  # aten::_softmax.out, one C call
    else:
        probs = torch.softmax(t, dim)
    if mask is not None:
        probs = probs.masked_fill_(dead, 0.0)
    return probs


def _softmax_bwd(dp, probs, dim):
    # dp is the caller's temporary: dS goes into its buffer where that is exact
    # the aliased kernel on CPU only (_softmax_fwd)
    if dp.dtype == probs.dtype and dp.device.type == "cpu" and dp.is_contiguous():
        # aten::_softmax_backward_data.out, one C call
        return torch._softmax_backward_data(dp, probs, dim, probs.dtype, grad_input=dp)
    return torch._softmax_backward_data(dp, probs, dim, probs.dtype)


def _fwd_torch(s, v, p, dim, mm_dtype, causal=False, mask=None, own=False):
    probs = _softmax_fwd(s, dim, causal, mask, own=own)
    if p > 0:
        dropped, bits = _dropout._fwd_torch(probs, p, False)  # always packed
    else:
        dropped, bits = probs, probs.new_empty(0, dtype=torch.uint8)
    # .to() to a tensor's own dtype is the tensor itself, but one op more under a dispatch mode
    out = torch.matmul(
        dropped if dropped.dtype == mm_dtype else dropped.to(mm_dtype),
        v if v.dtype == mm_dtype else v.to(mm_dtype),
    )
    return out, probs, bits


def _bwd_torch(
    d_out,
    probs,
    bits,
    v,
    p,
    dim,
    fused,
    mm_dtype,
    v_shape,
    output_mask,
    own_probs=False,
    lib=None,
    n=0,
    mm=None,
):
    # One S-sized temporary at a time besides P. own_probs: P is dead after this backward
    # (ownership.take_saved granted it): dS first, then D rebuilt in P's buffer for dV.
    # Otherwise dV first (D in a fresh buffer, dropped before dP is made), then dS.
    # lib: the forward's C kernels for the float32 CPU P of n elements (NOTE [Dropout's straight
    # path] in ops/dropout.py), run without the kernel choice; None: _apply_mask_torch decides.
    # A .to() to the dtype a tensor has returns the tensor itself: such casts are skipped.
    # mm: torch.bmm where the caller's operands are 3-D with one batch size, else _matmul.
    ds = dv = None
    mm = mm or _matmul

    def grad_v(own):
        if p > 0 and lib is not None and probs.is_contiguous():
            out = probs if own else torch.empty_like(probs)
            dropped = _dropout._c_bwd(lib, probs, bits, p, n, out)
        elif p > 0:
            dropped = _dropout._apply_mask_torch(probs, bits, p, fused, inplace=own)
        else:
            dropped = probs
        if dropped.dtype != mm_dtype:
            dropped = dropped.to(mm_dtype)
        dv = mm(dropped.mT, d_out)  # NOTE [Attention matmuls as bmm]
        return dv if dv.shape == v_shape else dv.sum_to_size(v_shape)

    if output_mask[1] and not own_probs:
        dv = grad_v(False)
    if output_mask[0]:
        d_dropped = mm(d_out, (v if v.dtype == mm_dtype else v.to(mm_dtype)).mT)
        if d_dropped.dtype != probs.dtype:
            d_dropped = d_dropped.to(probs.dtype)
        if d_dropped.shape != probs.shape:  # scores broadcast against value's batch dims
            d_dropped = d_dropped.sum_to_size(probs.shape).contiguous()
        if p > 0 and lib is not None and d_dropped.is_contiguous():
            dp = _dropout._c_bwd(lib, d_dropped, bits, p, n, d_dropped)
        elif p > 0:
            dp = _dropout._apply_mask_torch(d_dropped, bits, p, fused, inplace=True)
        else:
            dp = d_dropped
        del d_dropped
        ds = _softmax_bwd(dp, probs, dim)
        del dp
    if output_mask[1] and own_probs:
        dv = grad_v(True)
    return ds, dv


@custom_op("softmax_dropout_matmul_fwd", mutates_args=())
def _sdm_fwd(
    s: torch.Tensor,
    v: torch.Tensor,
    p: float,
    dim: int,
    mm_dtype: torch.dtype,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_torch(s, v, p, dim, mm_dtype, causal, mask)


@_sdm_fwd.register_fake
def _(s, v, p, dim, mm_dtype, causal, mask=None):
    probs = torch.empty_like(s, memory_format=torch.contiguous_format)
    out = torch.matmul(probs.to(mm_dtype), v.to(mm_dtype))
    nbits = (s.numel() + 7) // 8 if p > 0 else 0
    return out, probs, s.new_empty((nbits,), dtype=torch.uint8)


@custom_op("softmax_dropout_matmul_bwd", mutates_args=())
def _sdm_bwd(
    d_out: torch.Tensor,
    probs: torch.Tensor,
    bits: torch.Tensor,
    v: torch.Tensor,
    p: float,
    dim: int,
    fused: bool,
    mm_dtype: torch.dtype,
    v_dtype: torch.dtype,
    v_shape: list[int],
    output_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    ds, dv = _bwd_torch(
        d_out, probs, bits, v, p, dim, fused, mm_dtype, torch.Size(v_shape), output_mask
    )
    empty = probs.new_empty(0)
    return (ds if ds is not None else empty, dv.to(v_dtype) if dv is not None else empty.clone())


@_sdm_bwd.register_fake
def _(d_out, probs, bits, v, p, dim, fused, mm_dtype, v_dtype, v_shape, output_mask):
    ds = torch.empty_like(probs) if output_mask[0] else probs.new_empty(0)
    dv = probs.new_empty(v_shape, dtype=v_dtype) if output_mask[1] else probs.new_empty(0)
    return ds, dv


class _SoftmaxDropoutMatmulFn(torch.autograd.Function):
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, s, v, p, dim, mm_dtype, causal, mask):
        out, probs, bits = _sdm_fwd(s, v, p, dim, mm_dtype, causal, mask)
        # a float mask's gradient is dS summed to its shape: only the shape is kept
        ctx.mask_shape = mask.shape if mask is not None else None
        ctx.p, ctx.dim, ctx.mm_dtype, ctx.fused = p, dim, mm_dtype, _dropout._fused(s)
        ctx.v_dtype, ctx.v_shape = v.dtype, list(v.shape)
        # v is needed only for dS; P and the bits for both gradients.
        need_ds = ctx.needs_input_grad[0] or ctx.needs_input_grad[6]
        ctx.save_for_backward(probs, bits, v if need_ds else None)
        ctx.mark_non_differentiable(probs, bits)
        # no S-sized zero gradient for P (and none for the bits) at the start of backward
        ctx.set_materialize_grads(False)
        return out, probs, bits

    @staticmethod
    @first_order("ops.softmax_dropout_matmul")
    def backward(ctx, d_out, *_):
        ownership.check_not_consumed(ctx, _API)
        if d_out is None:  # only the non-differentiable outputs were used
            return None, None, None, None, None, None, None
        probs, bits, v = ctx.saved_tensors
        need_s, need_mask = ctx.needs_input_grad[0], ctx.needs_input_grad[6]
        mask = [need_s or need_mask, ctx.needs_input_grad[1]]
        # P's buffer can hold the rebuilt D for dV (saves an S-sized allocation) when nobody else
        # reads P: NOTE [Gradient-buffer ownership]; take_saved marks ctx consumed.
        own = (
            ownership.take_saved(ctx, probs) is not None
            if mask[1] and ctx.p > 0 and probs.dtype == ctx.mm_dtype
            else False
        )
        if v is None:  # dS not needed: dV needs only v's shape and dtype
            v = probs.new_empty(0)
        if own:  # eager only (take_saved refuses under torch.compile): outside the custom op
            ds, dv = _bwd_torch(
                d_out,
                probs,
                bits,
                v,
                ctx.p,
                ctx.dim,
                ctx.fused,
                ctx.mm_dtype,
                torch.Size(ctx.v_shape),
                mask,
                own_probs=True,
            )
            dv = dv.to(ctx.v_dtype)
        else:
            ds, dv = _sdm_bwd(
                d_out,
                probs,
                bits,
                v,
                ctx.p,
                ctx.dim,
                ctx.fused,
                ctx.mm_dtype,
                ctx.v_dtype,
                ctx.v_shape,
                mask,
            )
        d_mask = None
        if need_mask:
            d_mask = ds.sum_to_size(ctx.mask_shape)
            if need_s and d_mask is ds:  # two inputs never share one gradient buffer
                d_mask = ds.clone()
        return (ds if need_s else None, dv if mask[1] else None, None, None, None, None, d_mask)


def softmax_dropout_matmul(
    input: torch.Tensor,
    value: torch.Tensor,
    p: float = 0.1,
    training: bool = True,
    dim: int = -1,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``dropout(softmax(input, dim), p, training) @ value`` keeping P and the mask bits only.

    Values and gradients equal eager's ``F.dropout(F.softmax(input, dim), p, training) @ value``
    (same mask at the same RNG state). With ``mask`` they equal the math path of
    ``F.scaled_dot_product_attention`` given ``attn_mask=mask`` (rows with no finite score give 0).

    Memory: saves P + 1/8 B/elt of P (bits) + value; eager saves P, a 4 B/elt (CPU) mask and the
    dropped P.

    Args:
        input: attention scores, e.g. ``(B, H, T, T)``.
        value: ``(B, H, T, d)`` (``torch.matmul`` broadcasting).
        p: dropout probability in [0, 1].
        training: apply dropout if True.
        dim: softmax dimension.
        causal: mask ``input[..., i, j]`` with ``-inf`` for ``j > i`` first (the last two dims,
            softmax over the last), as ``input.masked_fill(~tril, float("-inf"))`` would.
        mask: SDPA's ``attn_mask``, broadcastable to ``input``'s shape: bool (False: the score is
            dropped, as ``-inf``) or a float tensor of ``input``'s dtype added to the scores (it
            gets gradient ``dS``). Applied inside the op after ``causal``; nothing extra is kept.
            A row whose scores are all ``-inf`` afterwards gives P = 0 (SDPA's safe softmax).
        matmul_dtype: the dtype ``D @ value`` is computed and returned in: ``D.to(matmul_dtype)
            @ value.to(matmul_dtype)``, with ``value`` kept in its own dtype and cast again in
            backward (its gradient is cast back to its dtype). SDPA's CPU math path computes
            half-precision attention this way in float32. None: ``value``'s dtype (under
            autocast, the dtype autocast gives the matmul).

    Returns:
        ``dropout(softmax(input)) @ value``.

    Raises:
        ValueError: ``p`` outside [0, 1], ``causal`` with a softmax dim other than the last, or a
            ``mask`` that does not broadcast to ``input``'s shape.
        TypeError: a float ``mask`` whose dtype is not ``input``'s.

    Example:
        >>> o = softmax_dropout_matmul(torch.randn(2, 4, 7, 7), torch.randn(2, 4, 7, 8), p=0.1)
    """
    _dtensor.refuse("slimgrad.ops.softmax_dropout_matmul", input=input, value=value, mask=mask)
    _check_p("ops.softmax_dropout_matmul", p)
    if causal and (input.dim() < 2 or dim not in (-1, input.dim() - 1)):
        raise ValueError(
            f"{_API}: causal masks the last two dims; expected the softmax over the last dim of "
            f"an input with at least 2 dims, got dim={dim} for {input.dim()} dims. Pass dim=-1, "
            "or mask the scores yourself."
        )
    if mask is not None:
        _check_mask(input, mask)
    if matmul_dtype is not None and not (
        isinstance(matmul_dtype, torch.dtype) and matmul_dtype.is_floating_point
    ):
        raise TypeError(
            f"{_API}: matmul_dtype must be a floating torch.dtype; expected e.g. torch.float32, "
            f"got {matmul_dtype!r}. Pass a floating dtype, or None for value's dtype."
        )
    p_eff = float(p) if training and input.numel() > 0 else 0.0
    if p_eff == 1.0 or transforms_active() or input.is_meta:
        # eager's composition: p = 1 (nothing to keep), under torch.func (NOTE [torch.func
        # transforms] in slimgrad/_autograd.py), on meta (NOTE [Meta tensors take eager's op])
        if causal:
            drop = torch.ones(input.shape[-2:], dtype=torch.bool, device=input.device).triu_(1)
            input = input.masked_fill(drop, float("-inf"))
        if mask is not None:
            if mask.dtype == torch.bool:
                input = input.masked_fill(~mask, float("-inf"))
            else:
                input = input + mask
            dead = input.amax(dim, keepdim=True) == float("-inf")
            # dead rows: finite before softmax (no NaN in its backward), 0 after
            probs = F.softmax(input.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0)
        else:
            probs = F.softmax(input, dim)
        dropped = F.dropout(probs, p_eff, True)
        if matmul_dtype is not None:
            dropped, value = dropped.to(matmul_dtype), value.to(matmul_dtype)
        return torch.matmul(dropped, value)
    refuse_jit("ops.softmax_dropout_matmul")
    # Keep a compact V: a strided view (e.g. of a fused qkv output) would keep its whole base alive.
    value = value.contiguous()
    dev = input.device.type
    if matmul_dtype is not None:
        with torch.autocast(dev, enabled=False):
            return _SoftmaxDropoutMatmulFn.apply(
                input, value, p_eff, dim, matmul_dtype, causal, mask
            )[0]
    if torch.is_autocast_enabled(dev):
        sm_dtype = F.softmax(input.new_empty((0,)), -1).dtype
        mm_dtype = torch.matmul(value.new_empty((0, 0)), value.new_empty((0, 0))).dtype
        with torch.autocast(dev, enabled=False):
            if value.dtype == torch.float64:
                mm_dtype = torch.float64
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.to(sm_dtype)
            return _SoftmaxDropoutMatmulFn.apply(
                input.to(sm_dtype), value, p_eff, dim, mm_dtype, causal, mask
            )[0]
    return _SoftmaxDropoutMatmulFn.apply(input, value, p_eff, dim, value.dtype, causal, mask)[0]


class _ScoresSoftmaxDropoutMatmulFn(torch.autograd.Function):
    # NOTE [Attention probabilities recomputed in backward]: S = q @ k_t is recomputed from the
    # operands its matmul keeps anyway, and P = softmax(S) from S, with the same ops on the same
    # tensors (same shapes and strides): the same bits as the forward's P (CPU kernels are
    # deterministic for a fixed input and thread count; the tests compare with eager bit for bit).
    # Nothing T x T is kept: q, k_t, value, the dropout bits and a bool mask (or none).
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, q, k_t, v, p, mm_dtype, causal, mask, direct=False, bmm=False):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py):
        # _sdm_fwd's implementation runs here, its dropout on the C kernels when they take P
        # (NOTE [Dropout's straight path] in ops/dropout.py), kept in ctx.lib for backward.
        # bmm: q, k_t and v are 3-D CPU tensors with one batch size and no mask (HF's straight
        # path, NOTE [Attention matmuls as bmm]): every product here and in backward is one
        # torch.bmm call, whose result is contiguous.
        mm = torch.bmm if bmm else _matmul
        s = mm(q, k_t)  # NOTE [Attention matmuls as bmm]
        ctx.lib, ctx.bmm, ctx.direct = None, bmm, direct
        if direct and bmm:  # _softmax_fwd's steps for a contiguous CPU S without a mask tensor
            if causal:
                key = (s.shape[1], s.shape[2], s.device)
                drop = _CAUSAL[key] if key in _CAUSAL else _causal_mask(*key)
                s = torch.where(drop, float("-inf"), s)  # NOTE [Causal fill by where]
            probs = torch._softmax(s, -1, False, out=s)
        elif direct:
            probs = _softmax_fwd(s, -1, causal, mask, True, own=True)
        if direct:
            r = _dropout._straight_c(probs, p) if p > 0 else None
            if r is not None:
                dropped, bits, ctx.n, ctx.lib = r
            elif p > 0:
                dropped, bits = _dropout._fwd_torch(probs, p, False)  # always packed
            else:
                dropped, bits = probs, probs.new_empty(0, dtype=torch.uint8)
            # _fwd_torch's product; .to() to a tensor's own dtype is the tensor itself
            out = mm(
                dropped if dropped.dtype == mm_dtype else dropped.to(mm_dtype),
                v if v.dtype == mm_dtype else v.to(mm_dtype),
            )
            del dropped
            if out._base is not None:  # 4-D: NOTE [Function outputs are not views] in ops/linear.py
                out = out.detach()
        else:
            out, probs, bits = _sdm_fwd(s, v, p, -1, mm_dtype, causal, mask)
        del s, probs
        ctx.p, ctx.mm_dtype, ctx.causal = p, mm_dtype, causal
        ctx.fused = q.device.type != "cpu"  # _dropout._fused(q)
        ctx.v_dtype, ctx.v_shape = v.dtype, v.shape
        if direct and CTX_FIELDS:  # NOTE [Saving through ctx's fields] in slimgrad/_autograd.py
            ctx.to_save = (q, k_t, v, bits, mask)
            ctx.materialize_grads = False
            return out
        ctx.save_for_backward(q, k_t, v, bits, mask)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, d_out):
        # first_order's check inline, one frame fewer (NOTE [Second derivatives] in
        # slimgrad/_autograd.py): under create_graph=True this backward runs again without grad
        # and its results are tied to the refusal
        if _grad_on():
            return refuse_second_order(
                _QK_OP, _ScoresSoftmaxDropoutMatmulFn.backward, ctx, (d_out,)
            )
        if d_out is None:
            return None, None, None, None, None, None, None, None, None
        q, k_t, v, bits, mask = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        mm = torch.bmm if ctx.bmm else _matmul
        # the forward ran straight, and so does this backward: plain tensors, outside compile
        # and dispatch modes
        plain = (
            ctx.direct and type(d_out) is _Tensor and not compiling() and not _dispatch_stack_len()
        )
        lib = ctx.lib if plain else None  # the forward's C kernels
        if ctx.bmm and lib is not None:
            # where forward and backward ran straight on HF's folded CPU operands with the dropout
            # C kernels (ctx.bmm, ctx.lib): _softmax_fwd's and _bwd_torch's steps for that case
            # (p > 0, one dtype, contiguous bmm results, P owned: dS first, then D rebuilt in P's
            # buffer for dV), the same ops on the same tensors, in this frame
            s = torch.bmm(q, k_t)
            if ctx.causal:
                key = (s.shape[1], s.shape[2], s.device)
                s = torch.where(  # NOTE [Causal fill by where]
                    _CAUSAL[key] if key in _CAUSAL else _causal_mask(*key), float("-inf"), s
                )
            probs = torch._softmax(s, -1, False, out=s)  # the forward's P
            del s
            p, n = ctx.p, ctx.n
            # _dropout._c_bwd's C pass (g * m) * s into g, inline: its scale, bound function, bits
            # pointer and thread count read once for both uses (one device, dtype and thread)
            key = (p, _dropout._F32, probs.device)  # the C kernels' dtype
            scale = _dropout._SCALES[key] if key in _dropout._SCALES else _dropout._scale(p, probs)
            try:  # the bound C functions, an attribute once bound (_dropout._c_fns)
                c_bwd = lib._slimgrad_fns["bwd"]
            except AttributeError:
                c_bwd = _dropout._c_fns(lib)["bwd"]
            bits_ptr, nthreads = bits.data_ptr(), _dropout._nthreads()
            ds = dv = None
            if need_q or need_k:
                dp = torch.bmm(d_out, v.mT)
                ptr = dp.data_ptr()
                c_bwd(ptr, bits_ptr, ptr, n, scale, nthreads)
                ds = torch._softmax_backward_data(dp, probs, -1, probs.dtype, grad_input=dp)
                del dp
            if need_v:
                ptr = probs.data_ptr()
                c_bwd(ptr, bits_ptr, ptr, n, scale, nthreads)
                dv = torch.bmm(probs.mT, d_out)
            del probs
            dq = torch.bmm(ds, k_t.mT) if need_q else None  # eager's bmm backward, operand order
            dk = torch.bmm(q.mT, ds) if need_k else None
            return dq, dk, dv, None, None, None, None, None, None
        probs = _softmax_fwd(mm(q, k_t), -1, ctx.causal, mask, plain, own=True)  # forward's P
        # P is this backward's own temporary: D for dV is rebuilt in its buffer after dS
        ds, dv = _bwd_torch(
            d_out,
            probs,
            bits,
            v,
            ctx.p,
            -1,
            ctx.fused,
            ctx.mm_dtype,
            ctx.v_shape,
            [need_q or need_k, need_v],
            own_probs=ctx.p > 0 and probs.dtype == ctx.mm_dtype,
            lib=lib,
            n=ctx.n if lib is not None else 0,
            mm=mm,
        )
        del probs
        dq = mm(ds, k_t.mT) if need_q else None  # eager's bmm backward, operand order
        dk = mm(q.mT, ds) if need_k else None
        if dv is not None and dv.dtype != ctx.v_dtype:
            dv = dv.to(ctx.v_dtype)
        return dq, dk, dv, None, None, None, None, None, None


_SSDM_APPLY = direct_apply(_ScoresSoftmaxDropoutMatmulFn)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def scores_softmax_dropout_matmul(
    query: torch.Tensor,
    key_t: torch.Tensor,
    value: torch.Tensor,
    p: float = 0.1,
    training: bool = True,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``dropout(softmax(query @ key_t), p) @ value``, recomputing the probabilities in backward.

    Values and gradients equal eager's ``F.dropout(F.softmax(query @ key_t, -1), p) @ value``
    (with ``causal``/``mask`` as in :func:`softmax_dropout_matmul`, i.e. SDPA's math path given
    the scaled query and transposed key) bit for bit: backward recomputes ``S = query @ key_t``
    and ``P = softmax(S)`` from the kept operands with the same ops (NOTE [Attention
    probabilities recomputed in backward]).

    Memory: saves query, key_t (eager's ``q @ k^T`` keeps both too), value and 1/8 B/elt of S
    (dropout bits) and ``mask`` (bool); eager also keeps P, a 4 B/elt (CPU) noise tensor and the
    dropped P, all T x T. Backward holds one S-sized buffer besides dS at a time.

    Args:
        query: ``(..., T_q, d)``, already scaled.
        key_t: ``(..., d, T_k)``, the transposed (scaled) key, same dtype as ``query``.
        value: ``(..., T_k, d_v)``.
        p: dropout probability in [0, 1].
        training: apply dropout if True.
        causal: mask ``S[..., i, j]`` (``j > i``) with ``-inf`` inside the op.
        mask: None or a bool mask broadcastable to S (False drops the score); rows with no
            finite score give P = 0 (SDPA's safe softmax).
        matmul_dtype: the dtype of ``D @ value`` (see :func:`softmax_dropout_matmul`); None:
            value's dtype.

    Returns:
        ``dropout(softmax(query @ key_t)) @ value`` in ``matmul_dtype``.

    Raises:
        ValueError: ``p`` outside [0, 1], or a ``mask`` that does not broadcast to S.
        TypeError: a ``mask`` that is not a bool tensor, or operands of different dtypes.

    Example:
        >>> q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
        >>> o = scores_softmax_dropout_matmul(q, k.mT, torch.randn(2, 4, 7, 8), p=0.1)
    """
    if (  # the straight path (no mask): NOTE [One gate per call] in slimgrad/_library.py
        mask is None
        and type(p) is float
        and 0.0 <= p < 1.0
        and training
        and type(query) in _PLAIN
        and type(key_t) in _PLAIN
        and type(value) in _PLAIN
        and query.dtype == key_t.dtype
        and 0 not in query.shape
        and 0 not in key_t.shape
        and _grad_on()
        and not _any_autocast()
        and straight()
    ):
        mm_dtype = value.dtype if matmul_dtype is None else matmul_dtype
        value = value.contiguous()  # a strided view would keep its whole base alive
        return _SSDM_APPLY(
            unwrap_if_dead(query),
            unwrap_if_dead(key_t),
            unwrap_if_dead(value),
            p,
            mm_dtype,
            causal,
            None,
            True,
        )
    _dtensor.refuse(_API_QK, query=query, key_t=key_t, value=value, mask=mask)
    _check_p("ops.scores_softmax_dropout_matmul", p)
    if query.dtype != key_t.dtype:
        raise TypeError(
            f"{_API_QK}: query and key_t must have one dtype; expected {query.dtype}, got "
            f"{key_t.dtype}. Cast them to one dtype."
        )
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(
            f"{_API_QK}: mask must be a bool tensor; expected torch.bool, got {got}. Add a float "
            "mask to the scores and use softmax_dropout_matmul."
        )
    mm_dtype = value.dtype if matmul_dtype is None else matmul_dtype
    p_eff = float(p) if training and query.numel() > 0 and key_t.numel() > 0 else 0.0
    if p_eff == 1.0 or transforms_active() or not torch.is_grad_enabled() or query.is_meta:
        # nothing to keep (p = 1, no grad), torch.func or meta (NOTE [Meta tensors take eager's
        # op] in slimgrad/_autograd.py): the composition
        return softmax_dropout_matmul(
            torch.matmul(query, key_t),
            value,
            p_eff,
            True,
            causal=causal,
            mask=mask,
            matmul_dtype=mm_dtype,
        )
    if mask is not None:
        batch = torch.broadcast_shapes(query.shape[:-2], key_t.shape[:-2])
        scores = torch.empty((*batch, query.shape[-2], key_t.shape[-1]), device="meta")
        _check_mask(scores, mask)
    refuse_jit("ops.scores_softmax_dropout_matmul")
    value = value.contiguous()  # a strided view would keep its whole base alive
    with torch.autocast(query.device.type, enabled=False):
        if torch.compiler.is_compiling():  # NOTE [slimgrad ops under torch.compile]
            return _scores_sdm(query, key_t, value, p_eff, mm_dtype, causal, mask)[0]
        return _ScoresSoftmaxDropoutMatmulFn.apply(
            query, key_t, value, p_eff, mm_dtype, causal, mask
        )


def _check_mask(input, mask):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{_API}: mask must be a tensor; expected a bool or float torch.Tensor, got "
            f"{type(mask).__name__}. Pass attn_mask as a tensor, or None."
        )
    if mask.dtype != torch.bool and mask.dtype != input.dtype:
        raise TypeError(
            f"{_API}: a float mask is added to the scores; expected dtype {input.dtype} (the "
            f"scores') or torch.bool, got {mask.dtype}. Cast the mask with mask.to(scores.dtype)."
        )
    try:
        shape = torch.broadcast_shapes(input.shape, mask.shape)
    except RuntimeError:
        shape = None
    if shape != input.shape:
        raise ValueError(
            f"{_API}: mask must broadcast to the scores' shape; expected a shape broadcastable "
            f"to {tuple(input.shape)}, got {tuple(mask.shape)}. Expand the scores or slice the "
            "mask to the key length."
        )


# ----------------------------------------------------------------------------- eager attention


def _eager_probs(q, k_t, biases, scaling, softcap, softmax_dtype, probs_dtype):
    # HF's eager_attention_forward after repeat_kv up to the cast P, op for op (NOTE [HF eager
    # attention, recomputed in backward]); k_t is key.transpose(2, 3)
    s = torch.matmul(q, k_t) * scaling
    if softcap is not None:
        s = s / softcap
        s = torch.tanh(s)
        s = s * softcap
    for b in biases:
        if b is not None:
            s = s + b
    if softmax_dtype is not None:
        probs = F.softmax(s, dim=-1, dtype=softmax_dtype)
    else:
        probs = F.softmax(s, dim=-1)
    del s
    return probs.to(probs_dtype) if probs_dtype is not None else probs


class _ApplyBitsFn(torch.autograd.Function):
    # dropout with given bits: x * noise and dy * noise, bit for bit as eager's CPU dropout and
    # its backward (NOTE [Dropout masks: drawn like eager, kept as bits]), without the noise tensor
    @staticmethod
    def forward(ctx, x, bits, p):
        ctx.save_for_backward(bits)
        ctx.p = p
        return _dropout._dropout_apply_mask(x, bits, p, False)

    @staticmethod
    @first_order(
        "ops.eager_attention",
        double=lambda ctx, g: (_ApplyBitsFn.apply(g, *ctx.saved_tensors, ctx.p), None, None),
    )
    def backward(ctx, g):
        (bits,) = ctx.saved_tensors
        return _dropout._dropout_apply_mask(g, bits, ctx.p, False), None, None


# NOTE [The output's product not recomputed]
# The backward needs the probabilities D (after dropout) and v, not ``out = D @ v``: recomputing
# the product through autograd made ``out`` (B x H x T x d_v) and held it, next to the incoming
# gradient the engine hands this node (kept until it returns, where eager's matmul node lets it go
# once folded), through the softmax's backward: under HF gradient checkpointing, where that
# backward is the step's peak, HF Speech2Text (3 x 40 tokens) peaked 1.09x eager's. Outside
# create_graph the product's gradients are taken by hand, as autograd runs torch.matmul's: on the
# operands autocast's matmul casts (_matmul_operand), bmm on the 3-D folds (``dD = g @ v^T``,
# ``dv = D^T @ g``, g folded by the reshape ``_unsafe_view``'s backward runs, a copy where it
# does not fold), then the cast's backward; the same ops on the same operands, so the same bits.
# dv first, then the probabilities' graph ends in _ProductGrad, whose backward makes dD inside
# autograd's engine, which lets it and the fold of g go once used. v is dead once dD is made:
# the saved tensors are unpacked once and handed over in a list the backward empties, so a
# tensor only this node holds dies there (a non-reentrant checkpoint's recomputed v: HF
# Speech2Text, gradient checkpointing, 3 x 40: 1.031x eager's peak in fp32 and 1.030x under bf16
# autocast, 1.062x and 1.053x while this frame held v to the end); where ownership.take_saved
# grants v (asked in backward itself, as its call pattern requires; a contiguous v nobody else
# holds, not under autocast: bmm's out= variant runs outside it) dv is written into it. What
# stays above eager's matmul node: the incoming gradient (the engine hands it in; held until
# this returns) and, where the forward's v is a fold nobody frees, that fold.
def _matmul_operand(t: torch.Tensor, enabled: bool, dtype: torch.dtype) -> torch.Tensor:
    # matmul's operand as CPU autocast hands it to the kernel: a floating tensor other than
    # float64 cast to autocast's dtype (matmul is on its lower-precision list), else as it is
    if enabled and t.is_floating_point() and t.dtype != dtype and t.dtype != torch.float64:
        return t.to(dtype)
    return t


class _ProductGrad(torch.autograd.Function):
    # the end of the probabilities' graph in place of ``D @ v`` (NOTE [The output's product not
    # recomputed]): an empty output; its backward hands D the gradient taken out of ``box``, so
    # that autograd's engine holds it only until D's node has used it
    @staticmethod
    def forward(ctx, d, box):
        ctx.box = box
        return d.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return ctx.box.pop(), None


def _probs_again(ctx, leaves, bits):
    # the forward's probabilities (dropped) from the kept tensors: ``leaves`` are (q, k^T, v, the
    # biases) as the backward differentiates them; called under grad mode and the forward's
    # autocast state
    probs = _eager_probs(
        leaves[0],
        leaves[1],
        leaves[3:],
        ctx.scaling,
        ctx.softcap,
        ctx.softmax_dtype,
        ctx.probs_dtype,
    )
    if ctx.p > 0:  # eager's CPU dropout, input.mul(noise), from the bits
        probs = _ApplyBitsFn.apply(probs, bits, ctx.p)
    return probs


def _grads_by_hand(ctx, d_out, saved, buf):
    # NOTE [The output's product not recomputed]; None where it does not apply. ``buf``: v
    # itself where backward took it (ownership.take_saved), for dv
    q, k_t, v, b0, b1, bits = saved
    need = ctx.needs_input_grad[:5]
    if v.dim() < 3:
        return None
    if q.shape[:-2] != v.shape[:-2]:
        return None
    saved.clear()  # from here this frame's names hold them, and let them go
    enabled, ac_dtype = ctx.autocast
    leaves = [  # v is not in the probabilities' graph
        t.detach().requires_grad_(k) if t is not None else None
        for t, k in zip((q, k_t, None, b0, b1), need)
    ]
    with torch.enable_grad():
        with torch.autocast("cpu", dtype=ac_dtype, enabled=enabled, cache_enabled=False):
            probs = _probs_again(ctx, leaves, bits)
        pc = _matmul_operand(probs, enabled, ac_dtype)  # the cast autograd records
    del probs
    vc = _matmul_operand(v, enabled, ac_dtype)
    if pc.dtype != vc.dtype:  # eager's matmul raises here: its own error
        del pc, vc, leaves
        return _eager_attention_grads(ctx, d_out, False, (q, k_t, v, b0, b1, bits))
    del q, k_t, b0, b1, bits
    n = math.prod(pc.shape[:-2])
    g3 = d_out.reshape(n, *d_out.shape[-2:])  # _unsafe_view's backward: a copy or a view
    wanted = [t for i, (t, k) in enumerate(zip(leaves, need)) if k and i != 2]
    dd = None
    if wanted:  # bmm's formula for its first operand: g @ v^T
        dd = torch.bmm(g3, vc.reshape(n, *vc.shape[-2:]).transpose(1, 2)).view(pc.shape)
    del vc
    dv = None
    if need[2]:  # bmm's formula for its second operand, D^T @ g; then the cast's backward
        d3 = pc.detach().reshape(n, *pc.shape[-2:])
        # v's fold, dead now: its memory takes dv (the same shape) where backward took it
        out = None
        if buf is not None and d3.dtype == v.dtype and buf.is_contiguous():
            out = buf.view(n, *buf.shape[-2:])
        dv = torch.bmm(d3.transpose(1, 2), g3, out=out).view(v.shape)
        del d3, buf, out
        if dv.dtype != v.dtype:
            dv = dv.to(v.dtype)
    del g3, v
    got = ()
    if wanted:
        with torch.enable_grad():
            end = _ProductGrad.apply(pc, [dd])
        del dd, pc
        got = torch.autograd.grad(end, wanted, torch.empty_like(end))
    got = iter(got)
    grads = [None if not k else dv if i == 2 else next(got) for i, k in enumerate(need)]
    return (*grads, *(None,) * 5)


def _eager_attention_grads(ctx, d_out, create_graph, saved=None):
    q, k_t, v, b0, b1, bits = ctx.saved_tensors if saved is None else saved
    need = list(ctx.needs_input_grad[:5])
    if create_graph:
        # the recomputed graph on the inputs themselves, so that the first derivatives depend on
        # them as eager's do (eager's second derivatives); an input passed twice gets its whole
        # gradient in its first slot
        leaves = [q, k_t, v, b0, b1]
        firsts = {}
        for i, (t, n) in enumerate(zip(leaves, need)):
            if n and firsts.setdefault(id(t), i) != i:
                need[i] = False
    else:
        leaves = [
            t.detach().requires_grad_(n) if t is not None else None
            for t, n in zip((q, k_t, v, b0, b1), need)
        ]
    enabled, ac_dtype = ctx.autocast
    with torch.enable_grad():
        # the forward's ops under the forward's autocast state; autograd's backward outside it
        with torch.autocast("cpu", dtype=ac_dtype, enabled=enabled, cache_enabled=False):
            probs = _probs_again(ctx, leaves, bits)
            out = torch.matmul(probs, leaves[2])
            del probs
        wanted = [t for t, n in zip(leaves, need) if n]
        got = iter(torch.autograd.grad(out, wanted, d_out, create_graph=create_graph))
    return (*(next(got) if n else None for n in need), *(None,) * 5)


class _EagerAttentionFn(torch.autograd.Function):
    # NOTE [HF eager attention, recomputed in backward]: keeps what the score matmul keeps anyway
    # (q, k^T: folded first, NOTE [Attention operands folded before the op]), value, the biases
    # (references: HF builds one mask for every layer) and 1 bit per score. Backward runs the
    # forward's own ops again on the same tensors (same ops, shapes, strides, dtypes and
    # autocast state: the same bits, CPU kernels being deterministic for a fixed input and thread
    # count), with dropout's noise rebuilt from the bits, and differentiates that graph with
    # autograd: eager's backward ops by construction (and eager's second derivatives under
    # create_graph), one call's T x T tensors alive at a time instead of every layer's.
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, q, k_t, v, b0, b1, scaling, softcap, p, softmax_dtype, probs_dtype):
        probs = _eager_probs(q, k_t, (b0, b1), scaling, softcap, softmax_dtype, probs_dtype)
        if p > 0:  # eager's CPU draw: NOTE [Dropout masks: drawn like eager, kept as bits]
            probs, bits = _dropout._dropout_fwd(probs, p)
        else:
            bits = probs.new_empty(0, dtype=torch.uint8)
        out = torch.matmul(probs, v)
        del probs
        ctx.scaling, ctx.softcap, ctx.p = scaling, softcap, p
        ctx.softmax_dtype, ctx.probs_dtype = softmax_dtype, probs_dtype
        ctx.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        ctx.save_for_backward(q, k_t, v, b0, b1, bits)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    @first_order(
        "ops.eager_attention", double=lambda ctx, d_out: _eager_attention_grads(ctx, d_out, True)
    )
    def backward(ctx, d_out):
        if d_out is None:
            return (None,) * 10
        # unpacked once (a non-reentrant checkpoint's recomputed tensors unpack only once)
        q, k_t, v, b0, b1, bits = ctx.saved_tensors
        buf = None
        # NOTE [The output's product not recomputed]: v for dv, asked here, where ownership's
        # call pattern holds; not under autocast (bmm's out= variant is not autocast's: eager's
        # backward product runs in autocast's dtype)
        if ctx.needs_input_grad[2] and v.dim() >= 3 and not _any_autocast():
            buf = ownership.take_saved(ctx, v)
        # handed over in a list the callee empties: what it lets go dies then (a checkpoint's
        # recomputed v once dD is made), not when this frame returns
        saved = [q, k_t, v, b0, b1, bits]
        del q, k_t, v, b0, b1, bits
        got = _grads_by_hand(ctx, d_out, saved, buf)
        return got if got is not None else _eager_attention_grads(ctx, d_out, False, saved)


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    p: float = 0.0,
    training: bool = True,
    *,
    scaling: float,
    softcap: float | None = None,
    biases: tuple[torch.Tensor | None, ...] = (),
    softmax_dtype: torch.dtype | None = None,
    probs_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """HF's eager attention after ``repeat_kv``, keeping no T x T tensor but 1 bit per score.

    Math, op for op as HF's ``eager_attention_forward`` (Llama, Gemma2 with ``softcap``, BERT and
    the families that copy them): ``S = (query @ key.transpose(2, 3)) * scaling``; with a softcap
    ``S = tanh(S / softcap) * softcap``; ``S = S + b`` for each bias in order (position bias,
    mask); ``P = softmax(S, -1, dtype=softmax_dtype)``; ``P = P.to(probs_dtype)``; ``D =
    dropout(P, p)`` (eager's CPU draw, ``P * noise``); ``out = D @ value``. Every op runs under
    the caller's autocast state, as eager's would. Output and gradients equal that composition's
    bit for bit on CPU: backward recomputes it from the kept tensors and differentiates it (NOTE
    [HF eager attention, recomputed in backward]).

    Memory: saves query, ``key.transpose(2, 3)`` and value as eager's matmuls keep them (folded
    to 3-D, a copy where their batch dims do not fold: NOTE [Attention operands folded before the
    op]), the biases (references, not copies) and 1/8 B/elt of S (dropout bits, none for ``p =
    0``); eager also keeps, T x T each: P (softmax's output, in ``softmax_dtype``), dropout's
    noise and the dropped P (in ``probs_dtype``; the cast P instead when ``p = 0`` and the cast
    changes the dtype; under autocast the dropped P's cast for the matmul) and, with a softcap,
    tanh's output. Backward holds one call's eager T x T tensors at a time.

    Args:
        query: ``(B, H, T_q, d)``.
        key: ``(B, H, T_k, d)`` (kv heads already repeated).
        value: ``(B, H, T_k, d_v)``.
        p: dropout probability in [0, 1).
        training: apply dropout if True.
        scaling: the scores' scale.
        softcap: Gemma2's logit softcap, or None.
        biases: at most two tensors added to the scores in order (None entries skipped).
        softmax_dtype: softmax's ``dtype`` argument (HF's float32 upcast) or None.
        probs_dtype: the dtype P is cast to after softmax (HF's ``.to(query.dtype)``) or None.

    Returns:
        ``dropout(softmax(...)) @ value``, ``(B, H, T_q, d_v)``.

    Raises:
        ValueError: ``p`` outside [0, 1), or more than two biases.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 7, 8) for _ in range(3))
        >>> o = eager_attention(q, k, v, 0.1, scaling=8**-0.5)
    """
    _dtensor.refuse(_API_EAGER, query=query, key=key, value=value)
    _check_p("ops.eager_attention", p)
    if p >= 1.0:
        raise ValueError(
            f"{_API_EAGER}: p must be below 1; expected p in [0, 1), got {p}. Use "
            "torch.nn.functional.dropout after softmax for p = 1."
        )
    biases = tuple(biases)
    if len(biases) > 2:
        raise ValueError(
            f"{_API_EAGER}: at most two biases are added to the scores; expected <= 2, got "
            f"{len(biases)}. Add them together first."
        )
    b0, b1 = (*biases, None, None)[:2]
    p_eff = float(p) if training else 0.0
    if transforms_active() or not torch.is_grad_enabled():
        # nothing to keep, or torch.func: eager's composition
        k_t = key.transpose(2, 3)
        probs = _eager_probs(query, k_t, (b0, b1), scaling, softcap, softmax_dtype, probs_dtype)
        return torch.matmul(F.dropout(probs, p_eff, p_eff > 0), value)
    refuse_jit("ops.eager_attention")
    k_t = key.transpose(2, 3)
    if (
        query.ndim == key.ndim == value.ndim == 4
        and query.shape[:2] == key.shape[:2] == value.shape[:2]
        and _no_autocast_cast(query, key, value)
    ):  # NOTE [Attention operands folded before the op]
        query, k_t, value = _folded(query), _folded(k_t), _folded(value)
    return _EagerAttentionFn.apply(
        query, k_t, value, b0, b1, scaling, softcap, p_eff, softmax_dtype, probs_dtype
    )


def _no_autocast_cast(*ts) -> bool:
    # autocast casts matmul's operands before it folds them: fold only where it casts nothing
    # (the HF caller casts them first, as eager's matmul does)
    dev = ts[0].device.type
    # a device type autocast does not know (meta) casts nothing; asking it whether autocast is on
    # raises there
    if not torch.amp.is_autocast_available(dev) or not torch.is_autocast_enabled(dev):
        return True
    dtype = torch.get_autocast_dtype(dev)
    return all(t.dtype == dtype for t in ts)


_API_EAGER = "slimgrad.ops.eager_attention"


# --- torch.compile: the op as one custom op each way (NOTE [slimgrad ops under torch.compile] in
# slimgrad/_compile.py). Traced, _ScoresSoftmaxDropoutMatmulFn's backward recompute of S = q @ k_t
# would be merged with the forward's S by the joint graph's CSE and S kept.


@custom_op("scores_softmax_dropout_matmul", mutates_args=())
def _scores_sdm(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    p: float,
    mm_dtype: torch.dtype,
    causal: bool,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if mask is None and _folds(q, k_t, v, mm_dtype) and not _dispatch_stack_len():
        # NOTE [The compiled attention's products folded]
        probs = _softmax_fwd(_matmul(q, k_t), -1, causal, None, plain=True, own=True)
        if p > 0:
            dropped, bits = _dropout._fwd_torch(probs, p, False)  # always packed
        else:
            dropped, bits = probs, probs.new_empty(0, dtype=torch.uint8)
        return _matmul(dropped, v), bits
    out, _, bits = _fwd_torch(torch.matmul(q, k_t), v, p, -1, mm_dtype, causal, mask, own=True)
    return out, bits


@_scores_sdm.register_fake
def _(q, k_t, v, p, mm_dtype, causal, mask):
    s = torch.matmul(q, k_t)
    out = torch.matmul(s.to(mm_dtype), v.to(mm_dtype))
    nbits = (s.numel() + 7) // 8 if p > 0 else 0
    return out, s.new_empty((nbits,), dtype=torch.uint8)


@custom_op("scores_softmax_dropout_matmul_bwd", mutates_args=())
def _scores_sdm_bwd(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    bits: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    mm_dtype: torch.dtype,
    causal: bool,
    fused: bool,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # _ScoresSoftmaxDropoutMatmulFn.backward's math: the same ops on the same tensors
    need_q, need_k, need_v = needs
    if (
        mask is None
        and _folds(q, k_t, v, mm_dtype)
        and d_out.shape == q.shape[:-1] + v.shape[-1:]
        and d_out.dtype == mm_dtype
        and not _dispatch_stack_len()
    ):
        return _scores_sdm_bwd_folded(d_out, q, k_t, v, bits, p, causal, fused, needs)
    probs = _softmax_fwd(_matmul(q, k_t), -1, causal, mask, own=True)
    ds, dv = _bwd_torch(
        d_out,
        probs,
        bits,
        v,
        p,
        -1,
        fused,
        mm_dtype,
        v.shape,
        [need_q or need_k, need_v],
        own_probs=p > 0 and probs.dtype == mm_dtype,
    )
    del probs
    empty = q.new_empty(0)
    dq = _matmul(ds, k_t.mT) if need_q else empty
    dk = _matmul(q.mT, ds) if need_k else empty.clone()
    return dq, dk, dv.to(v.dtype) if dv is not None else v.new_empty(0)


# NOTE [The compiled attention's products folded]
# Compiled, the scores op runs as its two custom ops (above) on HF's 4-D operands: q and k^T as
# views of the qkv projection (their batch dims do not fold), v contiguous. Where q, k^T and v
# have one batch shape of at least 3 dims and one dtype, which is the matmuls' dtype, there is no
# mask and no dispatch mode watches, the implementations take the steps the general ones take on
# the same tensors with fewer host calls: every product is _matmul's (NOTE [Attention matmuls as
# bmm]: torch.matmul's reshapes and bmm, so the same operands with the same strides and the same
# bits), the causal mask is the one kept per (T_q, T_k, device) (NOTE [Causal masks built once]:
# the same bool tensor's values), and backward folds dO to (batch, T_q, d_v) once where
# torch.matmul made the same contiguous copy for each of its two products with it (dP = dO V^T,
# dV = D^T dO), then runs _bwd_torch's steps on the folded 3-D tensors with bmm (the same
# operands, strides and kernels as the 4-D products). dq and dk take _matmul's operands
# (k^T.mT and q.mT reshaped as torch.matmul reshapes them). Outputs, bits and gradients are the
# general path's bit for bit (``tests/test_compile_gpt2_attention.py``): 108 ATen ops per layer
# and step where the general implementations took 138 (GPT-2's bench shapes, causal, p = 0.1).
def _folds(q, k_t, v, mm_dtype) -> bool:
    nd = q.ndim
    return (
        nd >= 3
        and k_t.ndim == nd
        and v.ndim == nd
        and q.shape[:-2] == k_t.shape[:-2] == v.shape[:-2]
        and q.dtype == k_t.dtype == v.dtype == mm_dtype
    )


def _fold(t):
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _scores_sdm_bwd_folded(d_out, q, k_t, v, bits, p, causal, fused, needs):
    # NOTE [The compiled attention's products folded]; mm_dtype is q's, k_t's, v's and d_out's
    need_q, need_k, need_v = needs
    empty = q.new_empty(0)
    probs = _softmax_fwd(_matmul(q, k_t), -1, causal, None, plain=True, own=True)
    probs = _fold(probs)  # a view: _matmul's 3-D product
    v3 = _fold(v)
    ds, dv = _bwd_torch(
        _fold(d_out),  # the contiguous copy torch.matmul made per product
        probs,
        bits,
        v3,
        p,
        -1,
        fused,
        v.dtype,
        v3.shape,
        [need_q or need_k, need_v],
        own_probs=p > 0,
        mm=torch.bmm,
    )
    del probs
    batch = q.shape[:-2]
    dq = torch.bmm(ds, _fold(k_t.mT)).view(q.shape) if need_q else empty
    dk = torch.bmm(_fold(q.mT), ds).view(k_t.shape) if need_k else empty.clone()
    return dq, dk, dv.view(batch + dv.shape[1:]) if dv is not None else v.new_empty(0)


@_scores_sdm_bwd.register_fake
def _(d_out, q, k_t, v, bits, mask, p, mm_dtype, causal, fused, needs):
    ds = torch.empty(
        (*torch.broadcast_shapes(q.shape[:-2], k_t.shape[:-2]), q.shape[-2], k_t.shape[-1]),
        dtype=q.dtype,
        device=q.device,
    )
    dq = torch.matmul(ds, k_t.mT) if needs[0] else q.new_empty(0)
    dk = torch.matmul(q.mT, ds) if needs[1] else q.new_empty(0)
    return dq, dk, torch.empty_like(v) if needs[2] else v.new_empty(0)


def _scores_sdm_setup(ctx, inputs, output):
    q, k_t, v, p, mm_dtype, causal, mask = inputs
    ctx.save_for_backward(q, k_t, v, output[1], mask)
    ctx.p, ctx.mm_dtype, ctx.causal, ctx.fused = p, mm_dtype, causal, _dropout._fused(q)


def _scores_sdm_backward(ctx, d_out, _d_bits):
    q, k_t, v, bits, mask = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    dq, dk, dv = _scores_sdm_bwd(
        d_out, q, k_t, v, bits, mask, ctx.p, ctx.mm_dtype, ctx.causal, ctx.fused, needs
    )
    grads = [g if n else None for g, n in zip((dq, dk, dv), needs, strict=True)]
    return (*grads, None, None, None, None)


_scores_sdm.register_autograd(
    autocast_free(_scores_sdm_backward),  # NOTE [Backward without autocast] in _autograd.py
    setup_context=_scores_sdm_setup,
)


# NOTE [The attention ops' FLOPs for FlopCounterMode]
# torch's FlopCounterMode counts an op from its formula table, and sees a slimgrad custom op
# called through the dispatcher (under any dispatch mode: NOTE [One gate per call] in
# slimgrad/_library.py) as one op: without a formula, the products inside it went uncounted (a
# converted GPT-2's forward counted half its attention bmm FLOPs, and its count then depended on
# whether the step ran under a checkpoint, where the straight path's ATen ops are seen; a review).
# So the four ops that multiply matrices inside have formulas: the FLOPs of the products their
# implementations issue, 2·m·k·n per (m, k) @ (k, n) over the broadcast batch, as the table
# counts ``aten.bmm``/``aten.mm`` (torch.matmul's reshapes and bmm: the same count), each
# backward product only where its gradient is asked. Registered in torch's table (public:
# ``torch.utils.flop_counter.register_flop_formula``) once, by ``convert_`` (importing that module
# at slimgrad's import would slow every import: docs/measurements.md): a FlopCounterMode made after
# the first ``convert_`` counts them; slimgrad's own counters (the memory tracker,
# ``BackwardCounts``) run the implementations and count their ATen ops instead.
def _mm_flops(a, b) -> int:
    # (..., m, k) @ (..., k, n), batch dims broadcast
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    return 2 * math.prod(batch) * a[-2] * a[-1] * b[-1]


def _t(shape) -> tuple:
    return (*shape[:-2], shape[-1], shape[-2])


def _scores_shape(q, k_t) -> tuple:
    # S = q @ k_t's shape, batch dims broadcast
    return (*torch.broadcast_shapes(tuple(q[:-2]), tuple(k_t[:-2])), q[-2], k_t[-1])


def _sdm_fwd_flops(s, v, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(s, v)


def _sdm_bwd_flops(d_out, probs, bits, v, *args, out_shape=None, **kwargs) -> int:
    output_mask = kwargs["output_mask"] if "output_mask" in kwargs else args[-1]
    n = _mm_flops(d_out, _t(v)) if output_mask[0] else 0  # dD = dO @ V^T
    return n + (_mm_flops(_t(probs), d_out) if output_mask[1] else 0)  # dV = D^T @ dO


def _scores_flops(q, k_t, v, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(q, k_t) + _mm_flops(_scores_shape(q, k_t), v)


def _scores_bwd_flops(d_out, q, k_t, v, *args, out_shape=None, **kwargs) -> int:
    need_q, need_k, need_v = kwargs["needs"] if "needs" in kwargs else args[-1]
    s = _scores_shape(q, k_t)
    n = _mm_flops(q, k_t)  # S recomputed
    if need_q or need_k:
        n += _mm_flops(d_out, _t(v))  # dD
    if need_v:
        n += _mm_flops(_t(s), d_out)  # dV
    if need_q:
        n += _mm_flops(s, _t(k_t))  # dq = dS @ k
    if need_k:
        n += _mm_flops(_t(q), s)  # dk^T = q^T @ dS
    return n


_FLOPS_REGISTERED = False


def register_flop_formulas() -> None:
    """Register the attention ops' FLOP formulas with torch's FlopCounterMode, once (NOTE [The
    attention ops' FLOPs for FlopCounterMode])."""
    global _FLOPS_REGISTERED
    if _FLOPS_REGISTERED:
        return
    _FLOPS_REGISTERED = True
    try:
        from torch.utils.flop_counter import flop_registry, register_flop_formula
    except ImportError:  # pragma: no cover - depends on the torch release
        return
    ops = torch.ops.slimgrad
    for packet, formula in (
        (ops.softmax_dropout_matmul_fwd, _sdm_fwd_flops),
        (ops.softmax_dropout_matmul_bwd, _sdm_bwd_flops),
        (ops.scores_softmax_dropout_matmul, _scores_flops),
        (ops.scores_softmax_dropout_matmul_bwd, _scores_bwd_flops),
    ):
        if packet not in flop_registry:
            register_flop_formula(packet)(formula)

"""HF GPT-2's attention after the head split as one autograd node: the scores op, the head merge,
``c_proj`` and the residual dropout, ``dropout(merge(attend(q, k, v)) W_proj + b_proj)``.

Math: ``O = dropout_a(softmax(causal(q' k'^T))) V`` on the folded ``(B·H, T, d)`` operands
``q' = q sqrt(s)``, ``k'^T = k^T sqrt(s)`` (SDPA's math path, :func:`scores_softmax_dropout_matmul
<slimgrad.ops.softmax_dropout.scores_softmax_dropout_matmul>`), ``A = merge(O)`` (``(B, T, H·d)``,
HF's ``transpose(1, 2)`` then ``reshape``), ``Z = A W_proj + b_proj`` (HF ``Conv1D``, W ``(in,
out)``), ``out = dropout_r(Z)``. Backward: each step's backward in reverse order, the very functions
the per-op Functions run.

Memory: saves q', k'^T, V and the attention's dropout bits (1/8 B/elt of the scores; what the
scores op keeps), A (if W_proj needs grad; what ``c_proj`` keeps) and the residual dropout's bits
(1/8 B/elt of out): the per-op converted path's tensors, byte for byte (eager: q', k'^T, P, the
float noise and the dropped P, V, A and a float residual mask). All of it goes through
``save_for_backward``.

# NOTE [One node for GPT-2's attention output]
A converted GPT-2 attention ran the scores op's Function, four autograd view nodes for the head
merge (view, transpose, the contiguous copy, HF's reshape), ``c_proj``'s node and the residual
Dropout's Function: three Python forwards and backwards and five gradient hand-overs through the
engine per layer. :class:`_GPT2AttentionFn` runs the same steps in one Function, as NOTE [One node
for GPT-2's MLP] in ``ops/gpt2_mlp.py`` does for the MLP: each op's own Function ``forward`` on a
``_Step`` (a ``ctx`` stand-in), in the order the per-op path runs them, so the outputs, the saved
tensors and both dropout masks (the same draws from the same generator, after the same ops: the
attention's noise inside the scores op, then ``c_proj``'s addmm, then the residual noise) are the
per-op path's; one ``save_for_backward`` keeps every step's tensors (saved-tensor hooks and
checkpointing see each). Backward runs the residual dropout's, ``c_proj``'s and the scores op's
backward in reverse order on the same tensors; the gradient between ``c_proj`` and the scores op
takes the per-op path's layout (``view`` as ``(B, T, H, d)``, ``transpose(1, 2)``, ``reshape`` to
``(B·H, T, d)``: the copy the view node's backward made), so each product runs on operands of the
same strides and every gradient is the per-op path's bit for bit. Ownership: the block's
incoming gradient is taken (``ownership.grant``) as the per-op Dropout's backward takes it; the
gradients inside are the node's own.

What the node holds longer than the per-op path: ``c_proj``'s node released A when its backward
returned; the node holds A until the scores op's backward has run (B·T·H·d elements, the size of
the attention output). Where the scores op's backward is the step's peak, the peak is up to A's
bytes above the per-op path's (measured in ``tests/ops/test_gpt2_attention.py``).

# NOTE [GPT-2's attention node under dispatch modes]
The node is taken wherever the per-op path would run eagerly: dispatch modes included (the memory
tracker of ``slimgrad.memory.measure``, ``slimgrad.memory.estimate``'s ``FakeTensorMode``, a
profiler), as GPT-2's MLP node is (``ops/gpt2_mlp.py``). At first it asked the gate (NOTE [One
gate per call] in ``slimgrad/_library.py``), so every measured and every estimated step ran HF's
per-op forward while the unwatched step ran the node: the same saved bytes, but a peak up to A's
bytes apart (the functional at (2, 4, 13, 8): 31,857 B measured and planned, 33,209 B for the
node; ``tests/test_estimate_gpt2_attention.py``). The gate now only tells the node how to run its
steps (``direct``): passed, each step takes its straight path (the C dropout kernels, ``ctx``
fields); not passed, each takes its general path (the custom ops, ``save_for_backward``), the
very paths the per-op Functions take under a mode, with the same bits. The estimate's tensors are
``FakeTensor``s (a fake Parameter too): they pass the type checks as plain tensors do. Refused as
before: compiling, a ``torch.func`` transform, a TorchScript trace (the per-op path's rules
there), and the device rule: the node is CPU only, so a CUDA step runs the per-op path, and so
does an estimate with ``device="cuda"``, whose CPU fakes stand for CUDA tensors
(``device_rule.stands_for``). What the tracker cannot see is the straight steps' own allocations
(any watcher turns them off); they make the same tensors as the general steps.

GPT-2's ``ln_1`` and ``c_attn`` before the head split run as one node too
(``_GPT2LNConv1DFn``: NOTE [A LayerNorm folded into its consumer's node] in ``ops/gpt2_mlp.py``):
it saves what the per-op LayerNorm and ``c_attn`` keep (y, mean, rstd; y is ``c_attn``'s input).

Second derivatives: first derivatives only; ``create_graph=True`` gives them, differentiating them
raises a ``slimgrad.ops.gpt2_attention`` error, as the per-op scores op does.
"""

from __future__ import annotations

import importlib
import math

import torch

from slimgrad import _ext, ownership
from slimgrad._autograd import (
    backward_without_autocast,
    compiling,
    direct_apply,
    refuse_forward_ad,
    refuse_second_order,
    unwrap_if_dead,
)
from slimgrad._library import straight
from slimgrad.convert_handlers import device_rule
from slimgrad.kernels import _backend
from slimgrad.ops.gpt2_mlp import (
    _dropout_backward,
    _hand_out_saved,
    _release_saved,
    _save_steps,
    _Step,
    layer_norm_backward,
    layer_norm_forward,
)
from slimgrad.ops.linear import _FakeTensor, _LinearFn, fresh

__all__ = ["gpt2_attention"]

_dr = importlib.import_module("slimgrad.ops.dropout")
_sdm = importlib.import_module("slimgrad.ops.softmax_dropout")
_ScoresFn = _sdm._ScoresSoftmaxDropoutMatmulFn
_grad_on = torch._C.is_grad_enabled
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_Tensor = torch.Tensor
_API = "slimgrad.ops.gpt2_attention"
_EXT_BWD = None  # the C++ extension's gpt2_attention_bwd, once it is loaded
_EXT_CONV1D = None  # and its conv1d_bwd
_EXT_FWD = None  # and its gpt2_attention_fwd


def _use_extension(mod) -> None:
    global _EXT_BWD, _EXT_CONV1D, _EXT_FWD
    _EXT_BWD = getattr(mod, "gpt2_attention_bwd", None)
    _EXT_CONV1D = getattr(mod, "conv1d_bwd", None)
    _EXT_FWD = getattr(mod, "gpt2_attention_fwd", None)


_ext.when_loaded(_use_extension)


# NOTE [GPT-2's attention backward from C++]
# Where forward took every step's straight path on the dropout C kernels (the scores op's bmm
# case with ``lib``, the residual dropout's ``lib``: NOTE [Dropout's straight path] in
# ops/dropout.py) and backward runs on a plain gradient outside compile and dispatch modes (the
# conditions under which the Python body below takes those same straight paths), the extension's
# ``gpt2_attention_bwd`` (``_ext/backward.cpp``, NOTE [Backward bodies from C++]) issues the
# body's ATen ops from C++: the residual dropout's C pass (into dy where ``ownership.grant``
# granted it, as ``_dropout_backward``), ``c_proj``'s ``_LinearFn.backward`` for a 3-D input,
# the head merge's backward and the scores op's straight backward, the same ops on the same
# operands in the same order, each temporary dropped where Python drops it; the dropout passes
# call the same C function the Python body calls through ctypes (its address read once from
# that ctypes function). The same bits, buffers and peak; a dispatch mode (the tracker, the
# estimate's fake tensors) never gets here and runs the Python body as before. It returns None
# (the Python body then runs) for a tensor subclass, a torch function mode, a gradient that is
# not contiguous, or operands of other shapes. The ln_1 + c_attn node's c_attn step likewise
# (``conv1d_bwd``: ``_LinearFn.backward``'s ops for a Conv1D on a 3-D input, outside dispatch
# modes); its LayerNorm's backward stays in Python. Measured (tiny GPT-2, 12 x 64, 1 x 16 tokens,
# 1 thread, interleaved in one process): converted / eager step 1.148 -> 1.115 (load 11).
# tests/ops/test_gpt2_attention_ext.py compares the bodies bit for bit.


# NOTE [GPT-2's attention node's forward from C++]
# A forward past the gate (``direct``) whose dropout C kernels are built and chosen (the tables
# _straight_c reads: NOTE [Dropout's straight path] in ops/dropout.py) runs the steps'
# straight paths in the extension's ``gpt2_attention_fwd`` (``_ext/backward.cpp``): the scores
# op's bmm case with its C dropout, the head merge, ``c_proj``'s addmm and the residual dropout's
# C pass, the same ops on the same operands in the same order (eager's two draws from the
# default generator where the Python steps draw them), each temporary dropped where Python drops
# it. ``_ext_forward`` then fills each step's ``_Step`` with the fields and saved tensors the
# Python steps' forwards set on that path (TWIN of _ScoresSoftmaxDropoutMatmulFn.forward's bmm +
# C-kernel case, _LinearFn.forward's 3-D Conv1D case and _DropoutFn.forward's C case: change them
# together; tests/ops/test_gpt2_attention_ext.py runs both bodies and compares outputs, masks,
# gradients and bytes). None (a tensor subclass, a torch function mode, no C kernels): the
# Python steps run. Measured with benchmarks/gpt2_attention_ext_ab.py (tiny GPT-2, 1 thread,
# interleaved in one process): forward alone on / off 0.968; with both backward bodies,
# converted / eager 1.066 on against 1.174 off (load 9.6).


def _ext_forward(ctx, n, q, k_t, v, w, b, p_attn, causal, p_resid, heads):
    bk, cpu = _backend._resolved[0], _backend._cpu_module[0]
    if not ((bk == "auto" or bk == "cpu") and cpu is not None and _dr.C_STEM in cpu._libs):
        return None
    lib = cpu._libs[_dr.C_STEM]
    if lib is None:
        return None
    bb, h, t, d = heads
    dev = q.device
    drop_mask = None
    if causal:
        ck = (t, t, dev)
        drop_mask = _sdm._CAUSAL[ck] if ck in _sdm._CAUSAL else _sdm._causal_mask(*ck)
    scales = _dr._SCALES
    key_a, key_r = (p_attn, _dr._F32, dev), (p_resid, _dr._F32, dev)
    r = _EXT_FWD(
        q,
        k_t,
        v,
        w,
        b,
        p_attn,
        scales[key_a] if key_a in scales else _dr._scale(p_attn, q),
        drop_mask,
        p_resid,
        scales[key_r] if key_r in scales else _dr._scale(p_resid, q),
        bb,
        h,
        t,
        d,
        _dr.FWD_ADDR[lib] if lib in _dr.FWD_ADDR else _dr.c_addr(lib, "fwd"),
    )
    if r is None:
        return None
    y, bits_a, a, bits_r = r
    # the scores op's fields on its bmm + C-kernel path
    core = _Step()
    core.needs_input_grad = (n[0], n[1], n[2], False, False, False, False, False, False)
    core.lib, core.bmm, core.direct, core.n = lib, True, True, bb * h * t * t
    core.p, core.mm_dtype, core.causal, core.fused = p_attn, q.dtype, causal, False
    core.v_dtype, core.v_shape = v.dtype, v.shape
    core.to_save = (q, k_t, v, bits_a, None)
    # c_proj's (_LinearFn, a Conv1D on a 3-D input)
    proj = _Step()
    need = proj.needs_input_grad = (n[0] or n[1] or n[2], n[3], n[4], False, False)
    proj.w_in_out, proj.has_bias, proj.lead = True, True, a.shape[:-1]
    proj.to_save = (a if need[1] else None, w if need[0] else None)
    # the residual dropout's (_DropoutFn, its C case)
    drop = _Step()
    drop.p, drop.lib, drop.n, drop.k, drop.fused = p_resid, lib, y.numel(), None, False
    drop.to_save = (bits_r,)
    ctx.heads = heads
    _save_steps(ctx, (core, proj, drop))
    return y


def _ext_backward(ctx, dy, owned: bool):
    # NOTE [GPT-2's attention backward from C++]; None where it does not apply
    core, proj, drop = ctx.steps
    lib = drop.lib
    if not (
        lib is not None
        and core.lib is lib
        and core.bmm
        and core.direct
        and proj.lead is not None
        and type(dy) is _Tensor
        and not _dispatch_stack_len()
    ):
        return None
    q, k_t, v, bits_a, _, a, w, bits_r = ctx.saved_tensors
    b, h, t, d = ctx.heads
    dev = q.device
    scales = _dr._SCALES
    key_r, key_a = (drop.p, _dr._F32, dev), (core.p, _dr._F32, dev)
    causal = None
    if core.causal:
        ck = (t, t, dev)
        causal = _sdm._CAUSAL[ck] if ck in _sdm._CAUSAL else _sdm._causal_mask(*ck)
    nq, nk, nv = core.needs_input_grad[:3]
    na, nw, nb = proj.needs_input_grad[:3]
    return _EXT_BWD(
        dy,
        owned,
        bits_r,
        drop.n,
        scales[key_r] if key_r in scales else _dr._scale(drop.p, dy),
        a,
        w,
        na,
        nw,
        nb and proj.has_bias,
        q,
        k_t,
        v,
        bits_a,
        core.n,
        scales[key_a] if key_a in scales else _dr._scale(core.p, q),
        causal,
        nq,
        nk,
        nv,
        b,
        h,
        t,
        d,
        _dr.BWD_ADDR[lib] if lib in _dr.BWD_ADDR else _dr.c_addr(lib, "bwd"),
    )


def _backward(ctx, dy, owned: bool = False):
    if _EXT_BWD is not None:
        r = _ext_backward(ctx, dy, owned)
        if r is not None:
            dq, dk, dv, dw, db = r
            return dq, dk, dv, dw, db, None, None, None, None, None
    core, proj, drop = ctx.steps
    _hand_out_saved(ctx)
    g = _dropout_backward(drop, dy, owned)
    del dy
    # c_proj's gradient arrives as its 2-D product's (NOTE [Linear's 2-D product] in ops/linear.py)
    g2 = g.reshape(-1, g.shape[-1]) if proj.lead is not None else g
    del g
    da, dw, db = _LinearFn.backward(proj, g2)[:3]
    del g2
    dq = dk = dv = None
    if da is not None:
        b, h, t, d = ctx.heads
        # the head merge's backward, as its view nodes ran it: (B, T, H, d) -> (B, H, T, d) ->
        # (B·H, T, d), a contiguous copy (ViewBackward's reshape of a transposed gradient)
        d_out = da.view(b, t, h, d).transpose(1, 2).reshape(b * h, t, d)
        del da
        dq, dk, dv = _ScoresFn.backward(core, d_out)[:3]
        del d_out
    _release_saved(ctx.steps)
    return dq, dk, dv, dw, db, None, None, None, None, None


class _GPT2AttentionFn(torch.autograd.Function):
    # NOTE [One node for GPT-2's attention output]
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, q, k_t, v, w, b, p_attn, causal, p_resid, heads, direct):
        # q, k_t, v: the folded, scaled operands of HF's straight path (NOTE [HF attention's
        # straight path] in convert_handlers/hf_attention.py); heads: (B, H, T, d); direct: the
        # caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py), else each
        # step runs its general path (NOTE [GPT-2's attention node under dispatch modes])
        n = ctx.needs_input_grad
        if direct and _EXT_FWD is not None:
            # NOTE [GPT-2's attention node's forward from C++]
            y = _ext_forward(ctx, n, q, k_t, v, w, b, p_attn, causal, p_resid, heads)
            if y is not None:
                return y
        core = _Step()
        core.needs_input_grad = (n[0], n[1], n[2], False, False, False, False, False, False)
        out = _ScoresFn.forward(core, q, k_t, v, p_attn, q.dtype, causal, None, direct, True)
        bb, h, t, d = heads
        # _attention's return, then HF's reshape(..., -1).contiguous() (a view of the copy)
        a = out.view(bb, h, t, d).transpose(1, 2).contiguous().reshape(bb, t, h * d)
        del out
        proj = _Step()
        proj.needs_input_grad = (n[0] or n[1] or n[2], n[3], n[4], False, False)
        z = _LinearFn.forward(proj, a, w, b, True, direct)
        if proj.lead is not None:
            z = z.view(proj.lead + z.shape[-1:])
        del a
        drop = _Step()
        z = _dr._DropoutFn.forward(drop, z, p_resid, direct)
        ctx.heads = heads
        _save_steps(ctx, (core, proj, drop))
        return fresh(z)

    @staticmethod
    def backward(ctx, dy):
        if _grad_on():  # create_graph=True (NOTE [Second derivatives] in slimgrad/_autograd.py)
            return refuse_second_order("ops.gpt2_attention", _backward, ctx, (dy,))
        # first use of dy: NOTE [Gradient-buffer ownership], as the per-op Dropout's backward
        owned = not compiling() and ownership.grant(dy, ownership.PROBE)
        return _backward(ctx, dy, owned)


_GPT2_ATTENTION_APPLY = direct_apply(_GPT2AttentionFn)


def _ln_conv1d_backward(ctx, dy):
    ln, lin = ctx.steps
    _hand_out_saved(ctx)
    r = None
    if (
        _EXT_CONV1D is not None
        and lin.lead is not None
        and type(dy) is _Tensor
        and not _dispatch_stack_len()
    ):
        # c_attn's backward from C++ (NOTE [GPT-2's attention backward from C++]): None hands back
        x, w = lin.saved_tensors
        n = lin.needs_input_grad
        r = _EXT_CONV1D(dy, x, w, n[0], n[1], n[2] and lin.has_bias)
        del x, w  # as the Python body holds them: only in lin.saved_tensors
    if r is not None:
        dy_ln, dw, db = r
    else:
        # c_attn's gradient arrives as its 2-D product's (NOTE [Linear's 2-D product] in
        # ops/linear.py)
        g2 = dy.reshape(-1, dy.shape[-1]) if lin.lead is not None else dy
        dy_ln, dw, db = _LinearFn.backward(lin, g2)[:3]
        del g2
    del dy, r
    dx = dlw = dlb = None
    if dy_ln is not None:
        dx, dlw, dlb = layer_norm_backward(ln, dy_ln)
        del dy_ln
    _release_saved(ctx.steps)
    return dx, dlw, dlb, None, None, None, dw, db, None


class _GPT2LNConv1DFn(torch.autograd.Function):
    # NOTE [A LayerNorm folded into its consumer's node] in ops/gpt2_mlp.py: GPT-2's ln_1, then
    # c_attn (HF Conv1D: addmm on the 2-D view), as the per-op path runs them
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, arg, eps, y_kept_after, w, b, direct):
        n = ctx.needs_input_grad
        ln, y = layer_norm_forward(n, x, arg, ln_w, ln_b, eps, y_kept_after, direct)
        lin = _Step()
        lin.needs_input_grad = (n[0] or n[1] or n[2], n[6], n[7], False, False)
        z = _LinearFn.forward(lin, y, w, b, True, direct)
        if lin.lead is not None:
            z = z.view(lin.lead + z.shape[-1:])
        del y
        _save_steps(ctx, (ln, lin))
        return fresh(z)

    @staticmethod
    def backward(ctx, dy):
        if _grad_on():  # create_graph=True (NOTE [Second derivatives] in slimgrad/_autograd.py)
            return refuse_second_order("ops.gpt2_attention", _ln_conv1d_backward, ctx, (dy,))
        return _ln_conv1d_backward(ctx, dy)


_GPT2_LN_CONV1D_APPLY = direct_apply(_GPT2LNConv1DFn)
# the estimate's fake tensors (a fake Parameter is a FakeTensor) take the node as real ones do
# (NOTE [GPT-2's attention node under dispatch modes])
_PLAIN = (torch.Tensor, torch.nn.Parameter, _FakeTensor)
_WEIGHT = (torch.nn.Parameter, _FakeTensor)
_F32 = torch.float32
_C = torch._C
_any_autocast = _C._is_any_autocast_enabled
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing


def block_ok(q, k, v, w, b, p_attn, p_resid) -> bool:
    """Whether the one-node path applies to heads ``q``, ``k``, ``v`` (``(B, H, T, d)``): eager
    (not compiling, no ``torch.func`` transform or TorchScript trace; dispatch modes such as the
    memory tracker and ``slimgrad.memory.estimate``'s fake tensors take it too), grad mode on
    without autocast, float32 CPU tensors (plain or the estimate's fake ones, not standing for
    another device) of one shape without zero sizes, both dropout probabilities in (0, 1), and a
    2-D ``c_proj`` weight ``(H·d, out)`` with a bias."""
    return (
        not compiling()  # first: Dynamo folds it and traces nothing after it here
        and type(p_attn) is float
        and 0.0 < p_attn < 1.0
        and type(p_resid) is float
        and 0.0 < p_resid < 1.0
        and type(q) in _PLAIN
        and type(k) in _PLAIN
        and type(v) in _PLAIN
        and type(w) in _PLAIN
        and type(b) in _PLAIN
        and q.ndim == 4
        and q.shape == k.shape
        and q.shape == v.shape
        and 0 not in q.shape
        and q.is_cpu
        and q.dtype is _F32
        and k.dtype is _F32
        and v.dtype is _F32
        and w.dtype is _F32
        and b.dtype is _F32
        and w.ndim == 2
        and w.shape[0] == q.shape[1] * q.shape[3]
        and b.shape == w.shape[1:]
        and device_rule._STANDS_FOR.get() is None  # the device rule: CPU only
        and _grad_on()
        and not _any_autocast()
        and not _functorch_on()
        and not _is_tracing()
    )


def apply(q, k, v, w, b, root: float, p_attn: float, p_resid: float) -> torch.Tensor:
    """The node on heads :func:`block_ok` accepted: HF's straight-path operands (NOTE [HF
    attention's straight path]), then :class:`_GPT2AttentionFn`."""
    bb, h, t, d = q.shape
    bh = bb * h
    vc = v.contiguous()  # a copy is plain too; v itself may be a dead wrapper
    if vc is v:
        vc = unwrap_if_dead(vc)
    return _GPT2_ATTENTION_APPLY(
        (q * root).reshape(bh, t, d),
        (k.mT * root).reshape(bh, d, t),  # mT: transpose(-2, -1)
        vc.view(bh, t, d),
        w,
        b,
        p_attn,
        t > 1,
        p_resid,
        (bb, h, t, d),
        straight(),
    )


def gpt2_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    c_proj_weight: torch.Tensor,
    c_proj_bias: torch.Tensor,
    scaling: float | None = None,
    attn_p: float = 0.1,
    resid_p: float = 0.1,
    training: bool = True,
) -> torch.Tensor:
    """HF GPT-2's causal self-attention after the head split: ``dropout(merge(attend(query, key,
    value)) @ c_proj_weight + c_proj_bias, resid_p)``, one autograd node where it applies (NOTE
    [One node for GPT-2's attention output]).

    ``attend`` is SDPA's math path with dropout ``attn_p`` (causal where ``T > 1``), as HF's
    ``sdpa_attention_forward`` computes it on CPU; ``merge`` is HF's ``transpose(1, 2)`` and
    ``reshape`` to ``(B, T, H·d)``. Values and gradients equal the per-op path (the scores op,
    ``Conv1D``, ``Dropout``) bit for bit, the same dropout masks at the same RNG state.

    Memory: saves the scaled q and k^T, value, the attention's dropout bits (1/8 B/elt of the
    scores), the merged attention output (``c_proj``'s input) and the residual dropout bits (1/8
    B/elt of the output): what the per-op ops keep, together.

    Args:
        query, key, value: ``(B, H, T, d)``.
        c_proj_weight: ``(H·d, out)`` (HF ``Conv1D`` layout); c_proj_bias: ``(out,)``.
        scaling: the softmax scale; None: ``1 / sqrt(d)``.
        attn_p: the attention dropout probability. resid_p: the residual dropout probability.
        training: dropout on (as ``F.dropout``'s ``training``).

    Returns:
        ``(B, T, out)``.

    Raises:
        ValueError: a probability outside [0, 1] or a negative ``scaling``.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 7, 8, requires_grad=True) for _ in range(3))
        >>> y = gpt2_attention(q, k, v, torch.randn(32, 32), torch.zeros(32))
    """
    _dr._check_p("ops.gpt2_attention", attn_p)
    _dr._check_p("ops.gpt2_attention", resid_p)
    if scaling is not None and not scaling >= 0:
        raise ValueError(
            f"{_API}: scaling must be >= 0; expected a non-negative float or None, got "
            f"{scaling!r}. Pass None for 1/sqrt(head size)."
        )
    # as HF's straight path (_roots in convert_handlers/hf_attention.py): math.sqrt, not ** 0.5
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    root = math.sqrt(scale)
    p_a, p_r = float(attn_p) if training else 0.0, float(resid_p) if training else 0.0
    if block_ok(query, key, value, c_proj_weight, c_proj_bias, p_a, p_r):
        return apply(query, key, value, c_proj_weight, c_proj_bias, root, p_a, p_r)
    from slimgrad.ops.dropout import dropout
    from slimgrad.ops.linear import conv1d_addmm

    b, h, t, d = query.shape
    out = _sdm.scores_softmax_dropout_matmul(query * root, key.mT * root, value, p_a, causal=t > 1)
    a = out.transpose(1, 2).contiguous().reshape(b, t, h * d)
    return dropout(conv1d_addmm(a, c_proj_weight, c_proj_bias), p_r, training)


def ln_conv1d_ok(x, w, b) -> bool:
    """Whether ``c_attn`` (weight ``w`` ``(C, 3C)``, bias ``b``) on a LayerNorm's output of ``x``
    runs in :class:`_GPT2LNConv1DFn`: the LayerNorm's own checks (``ops.gpt2_mlp.ln_ok``) are
    the caller's; here float32 CPU ``x`` of 3 dims (plain or the estimate's fakes), not standing
    for another device, and a float32 2-D weight with a bias; eager and grad mode on, as
    :func:`block_ok`, which the attention after it passed."""
    return (
        type(x) in _PLAIN
        and type(w) in _WEIGHT
        and type(b) in _WEIGHT
        and x.ndim == 3
        and x.dtype is _F32
        and x.is_cpu
        and 0 not in x.shape
        and w.dtype is _F32
        and b.dtype is _F32
        and w.ndim == 2
        and w.shape[0] == x.shape[-1]
        and b.shape == w.shape[1:]
    )


def ln_conv1d(x, ln_w, ln_b, arg, eps: float, y_kept_after: bool, w, b) -> torch.Tensor:
    """``c_attn(ln_1(x))`` as one node (:class:`_GPT2LNConv1DFn`), on arguments
    :func:`ln_conv1d_ok` and ``ops.gpt2_mlp.ln_ok`` accepted."""
    return _GPT2_LN_CONV1D_APPLY(
        unwrap_if_dead(x), ln_w, ln_b, arg, eps, y_kept_after, w, b, straight()
    )


# this module is imported after slimgrad's own import (NOTE [Forward-mode AD is refused], NOTE
# [Backward without autocast])
refuse_forward_ad()
backward_without_autocast()

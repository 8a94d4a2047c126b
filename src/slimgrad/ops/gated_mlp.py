"""Gated MLP (SwiGLU, GeGLU): ``down(act(gate(x)) * up(x))`` keeping the two pre-activations.

Math: ``g = x Wg^T + bg``, ``u = x Wu^T + bu`` (or one ``gate_up`` projection whose last dimension
is split in two halves, gate first: HF Phi-3), ``h = act(g) * u``, ``y = h Wd^T + bd``, with
``act`` one of SiLU (``'silu'``), erf GELU (``'gelu'``) and tanh GELU (``'gelu_tanh'``).
Backward: ``dh = dy Wd``, ``dWd = dy^T h``, ``du = dh * act(g)``, ``dg = act'(g) (dh * u)``,
``dWg = dg^T x``, ``dWu = du^T x``, ``dx = dg Wg + du Wu``.

The forward runs eager's own ops in eager's order (``F.linear``, ``F.silu``/``F.gelu``, ``*``), so
the output is eager's bit for bit in every dtype and under ``torch.autocast``. The backward
recomputes ``a = act(g)`` and ``h = a * u`` (the same bits as forward's) and then runs eager's
gradient formulas (``aten.silu_backward``/``gelu_backward``, the products, the matmuls) on the
same operands, autocast's casts included: on CPU the gradients are eager's bits (tested in fp32,
bf16, fp16 and autocast), up to the order in which autograd sums ``x``'s contributions when x has
other consumers. Extra work: one activation and one product per element; no matmul is redone.

Memory (per token; D = hidden, I = intermediate size, s = bytes/elt of the matmuls' dtype, s_x of
``x``'s): saves x (D s_x) + g (I s) + u (I s) = D s_x + 2 I s; eager saves x + g, act(g), u and
h = D s_x + 4 I s (fp32 at I = 2048: 16 KiB + D s_x per token, eager 32 KiB + D s_x).
Under autocast eager keeps two casts of x (one per projection, 2 D s) and a cast of every
weight (and autocast's cache holds every weight's cast until the region exits); this op keeps x
as given (often already kept by the norm before it) and casts each leaf weight itself for its
matmul, drops the cast, and casts again in backward (no weight cast outlives its matmul); the
gradients reach the weights through slimgrad's cast nodes, one per weight per region as
autocast's cache, so a weight used twice in one region sums in the autocast dtype as in eager
(NOTE [Autocast weight casts] in ``ops/linear.py``). A weight that is not a leaf keeps eager's
behaviour (autocast's cast, kept).
Selective saving: x is kept only if Wg or Wu needs a gradient; g and u only if anything before
``h`` (x, Wg, bg, Wu, bu) does; if only Wd needs a gradient, h alone (I s) is kept (eager: the
same); weights are referenced only where the gradient of their input is needed. The tracker
counts all it keeps in the matmul-input floor (``_slimgrad_floor``): x, and g and u standing in
for h, down's input (h is a function of g and u, and no single tensor of I elements gives eager's
gradients of g and u).

:func:`glu` and :func:`glu_linear` are the same op from given ``gate``/``up`` (when a projection is
a module slimgrad does not see through, e.g. a PEFT LoRA layer, ``slimgrad.nn.GatedMLP`` calls it
and hands its output here): they save g and u (the product is recomputed), eager saves g,
act(g), u and h.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad import _ext
from slimgrad._autograd import (
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    refuse_second_order,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._compile import recompute_in_backward
from slimgrad._library import custom_op
from slimgrad.ops.linear import (
    _autocast_cast,
    _top_hooks,
    autocast_weight,
    keeps_master,
    later_ok,
)
from slimgrad.ops.linear import _bwd_torch as _linear_bwd

__all__ = ["ACTIVATIONS", "gated_mlp", "gated_mlp_fused", "glu", "glu_linear", "lean_wins"]

#: The activations this op computes bit for bit: SiLU, erf GELU, tanh GELU (``F.gelu``'s).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


_silu = torch._C._nn.silu  # F.silu's kernel without its Python frame (the same bits)
_silu_bwd_into = torch.ops.aten.silu_backward.grad_input


def _act(g: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return _silu(g) if type(g) is Tensor else F.silu(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


_C = torch._C
_is_compiling = compiling  # NOTE [One-frame compile check] in slimgrad/_autograd.py
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing
_any_autocast = _C._is_any_autocast_enabled
_grad_on = _C.is_grad_enabled

# NOTE [The lean MLP ops refuse second derivatives]
# The gated MLP op and GPT-2's MLP node keep what first derivatives need and no more: a frozen
# projection's input, a cast of x nobody's gradient reads. A double backward would need them on
# every first-order call (+18-37% saved bytes for attention-only LoRA), so differentiating their
# first derivatives raises this error instead; the fix names the switch that really leaves the
# MLPs to torch (their handlers sit under ConvertConfig's ``activations`` field).
_DOUBLE_FIX = (
    "the lean MLP op does not support second derivatives; convert with "
    "ConvertConfig(activations=False) (MLPs and activations stay torch's), or leave this MLP "
    "unconverted with convert_(model, filter_fn=...)"
)
_PLAIN = (Tensor, torch.nn.Parameter)
_Parameter = torch.nn.Parameter
_NO_CONTEXT = contextlib.nullcontext()
_EXT_BWD = None  # the C++ extension's gated_mlp_bwd, once it is loaded
_ACT_CODE = {"silu": 0, "gelu": 1, "gelu_tanh": 2}  # its activation argument


def _use_extension(mod) -> None:
    global _EXT_BWD
    _EXT_BWD = getattr(mod, "gated_mlp_bwd", None)


_ext.when_loaded(_use_extension)


def _act_bwd(da: Tensor, g: Tensor, activation: str, out: Tensor) -> Tensor:
    # act'(g) * da written into ``out`` (``da`` itself, or a slice of the fused gradient)
    if activation == "silu":
        return torch.ops.aten.silu_backward.grad_input(da, g, grad_input=out)
    approx = "tanh" if activation == "gelu_tanh" else "none"
    return torch.ops.aten.gelu_backward.grad_input(da, g, approximate=approx, grad_input=out)


def lean_wins(
    n: int, d: int, i: int, do: int, path: str = "straight", sizes: tuple | None = None
) -> bool:
    """Whether the block's backward peaks at most at eager's for ``n`` tokens of ``d`` features,
    intermediate size ``i`` and ``do`` outputs, on ``path`` ``'straight'`` (no biases),
    ``'general'``, ``'fused'`` or ``'autocast'`` (NOTE [The gated MLP's peak against eager's];
    ``'autocast'``: NOTE [The gated MLP's peak under autocast], with ``sizes`` the bytes per
    element of x, of autocast's dtype and of the weights)."""
    if path == "autocast":
        ours, eager = _autocast_peaks(n, d, i, do, *sizes)
        return ours <= eager
    t, w, o, od = n * i, d * i, n * d, n * do
    if path == "fused":
        return max(5 * t + od, 4 * t + 2 * w + o + od) <= max(5 * t + od, 6 * t, 2 * t + 2 * w + o)
    two = o if path == "general" else 0  # dx and dx_u live during dWu's matmul
    s3 = 3 * t + w + o + od
    return max(s3 + t, s3 + w + two, s3 + o) <= max(
        5 * t + od, 6 * t, 3 * t + w + o, t + 2 * w + 2 * o
    )


# NOTE [The gated MLP's peak against eager's]
# Eager frees each node's saved tensors as its node finishes: after down's backward h and dy,
# after the product's a and u, after the activation's g. This op is one node: it holds g, u and
# dy until its last matmul, when the three weight gradients (each d i or do i elements) are live.
# In elements, with t = n i, w = d i, o = n d, od = n do and down's weight gradient (common to
# both) left out, the op's backward peaks at
#     slimgrad: max(4t + w + o + od, 3t + 2w + o + od, 3t + w + 2o + od)
#               (dWg's matmul; dWu's; the product du Wu before its sum into dx)
#     eager:    max(5t + od, 6t, 3t + w + o, t + 2w + 2o)
#               (dh with h, g, a, u, dy; the product's du and da; up's backward; gate's)
# over what else is live then, the same for both (the rest of the step saves the same tensors).
# The general path (biases, autocast, mixed dtypes) allocates x's two gradients apart: + o in
# dWu's term. Fused (Phi-3: one (n, 2i) projection gu kept; eager keeps gu, a and h and frees gu
# after the activation's node): slimgrad max(5t + od, 4t + 2w + o + od) (h beside the gradient
# dgu; dWgu's matmul), eager max(5t + od, 6t, 2t + 2w + o), w = d i.
# These are the tracker's counts (Linear -> LlamaMLP -> Linear, fp32: exact at (32, 64, 18),
# where slimgrad's is 7,168 B above eager's, and at (256, 688, 512), where it is 1,064,960 B
# below). When the weight gradients dominate (few tokens), holding g and u costs 2t over eager;
# with many tokens eager's 6t dominates and this op saves 2t or more. ``lean_wins`` compares the
# two from the shapes' integers; where slimgrad's is higher, gated_mlp and GatedMLP run eager's
# modules (the same bits, eager's bytes, or fewer with converted submodules); the functions here
# are the lean op as asked for.


# NOTE [The gated MLP's peak under autocast]
# Under autocast (fp32 leaf weights, a non-leaf x of more bytes per element than autocast's dtype,
# no biases, not fused, every gradient asked for: HF Llama's MLP under bf16 autocast), the two
# sides keep and allocate tensors of three sizes, so the comparison is in bytes. With T = n i s
# (a pre-activation in autocast's dtype, s bytes), Wb = d i s and Wdb = do i s (a weight's cast or
# its gradient in that dtype), Wf = d i sw and Wdf = do i sw (a weight's gradient in the
# weights' dtype), Ob = n d s and Of = n d sx (x or its gradient, cast or in x's dtype), Yb = n do s
# (dy), the op's backward (x, g, u and dy held until it returns; each weight's gradient handed
# back in autocast's dtype to its cast node, which casts it after the op returns) peaks at
#     slimgrad: max(Of + Yb + 4T + 2Wdb                 (dh's matmul)
#                   Of + Yb + 4T + Wdb + 2Ob + 2Wb      (dWg's matmul)
#                   Of + Yb + 3T + Wdb + 3Ob + 3Wb      (dWu's matmul)
#                   2Of + 2Ob + Yb + 2T + Wdb + 2Wb     (x's gradient cast back)
#                   Of + Wdb + 2Wb + Wdf, Of + 2Wb + Wdf + Wf,
#                   Of + Wb + Wdf + 2Wf)                (the weights' gradients cast back)
#     eager:    max(2Ob + 2Wb + 2Wdb + 5T + Yb          (down's backward: x's two casts, the
#                                                        weights' casts, g, a, u, h, dh)
#                   2Ob + 2Wb + Wdb + Wdf + 4T          (dWd cast back)
#                   2Ob + 2Wb + Wdf + 6T                (the product's backward)
#                   3Ob + 3Wb + Wdf + 3T                (up's backward)
#                   2Ob + 2Wb + Wdf + 2T + Of, Ob + 2Wb + Wdf + Wf + 2T + Of
#                   Ob + Wb + Wdf + Wf + 3T + Of        (the activation's backward)
#                   2Ob + 2Wb + Wdf + Wf + T + Of       (gate's backward)
#                   Ob + Wb + Wdf + Wf + 2Of            (x's second gradient cast back; autograd
#                                                        sums the two in place)
#                   Wb + Wdf + 2Wf + Of)
# over what else is live, the same for both: eager frees x after forward where this op keeps
# it, and keeps x's two casts instead (2Ob = Of for fp32 x under a 16-bit autocast; counted as
# this op's, so where a norm before the MLP keeps x too the op's side is Of lower than counted).
# These are the tracker's counts exactly (tests/ops/test_gated_mlp_autocast.py: several shapes,
# both sides). Element counts (the 'general' path) ignored the weights' casts eager keeps and
# ran eager's ops where the op is lower: HF Llama's MLP under bf16 autocast (64 tokens, 64 wide,
# intermediate 128) kept eager's 81,920 B where the op keeps 49,152 (x, g and u).
def _autocast_peaks(n, d, i, do, sx, s, sw) -> tuple[int, int]:
    t, wb, wdb, wf, wdf = n * i * s, d * i * s, do * i * s, d * i * sw, do * i * sw
    ob, of, yb = n * d * s, n * d * sx, n * do * s
    ours = max(
        of + yb + 4 * t + 2 * wdb,
        of + yb + 4 * t + wdb + 2 * ob + 2 * wb,
        of + yb + 3 * t + wdb + 3 * ob + 3 * wb,
        2 * of + 2 * ob + yb + 2 * t + wdb + 2 * wb,
        of + wdb + 2 * wb + wdf,
        of + 2 * wb + wdf + wf,
        of + wb + wdf + 2 * wf,
    )
    eager = max(
        2 * ob + 2 * wb + 2 * wdb + 5 * t + yb,
        2 * ob + 2 * wb + wdb + wdf + 4 * t,
        2 * ob + 2 * wb + wdf + 6 * t,
        3 * ob + 3 * wb + wdf + 3 * t,
        2 * ob + 2 * wb + wdf + 2 * t + of,
        ob + 2 * wb + wdf + wf + 2 * t + of,
        ob + wb + wdf + wf + 3 * t + of,
        2 * ob + 2 * wb + wdf + wf + t + of,
        ob + wb + wdf + wf + 2 * of,
        wb + wdf + 2 * wf + of,
    )
    return ours, eager


def _fwd_torch(x, wg, bg, wu, bu, wd, bd, activation: str, fused: bool) -> Tensor:
    # eager's composition (HF LlamaMLP's forward; Phi3MLP's for ``fused``), op for op
    if fused:
        g, u = F.linear(x, wg, bg).chunk(2, dim=-1)
        return F.linear(u * _act(g, activation), wd, bd)
    return F.linear(_act(F.linear(x, wg, bg), activation) * F.linear(x, wu, bu), wd, bd)


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    # the cast autocast made in forward for a matmul that ran in ``dtype``: the same bits
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _to(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    # a gradient back to its input's dtype (eager: the cast's ToCopyBackward)
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


def _dtypes(*ts) -> tuple:
    out = []  # a loop, not a generator: one frame per call instead of one per element
    for t in ts:
        out.append(None if t is None else t.dtype)
    return tuple(out)


def _act_into(g: Tensor, activation: str, out: Tensor | None) -> Tensor:
    # act(g) (forward's bits: the same kernel), into ``out`` when given
    if out is None:
        return _act(g, activation)
    if activation == "silu":
        return torch.ops.aten.silu.out(g, out=out)
    approx = "tanh" if activation == "gelu_tanh" else "none"
    return torch.ops.aten.gelu.out(g, approximate=approx, out=out)


def _glu_bwd(dy, g, u, h, wd, down: bool, need_gu, nwd, nbd, has_bd, act, fused: bool = False):
    # (dg, du, dWd, dbd) from the kept g, u (or h alone); every product as eager's, on the same
    # operands: a = act(g) and h = a * u are forward's bits, du = dh * a, dg = act'(g)(dh * u).
    # Products are written into this backward's own buffers (a, dh). ``fused``: dg and du are
    # written into the two halves of one (*, 2 I) gradient, returned as dg (du None): the
    # gate_up projection's gradient (eager: a cat of the two).
    dg = du = dwd = dbd = None
    dgu = None
    if fused and need_gu:
        n = g.shape[-1]
        dgu = g.new_empty((*g.shape[:-1], 2 * n))
    if g is not None and torch.compiler.is_compiling():  # NOTE [slimgrad ops under torch.compile]
        a = _act_recompute(g, act)  # opaque: the joint graph's CSE would keep forward's act(g)
        if dgu is not None:
            a = dgu[..., n:].copy_(a)
    else:
        a = _act_into(g, act, None if dgu is None else dgu[..., n:]) if g is not None else None
    if down:
        if nwd or nbd:
            if nwd and h is None:
                h = a * u
            _, dwd, dbd = _linear_bwd(dy, h, None, has_bd, False, (False, nwd, nbd))
            h = None
        if not need_gu:
            return dg, du, dwd, dbd
        dh, _, _ = _linear_bwd(dy, None, _cast(wd, dy.dtype), False, False, (True, False, False))
        du = a.mul_(dh)
        da = dh.mul_(u)
    else:  # glu: dy is dh, the caller's
        du = a.mul_(dy)
        da = dy * u
    del a
    if dgu is not None:
        _act_bwd(da, g, act, dgu[..., :n])
        return dgu, None, dwd, dbd
    return _act_bwd(da, g, act, da), du, dwd, dbd


@custom_op("glu_act_recompute", mutates_args=())
def _act_recompute(g: Tensor, activation: str) -> Tensor:
    # act(g) in backward under torch.compile (NOTE [slimgrad ops under torch.compile]); the same
    # kernel on the same g as forward's: the same bits
    return _act(g, activation).contiguous()


@_act_recompute.register_fake
def _(g, activation):
    return g.new_empty(g.shape)


# NOTE [The gated MLP traced under torch.compile]
# Compiled, the gated MLP's float32 lean case is eager's own ops: g and u are ``F.linear``'s
# outputs outside any checkpoint, and ``down(act(g) * u)`` runs inside a non-reentrant
# ``torch.utils.checkpoint`` (:func:`_glu_down_checkpointed`). Under torch.compile what a Function
# saves is no constraint (NOTE [slimgrad ops under torch.compile] in slimgrad/_compile.py): the
# min-cut partitioner keeps what the joint graph's backward reads and cannot recompute. Eager's
# ops alone keep act(g) and the product h besides g and u: h feeds the down projection, whose
# weight gradient (an mm) reads it in backward, and the partitioner never recomputes a value that
# an op outside a fusion reads there. Inside the checkpoint every op is tagged "recompute": its
# inputs g and u are kept, act(g) and h are made again in backward (fused with their consumers),
# so the graph keeps x, g and u, what the uncompiled op keeps, with no custom op in the graph
# (the ``_GatedMLPFn`` path traced ``glu_act_recompute``, an opaque call per MLP per step, so
# that the joint graph's CSE would not keep forward's act(g)). The backward is autograd's on
# eager's ops: compiled eager's formulas (``tests/test_compile_gated_mlp.py``).


def _glu_down(g: Tensor, u: Tensor, wd: Tensor, bd: Tensor | None, activation: str, fused: bool):
    # eager's ops after the projections (HF LlamaMLP; Phi3MLP's operand order for ``fused``)
    if fused:
        return F.linear(u * _act(g, activation), wd, bd)
    return F.linear(_act(g, activation) * u, wd, bd)


def _glu_down_checkpointed(x, wg, bg, wu, bu, wd, bd, activation: str, fused: bool) -> Tensor:
    # NOTE [The gated MLP traced under torch.compile]; no RNG inside, so none is restored
    if fused:
        g, u = F.linear(x, wg, bg).chunk(2, dim=-1)
    else:
        g, u = F.linear(x, wg, bg), F.linear(x, wu, bu)
    return recompute_in_backward(_glu_down, g, u, wd, bd, activation, fused)


def _compiled_lean(args: tuple) -> bool:
    # the compiled lean case (NOTE [The gated MLP traced under torch.compile]), on facts the
    # trace sees as constants (types, dtypes, requires_grad, grad mode, autocast, transforms)
    if not _grad_on() or _any_autocast() or transforms_active():
        return False
    grad = False
    for t in args:
        if t is None:
            continue
        if type(t) not in _PLAIN or t.dtype != torch.float32:
            return False
        grad = grad or t.requires_grad
    return grad


def _autocast_args(x: Tensor, args: tuple) -> tuple:
    # (x, ...weights and biases...) -> the same with each bias as autocast hands it to the matmul
    # (its cached cast for an fp32 leaf) and each weight that is a leaf as its cast token (None
    # without a recorded gradient), then the masters (the leaf weights, which the op casts
    # itself), one per weight (args[1::2] after x), None where there is no autocast or the weight
    # is not a leaf (eager's behaviour: autocast's cast, kept), then the autocast dtype or None
    # (NOTE [Autocast weight casts] in ops/linear.py)
    n = (len(args) - 1) // 2
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return (*args, *([None] * n), None)
    dt = torch.get_autocast_dtype(dev)
    out, masters = [args[0]], []
    for w, b in zip(args[1::2], args[2::2], strict=True):
        keep = keeps_master(w, dt)
        out += [autocast_weight(w, dt) if keep else _autocast_cast(w, dev, dt)]
        out += [_autocast_cast(b, dev, dt)]
        masters.append(w if keep else None)
    return (*out, *masters, dt)


def _mm_weight(w: Tensor | None, master: Tensor | None, dt) -> Tensor | None:
    # the weight a forward matmul reads: the leaf cast here (freed after its matmul) when kept
    return w if master is None else master.to(dt)


def _records(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


# NOTE [x's gradient under autocast]
# Eager casts x's two gradients (one per projection, in autocast's dtype) back to x's dtype and
# autograd sums them: fp32(dxg) + fp32(dxu). The op makes dxg, runs up's matmuls, and only then
# casts dxg back and adds dxu into it in place: for an fp32 (or fp64) x, ``add_`` of the 16-bit
# dxu computes fp32(dxu) exactly and adds in fp32, the same bits without the cast's buffer.
# Casting dxg back before up's matmuls held x's dtype's gradient through them: at 256 tokens,
# 688 wide, intermediate 512 under bf16 autocast the op's backward peaked 172,032 B above eager's
# (6,070,280 B against 5,898,248); now 5,718,024 (NOTE [The gated MLP's peak under autocast]).
# A 16-bit x other than autocast's dtype keeps the cast (fp16 + bf16 would round once more).


class _GatedMLPFn(torch.autograd.Function):
    _slimgrad_floor = True

    @staticmethod
    def forward(
        ctx, x, wg, bg, wu, bu, wd, bd, mg, mu, md, dt, activation: str, fused: bool, later=None
    ):
        # m*: the fp32 leaf weights under autocast (dt: autocast's dtype), w* then their cast
        # tokens (NOTE [Autocast weight casts] in ops/linear.py): each master is cast here for its
        # matmul and dropped, kept and re-cast in backward; the tokens carry the gradients.
        # ``later``: a list where the down product is left to run after the saves (NOTE [The down
        # product after the saves]), or None
        nx, nwg, nbg, nwu, nbu, nwd, _ = ctx.needs_input_grad[:7]
        # _mm_weight and _act inline
        gu = F.linear(x, wg if mg is None else mg.to(dt), bg)
        if fused:  # Phi-3: gate, up = gate_up_proj(x).chunk(2, dim=-1)
            g, u = gu.chunk(2, dim=-1)
        else:
            g, u = gu, F.linear(x, wu if mu is None else mu.to(dt), bu)
        # eager: act(g) * u (Phi-3: u * act(g)); the same bits
        a = _silu(g) if activation == "silu" and type(g) is Tensor else _act(g, activation)
        h = a.mul_(u)
        if later is None:
            y = F.linear(h, wd if md is None else md.to(dt), bd)
        else:  # NOTE [The down product after the saves]: y's buffer now, its values after
            w = wd if md is None else md  # the master's cast made at the product, not held
            later.append((h, w, None if md is None else dt))  # through the saves
            y = h.new_empty((*h.shape[:-1], w.shape[0]))
        need_gu = nx or nwg or nbg or nwu or nbu
        ctx.activation, ctx.fused = activation, fused
        ctx.has = (bg is not None, bu is not None, bd is not None)
        ctx.mm_dtypes = (g.dtype, u.dtype)
        ctx.in_dtypes = (  # _dtypes(x, wg, bg, wu, bu, wd, bd), without its calls
            x.dtype,
            None if wg is None else wg.dtype,
            None if bg is None else bg.dtype,
            None if wu is None else wu.dtype,
            None if bu is None else bu.dtype,
            None if wd is None else wd.dtype,
            None if bd is None else bd.dtype,
        )
        # every input, weight and matmul in one dtype, no master weights (no autocast): the
        # backward's casts (_cast, _to) are identities, skipped
        dts, gdt = ctx.in_dtypes, g.dtype
        ctx.one_dtype = (
            mg is None
            and mu is None
            and md is None
            and u.dtype == gdt
            and dts[0] == gdt
            and dts[1] in (None, gdt)
            and dts[2] in (None, gdt)
            and dts[3] in (None, gdt)
            and dts[4] in (None, gdt)
            and dts[5] in (None, gdt)
            and dts[6] in (None, gdt)
        )
        # autocast caches the cast of a leaf that requires grad: both projections then read one
        # cast of x, whose two gradients eager sums before casting back. Not under torch.compile
        # (dynamo cannot trace _is_view; compiled graphs keep eager's casts: masters are None)
        ctx.x_cast_cached = (  # autocast's cache condition
            x.dtype == torch.float32
            and x.is_leaf
            and x.requires_grad
            and not compiling()
            and not x._is_view()
            and torch.is_autocast_cache_enabled()
        )
        # the usual training call, whose backward runs straight (every input but the biases needs
        # a gradient, none given, one dtype, not fused): NOTE [The gated MLP's straight backward]
        ctx.straight = (
            ctx.one_dtype
            and not fused
            and nx
            and nwg
            and nwu
            and nwd
            and bg is None
            and bu is None
            and bd is None
        )
        ctx.save_for_backward(
            x if (nwg or nwu) else None,
            gu if need_gu else None,
            u if need_gu and not fused else None,
            h if nwd and not need_gu else None,
            (wg if mg is None else mg) if nx else None,
            (wu if mu is None else mu) if nx and not fused else None,
            (wd if md is None else md) if need_gu else None,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        # first_order("ops.gated_mlp") inline, one frame fewer (NOTE [Second derivatives] in
        # slimgrad/_autograd.py)
        if _grad_on():
            return refuse_second_order(
                "ops.gated_mlp", _GatedMLPFn.backward, ctx, (dy,), _DOUBLE_FIX
            )
        x, g, u, h, wg, wu, wd = ctx.saved_tensors
        if ctx.straight and not (_any_autocast() or compiling()):
            if _EXT_BWD is None and not _ext._state["tried"]:
                _ext.load()  # built on first use (as ownership's first question builds it)
            if _EXT_BWD is not None:
                # NOTE [Backward bodies from C++] in slimgrad/_ext: the body below in C++ (None for
                # a tensor subclass or under a torch function mode)
                r = _EXT_BWD(dy, x, g, u, wg, wu, wd, _ACT_CODE[ctx.activation])
                if r is not None:
                    dx, dwg, dwu, dwd = r
                    return dx, dwg, None, dwu, None, dwd, *_NONES8
            # NOTE [The gated MLP's straight backward]
            # The general path below for this one case, its helpers' frames inline: the same
            # ops on the same operands in the same order (g, u and dh as 2-D (tokens, I) views:
            # elementwise, the same bits), dx allocated in its final shape (a base: the next
            # backward may reuse it, NOTE [Gradient-buffer ownership])
            d, n = dy.shape[-1], g.shape[-1]
            dy2 = dy.reshape(-1, d)
            g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
            act = ctx.activation
            a = _silu(g2) if act == "silu" else _act(g2, act)
            dwd = dy2.t() @ (a * u2)
            dh = dy2 @ wd
            du = a.mul_(dh)
            da = dh.mul_(u2)
            if act == "silu":
                dg = _silu_bwd_into(da, g2, grad_input=da)
            else:
                dg = _act_bwd(da, g2, act, da)
            xd = x.shape[-1]
            dx = dg.new_empty((*dy.shape[:-1], xd))
            dx2 = dx.view(-1, xd)
            torch.mm(dg, wg, out=dx2)
            x2 = x.reshape(-1, xd)
            dwg = dg.t() @ x2
            del dg, da, dh  # one buffer: freed before du's matmuls, as the general path's del dg
            dx2.add_(du @ wu)
            dwu = du.t() @ x2
            return dx, dwg, None, dwu, None, dwd, *_NONES8
        m = ctx.needs_input_grad[:7]
        need_gu = any(m[:5])
        (has_bg, has_bu, has_bd), (gdt, udt) = ctx.has, ctx.mm_dtypes
        xdt, wgdt, bgdt, wudt, budt, wddt, bddt = ctx.in_dtypes
        dx = dwg = dbg = dwu = dbu = None
        # autocast off for the products; entering the context costs more than the products at
        # small sizes, so only when some autocast is on
        with torch.autocast(dy.device.type, enabled=False) if _any_autocast() else _NO_CONTEXT:
            if ctx.fused and g is not None:
                g, u = g.chunk(2, dim=-1)
            dg, du, dwd, dbd = _glu_bwd(
                dy, g, u, h, wd, True, need_gu, m[5], m[6], has_bd, ctx.activation, ctx.fused
            )
            one = ctx.one_dtype  # every cast below is then the identity (forward)
            if not one:
                dwd, dbd = _to(dwd, wddt), _to(dbd, bddt)
            del g, u, h
            if need_gu:  # each gradient cast back as soon as it is made, its buffers dropped
                xg = x if one else _cast(x, gdt)
                # fused: dg is the (*, 2 I) gradient of the gate_up projection
                wgc = wg if one else _cast(wg, gdt)
                dx, dwg, dbg = _linear_bwd(dg, xg, wgc, has_bg, False, m[0:3])
                del dg, wgc
                if not one:
                    dwg, dbg = _to(dwg, wgdt), _to(dbg, bgdt)
                # eager: x's gradients from both projections, each cast back (a leaf's cast
                # cached by autocast: summed before), summed by autograd
                both = ctx.x_cast_cached and udt == gdt
                if not both and not one and ctx.fused:
                    dx = _to(dx, xdt)
                if not ctx.fused:
                    xu = xg if udt == gdt else _cast(x, udt)
                    del xg
                    mu = (m[0], m[3], m[4])
                    wuc = wu if one else _cast(wu, udt)
                    dxu, dwu, dbu = _linear_bwd(du, xu, wuc, has_bu, False, mu)
                    del du, xu, wuc
                    if not one:
                        dwu, dbu = _to(dwu, wudt), _to(dbu, budt)
                    if m[0]:  # NOTE [x's gradient under autocast]
                        if both or one:
                            dx = dx.add_(dxu)
                        else:
                            dx = _to(dx, xdt)
                            exact = xdt in (torch.float32, torch.float64)
                            dx = dx.add_(dxu if exact else _to(dxu, xdt))
                        del dxu
                if not one:
                    dx = _to(dx, xdt)
        return dx, dwg, dbg, dwu, dbu, dwd, dbd, None, None, None, None, None, None, None


_NONES8 = (None,) * 8  # the straight backward's last gradients: bd's, the masters', dt's, ...
_GATED_MLP_APPLY = direct_apply(_GatedMLPFn)


# NOTE [The down product after the saves]
# A non-reentrant ``torch.utils.checkpoint`` stops its recompute once every tensor the block saved
# is back (``early_stop``), and a custom Function's saved tensors reach the pack hooks only when
# its forward returns: the whole op's, down's product included, ran before the recompute could
# stop. An HF Llama layer ends in its MLP, so a checkpointed converted layer recomputed its down
# projection (2 T D I FLOPs: a fifth to a quarter of the layer's matmuls at Llama 1B to 8B
# shapes), which eager's ``F.linear`` (it saves its inputs before its product) never recomputes:
# slimgrad + checkpointing recomputed more than checkpointing alone (HF Llama ~1B: 0.935 of the
# forward's matmul FLOPs against 0.756). Under torch.utils.checkpoint's own hooks (its forward
# and its recompute: ``later_ok`` in ops/linear.py), the op's forward leaves the product
# out: it returns y's buffer unfilled and hands ``h`` and the weight the product reads (the
# master, cast at the product under autocast) to :func:`_down_after`, which fills y with
# ``mm(..., out=)`` once ``apply`` returned (after the saves: a recompute stops before it).
# Only those hooks: they pack without copying, while other hooks (``save_on_cpu``, a user's
# clone or compression) may copy what they pack, and whatever the fill makes (the weight's cast,
# the product's operands) would then sit beside those copies: a review measured one bf16 weight
# cast above the parent's peak under a cloning hook. The same kernel on the
# same operands as ``F.linear`` without a bias (the 2-D fold ``matmul`` makes of a contiguous h),
# so the same bits; the write is to a buffer no tensor the user or autograd holds has seen yet,
# under ``no_grad`` (``out=`` records no graph). A dispatch mode sees the buffer too, and one that
# stores op results can hand the stored one back in place of the write: torch's selective
# checkpointing, whose recompute then returned forward's y for ``mm.out`` and left the new buffer
# unfilled (an error, or wrong gradients with ``allow_cache_entry_mutation``), and whose policies
# name ``mm.default``. So the product is left until later only where every mode on the stack
# only reads ops (``_readers_only``: slimgrad's trackers, which carry ``_slimgrad_reads_ops``,
# fake tensors, torch's FLOP counter); under any other mode or hooks, forward runs ``F.linear``.
# An h that is not contiguous (none the op makes) is multiplied by ``F.linear`` and copied in;
# with a down bias forward runs ``F.linear`` itself as before.
def _later_list(bd: Tensor | None) -> list | None:
    # a list for forward's deferred product where it applies (NOTE [The down product after the
    # saves]), else None; the straight paths test ``_top_hooks(False)`` inline (one call). Not
    # while compiling: there what is saved, and when, is the partitioner's (NOTE [slimgrad ops
    # under torch.compile] in slimgrad/_compile.py), and the trace stays free of hook state
    if bd is not None or compiling():
        return None
    return [] if _top_hooks(False) is not None and later_ok() else None


def _down_after(y: Tensor, later: list | None) -> Tensor:
    # fills y, the op's output, with h @ W^T (NOTE [The down product after the saves])
    if later:
        h, w, dt = later.pop()
        if dt is not None:  # the master weight's cast, made for the product
            w = w.to(dt)
        with torch.no_grad():
            if h.is_contiguous() and h.shape[-1] and y.numel():
                h2 = h.view(-1, h.shape[-1])  # rows given below: y may have 0 columns
                torch.mm(h2, w.t(), out=y.view(h2.shape[0], y.shape[-1]))
            else:
                y.copy_(F.linear(h, w))
    return y


class _GluFn(torch.autograd.Function):
    _slimgrad_floor = True  # h, when it is what is kept, is a matmul input

    @staticmethod
    def forward(ctx, g, u, wd, bd, md, dt, activation: str):
        ng, nu, nwd, _ = ctx.needs_input_grad[:4]
        h = _act(g, activation).mul_(u)
        y = F.linear(h, _mm_weight(wd, md, dt), bd) if wd is not None or md is not None else h
        need_gu = ng or nu
        ctx.activation, ctx.has_bd = activation, bd is not None
        ctx.down = wd is not None or md is not None
        ctx.in_dtypes = _dtypes(g, u, wd, bd)
        ctx.save_for_backward(
            g if need_gu else None,
            u if need_gu else None,
            h if nwd and not need_gu else None,
            (wd if md is None else md) if need_gu else None,
        )
        return y

    @staticmethod
    @first_order("ops.glu")
    def backward(ctx, dy):
        g, u, h, wd = ctx.saved_tensors
        ng, nu, nwd, nbd = ctx.needs_input_grad[:4]
        with torch.autocast(dy.device.type, enabled=False):
            dg, du, dwd, dbd = _glu_bwd(
                dy, g, u, h, wd, ctx.down, ng or nu, nwd, nbd, ctx.has_bd, ctx.activation
            )
        grads = (dg if ng else None, du if nu else None, dwd, dbd)
        return (*(_to(t, d) for t, d in zip(grads, ctx.in_dtypes, strict=True)), None, None, None)


def _check_activation(api: str, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"slimgrad.ops.{api}: unknown activation; expected one of {ACTIVATIONS}, got "
            f"{activation!r}. Use 'silu' (SwiGLU), 'gelu' or 'gelu_tanh' (GeGLU)."
        )


def _check_in(api: str, what: str, x: Tensor, w: Tensor) -> None:
    if not x.shape or w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"slimgrad.ops.{api}: {what} does not match its weight; expected input.shape[-1] == "
            f"weight.shape[1] with a 2-D weight, got input {tuple(x.shape)} and weight "
            f"{tuple(w.shape)}. Pass (*, in_features) inputs and (out, in) weights."
        )


def gated_mlp(
    input: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Tensor | None = None,
    up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    activation: str = "silu",
) -> Tensor:
    """``down(act(gate(x)) * up(x))`` (HF LlamaMLP's forward) keeping x and the pre-activations.

    ``F.linear(act(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu), Wd, bd)``: output bit for bit
    eager's in every dtype and under autocast; gradients eager's formulas on the same operands.

    Memory: saves x + g + u (D s_x + 2 I s bytes per token), recomputing ``act(g) * u`` in
    backward; eager saves x + g + act(g) + u + h (D s_x + 4 I s). Selective: x only if Wg or Wu
    needs grad, g and u only if x, Wg, bg, Wu or bu does, h alone if only Wd does.

    Args:
        input: ``(*, D)``.
        gate_weight, up_weight: ``(I, D)``.
        down_weight: ``(D_out, I)``.
        gate_bias, up_bias: optional ``(I,)``; down_bias: optional ``(D_out,)``.
        activation: ``'silu'`` (SwiGLU), ``'gelu'`` (erf) or ``'gelu_tanh'`` (GeGLU, Gemma).

    Returns:
        ``(*, D_out)``.

    Raises:
        ValueError: unknown activation or mismatched shapes.
        RuntimeError: double backward (``create_graph=True``) through this op; torch.jit.trace.

    Example:
        >>> y = gated_mlp(x, wg, wu, wd, activation="silu")  # doctest: +SKIP
    """
    if activation not in ACTIVATIONS:
        _check_activation("gated_mlp", activation)
    s = input.shape  # _check_in raises where these fail (no call when they hold)
    if not (s and gate_weight.ndim == 2 and s[-1] == gate_weight.shape[1]):
        _check_in("gated_mlp", "input", input, gate_weight)
    if not (s and up_weight.ndim == 2 and s[-1] == up_weight.shape[1]):
        _check_in("gated_mlp", "input", input, up_weight)
    args = (input, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
    comp = _is_compiling()  # one call: NOTE [One-frame compile check] in slimgrad/_autograd.py
    if comp and _compiled_lean(args):  # NOTE [The gated MLP traced under torch.compile]
        return _glu_down_checkpointed(*args, activation, False)
    if (  # NOTE [Linear's straight path] in ops/linear.py, for the block
        not comp
        and not (_functorch_on() or _is_tracing() or _any_autocast())
        and _grad_on()
        and (
            input.requires_grad
            or gate_weight.requires_grad
            or up_weight.requires_grad
            or down_weight.requires_grad
        )
        and type(input) in _PLAIN
        and type(gate_weight) is _Parameter
        and type(up_weight) is _Parameter
        and type(down_weight) is _Parameter
        and gate_bias is None
        and up_bias is None
        and down_bias is None
    ):
        # _later_list(None), inline: one call without hooks
        later = [] if _top_hooks(False) is not None and later_ok() else None
        y = _GATED_MLP_APPLY(
            unwrap_if_dead(input),
            *args[1:],
            None,
            None,
            None,
            None,
            activation,
            False,
            later,
        )
        return y if later is None else _down_after(y, later)
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta or not _records(*args):
        return _fwd_torch(*args, activation, False)
    refuse_jit("ops.gated_mlp")
    later = _later_list(down_bias)
    y = _GatedMLPFn.apply(*_autocast_args(input, args), activation, False, later)
    return y if later is None else _down_after(y, later)


def gated_mlp_fused(
    input: Tensor,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    activation: str = "silu",
) -> Tensor:
    """HF Phi3MLP's forward: ``gate, up = F.linear(x, W, b).chunk(2, -1)``;
    ``down(up * act(gate))``, keeping x and the fused pre-activation (gate first, then up).

    Memory: as :func:`gated_mlp` (x + the ``(*, 2 I)`` projection output; eager also keeps
    act(gate) and the product).

    Args:
        input: ``(*, D)``.
        gate_up_weight: ``(2 I, D)``, rows of gate then up.
        down_weight: ``(D_out, I)``.
        gate_up_bias: optional ``(2 I,)``; down_bias: optional ``(D_out,)``.
        activation: ``'silu'``, ``'gelu'`` or ``'gelu_tanh'``.

    Returns:
        ``(*, D_out)``.

    Raises:
        ValueError: unknown activation, mismatched shapes or an odd ``gate_up_weight.shape[0]``.
        RuntimeError: double backward through this op; torch.jit.trace.
    """
    _check_activation("gated_mlp_fused", activation)
    _check_in("gated_mlp_fused", "input", input, gate_up_weight)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(
            "slimgrad.ops.gated_mlp_fused: gate_up_weight must stack gate and up rows; expected "
            f"an even number of rows, got {gate_up_weight.shape[0]}. Pass torch.cat([Wg, Wu])."
        )
    args = (input, gate_up_weight, gate_up_bias, None, None, down_weight, down_bias)
    if _is_compiling() and _compiled_lean(args):  # NOTE [The gated MLP traced under torch.compile]
        return _glu_down_checkpointed(*args, activation, True)
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta or not _records(*args):
        return _fwd_torch(*args, activation, True)
    refuse_jit("ops.gated_mlp_fused")
    later = _later_list(down_bias)
    y = _GatedMLPFn.apply(*_autocast_args(input, args), activation, True, later)
    return y if later is None else _down_after(y, later)


def glu_linear(
    gate: Tensor,
    up: Tensor,
    down_weight: Tensor | None = None,
    down_bias: Tensor | None = None,
    activation: str = "silu",
) -> Tensor:
    """``F.linear(act(gate) * up, down_weight, down_bias)`` from given pre-activations, keeping
    ``gate`` and ``up`` and recomputing the product; without ``down_weight``, ``act(gate) * up``.

    Memory: saves gate + up (2 I s per token) if gate or up needs grad, the product alone (I s) if
    only down_weight does; eager saves gate, act(gate), up and (for down_weight's gradient) the
    product.

    Args:
        gate, up: ``(*, I)`` of one dtype and shape (e.g. a projection module's outputs).
        down_weight: optional ``(D_out, I)``; down_bias: optional ``(D_out,)``.
        activation: ``'silu'``, ``'gelu'`` or ``'gelu_tanh'``.

    Returns:
        ``(*, D_out)``, or ``act(gate) * up`` without ``down_weight``.

    Raises:
        ValueError: unknown activation or mismatched shapes.
        RuntimeError: double backward through this op; torch.jit.trace.
    """
    _check_activation("glu_linear", activation)
    if down_weight is not None:
        _check_in("glu_linear", "gate", gate, down_weight)
    if (
        transforms_active()
        or gate.is_meta  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
        or not _records(gate, up, down_weight, down_bias)
        or gate.shape != up.shape
        or gate.dtype != up.dtype
    ):  # eager's composition (broadcasting or promoting products stay eager's)
        h = _act(gate, activation) * up
        return h if down_weight is None else F.linear(h, down_weight, down_bias)
    refuse_jit("ops.glu_linear")
    _, wd, bd, md, dt = _autocast_args(gate, (gate, down_weight, down_bias))
    return _GluFn.apply(gate, up, wd, bd, md, dt, activation)


def glu(gate: Tensor, up: Tensor, activation: str = "silu") -> Tensor:
    """``act(gate) * up`` keeping ``gate`` and ``up`` (eager keeps both and ``act(gate)``).

    See :func:`glu_linear` (without a down projection)."""
    return glu_linear(gate, up, None, None, activation)

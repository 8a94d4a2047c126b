"""BatchNorm that keeps its output instead of its input when an activation follows, its input
conv's recipe instead of its input otherwise, and nothing full-size in eval with a frozen affine.

Math (per channel c, over the batch and spatial dims; training uses batch statistics μ, σ² (biased),
eval the running ones):

    x̂ = (x - μ) / sqrt(σ² + eps),   b = γ x̂ + β
    dβ = Σ dy,   dγ = Σ dy x̂
    training: dx = γ / sqrt(σ² + eps) · (dy - mean(dy) - x̂ · mean(dy x̂))
    eval:     dx = γ / sqrt(σ²_run + eps) · dy

From the output: x̂ = (b - β) / γ. Backward computes dx = S dy + K b + C per channel from float64
coefficients rounded once (NOTE [dx from the output]: two fused passes, one dx buffer, no other
full-size temporary; a 16-bit b runs aten's ``native_batch_norm_backward`` on ``b`` with
mean' = mean(b), invstd' = 1/γ, weight' = γ² / sqrt(σ² + eps)); dβ = Σ dy summed in float64 and
rounded once; dγ = Σ dy (b - mean(b)) / γ is accumulated in float64 in batch chunks (temporaries
of 1/8 of the tensor). For contiguous float32 CPU tensors with every channel recovered from b, one
call to ``kernels/cpu/batch_norm.c`` does the whole backward, channel by channel while the
channel's data is in cache: Σ b, Σ dy and Σ dy·b in float64 (mean(b), dβ, dγ), the coefficients,
then dx, the same bits as the PyTorch path for dx and dγ (dβ: its float64 sum in another order,
rounded once), in about eager's time (``docs/measurements.md``). A channel whose output cannot be
inverted accurately (γ = 0, |γ| < 1e-20, |β| > |γ| / 2, non-finite, or |γ| (sqrt(n) + 1) at or
above b's dtype's largest value, n values per channel, so that b may overflow; without weight the
same tests with γ = 1) keeps its input channel instead (a copy of those channels only); if more
than half the channels are such, the layer keeps its whole input (eager). So does a training call
with at most 32 values per channel (NOTE [Few values per channel]: at 2 values eager's dx sums to
exactly 0 per channel, the rebuilt one to rounding noise, 221x the rule's bound in a timm ReXNet-100
at batch 2).

Memory: training keeps the input x (4 B/elt fp32, as eager) unless a slimgrad activation consumes
the output, in which case it keeps the output b instead; b is also what the activation and the next
slimgrad conv keep (NOTE [Derived saved inputs] in ``ops/_derived.py``), so a BN → ReLU → Conv block
keeps one full-size tensor (eager: two, x and relu(b)), plus O(C) statistics. When x is the output
of a slimgrad 1x1 conv that keeps its own input, does not reduce the channels (C_in <= C_out) and
does not read a squeeze-excite output, and a training call sees more than 32 values per channel
(NOTE [Which convs the default replays]), the BatchNorm keeps a recipe instead of x (0 bytes; the
conv is re-run in backward: NOTE [Recomputable inputs]; any conv with
``recompute_input="always"``). Eval: nothing full-size when γ and β need no gradient (eager keeps
x), else x (or its recipe). Under autocast (a bf16/fp16 output b with fp32
γ, β or statistics) the BatchNorm keeps x (or its recipe), never b: x rebuilt as (b - β)/γ from the
rounded b put dγ and the input conv's dbias past the error rule (up to 1.7x its bound), where eager
uses x; the activation then keeps its own tensor (a timm EfficientNet-B0 step at 4x3x64x64 saves
0.840x eager instead of 0.586x; ResNet-18 0.996x instead of 0.977x). A bf16/fp16 model (γ, β in
its dtype) keeps x too: one 16-bit rounding of b, divided by γ and summed over a channel, put dγ
past the rule on the op itself (4x3x8x8, random dy: 10 of 30 seeds in float16, 4 of 30 in
bfloat16, up to 3.1x the bound; tests/ops/test_bn_act_adversarial.py), where eager's dγ comes from
the exact x. Limitation (float32): a loss gradient correlated with b's own rounding errors (dy =
±1 by the sign of each element's rounding) sums them coherently into dγ, past the error rule
(8x1x32x32: 16x its bound at β = 0, 37x at β = γ/2; the factor grows like sqrt(n), as the coherent
sum against eager's random-walk one); random gradients do not (NOTE [dx from the output]). The
worst case is bounded: each b_i is one rounding away from its value (|error| <= u |b_i|, u = 2^-24),
and Σ dy (b - mean(b)) is summed in float64 and divided once, so per channel
|dγ - dγ64| <= (the rule's bound) + u Σ_i |dy_i| |b_i| / |γ|, found at most 0.51 of that last
term (tests/ops/test_bn_act_adversarial.py, test_dgamma_bound_for_gradient_along_output_rounding).
Inside a saved_tensors_hooks region (save_on_cpu, offloading, non-reentrant checkpointing) what
is kept full-size goes through save_for_backward, decided at forward: b where this module's
output was claimed by an activation at the last weight version (then the same bytes and bits as
without hooks), else x, or the input of x's 1x1 conv where that is smaller (re-run in backward)
(NOTE [Under saved-tensor hooks]), with the batch mean and invstd (NOTE [Batch statistics under
saved-tensor hooks]); eval with frozen γ, β keeps nothing full-size there too. There
b goes through the hooks once, for this op, the activation, a squeeze-excite gate and the next conv
together (NOTE [One pack per shared tensor] in ``ops/_derived.py``): an offload copies it once.
"""

from __future__ import annotations

import math
import weakref
from functools import partial as _partial
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import is_fake

from slimgrad import _library, ownership
from slimgrad._autograd import (
    compiling as _compiling,
)
from slimgrad._autograd import (
    direct_apply,
    refuse_jit,
    unwrap_if_dead,
)
from slimgrad._math import steps as _steps
from slimgrad._math.abn import ParamChannels
from slimgrad.kernels import _backend
from slimgrad.ops import _derived
from slimgrad.ops import conv as _conv
from slimgrad.ops.layer_norm import _ANCHOR_APPLY, bridged

__all__ = ["batch_norm"]

# |β| / |γ| above which x̂ is not recovered from b: b's rounding error, divided by γ, grows with
# |β/γ|; at 0.5 dγ stays within 0.65x of the error rule's bound over 90 adversarial float32 trials
# (1.6x over the bound at 1.0, 3x at 4).
_BAD_RATIO = 0.5
_MAX_BAD_FRACTION = 0.5  # more such channels than this: keep the whole input (the eager path)
# NOTE [Few values per channel]: at most this many values per channel, a training call keeps x
_MAX_FEW = 32
_POLICIES = ("pointwise", "always", "never")

_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _bshape(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view([1, -1] + [1] * (ndim - 2))


def _less_precise(a: torch.dtype, b: torch.dtype) -> bool:
    return b.is_floating_point and torch.finfo(a).eps > torch.finfo(b).eps


class _Source(SimpleNamespace):
    """``_Source(ctx=ctx)``: the source side of NOTE [Derived saved inputs]: lets a following
    activation make this BatchNorm call keep its output instead of its input. Holds the call's
    ctx; the ctx does not hold it (no reference cycle, so the graph is freed by reference counting
    as in eager). Made by the C constructor, no Python frame (NOTE [Records made without a Python
    frame] in ops/_derived.py)."""

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__
    # NOTE [One pack per shared tensor] in ops/_derived.py: the output's one pack under
    # saved-tensor hooks, set where keep_output accepts a claim with one
    pack: list | None = None

    def keep_output(self, b: torch.Tensor) -> bool:
        ctx = self.ctx
        if ctx.fwd_hooks is not None and ctx.b is None and not ctx.b_saved:
            if _derived.under_checkpoint():  # NOTE [A claim under checkpoint's hooks]
                return False
        if ctx.b is not None or ctx.b_saved:
            return True
        rec = ctx.claims
        if rec is not None:
            # NOTE [Under saved-tensor hooks]: a claim asked of a call inside a hooks region
            # counts once per call (the decision for the next parameter version reads it)
            ctx.claims = None
            rec[3] += 1
        if ctx.saved_x:
            # NOTE [Under saved-tensor hooks]: x or its ingredient went through the hooks; where
            # pre, the activation and the next conv keep b (the claim), this call what it saved:
            # b packed once for them (NOTE [One pack per shared tensor] in ops/_derived.py)
            if ctx.pre and ctx.b_hooks is not None:
                # held by the source and the nodes that keep b, not by this call (which never
                # reads b): b goes with the last of them in backward. Packed with the hooks
                # active at the claim (the activation's own), where there are any but
                # checkpoint's (NOTE [One pack per shared tensor])
                ctx.b_hooks = None
                hooks = _derived.pack_hooks()
                if hooks is not None:
                    self.pack = _derived.pack_once(b, hooks)
            return ctx.pre
        if (ctx.x is None and ctx.recipe is None) or not ctx.training:
            return False
        # the shape and dtype tests below read attributes (b's dtype, ndim, shape) and b.numel()
        # only: a claim is one of a step's most frequent calls
        n = b.numel()
        C = b.shape[1] if b.ndim > 1 else 1
        if n <= _MAX_FEW * C:
            return False  # NOTE [Few values per channel]: keep x, as eager
        dt = b.dtype
        if dt.is_floating_point and dt.itemsize < 4:
            # a 16-bit output (a bf16/fp16 model, or autocast): keep x (module docstring)
            return False
        if dt.is_floating_point and dt != ctx.param_dtype and _less_precise(dt, ctx.param_dtype):
            # A mixed-precision call (autocast: bf16/fp16 x, fp32 statistics and γ, β): x rebuilt
            # from the rounded output, x̂ = (b - β)/γ, carries b's rounding into dγ and the input
            # conv's dbias (up to 1.7x the error rule's bound in Conv-BN-ReLU), where eager
            # uses x itself; keep x, as eager.
            return False
        affine = ctx.weight_v is not None or ctx.bias_v is not None
        # a fake b (an estimate) is a subclass, tested without is_fake's unwrapping for a plain
        # tensor (a functorch or functional wrapper never reaches here): its γ, β are read from
        # the real parameters they stand for, else no bad channel is assumed (NOTE [Real values
        # behind the stand-ins] in slimgrad/memory.py)
        fake = affine and type(b) is not torch.Tensor and is_fake(b)
        real = _real_affine(ctx.weight_src, ctx.bias_src) if fake else None
        if affine and (not fake or real is not None):
            w, bb = ctx.weight_src, ctx.bias_src
            if (w is not None and w._version != ctx.weight_version) or (
                bb is not None and bb._version != ctx.bias_version
            ):  # γ or β written since forward
                # γ or β changed since forward: b cannot be inverted with them (NOTE [BatchNorm
                # keeps its parameters, not copies]); keep x, as eager
                return False
            # |γ| at or above which b = γ x̂ + β may overflow b's dtype: |x̂| <= sqrt(m - 1) for m
            # values per channel (biased variance) and |β| <= |γ| / 2 on a good channel, so
            # |b| < |γ| (sqrt(m) + 1) (C > 0 here: n > 0 values)
            lim = torch.finfo(dt).max / (math.sqrt(n // C if b.ndim > 1 else n) + 1.0)
            # γ, β as in forward (their versions); NOTE [Decided once per parameter version] in
            # slimgrad/_math/abn.py: no host sync while they do not change
            if real is None:
                bad, idx = _bad_channels(w, bb, lim)
            else:
                with _unset_fake():
                    bad, idx = _bad_channels(*real, lim)
            if bad and len(bad) > _MAX_BAD_FRACTION * C:
                return False
            if bad:
                ctx.bad = idx
                if ctx.x is not None:
                    ctx.x_bad = ctx.x.index_select(1, idx)
        if ctx.x is not None and ctx.x._version != ctx.x_version:
            _derived.check_version(ctx.x, ctx.x_version, "batch_norm input")
        if ctx.bad is None or ctx.x_bad is not None:
            r = ctx.recipe
            if r is not None and r.rebuild is not None:
                # r.drop(): its backward will not call it (NOTE [Rebuilt once per backward])
                r.rebuild.add_user(-1)
            ctx.recipe = ctx.recipe_tensors = None
        if dt == torch.float32:
            # NOTE [A conv bias gradient after dx from the output]: the node of this call's input
            node = ctx.next_functions[0][0]
            if node is not None and type(node).__name__ in _CONV_NODES:
                edge = node.next_functions[2:3]  # the bias's (eager's node has none without bias)
                if edge and edge[0][0] is not None:  # the conv's bias needs a gradient
                    if ctx.bad is None and type(node).__name__ == "_ConvFnBackward":
                        # slimgrad's conv sums it itself, before its dW (its ctx is the node)
                        node.bias_f64 = True
                    else:
                        node.register_hook(_partial(_bias_grad_f64, ctx.bad))
                        bias = getattr(edge[0][0], "variable", None)  # AccumulateGrad's
                        if ctx.bad is None and bias is not None:
                            # eager's node: the conv's next calls take slimgrad's Function
                            _conv.sum_bias_in_f64(bias)
        if ctx.pre:
            # NOTE [Under saved-tensor hooks]: b went through save_for_backward in forward, or
            # into a pack the activation and the next conv share (NOTE [One pack per shared
            # tensor] in ops/_derived.py)
            ctx.b_saved, ctx.b_version, ctx.b_ref = True, b._version, weakref.ref(b)
            if ctx.b_hooks is not None:
                # packed with the hooks active at the claim (the activation's own), or, where
                # there are none or they are checkpoint's, kept as without hooks: the activation
                # (or the checkpoint) keeps b itself there (NOTE [One pack per shared tensor])
                ctx.b_hooks = None
                hooks = _derived.pack_hooks()
                if hooks is None:
                    ctx.b_saved, ctx.b_ref = False, None
                    ctx.b = b.detach()
                else:
                    p = ctx.b_pack = self.pack = _derived.pack_once(b, hooks)
                    p[1].users += 1
        else:
            ctx.b, ctx.b_version = b.detach(), b._version
        ctx.x = None
        return True


# NOTE [A conv bias gradient after dx from the output]
# Σ dx over a channel is 0 in exact arithmetic (the batch statistics remove any per-channel
# constant), so the gradient of a conv bias before this BatchNorm is rounding noise around 0, and
# the error rule compares one draw of that noise against one draw of eager's (NOTE [dx from the
# output]). Eager sums its dx in float32; dx from the output differs from eager's dx by its own
# roundings, and summed in float32 as well it broke the rule on a few seeds in a few thousand
# (Conv(1x1) -> BN -> SiLU or ReLU at 4x16x7x7 float32, one thread, 3,000 seeds each: SiLU 5,
# worst 1.26x, ReLU 2, worst 1.28x; tests/ops/test_bn_rule.py pins them). So where a float32 call
# keeps its output and its input is the output of a conv whose bias needs a gradient (that conv's
# node is this node's first input edge: eager's ConvolutionBackward0 or slimgrad's Function),
# _Source.keep_output has the bias gradient replaced by the gradient arriving at the conv summed in
# float64 and rounded once: the float32 summation error goes, only dx's element roundings stay.
# slimgrad's conv Function (its node: the ctx) sums it itself before its convolution_backward,
# which it then asks no bias gradient (``bias_f64``); on eager's node (NOTE [A conv that keeps what
# eager keeps] in ops/conv.py) a post hook sums it after the node, and marks the bias so that the
# conv's next calls take the Function: the hook's temporaries lived with dW and dx, 3 x 4 B per
# channel above eager's peak (2x64x8x8 float32: +768 B), the Function's come before them. Where
# the structure shows the pair (a conv with a bias right before a BatchNorm in an nn.Sequential),
# convert_ marks the conv module instead (``slimgrad.nn.conv.mark_bias_before_batch_norm_``), so
# its first call takes the Function too; elsewhere (a functional call, a parent's own forward) the
# first call of an eager node's conv keeps those bytes. Channels kept from x (_bad_channels) keep
# the conv's own float32 sum (the post hook, on either node), and nothing changes where the
# BatchNorm keeps x: there dx is aten's, eager's own bits, and so is its float32 sum (where that
# sum cancels exactly a float64 sum may not: a float64 bias sum in the conv itself, for every
# conv, failed that way and was reverted). A double backward keeps aten's sum.
_CONV_NODES = ("ConvolutionBackward0", "_ConvFnBackward")


def _bias_grad_f64(bad, grad_inputs, grad_outputs):
    # NOTE [A conv bias gradient after dx from the output]: a post hook on the conv's node; bad:
    # the channels kept from x (their dx is aten's: their sum stays the conv's), or None
    g, gb = grad_outputs[0], grad_inputs[2]
    if g is None or gb is None or _grad_on():  # a double backward keeps aten's sum
        return None
    red = [d for d in range(g.dim()) if d != 1]
    out = g.sum(red, dtype=torch.float64).to(gb.dtype)
    if bad is not None:
        out.index_copy_(0, bad, gb.index_select(0, bad))
    return (*grad_inputs[:2], out, *grad_inputs[3:])


# NOTE [Few values per channel]
# With n values per channel, eager's backward has structure that x̂ rebuilt from b does not keep. At
# n = 2, x̂ = ±sqrt(σ²/(σ² + eps)) is exactly antisymmetric in eager (x - μ of two values), so its
# dx sums to exactly 0 over the channel (a preceding conv's or linear's bias gradient: error 0);
# from b, dx = S dy + K b + C sums to rounding noise of |S dy|, which the rule's bound (2 x 0 +
# atol) does not admit: 488x the bound on a Linear-BatchNorm1d-ReLU at 2x16 (a timm ReXNet-100 SE
# block at batch 2: 221x). For n = 4 to 32 a sweep of 192 Linear/Conv-BN-ReLU/SiLU trials per n
# (float32, γ 1e-3 to 10, |β| <= |γ|/2, input scale 1e-3 and 1) put 1-6 % of them past the rule (n =
# 4: 11, 8: 8, 16: 2, 32: 4 trials; up to 1.7x), a float64 backward from x itself 0-2 % (4: 3, 8: 4,
# 16: 1, 32: 0): eager's own error there is one small draw that the rule compares against. timm
# HGNetV2-B0 at 2x3x32x32 failed (a LearnableAffineBlock bias at 2.4x the bound) through a BatchNorm
# with 32 values per channel. Such a layer holds n x C values, small next to the layers whose saving
# matters, so a training call with n <= _MAX_FEW (32: the largest count seen failing in a
# model) keeps x (or its conv's recipe, which recomputes x's exact bits) and runs aten's backward:
# eager's bits. Decided from the shape alone: no device read. Above it, the per-channel tests of
# _bad_mask apply (|β| > |γ|/2 and the rest). A variance far below eps shrinks x̂ and so magnifies
# b's rounding relative to it, but dγ = Σ dy x̂ shrinks with it and mostly stays within the rule's
# atol: at 16x4x16x16 with σ² from 1e-3 eps to 1e-7 eps and |β| = |γ|/2, the worst results over 3
# seeds were 1.9x the bound (dγ at σ² = 1e-3 eps, γ = 1e-3; the preceding conv's weight gradient at
# 1e-7 eps), the same order as the scatter the sweep above saw at every n, and not growing as σ²/eps
# falls. No per-call variance test: it would be a host read per layer per step on CUDA (NOTE
# [Decided once per parameter version]).
def _bad_mask(weight, bias, extra=None):
    # extra: the |γ| at or above which the output may overflow (keep_output's limit; None: no
    # such bound)
    ref = weight if weight is not None else bias
    w = ref if ref.dtype == torch.float64 else ref.float()
    if weight is None:  # no affine scale: γ = 1
        w = torch.ones_like(w)
    beta = bias.to(w.dtype) if bias is not None else torch.zeros_like(w)
    aw = w.abs()
    lim = float("inf") if extra is None else extra
    # NaN compares False, so NaN γ or β count as bad too; so does a γ whose output may overflow
    # (x̂ = (b - β)/γ of an inf b is not x̂)
    return ~((aw >= 1e-20) & (aw < lim) & (aw < float("inf")) & (beta.abs() <= _BAD_RATIO * aw))


_BAD = ParamChannels(_bad_mask)
# _BAD's last answer per parameter, read with plain comparisons: {id(γ, or β without γ): (the
# anchors of γ's and β's storages, None, state, answer)}; state as ParamChannels._state
# (each parameter's version, data_ptr, dtype and device, the optimizer steps, the output's
# overflow limit). A changed state asks _BAD, which decides (NOTE [Decided once per parameter
# version] in slimgrad/_math/abn.py); the same state gives _BAD's same answer. No reference to γ
# or β (NOTE [Caches that hold no reference to a parameter] in slimgrad/_math/steps.py).
_BAD_LAST: dict = {}


def _bad_channels(w, bias, lim):
    key = w if w is not None else bias
    e = _BAD_LAST.get(id(key))
    if e is not None:  # β's memory and version are in the state (β None: None there)
        st = e[2]
        if (
            st[0] == lim
            and st[1] == _steps._count[0]
            and (
                st[2] is None
                if w is None
                else (w._version, w.data_ptr(), w.dtype, w.device) == st[2]
            )
            and (
                st[3] is None
                if bias is None
                else (bias._version, bias.data_ptr(), bias.dtype, bias.device) == st[3]
            )
        ):
            return e[3]
    # epoch() is asked there: the step hook is registered; it searches with the dispatch modes
    # set aside (NOTE [A channel search no mode sees])
    out = _BAD.lookup(w, bias, lim)
    st = (
        lim,
        _steps._count[0],
        None if w is None else (w._version, w.data_ptr(), w.dtype, w.device),
        None if bias is None else (bias._version, bias.data_ptr(), bias.dtype, bias.device),
    )
    if not (_steps.pinned(w) and _steps.pinned(bias)):
        return out  # NOTE [Caches that hold no reference to a parameter] in _math/steps.py
    k = id(key)
    anchors = (_steps.anchor(_BAD_LAST, k, w), _steps.anchor(_BAD_LAST, k, bias))
    _BAD_LAST[k] = (anchors, None, st, out)
    return out


# NOTE [A channel search no mode sees]
# Which channels are kept from x is searched at the first call of a parameter version (abs,
# comparisons, a read to the host: NOTE [Decided once per parameter version] in _math/abn.py);
# later calls of that version, and a checkpoint's recompute inside backward, take the cached
# answer and issue none of those ops. torch's selective checkpointing records every aten op of its
# forward under a dispatch mode and, in the recompute, hands each op the output stored for the
# same op by call count: the search's abs(γ), stored at forward, was handed to the first abs the
# recompute called (a layer scale's |s| after the block: the gradients off by 72 from the second
# step on, silently; a full-size mul/abs/lt there raised CheckpointError: different metadata). The
# search is a cache of the parameters, part of no step, so it runs with the dispatch modes set
# aside (ParamChannels.lookup in _math/abn.py; as the bit tables: NOTE [Bit tables outside every
# step] in _math/bits.py): the forward and its recompute issue the same ops whether the search
# ran or not, and no tracker counts it (the real step's and the estimate's, which reads the real
# γ, β: NOTE [Real values behind the stand-ins] in slimgrad/memory.py). In-Place ABN's side
# channels (NOTE [Invertibility]) are searched there too: Conv -> InPlaceABN(leaky_relu) -> Conv
# then a layer scale, under a policy saving abs, had gradients off by 62 from the first step.
# Without the private ``_disable_current_modes`` the search runs under the modes as before.


def _real_affine(w, bias) -> tuple | None:
    # (γ, β) the fake stand-ins w, bias of an estimate stand for, or None where one of them has no
    # real Parameter behind it (NOTE [Real values behind the stand-ins] in slimgrad/memory.py)
    from slimgrad.memory import real_of

    rw = None if w is None else real_of(w)
    rb = None if bias is None else real_of(bias)
    if (w is not None and rw is None) or (bias is not None and rb is None):
        return None
    return rw, rb


def _unset_fake():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _release(ctx) -> None:
    # the batch statistics too: the node outlives this backward until the whole graph is freed,
    # and eager's node frees them when its backward returns
    ctx.x = ctx.b = ctx.x_bad = ctx.recipe = ctx.recipe_tensors = None
    ctx.save_mean = ctx.save_invstd = None
    ctx.weight_src = ctx.bias_src = None
    ctx.b_pack = ctx.k_pack = ctx.b_hooks = None
    ctx.released = True
    if ctx.derived is not None:  # NOTE [Dropped at b's backward] in ops/_derived.py
        _derived.drop_derived(ctx.derived)
        ctx.derived = None


# NOTE [BatchNorm's output gradient that never came]
# A double backward (R1 penalty: ``create_graph=True``, then the penalty's backward) can reach
# this node with no gradient for its output: the next Conv's ``ConvolutionBackwardBackward0``
# links to its input but gives it an undefined gradient (the input gradient of a convolution does
# not depend on its input). Eager's node then returns undefined gradients, so β's ``.grad``
# stays None (the penalty does not depend on β); autograd's default for a custom Function is a
# zero tensor instead, and this backward turned it into dβ = 0, dγ = 0: an optimizer with weight
# decay then moved β where eager's skips it. The forward sets ``ctx.materialize_grads = False``
# (the field ``set_materialize_grads`` writes, without its frame), and a None gradient returns
# None for every input, releasing what a first-order backward would have released.
def _no_output_grad(ctx) -> tuple:
    if _keep_graph is not None and not _keep_graph():
        r = ctx.recipe
        if r is not None and r.rebuild is not None:
            # r.drop(): no backward will call it now (NOTE [Rebuilt once per backward])
            r.rebuild.add_user(-1)
        _release(ctx)
    return (None,) * 11


def _kept_nothing(ctx) -> bool:
    # nothing full-size kept: eval with a frozen affine, or training where only β needs a gradient
    return ctx.x is None and ctx.recipe is None and ctx.b is None and not ctx.saved_x


# NOTE [Under saved-tensor hooks]
# saved_tensors_hooks (save_on_cpu, torchtune-style offloading, non-reentrant checkpointing and its
# recompute) see only what goes through save_for_backward, and see it when forward returns; the
# switchable slot (_Source.keep_output swaps x for b after forward) cannot be packed then. So
# inside such a region a call decides at forward, once, what it saves through save_for_backward:
#   - b, its output, where every call of this module at the weight's last version (before the
#     current one) had its output claimed by a slimgrad activation (what outside hooks makes it
#     keep b), unless x's recipe has an ingredient smaller than x (below: that ingredient is
#     saved, the claim accepted, so the activation and the next conv keep b and this call
#     replays the conv: each hook copy is then the smaller one, and its bits are eager's, aten's
#     backward on the exact x). x, or its recipe, is held as outside hooks only until the claim
#     (the next op, in a BN -> act -> conv block; the claim then keeps nothing more: backward
#     reads b back through the hooks; autograd checks no version under hooks, so b's version at
#     the claim is checked there where the hooks hand b's memory back). Outside checkpoint's
#     hooks b is packed at the claim with the hooks active there, once for this call, the
#     activation and the next conv where their hooks are those, or kept as without hooks where
#     none (or checkpoint's) are active at the claim (NOTE [One pack per shared tensor] in
#     ops/_derived.py). A call whose claim does
#     not come keeps x or its recipe as outside hooks and never reads b: its bits are those of
#     the unhooked model, and under checkpoint's hooks b's pack was wasted (elsewhere b is
#     packed at the claim only; that module's next weight version decides again, and saves x).
#     The same bits as without hooks in both cases.
#   - else x (as eager), or, where x has a recipe (NOTE [Recomputable inputs] in ops/_derived.py)
#     whose full-size ingredient is smaller than x (ResNet's bn3 after its 1x1 conv3: a quarter of
#     x), that ingredient, and re-runs the conv on it in backward (bit for bit, as the recipe
#     does; the conv's weight and bias are Parameters, kept as attributes and version-checked, not
#     packed, as eager's BatchNorm does not pack them; a derived ingredient is rebuilt from the
#     store, NOTE [Rebuilt once per backward]). A stride-2 1x1 conv's input is larger than x: x is
#     saved there (one more x-sized tensor retained under identity hooks than outside them, one
#     fewer k-sized copy offloaded). Such a call registers a source that counts the claims asked
#     of it and refuses them (the activation runs eager's op).
# Why the weight's version: it changes at each optimizer step and never between a checkpoint's
# forward and its recompute (a write to γ there fails the backward anyway), so the recompute
# decides as its forward did and saves as many tensors, of the same kinds, in the same order (a
# decision read from the current step's claims would let a recompute save b where its forward
# saved x, which the checkpoint's metadata check cannot tell apart). So the first step in a hooks
# region (and every step with a frozen γ, or no γ) saves x; from the next weight version on, a
# claimed module saves b. Channels kept from x (_bad_channels, few where any) stay an attribute
# the hooks do not see. Eval with γ, β frozen saves nothing full-size, as outside hooks.
def _smaller_ingredient(recipe, x: torch.Tensor) -> bool:
    k = recipe.tensors[0] if recipe is not None else None
    return k is not None and k.numel() * k.element_size() < x.numel() * x.element_size()


def _save_under_hooks(ctx, x: torch.Tensor, recipe) -> torch.Tensor | None:
    # recipe: x's (batch_norm looked it up), or None; returns the full-size tensor the forward
    # saves (x or the recipe's ingredient), None where the conv's pack holds it
    kept = x
    if recipe is not None:
        _derived.adopt_recipe(recipe)
        k = recipe.tensors[0]
        if _smaller_ingredient(recipe, x):
            # the closure holds no tensor; its parameters are held here, not the Recipe (whose
            # aliases would keep k on the device beside its packed copy)
            ctx.recipe_fn = recipe.fn
            ctx.recipe_params = recipe.tensors[1:]
            ctx.recipe_versions = recipe.versions[1:]
            kept = k
            p = None if recipe.pack is None else _derived.shared(recipe.pack)
            if p is not None:
                # k's one pack, kept by the conv (NOTE [One pack per shared tensor])
                p[1].users += 1
                ctx.k_pack = p
                kept = None
        else:
            recipe.drop()
    ctx.saved_x = True
    return kept


# NOTE [Batch statistics under saved-tensor hooks]
# A training call keeps its batch mean and invstd (2 C values) for backward, as eager's node
# does. Outside hooks they stay ctx attributes (no hook to see them: the same bytes as eager's
# saved tensors). Inside a saved_tensors_hooks region they go through save_for_backward with the
# full-size tensor the call saves there (NOTE [Under saved-tensor hooks]), in one call (a second
# would replace the first): as attributes, a non-reentrant checkpoint kept them alive past forward
# where eager's were dropped and recomputed (a 5-BN conv net at C=8 peaked 256 B above eager's,
# 2 C x 4 B per norm alive at the peak) and an offload never moved them. Backward reads
# ``ctx.saved_tensors`` once (``_load_saved``: a checkpoint refuses a second unpack of the same
# tensor, an offload would copy it back twice) and drops what it unpacked at its end, so a
# retained graph unpacks again.
def _load_saved(ctx) -> None:
    if ctx.released:
        _check_not_released(ctx)
    try:
        ctx.saved_full, ctx.save_mean, ctx.save_invstd = ctx.saved_tensors
    except RuntimeError as e:  # NOTE [A kept tensor written after forward] in ops/_derived.py
        _derived.raise_written(e, "ops.batch_norm")
        raise


def _unpack(ctx) -> torch.Tensor:
    # the full-size tensor the forward saved under hooks (NOTE [Batch statistics under
    # saved-tensor hooks]: unpacked already, with the statistics, in a training call)
    if ctx.stats_saved:
        return ctx.saved_full
    (t,) = ctx.saved_tensors
    return t


def _load_saved_b(ctx) -> None:
    # NOTE [Under saved-tensor hooks]: b as save_for_backward kept it (unpacked by the hooks), or
    # from its pack (NOTE [One pack per shared tensor] in ops/_derived.py: version checked there)
    if ctx.released:
        _check_not_released(ctx)
    if ctx.b_pack is not None:
        b = _derived.read_pack(ctx.b_pack, "batch_norm output")
        ctx.b, ctx.b_version = b, b._version
        return
    try:
        b = _unpack(ctx)
    except RuntimeError as e:  # NOTE [A kept tensor written after forward] in ops/_derived.py
        _derived.raise_written(e, "ops.batch_norm")
        raise
    # identity hooks hand b itself back, which autograd does not version-check under hooks: a
    # write over b since the claim raises as outside hooks. A hook's copy (save_on_cpu: its
    # version is the copy's own) holds b's values at forward, whatever was written over b since.
    orig = ctx.b_ref()
    if orig is not None and orig._version != ctx.b_version and orig.data_ptr() == b.data_ptr():
        _derived.check_version(orig, ctx.b_version, "batch_norm output")
    ctx.b, ctx.b_version = b, b._version


def _saved_input(ctx) -> torch.Tensor:
    # NOTE [Under saved-tensor hooks]: x from what save_for_backward kept (unpacked by the hooks),
    # or from its conv's pack (NOTE [One pack per shared tensor] in ops/_derived.py)
    if ctx.k_pack is not None:
        if ctx.released:
            _check_not_released(ctx)
        k = _derived.read_pack(ctx.k_pack, "tensor kept to recompute a normalisation input")
    else:
        k = _unpack(ctx)
    if ctx.recipe_fn is None:
        return k
    for t, v in zip(ctx.recipe_params, ctx.recipe_versions):
        if t is not None:
            _derived.check_version(t, v, "tensor kept to recompute a normalisation input")
    with torch.no_grad():
        return ctx.recipe_fn(k, *ctx.recipe_params)


def _input(ctx) -> torch.Tensor:
    if ctx.saved_x:
        return _saved_input(ctx)
    if ctx.x is not None:
        _derived.check_version(ctx.x, ctx.x_version, "batch_norm input")
        return ctx.x
    return ctx.recipe()


class _BatchNormFn(torch.autograd.Function):
    # Tensors are kept as ctx attributes, not with save_for_backward, because a following activation
    # may swap the input for the output after forward (_Source.keep_output); versions are checked by
    # hand (_derived.check_version) and the slots are released after a backward that frees the
    # graph.
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        running_mean,
        running_var,
        training,
        momentum,
        eps,
        holder,
        recompute,
        hooked,
    ):
        # aten::native_batch_norm through its torch binding (one C call; the packet's is two)
        out, save_mean, save_invstd = torch.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        ctx.materialize_grads = False  # NOTE [BatchNorm's output gradient that never came]
        ctx.training, ctx.eps, ctx.released = training, eps, False
        ctx.x = ctx.b = ctx.x_bad = ctx.bad = ctx.recipe = ctx.recipe_tensors = ctx.claims = None
        ctx.derived = None  # NOTE [Dropped at b's backward] in ops/_derived.py
        ctx.x_version = ctx.b_version = 0
        # NOTE [Under saved-tensor hooks]: what this call keeps full-size went through
        # save_for_backward (x, or its recipe's input, rebuilt by ctx.recipe_fn if set; or, where
        # pre, b, read back where a claim came: b_saved)
        ctx.saved_x, ctx.recipe_fn = False, None
        ctx.pre = ctx.b_saved = False
        # NOTE [One pack per shared tensor] in ops/_derived.py: b's pack, the ingredient's, and
        # the hooks b is packed with at the claim (where pre)
        ctx.b_pack = ctx.k_pack = ctx.b_hooks = ctx.fwd_hooks = None
        # NOTE [BatchNorm keeps its parameters, not copies]: the tensors themselves, read in a
        # first-order backward (grad mode off: no graph); _double detaches them first
        ctx.weight_v, ctx.bias_v = weight, bias
        # the parameters themselves and their versions: the keys of _BAD
        ctx.weight_src, ctx.bias_src = weight, bias
        ctx.weight_version = weight._version if weight is not None else 0
        ctx.bias_version = bias._version if bias is not None else 0
        # the parameters themselves, for a second derivative (_double); no bytes for Parameters
        ctx.weight_ref = weight if need_w else None
        ctx.bias_ref = bias if ctx.needs_input_grad[2] else None
        ctx.running_mean = ctx.running_var = None
        ref = weight if weight is not None else bias if bias is not None else running_mean
        ctx.param_dtype = ref.dtype if ref is not None else x.dtype
        if training:
            ctx.save_mean, ctx.save_invstd = save_mean, save_invstd
            keep_x = need_x or need_w
        else:
            # Eval uses the running statistics themselves (NOTE [BatchNorm keeps its parameters,
            # not copies]); invstd is computed from them in backward
            ctx.running_mean, ctx.running_var = running_mean, running_var
            ctx.stats_version = running_mean._version, running_var._version
            ctx.save_mean = ctx.save_invstd = None
            ctx.stat_dtype = save_mean.dtype
            keep_x = need_w
        ctx.recipe = None
        # x's recipe (not yet adopted): batch_norm looks it up once and hands it over as
        # holder == [recipe]; an empty holder (the Function applied directly) looks it up here.
        # holder[0] then says what this call kept: ctx where it keeps x or its recipe (what
        # batch_norm registers as a source), else None.
        if holder:
            recipe = holder[0]
            holder[0] = None
        else:
            recipe = _derived.usable_recipe(x, recompute) if keep_x else None
            holder.append(None)
        ctx.stats_saved = False  # NOTE [Batch statistics under saved-tensor hooks]
        full = None  # under hooks: the full-size tensor saved beside them (x, its ingredient, b)
        if keep_x and hooked and (hooked != _PRE or _smaller_ingredient(recipe, x)):
            full = _save_under_hooks(ctx, x, recipe)
            # a source that counts the claims asked of it and, where pre (an ingredient smaller
            # than b kept), accepts them and keeps what it saved
            ctx.pre = hooked == _PRE
            if ctx.pre:  # b packed once at the claim, for the activation and the next conv
                ctx.b_hooks = _derived.pack_hooks()
            holder[0] = ctx
        elif keep_x:
            if hooked:
                # NOTE [Under saved-tensor hooks]: b through the hooks (now, or at the claim);
                # x (or its recipe) held below only until the claim that this module's calls
                # met at the last parameter version
                # one pack of b that the activation and the next conv share, made with these
                # hooks at the claim (NOTE [One pack per shared tensor] in ops/_derived.py),
                # where the hooks are not checkpoint's; else save_for_backward. A recompute
                # inside a backward (a checkpoint's) saves a copy: its own activation may write
                # over b there where the forward's claim did not (a claim in place needs
                # ownership, which the checkpoint's hold on b refuses)
                ctx.b_hooks = _derived.pack_hooks()
                if ctx.b_hooks is None:
                    # NOTE [The same ops under selective checkpointing]
                    copy = _task_id() != -1 or (_dispatch_depth() and _derived.under_checkpoint())
                    full = out.clone() if copy else out
                else:  # NOTE [A claim under checkpoint's hooks] in ops/_derived.py
                    ctx.fwd_hooks = ctx.b_hooks
                ctx.pre = True
            # a stand-in's recipe is not kept (NOTE [A recipe made in a checkpoint's forward] in
            # ops/_derived.py): x is, as without a recipe
            if recipe is not None and recipe.region is None:
                if recipe.rebuild is not None:  # _derived.adopt_recipe(recipe)
                    recipe.rebuild.add_user(1)
                # NOTE [Recomputable inputs]: keep how to rebuild x, not x.
                if type(recipe) is not _PLAIN_RECIPE:  # a NodeRecipe: its tensors read now
                    recipe = recipe.pinned()
                ctx.recipe, ctx.recipe_tensors = recipe, recipe.tensors
            else:
                ctx.x, ctx.x_version = x.detach(), x._version
            holder[0] = ctx
        if hooked:
            if training:
                # NOTE [Batch statistics under saved-tensor hooks]
                ctx.stats_saved = True
                ctx.save_mean = ctx.save_invstd = None
                ctx.save_for_backward(full, save_mean, save_invstd)
            elif full is not None:
                ctx.save_for_backward(full)
        return out

    @staticmethod
    def _double(ctx, grad):
        # grad mode is on here (create_graph): the forward's values without their graphs, so the
        # second derivative reaches γ and β only through weight_ref and bias_ref
        if ctx.weight_v is not None:
            ctx.weight_v = ctx.weight_v.detach()
        if ctx.bias_v is not None:
            ctx.bias_v = ctx.bias_v.detach()
        _check_not_released(ctx)
        if ctx.stats_saved:  # NOTE [Batch statistics under saved-tensor hooks]
            _load_saved(ctx)
        if ctx.b_saved:
            _load_saved_b(ctx)
        _check_params(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if _kept_nothing(ctx):
            # eval with a frozen affine (dx = dy * γ * invstd: constants) or bias-only training
            out = _bwd_kept_nothing(ctx, grad, need_x, need_b)
        else:
            # NOTE [Second derivatives of an op that keeps its output] (ops/layer_norm.py): eager's
            # forward recomputed on x's values (kept, recomputed from a recipe, or rebuilt from b)
            with torch.no_grad():
                x = _input_values(ctx)
            if need_x:
                x = bridged(ctx, "ops.batch_norm", x)
            with torch.enable_grad():
                w = _forward_value(ctx.weight_v, ctx.weight_ref)
                b = _forward_value(ctx.bias_v, ctx.bias_ref)
                pairs = [(x, need_x), (w, need_w), (b, need_b)]
                inputs = [t for t, n in pairs if n]
                y2 = torch.nn.functional.batch_norm(
                    x, ctx.running_mean, ctx.running_var, w, b, ctx.training, 0.0, ctx.eps
                )
                grads = list(
                    torch.autograd.grad(y2, inputs, grad, create_graph=True, allow_unused=True)
                )
            out = tuple(grads.pop(0) if n else None for _, n in pairs)
        if ctx.b_saved:
            ctx.b = None
        if ctx.stats_saved:  # read again from the hooks by another backward
            ctx.saved_full = ctx.save_mean = ctx.save_invstd = None
        if _keep_graph is not None and not _keep_graph():
            _release(ctx)
        return out + (None,) * 8

    @staticmethod
    def backward(ctx, grad):
        if grad is None:  # NOTE [BatchNorm's output gradient that never came]
            return _no_output_grad(ctx)
        if _grad_on():  # first_order's test, inline (NOTE [First order, tested inline])
            return _BatchNormFn._double(ctx, grad)
        # first use of grad (NOTE [Gradient-buffer ownership]), asked only where the C kernel
        # may write dx over it
        # (the C library _bwd_from_output_c runs where what it checks of ctx alone holds; handed
        # on to it: one backend choice per backward)
        if ctx.stats_saved:  # NOTE [Batch statistics under saved-tensor hooks]
            _load_saved(ctx)
        if ctx.b_saved:
            _load_saved_b(ctx)
        b = ctx.b
        lib = None
        if (
            b is not None
            and ctx.bad is None
            and ctx.needs_input_grad[0]
            and b.dtype == torch.float32
            and b.is_cpu
            and b.is_contiguous()
        ):
            lib = _backend.use_cpu(b, C_STEM)
            if (
                lib is None
                and type(b) is not torch.Tensor  # a plain tensor is never fake (no call)
                and _backend._is_fake(b)
                and _backend.cpu_kernel_would_run(b, C_STEM)
            ):
                lib = _FAKE_C  # NOTE [Fake tensors model BatchNorm's C kernel]
        # (or, where channels are kept from x and dx comes from coefficients, written over it by
        # channel groups: NOTE [Channels kept from x in backward])
        buf = (
            ownership.take(grad)
            if lib is not None
            or (
                ctx.bad is not None
                and b is not None
                and ctx.needs_input_grad[0]
                and b.dtype == ctx.save_invstd.dtype
                and b.dtype in (torch.float32, torch.float64)
            )
            else None
        )
        if ctx.released:
            _check_not_released(ctx)
        if (ctx.weight_v is not None and ctx.weight_v._version != ctx.weight_version) or (
            ctx.running_mean is not None
        ):
            _check_params(ctx)  # raises where a version changed (read inline: the common case)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.x is None and ctx.recipe is None and ctx.b is None and not ctx.saved_x:
            # _kept_nothing: nothing full-size kept: eval with a frozen affine, or training where
            # only the bias needs a gradient (dx and dγ would have kept x).
            out = _bwd_kept_nothing(ctx, grad, need_x, need_b)
        elif ctx.b is None:
            r = ctx.recipe
            if ctx.x is None and r is not None and not ctx.saved_x:
                # _input(ctx) -> r(), inline: grad mode is off here (tested above)
                for t, v in zip(r.tensors, r.versions):
                    if t is not None and t._version != v:
                        _derived.check_version(
                            t, v, "tensor kept to recompute a normalisation input"
                        )
                x = r.fn(*r.tensors)
            else:
                x = _input(ctx)
            out = torch.ops.aten.native_batch_norm_backward(
                grad,
                x,
                ctx.weight_v,
                ctx.running_mean,
                ctx.running_var,
                ctx.save_mean,
                ctx.save_invstd if ctx.training else None,
                ctx.training,
                ctx.eps,
                [need_x, need_w, need_b],
            )
        else:
            out = _bwd_from_output(ctx, grad, need_x, need_w, need_b, buf, lib)
        if ctx.b_saved:
            ctx.b = None  # the unpacked b: read again from the hooks by another backward
        if ctx.stats_saved:  # and the unpacked statistics and x (or its ingredient)
            ctx.saved_full = ctx.save_mean = ctx.save_invstd = None
        if _keep_graph is not None and not _keep_graph():
            # _release(ctx), inline
            ctx.x = ctx.b = ctx.x_bad = ctx.recipe = ctx.recipe_tensors = None
            ctx.save_mean = ctx.save_invstd = None
            ctx.weight_src = ctx.bias_src = None
            ctx.b_pack = ctx.k_pack = ctx.b_hooks = None
            ctx.released = True
            chain = ctx.derived
            if chain is not None:  # NOTE [Dropped at b's backward] in ops/_derived.py
                # _derived.drop_derived(chain), inline (no call)
                ctx.derived = None
                while chain is not None:
                    k, ref, chain = chain
                    if k in _DERIVED_D and _DERIVED_D[k][0] is ref:
                        del _DERIVED_D[k]
        gx, gw, gb = out
        # one gradient per forward argument (x, weight, bias; 8 non-differentiable ones)
        return (gx, gw if need_w else None, gb if need_b else None) + (None,) * 8


_BN_APPLY = direct_apply(_BatchNormFn)


# NOTE [Eval calls that cannot win]
# In eval this op keeps nothing full-size (a frozen affine) or x's recipe instead of x (γ needs a
# gradient), and per channel only temporaries of its backward (invstd from the running variance,
# the scale γ invstd: NOTE [BatchNorm keeps its parameters, not copies]). Where γ needs a gradient
# and x has no recipe it would keep x as well: eager's own node is then as good. Where a channel
# holds so few values that x's bytes per channel are no more than 5 per-channel values (the bound
# from when this op copied γ, β, the running statistics and invstd: at 2 values per channel and
# 1x1 spatial those copies saved 28 B where eager saved 16), eager's node is taken too: nothing
# to win there. Both are decided from the shape and the flags before any Function.
def _eval_cannot_win(x, weight, bias, running_mean, recompute) -> bool:
    if weight is not None and weight.requires_grad and not _derived.has_recipe(x, recompute):
        return True
    copies = [running_mean, running_mean, running_mean, weight, bias]  # 5 per-channel values
    per_channel = sum(t.element_size() for t in copies if t is not None)
    return (x.numel() // x.shape[1]) * x.element_size() <= per_channel


# NOTE [BatchNorm keeps its parameters, not copies]
# Eager's BatchNorm node keeps γ (and in eval the running mean and variance) as saved variables:
# the tensors themselves, no bytes beyond x, version-checked at backward. This op keeps them the
# same way (γ and β themselves, the running statistics themselves, their versions), not
# O(C) copies: copies made a BatchNorm keep and peak above eager on every shape (2C x 4 B in
# training, 5C x 4 B in eval with invstd; tests/conformance/test_never_more_than_eager.py). A γ or
# running statistic modified in place between forward and backward raises autograd's error, as
# eager does; so does β where this op needs it (the second derivative of a call that kept its
# output, x rebuilt from b; and a call whose γ or β changed between its forward and the activation
# that would make it keep b keeps x instead: _Source.keep_output).
def _check_params(ctx) -> None:
    if ctx.weight_v is not None:
        _derived.check_version(ctx.weight_v, ctx.weight_version, "batch_norm weight")
    if ctx.running_mean is not None:
        _derived.check_version(ctx.running_mean, ctx.stats_version[0], "batch_norm running_mean")
        _derived.check_version(ctx.running_var, ctx.stats_version[1], "batch_norm running_var")


def _check_not_released(ctx) -> None:
    if ctx.released:
        raise RuntimeError(
            "Trying to backward through the graph a second time (or directly access saved "
            "tensors after they have already been freed). Specify retain_graph=True if you "
            "need to backward through the graph a second time."
        )


def _bwd_kept_nothing(ctx, grad, need_x, need_b):
    # Differentiable in grad (double backward uses it as is): dx = dy γ invstd, dβ = Σ dy.
    nd = grad.dim()
    gx = gb = None
    if need_x:
        scale = ctx.save_invstd
        if scale is None:  # eval: from the running variance, as forward computed it
            scale = torch.rsqrt(ctx.running_var.to(ctx.stat_dtype) + ctx.eps)
        if ctx.weight_v is not None:
            scale = scale * ctx.weight_v.to(scale.dtype)
        gx = grad * _bshape(scale.to(grad.dtype), nd)
    if need_b:
        gb = grad.sum([d for d in range(nd) if d != 1]).to(ctx.bias_v.dtype)
    return gx, None, gb


def _forward_value(value, ref):
    # value (the forward's, detached) with ref's graph: a second derivative sees the forward's
    # parameter values and reaches the parameter itself.
    if ref is None:
        return value
    return value + (ref - ref.detach())


def _input_values(ctx) -> torch.Tensor:
    # x as in forward: kept, recomputed from its recipe, or rebuilt from the kept output b
    # (x = (b - β) / γ / invstd + μ; channels kept from x copied in).
    if ctx.x is not None or ctx.b is None:
        return _input(ctx)
    _derived.check_version(ctx.b, ctx.b_version, "batch_norm output")
    if ctx.bias_v is not None:  # β rebuilds x from b here
        _derived.check_version(ctx.bias_v, ctx.bias_version, "batch_norm bias")
    b = ctx.b
    pdt = ctx.save_invstd.dtype
    nd = b.dim()
    xh = b.to(pdt, copy=True)
    if ctx.weight_v is not None:
        gamma = ctx.weight_v.to(pdt)
        if ctx.bad is not None:
            gamma = gamma.index_fill(0, ctx.bad, 1.0)
        if ctx.bias_v is not None:
            xh.sub_(_bshape(ctx.bias_v.to(pdt), nd))
        xh.div_(_bshape(gamma, nd))
    x = xh.div_(_bshape(ctx.save_invstd, nd)).add_(_bshape(ctx.save_mean.to(pdt), nd))
    if ctx.bad is not None:
        x_bad = ctx.x_bad if ctx.x_bad is not None else ctx.recipe().index_select(1, ctx.bad)
        x.index_copy_(1, ctx.bad, x_bad.to(pdt))
    return x.to(b.dtype)


def _channel_dot(dy: torch.Tensor, b: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # Σ over all dims but 1 of dy·(b - m), in float64, in batch chunks so that the temporary stays
    # at most 1/8 of the tensor (no full-size buffer in backward).
    n = b.shape[0]
    step = max(1, n // 8)
    red = [d for d in range(b.dim()) if d != 1]
    mb = _bshape(m, b.dim()).to(b.dtype)
    acc = torch.zeros(b.shape[1], dtype=torch.float64, device=b.device)
    for i in range(0, n, step):
        t = b[i : i + step] - mb
        t.mul_(dy[i : i + step])
        acc += t.sum(red, dtype=torch.float64)
    return acc


C_STEM = "batch_norm"  # kernels/cpu/batch_norm.c: the backward's per-channel sums in one pass


# NOTE [Fake tensors model BatchNorm's C kernel]
# use_cpu never picks the C kernel for a fake tensor (no memory to run it on), so under
# slimgrad.memory.estimate a float32 CPU backward ran the PyTorch path of _bwd_from_output: dx in
# a fresh buffer, never over the incoming gradient, so the estimate asked ownership.take nothing
# (ResNet-50 small, bench case resnet50: 4 grants estimated where the real step grants 8), and
# with a kernel's sums declined its temporaries differ too. A fake tensor the real C kernel
# would take (kernels/_backend.cpu_kernel_would_run: the process-wide backend, dtype, device, the
# C file built) takes the C path's decisions: backward asks ownership.take as the real step does
# (``_FAKE_C`` stands for the library), and _bwd_from_output_c / _channel_sums_c allocate the
# kernel's outputs only, the same tensors with the same shapes (dx over the granted gradient as
# in the real call, its version bumped the same way); values are never read under fake tensors
# (as NOTE [Fake tensors model the C kernel] in ops/dropout.py). A fake b takes its channels kept
# from x from the real γ, β its stand-ins stand for (a model built before the estimate: NOTE [Real
# values behind the stand-ins] in slimgrad/memory.py), so those decline the C path there as in the
# real step; where no real values are behind them (a model built under fake tensors) it assumes no
# such channel, the estimate's only difference here.
_FAKE_C = object()


def _fake_c(t: torch.Tensor) -> bool:
    return (
        type(t) is not torch.Tensor
        and _backend._is_fake(t)
        and _backend.cpu_kernel_would_run(t, C_STEM)
    )


def _channel_sums_c(dy: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    # (3, C) float64: Σ b, Σ dy, Σ dy·b per channel (kernels/cpu/batch_norm.c), or None where the
    # C kernel does not apply (NOTE [Kernel backend choice]): the caller takes the PyTorch path
    if b.dim() < 2 or dy.dtype != b.dtype or not (b.is_contiguous() and dy.is_contiguous()):
        return None
    lib = _backend.use_cpu(b, C_STEM)
    if lib is None:
        if _fake_c(b):  # NOTE [Fake tensors model BatchNorm's C kernel]
            return torch.empty(3, b.shape[1], dtype=torch.float64)
        return None
    from slimgrad.kernels._cpu import functions, threads

    fn = functions(lib, _c_signatures)["sums"]
    n, c = b.shape[0], b.shape[1]
    out = torch.empty(3, c, dtype=torch.float64)
    fn(b.data_ptr(), dy.data_ptr(), n, c, b[0, 0].numel(), out.data_ptr(), threads())
    return out


def _c_signatures(C):
    p, i64 = C.c_void_p, C.c_int64
    return {
        "sums": ("bn_channel_sums_f32", [p, p, i64, i64, i64, p, C.c_int], None),
        "bwd": ("bn_bwd_from_output_f32", [p, p, i64, i64, i64, p, p, p, p, p, C.c_int], None),
    }


_C_FNS: dict = {}  # a loaded library -> its functions (kernels/_cpu.functions), read per call


def _bwd_from_output_c(ctx, grad, need_x, need_w, need_b, buf=None, lib=None):
    # The whole backward of a float32 CPU call with no channel kept from x in one C call
    # (kernels/cpu/batch_norm.c: per channel, the float64 sums, NOTE [dx from the output]'s
    # coefficients and dx, with the channel's data still in cache), or None: the caller's path.
    # dβ is Σ dy summed in float64 and rounded once (within the rule where aten's float32 sum is).
    # buf: grad itself when ownership.take granted it: dx is written over it (no dx allocation;
    # the kernel reads a channel's dy before it writes that channel's dx). lib: the backend's
    # library where the caller asked already (backward).
    b, invstd, w = ctx.b, ctx.save_invstd, ctx.weight_v
    shape = b.shape
    if (
        ctx.bad is not None
        or len(shape) < 2
        or b.dtype != torch.float32
        or invstd.dtype != torch.float32
        or grad.dtype != torch.float32
        or (w is not None and w.dtype != torch.float32)
        or (ctx.bias_v is not None and ctx.bias_v.dtype != torch.float32)
        # b's own contiguity: backward tested it where it handed lib over
        or not ((lib is not None or b.is_contiguous()) and grad.is_contiguous())
        or not invstd.is_contiguous()
        or 0 in shape  # no values (a tuple test: no call)
    ):
        return None
    if lib is None:
        lib = _backend.use_cpu(b, C_STEM)
        if lib is None:
            if not _fake_c(b):
                return None
            lib = _FAKE_C  # NOTE [Fake tensors model BatchNorm's C kernel]
    if lib is _FAKE_C:
        fn = None
    elif lib in _C_FNS:
        fn = _C_FNS[lib]["bwd"]
    else:
        from slimgrad.kernels._cpu import functions

        fn = (_C_FNS.setdefault(lib, functions(lib, _c_signatures)))["bwd"]
    n, c = shape[0], shape[1]
    s = 1
    for d in shape[2:]:  # math.prod(shape[2:])
        s *= d
    gx = None
    if need_x:
        mine = buf is not None and buf.stride() == b.stride() and buf.dtype == b.dtype
        gx = buf if mine else torch.empty_like(b)
    gw = torch.empty(c, dtype=torch.float32) if need_w else None
    gb = torch.empty(c, dtype=torch.float32) if need_b else None
    w = w.contiguous() if w is not None else None
    # fn None: a fake tensor; its outputs only (NOTE [Fake tensors model BatchNorm's C kernel])
    if fn is not None:
        fn(
            b.data_ptr(),
            grad.data_ptr(),
            n,
            c,
            s,
            None if w is None else w.data_ptr(),
            invstd.data_ptr(),
            None if gx is None else gx.data_ptr(),
            None if gw is None else gw.data_ptr(),
            None if gb is None else gb.data_ptr(),
            torch.get_num_threads() or 1,  # kernels/_cpu.threads()
        )
    if gx is not None and gx is buf:  # a raw write over the incoming gradient: visible to autograd
        _bump((gx,))  # torch.autograd.graph.increment_version(gx), without its frame
    return gx, gw, gb


def _bwd_from_output(ctx, grad, need_x, need_w, need_b, buf=None, lib=None):
    if ctx.b._version != ctx.b_version:
        _derived.check_version(ctx.b, ctx.b_version, "batch_norm output")
    out = _bwd_from_output_c(ctx, grad, need_x, need_w, need_b, buf, lib)
    if out is not None:
        return out
    invstd = ctx.save_invstd
    part = None
    if ctx.bad is not None:
        part = _bad_channels_dx(ctx, grad, need_x, need_w, need_b)
    pdt = invstd.dtype
    if ctx.weight_v is None:
        gamma = torch.ones_like(invstd)
        beta = torch.zeros_like(invstd)
    else:
        gamma = ctx.weight_v.to(pdt)
        beta = ctx.bias_v.to(pdt) if ctx.bias_v is not None else torch.zeros_like(gamma)
    # x̂ = (b - β) / γ has zero mean in exact arithmetic, so mean(b) = β; centring on the computed
    # mean(b) instead removes the part of b's rounding error that does not average out (what makes
    # Σ dx, e.g. a preceding conv bias's gradient, drift from 0). One reduction, no full-size temp.
    b = ctx.b
    red = [d for d in range(b.dim()) if d != 1]
    n = b.numel() // b.shape[1]
    # float32/float64 outputs: dx from per-channel coefficients (NOTE [dx from the output]); a
    # 16-bit output keeps aten's kernel, which computes in float32 where the coefficients would
    # have to be rounded to b's dtype
    direct = b.dtype == pdt and b.dtype in (torch.float32, torch.float64)
    # the CPU float32 kernel sums b, dy and dy·b per channel in one pass, in float64: mean(b) and
    # Σ dy (b - mean) = Σ dy·b - mean Σ dy (no cancellation: a good channel has |mean| <= |γ|/2)
    need_dot = need_w or (direct and need_x)
    sums = _channel_sums_c(grad, b) if need_dot and b.numel() else None
    dot = sdy = None
    if sums is not None:
        sb = sums[0]
        mean_p = (sb / n).to(pdt)
        dot, sdy = sums[2] - mean_p.double() * sums[1], sums[1]
    else:
        # Σ b in float64 (the C kernel's sum): mean(b) and dx's constant term (NOTE [dx from the
        # output])
        sb = b.sum(red, dtype=torch.float64) if b.numel() else None
        mean_p = (sb / n).to(pdt) if b.numel() else beta.clone()
        if need_dot:
            dot = _channel_dot(grad, b, mean_p)
    # γ = 1 on channels kept from x (their values come from x below): no division by a bad γ
    g64 = gamma.double() if ctx.bad is None else gamma.double().index_fill(0, ctx.bad, 1.0)
    gx = gb = None
    if direct:
        if sdy is None and (need_x or need_b):
            sdy = grad.sum(red, dtype=torch.float64)
        if need_x:
            gx = _dx_from_output(grad, b, g64, invstd, sb, dot, sdy, n, ctx.bad, buf)
        if need_b:
            # Σ dy summed in float64, rounded once (the C kernel's dβ, up to the last bit)
            gb = sdy.to(pdt)
    elif need_x or need_b:
        invstd_p, w_p = 1.0 / gamma, gamma * gamma * invstd
        if ctx.bad is not None:
            # Channels kept from x: neutral parameters here, exact values below.
            mean_p[ctx.bad] = 0
            invstd_p[ctx.bad] = 0
            w_p[ctx.bad] = 0
        gx, _, gb = torch.ops.aten.native_batch_norm_backward(
            grad, b, w_p, None, None, mean_p, invstd_p, True, ctx.eps, [need_x, False, need_b]
        )
    gw = None
    if need_w:
        # dγ = Σ dy (b - mean(b)) / γ, accumulated in float64 and divided once: multiplying by a
        # rounded 1/γ inside the kernel would add a systematic relative error to every term.
        gw = (dot / g64).to(pdt)
    if part is not None:
        idx = ctx.bad
        gx_b, gw_b, gb_b = part
        if need_x:
            gx.index_copy_(1, idx, gx_b)
            if gx is buf:  # written over the incoming gradient: visible to autograd
                _bump((gx,))
        if need_w:
            gw = gw.index_copy(0, idx, gw_b.to(gw.dtype))
        if need_b:
            gb = gb.index_copy(0, idx, gb_b.to(gb.dtype))
    if gw is not None:
        gw = gw.to(ctx.weight_v.dtype)
    if gb is not None:
        gb = gb.to(ctx.bias_v.dtype)
    return gx, gw, gb


# NOTE [dx from the output]
# dx = γ σ⁻¹ (dy - mean(dy) - x̂ mean(dy x̂)) with x̂ = (b - m)/γ (m = mean(b), see above) is
#     dx = S dy + K b + C,  S = γ σ⁻¹,  K = -S k,  C = -(S Σ dy + K Σ b) / n,
#     k = Σ dy (b - m) / (γ² n)
# per channel. S and K are computed in float64 from the float64 sums and rounded once to b's
# dtype; C is computed in float64 from those rounded S and K and the float64 Σ dy, Σ b, then
# rounded once; dx is then two fused passes (addcmul, addcmul_). With C from the rounded S and K,
# S Σ dy + K Σ b + n C is 0 but for C's own rounding: Σ dx over a channel, which is 0 in exact
# arithmetic and what a preceding conv's bias gradient sums, carries no coherent error from S's
# and K's roundings. C computed from the exact S and K (before: C = -S (mean(dy) - m k)) left
# (K_rounded - K) n m in that sum, m = mean(b) ~ β: the sweep's BN -> SiLU at 4x16x7x7
# (tests/conformance/test_never_more_than_eager.py) put the 1x1 conv's bias gradient at 6.68e-6
# against the rule's bound 5.77e-6; now 5.72e-6. That gradient is rounding noise around 0 (the
# conv sums dx in float32), so the rule compares one draw of noise against eager's: over 2,000
# seeds of that block (float32, one thread), the conv bias broke the rule on 4 seeds before
# (worst 1.33x), 3 now (worst 1.13x), and on 1 (1.44x) for a control that computes the
# BatchNorm's dx in float64 from x itself and rounds it once (the most accurate float32 dx there
# is). In an emulation of this formula on eager's b and dy, summing the conv bias gradient in
# float64 instead left 0 of 3,000 seeds past the rule (worst 0.70x; ops/conv.py sums it in aten's
# float32). aten's kernel, fed mean' = m,
# invstd' = 1/γ and weight' = γ² σ⁻¹, computes the same dx with 1/γ rounded to float32 (entering the
# projection squared and the scale with weight', itself two roundings): a systematic relative error
# on every element of a channel, which sums coherently in the preceding conv's dW. On the
# Conv-BN-SiLU-SE-Conv-BN block of tests/ops/test_derived_rebuild.py (3x3x11x9 float32, 200 seeds,
# one thread): the first conv's dW broke the error rule on 11 seeds with the kernel, 4 with these
# coefficients, and 4 for a control that computes eager's BatchNorm backward in float64 from x
# itself (every input the same: more accurate than eager, yet outside 2x eager's error on those
# seeds: eager's own float32 reduction error is sometimes far below its typical size, and the rule
# compares against that one draw; mean |dW - ref64| over the seeds: kernel 1.49e-5, these
# coefficients 1.25e-5, control 1.22e-5, eager 1.47e-5).
def _dx_from_output(grad, b, g64, invstd, sb, dot, sdy, n, bad, buf=None):
    # sb, dot, sdy: float64 Σ b, Σ dy (b - m), Σ dy per channel
    dt = b.dtype
    s64 = g64 * invstd.double()
    k_r = (-(dot / (g64 * g64) / n) * s64).to(dt)
    s_r = s64.to(dt)
    # C from the rounded S and K: Σ dx = S Σ dy + K Σ b + n C is then 0 but for C's own rounding
    c_r = (-(s_r.double() * sdy + k_r.double() * sb) / n).to(dt)
    if bad is not None:  # those channels' values come from x (index_copy_ after)
        k_r, c_r, s_r = (t.index_fill(0, bad, 0.0) for t in (k_r, c_r, s_r))
    nd = b.dim()
    if buf is None or buf.dtype != dt:
        dx = torch.addcmul(_bshape(c_r, nd), b, _bshape(k_r, nd))
        return dx.addcmul_(grad, _bshape(s_r, nd))
    # over grad where ownership granted it (NOTE [Channels kept from x in backward]): the same two
    # passes a group of channels at a time (at most 1/8 of them in a temporary), the same bits
    C = b.shape[1]
    g = -(-C // 8)
    for c0 in range(0, C, g):
        e = min(g, C - c0)
        t = torch.addcmul(
            _bshape(c_r[c0 : c0 + e], nd), b.narrow(1, c0, e), _bshape(k_r[c0 : c0 + e], nd)
        )
        t.addcmul_(grad.narrow(1, c0, e), _bshape(s_r[c0 : c0 + e], nd))
        buf.narrow(1, c0, e).copy_(t)
    return buf


# NOTE [Channels kept from x in backward]
# A channel whose output cannot be inverted keeps its input (x_bad, a copy of those channels
# only); its dx, dγ, dβ come from aten's kernel on x_bad, as eager's. That kernel runs on at most
# a quarter of those channels at a time (a copy of dy's and its dx for them live at once), and
# where the graph is not kept each group's dx is written over the group's x_bad, which nothing
# reads again: before the full-size dx exists only x_bad's bytes are live, and after it no
# other copy. dx is written over the incoming gradient where ownership.take granted it (NOTE
# [Gradient-buffer ownership]), a group of at most 1/8 of the channels at a time through a
# temporary: the passes, and bits, of a fresh dx. This matters where the activation's output is
# held anyway: inside a reentrant checkpoint's backward the checkpoint holds it whatever this op
# keeps, so b and x_bad stand against eager's x alone. One kernel call on all those channels, dx
# in a fresh buffer, put a Conv-BN-ReLU block's peak there at 1.099x eager's (2x8x6x6, 2 of 8
# channels with γ = 0; 1.171x at 4 of 8); now at or below it (tests/test_ckpt_never_above.py).
# Where grad is not granted (another holder), dx is a fresh buffer and the peak can be eager's
# plus x_bad.
def _bad_channels_dx(ctx, grad, need_x, need_w, need_b):
    idx = ctx.bad
    # x's recipe re-runs the whole conv (a full-size temporary): done while no dx buffer is live
    own = ctx.x_bad is None or (_keep_graph is not None and not _keep_graph())
    x_bad = ctx.x_bad if ctx.x_bad is not None else ctx.recipe().index_select(1, idx)
    if own:
        ctx.x_bad = None  # read by no other backward: the graph is freed after this one
    gx_b = (x_bad if own else torch.empty_like(x_bad)) if need_x else None
    w, mean, invstd = ctx.weight_v, ctx.save_mean, ctx.save_invstd
    k = idx.shape[0]
    g = -(-k // 4)  # at most 4 groups
    gws, gbs = [], []
    for s in range(0, k, g):
        e = min(g, k - s)
        ig = idx[s : s + e]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.index_select(1, ig),
            x_bad.narrow(1, s, e),
            None if w is None else w.index_select(0, ig),
            None,
            None,
            mean.index_select(0, ig),
            invstd.index_select(0, ig),
            True,
            ctx.eps,
            [need_x, need_w, need_b],
        )
        if need_x:
            gx_b.narrow(1, s, e).copy_(gx)
        del gx
        gws.append(gw)
        gbs.append(gb)
    del x_bad
    if k > g:
        gw = torch.cat(gws) if need_w else None
        gb = torch.cat(gbs) if need_b else None
    return gx_b, gw, gb


def _check_channels(x, *named) -> None:
    # aten.native_batch_norm does not check these sizes (eager's torch.batch_norm does).
    c = x.shape[1] if x.dim() > 1 else 1
    names = ("running_mean", "running_var", "weight", "bias")
    for name, t in zip(names, named):
        if t is not None and t.numel() != c:
            raise RuntimeError(
                f"slimgrad.ops.batch_norm: {name} should contain one element per channel; "
                f"expected {c} elements, got {t.numel()} (shape {tuple(t.shape)}). Pass a "
                f"({c},) tensor."
            )


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    recompute_input: str = "pointwise",
) -> torch.Tensor:
    """``torch.nn.functional.batch_norm`` that keeps less for backward.

    b = γ (x - μ) / sqrt(σ² + eps) + β per channel (dim 1). In training, the output is registered
    so that a following :func:`slimgrad.ops._derived.activation` makes this op keep b instead of x
    (NOTE [Derived saved inputs]); in eval with γ, β frozen nothing full-size is kept.

    Memory: training keeps x (as eager), or x's recipe when x comes from a slimgrad conv (0 bytes),
    or b when a slimgrad activation follows (shared with that activation and the next slimgrad
    conv), except under autocast (b less precise than γ, β: x or its recipe, as eager, since x
    rebuilt from a rounded b breaks the error rule); eval with frozen γ, β keeps nothing
    (eager keeps x); an eval call that would keep x as well, or whose channels hold at most 5
    values, runs eager's op (NOTE [Eval calls that cannot win]). γ, β and the running statistics
    are kept as themselves (no copies), version-checked at backward as eager does.

    Args:
        input: (N, C, *) tensor.
        running_mean, running_var: (C,) buffers or None; updated in place in training.
        weight, bias: (C,) affine parameters or None.
        training: use batch statistics and update the running ones.
        momentum: running-average factor.
        eps: added to the variance.
        recompute_input: where x is the output of a slimgrad conv that keeps its own input, keep
            how to recompute x instead of x and re-run that conv in backward (NOTE [Recomputable
            inputs]): ``"pointwise"`` (default) when that conv is 1x1, does not reduce the
            channels (C_in <= C_out) and does not read a squeeze-excite output, and a training
            call sees more than 32 values per channel (NOTE [Which convs the default replays]),
            ``"always"``, or ``"never"`` (keep x; no extra compute).

    Returns:
        The normalised tensor, same shape, dtype and memory format as ``input``.

    Raises:
        ValueError: training with one value per channel (as torch); unknown ``recompute_input``.
        RuntimeError: eval without running statistics, or a (C,) argument of another size (as
            torch).

    Example:
        >>> y = batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=True)
    """
    return _batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps, recompute_input
    )


def _batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    recompute_input: str,
    state: dict | None = None,
) -> torch.Tensor:
    # batch_norm; state: the calling module's __dict__, where the parameters and buffers last seen
    # not to be functorch wrappers are kept (NOTE [Arguments known to be plain]), or None
    if recompute_input not in _POLICIES:
        raise ValueError(
            "slimgrad.ops.batch_norm: recompute_input must be one of "
            f"{_POLICIES}; expected one of them, got {recompute_input!r}. Use 'pointwise' "
            "(default), 'always' or 'never'."
        )
    shape = input.shape
    ndim = input.ndim
    if training and (ndim < 2 or shape[0] < 2):  # else more than one value per channel
        torch.nn.functional._verify_batch_size(input.size())  # eager's check and message
    if eps <= 0.0 if training else eps < 0.0:  # eager's checks (F.batch_norm), before any path
        what = "positive during training" if training else "non-negative"
        raise ValueError(
            f"slimgrad.ops.batch_norm: batch_norm eps must be {what}, but got {eps}; expected "
            f"eps {'> 0' if training else '>= 0'}, got {eps}. Pass eps=1e-5 (torch's default)."
        )
    if not training and (running_mean is None or running_var is None):
        raise RuntimeError(
            "slimgrad.ops.batch_norm: eval mode needs running statistics; expected tensors, got "
            "None. Pass running_mean and running_var, or training=True."
        )
    needs_graph = (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ) and torch.is_grad_enabled()
    numel = input.numel() if needs_graph else 0
    compiled = numel != 0 and _compiling()
    # NOTE [Two watchers in one call] in ops/conv.py: transforms (bit 4) and TorchScript tracing (8)
    w = _library._watchers if numel != 0 and not compiled else None
    mask = w() if w is not None else None
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    plain = (
        numel == 0
        or compiled
        or input.is_meta
        or (_transforms_active() if mask is None else mask & 4 != 0)
    )
    # NOTE [Few values per channel]: decided from the shape alone
    few = training and numel <= _MAX_FEW * (shape[1] if ndim > 1 else 1)
    # x's recipe (NOTE [Recomputable inputs]; its cost: NOTE [What a replayed input costs]),
    # looked up once: the forward keeps it if it keeps x. The default policy replays no conv for
    # a norm with few values per channel (NOTE [Which convs the default replays])
    recipe = None
    if (
        not plain
        and (training or (weight is not None and weight.requires_grad))
        and not (few and recompute_input == "pointwise")
    ):
        # _derived.recipe_of(input, recompute_input), inline (not compiling: plain)
        k = id(input)
        if k in _RECIPES_D and recompute_input != "never":
            e = _RECIPES_D[k]
            r = e[1]
            if (
                e[0]() is input
                and input._version == r.version
                and (r.cheap or recompute_input != "pointwise")
                # NOTE [A recipe made in a checkpoint's forward] in ops/_derived.py
                and (r.region is None or _derived.usable(r))
            ):
                try:  # _derived.readable_tensors(r), inline
                    ts = r.tensors
                except RuntimeError:  # a NodeRecipe whose node let x go: no recipe
                    ts = None
                for t, v in zip(ts if ts is not None else (0,), r.versions):
                    if ts is None or (t is not None and t._version != v):
                        break
                else:
                    recipe = r
    if (
        plain
        # NOTE [Few values per channel]: such a training call keeps x (or its recipe) and runs
        # aten's backward whatever follows; where x has no recipe and x or γ needs a gradient
        # (so x is kept) that is eager's own node, decided from the shape before any Function
        or (
            few
            and (input.requires_grad or (weight is not None and weight.requires_grad))
            and recipe is None
        )
        # NOTE [Eval calls that cannot win]
        or (not training and _eval_cannot_win(input, weight, bias, running_mean, recompute_input))
        # a 16-bit output in training keeps x (_Source.keep_output): unless x has a recipe,
        # eager's op keeps exactly that
        or (
            training
            and input.dtype.is_floating_point
            and input.dtype.itemsize < 4
            and recipe is None
        )
    ):
        # Plain path: nothing is kept beyond what eager keeps (empty inputs: aten's own rules).
        if (
            numel == 0
            or compiled
            or (
                # NOTE [No torch function without a mode or a subclass]
                not (
                    mask is not None
                    and not mask & 2
                    and type(input) in _PLAIN
                    and (weight is None or type(weight) in _PLAIN)
                    and (bias is None or type(bias) in _PLAIN)
                    and (running_mean is None or type(running_mean) in _PLAIN)
                    and (running_var is None or type(running_var) in _PLAIN)
                )
                and _has_tf(input, running_mean, running_var, weight, bias)
            )
        ):
            return torch.nn.functional.batch_norm(
                input, running_mean, running_var, weight, bias, training, momentum, eps
            )
        # NOTE [Eager's batch_norm without its wrapper]
        return torch.batch_norm(
            input, weight, bias, running_mean, running_var, training, momentum, eps, _cudnn_on()
        )
    c = shape[1] if ndim > 1 else 1
    for t in (running_mean, running_var, weight, bias):  # eager's checks F does
        if t is not None and t.shape != (c,):  # (C,): no call; anything else is checked
            _check_channels(input, running_mean, running_var, weight, bias)
            break
    if _jit_tracing() if mask is None else mask & 8:
        refuse_jit("ops.batch_norm")
    # NOTE [Under saved-tensor hooks]: inside a hooks region, decided at forward and saved through
    # save_for_backward
    hooked = _top_hooks(False) is not None
    rec = None
    if (
        hooked
        and training
        and state is not None
        and weight is not None
        and not few
        and input.dtype == weight.dtype
        and input.dtype.itemsize >= 4
    ):
        # NOTE [Under saved-tensor hooks]: the claims asked of this module's calls in a hooks
        # region, [weight version, pre, calls, claims asked]; the decision is made at the first
        # call of each new weight version from the last version's calls
        rec = state[_CLAIMS_KEY] if _CLAIMS_KEY in state else None
        v = weight._version
        if rec is None:
            rec = state[_CLAIMS_KEY] = [v, False, 0, 0]
        elif rec[0] != v:
            rec[:] = [v, 0 < rec[2] <= rec[3], 0, 0]
        if rec[1]:
            hooked = _PRE
    # the forward takes x's recipe from holder[0] and puts there its ctx where it keeps x or its
    # recipe (what a _Source asks), else None
    holder: list = [recipe]
    # the C apply (NOTE [Applying a Function without its Python wrapper] in _autograd.py): not
    # compiling and no transform is active here (the plain path above took those)
    x = unwrap_if_dead(input)
    # make_anchor(input) where grad mode is on and nothing compiles or transforms (checked above)
    anchor = None
    if input.requires_grad:
        box: list = []
        anchor = (_ANCHOR_APPLY(x, box), box)
    # NOTE [Arguments known to be plain]
    known = state[_PLAIN_KEY] if state is not None and _PLAIN_KEY in state else None
    if (
        known is not None
        and known[0] is weight
        and known[1] is bias
        and known[2] is running_mean
        and known[3] is running_var
    ):
        w, b, rm, rv = weight, bias, running_mean, running_var
    else:
        w = None if weight is None else unwrap_if_dead(weight)
        b = None if bias is None else unwrap_if_dead(bias)
        rm = None if running_mean is None else unwrap_if_dead(running_mean)
        rv = None if running_var is None else unwrap_if_dead(running_var)
        if state is not None and w is weight and b is bias and rm is running_mean:
            if rv is running_var:
                state[_PLAIN_KEY] = (weight, bias, running_mean, running_var)
    out = _BN_APPLY(x, w, b, rm, rv, training, momentum, eps, holder, recompute_input, hooked)
    if anchor is not None and out.grad_fn is not None:  # attach_anchor(out, anchor)
        out.grad_fn._slimgrad_anchor = anchor
    ctx = holder[0]
    if (
        training
        and ctx is not None
        # NOTE [A source only where it can be claimed]
        and not few
        and input.dtype.itemsize >= 4
        and (out.dtype == ctx.param_dtype or not _less_precise(out.dtype, ctx.param_dtype))
    ):
        # _derived.put_source(out, _Source(ctx=ctx)), inline (not compiling: plain path above;
        # NOTE [A registry entry dropped in C]); out is this call's fresh output
        if rec is not None and _task_id() == -1:
            # counted outside a backward only: a checkpoint's recompute there may stop before the
            # activation that claims
            ctx.claims = rec
            rec[2] += 1
        _CLOCK[0] += 1  # _derived._tick()
        k = id(out)
        src = (_Source(ctx=ctx), out._version)
        e = _SOURCES_D[k] if k in _SOURCES_D else None
        if e is not None and e[0]() is out:
            _SOURCES_D[k] = (e[0], src)
        else:
            _SOURCES_D[k] = (weakref.ref(out, _partial(_SOURCES_D.pop, k)), src)
    return out


# NOTE [What a replayed input costs]
# Keeping x's recipe instead of x (NOTE [Recomputable inputs] in ops/_derived.py) re-runs x's conv
# in this op's backward: one more forward of that conv per step. In ResNet-50 the convs replayed by
# default (each bottleneck's 1x1 conv3 and the 1x1 downsample convs: those with C_in <= C_out,
# NOTE [Which convs the default replays] in ops/_derived.py) hold 28.9% of the forward's conv
# multiply-adds at 224x224, 8.86% of a forward + backward step's FLOPs. At the host-overhead
# proxy's 2x3x32x32 (bench case host_overhead) the deep 1x1 convs run on 1 to 16 pixels per
# sample, bound by reading their weights; their norms see at most 32 values per channel, so the
# default no longer replays them (that NOTE; figures: ``docs/measurements.md``, Replayed 1x1
# convs).
# recompute_input="never" trades those bytes for eager's compute, "always" replays every conv that
# has a recipe.


# NOTE [Arguments known to be plain]
# The C apply needs every tensor argument passed through ``unwrap_if_dead`` (what Function.apply
# does). With no torch.func transform active (the only case that reaches the apply) any functorch
# wrapper is dead, so a tensor that ``unwrap_if_dead`` returned as itself is no wrapper, and never
# becomes one. A slimgrad BatchNorm module keeps, in its ``__dict__``, the weight, bias and running
# statistics objects found so once; a later call with the same objects (``is``) passes them as
# they are, without the four calls. Any other object (a replaced Parameter, a functional call's
# tensors) is unwrapped, and stored when it is plain.
_PLAIN_KEY = "_slimgrad_bn_plain"


# NOTE [Eager's batch_norm without its wrapper]
# ``torch.nn.functional.batch_norm`` is, for arguments without ``__torch_function__`` (no tensor
# subclass, no torch function mode: ``_has_torch_function_variadic``, one C call), its batch-size
# and eps checks and then ``torch.batch_norm(..., torch.backends.cudnn.enabled)``. Both checks ran
# above, with eager's messages, before any path; so a plain-path call that needs a graph and is
# not traced by Dynamo calls ``torch.batch_norm`` itself with the flag read from
# ``torch._C._get_cudnn_enabled`` (what the ``cudnn.enabled`` property returns): the same aten op
# with the same arguments, five Python calls fewer per call (most BatchNorms of a small-image
# step take this path: NOTE [Few values per channel]). Dynamo traces, anything with a
# ``__torch_function__`` and a call without a graph keep the functional itself.


# NOTE [No torch function without a mode or a subclass]
# ``torch._C._has_torch_function_variadic`` is True only where a torch function mode is enabled or
# an argument's type overrides ``__torch_function__`` (``torch.Tensor`` does not, and
# ``nn.Parameter``'s is the disabled one, which the check skips). Where this call's watchers mask
# (NOTE [Two watchers in one call] in ops/conv.py) says no mode is enabled (bit 2, the fact
# ``torch._C._is_torch_function_mode_enabled`` returns) and every tensor argument's type is
# exactly Tensor or Parameter (read by type: no call), the answer is False without the call;
# anything else (no mask, a mode, a subclass) asks it.


# NOTE [A source only where it can be claimed]
# _Source.keep_output refuses, from the output's shape and dtypes alone, a training call with few
# values per channel (NOTE [Few values per channel]), a 16-bit output and an output less precise
# than γ, β (module docstring). Such a call registers no source: a following activation then finds
# none and runs eager's op, what it ran after the refusal, without asking for ownership or a claim
# (the same bits and bytes; fewer host calls per layer).


# The C tests of transforms_active and refuse_jit, and torch.compiler.is_compiling itself (Dynamo
# folds it by identity): one call each on the hot path, not two or three
_transforms_active = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._is_tracing
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_task_id = torch._C._current_graph_task_id
# the depth of the Python dispatch mode stack (torch's selective checkpointing runs under one);
# private: 0 where this torch lacks it
_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


# NOTE [The same ops under selective checkpointing]
# torch's selective activation checkpointing (checkpoint(..., context_fn=partial(
# create_selective_checkpoint_contexts, policy))) records every aten op of the forward under a
# dispatch mode and, in the recompute inside backward, hands each op its stored entry by name and
# call count: an op the recompute calls more often than the forward did raises "... encountered
# during backward but not found in storage". A norm claimed under checkpoint's hooks saves its
# output at forward and a copy of it in the recompute (NOTE [Under saved-tensor hooks] above:
# the recompute's own activation may write over it): from the second step on, when the decision
# read from the last weight version keeps b, the recompute's extra aten.clone raised (Conv ->
# BatchNorm -> SiLU or Hardswish under any policy; eager ran). Under a dispatch mode inside a
# checkpoint the forward copies too, so both runs issue the same ops; the forward's copy is let
# go at once (checkpoint's pack holds no tensor), a transient of b's bytes there and only there.
_PRE = 2  # the forward's ``hooked``: inside a hooks region, b saved at forward (pre)
_CLAIMS_KEY = "_slimgrad_bn_claims"  # NOTE [Under saved-tensor hooks]: in the module's __dict__
_has_tf = torch._C._has_torch_function_variadic
# Types whose instances have no __torch_function__ of their own: checked without a call
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_cudnn_on = torch._C._get_cudnn_enabled
_grad_on = torch._C.is_grad_enabled
_bump = torch._C._increment_version
_RECIPES_D, _SOURCES_D, _CLOCK = _derived._RECIPES_D, _derived._SOURCES_D, _derived._CLOCK
_PLAIN_RECIPE = _derived.Recipe
_DERIVED_D = _derived._DERIVED_D

"""In-Place Activated BatchNorm: BatchNorm + an invertible activation, written over the input.

Math (per channel c, over the N * prod(spatial) values of c; training uses batch statistics)::

    xhat = (x - mean_c) * invstd_c,   invstd_c = 1 / sqrt(var_c + eps)   (biased batch variance)
    y    = weight_c * xhat + bias_c                                       (any sign of weight)
    z    = act(y),    act in {identity, leaky_relu(slope > 0), elu(alpha > 0)}

Backward rebuilds ``y = act^-1(z)`` and ``xhat = (y - bias) / weight`` from the output ``z``::

    dy    = dz * act'(z)            (through z: leaky_relu -> slope, elu -> z + alpha)
    dbias = sum(dy),   dweight = sum(dy * xhat)
    dx    = weight * invstd * (dy - dbias / n - xhat * dweight / n)     (training)
    dx    = weight * invstd_running * dy                                 (eval)

Memory: saves z (the output, written over x: the storage the next layer saves anyway) + invstd
(one float32 per channel; float64 for float64 input; in eval running_var itself, as eager: NOTE
[InPlaceABN in eval keeps the running statistics]): 0 extra bytes/elt. Eager BatchNorm +
LeakyReLU(inplace) saves x and z (2 full-size tensors) + mean and invstd. Channels that cannot be
inverted exactly keep their x̂ in a side tensor (NOTE [Invertibility]). Backward allocates one
full-size buffer (dx) plus chunk-sized temporaries (NOTE [Chunked backward]).

# NOTE [Invertibility]
Rebuilding x̂ from z amplifies rounding error. With y = w*x̂ + b rounded to unit roundoff u, the
rebuilt x̂ = (y - b)/w carries an absolute error of about u*(|x̂| + |b|/|w|); eager BatchNorm,
reading the exact input, has about u*|x̂|. So a channel is rebuilt from z only when
|b| <= REBUILD_MAX_BIAS_RATIO * |w| (= 4) and |w| > tiny (the smallest normal number of the input
dtype); for ELU also its smallest pre-activation must be >= ELU_MIN_PREACT (= -ln 256), because
log1p(z/alpha) loses about u*exp(-y) and reaches -inf where elu saturates. Every other channel
(|w| ~ 0 included, NaN weights too) keeps its x̂ exactly as eager BatchNorm computes it (float32;
float64 for float64 input) in a side tensor of shape (N, k, *spatial) for its k channels: at most
k/C of one float32 activation, zero bytes in the common case. Never inf/NaN, never an
approximation beyond the tolerance rule for those channels. Measured (fp32, 16 channels x 4096
values, random w and b, 144 trials, tests are not timed): dx and dbias always within the error
rule; dweight within it in 137 trials, at most 1.36x the rule's bound in the other 7. That residue
is the rounding of the stored fp32 output itself: with ratio 1 it is 3 trials (1.10x), with 8 it is
18 trials (2.32x); 4 is the knee.
For bf16/fp16 inputs with fp32 weights, dweight carries the input dtype's rounding of z.

# NOTE [Chunked backward]
Backward runs over chunks: budget = min(numel / 16, CHUNK_ELEMS = 32768) values; channel groups of
up to `budget` values, one channel when a channel is larger; a channel above 4 * max(budget, 4096)
values is split over batch ranges of about that size (at least one sample's channel). Per chunk:
rebuild y = act^-1(z) and dy from (z, dz) into chunk-sized temporaries; then aten's fused BatchNorm
backward on the rebuilt input, with mean' = b, invstd' = 1/w, weight' = w * invstd * w (x̂ is formed
on the fly, never stored), gives sum(dy), sum(dy * x̂) and the chunk's dx, copied into its slice of
the one dx buffer. Split channels (partial sums add up) and the sync variant (sums all-reduced in
between) take a reduction pass, then a pass writing dx = k*dy + p*y + q. Full-size buffers in
backward: dz (incoming) and dx, never more; and only dz when the ownership rule
(``slimgrad.ownership.take``, NOTE [Gradient-buffer ownership]) proves nobody else can see dz: then
dx is written into dz's buffer (``owned``). The saved z is never written, and dz is never written
unless owned: PR #218 of mapillary/inplace_abn overwrote both unconditionally and gave silently
wrong gradients for shared gradients and retain_graph.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from slimgrad import _dtensor, ownership
from slimgrad._autograd import first_order, refuse_jit, transforms_active
from slimgrad._errors import check_seen, hooks_top, internal_error, raise_if_written, seen
from slimgrad._library import custom_op, python_impl
from slimgrad._math import abn as _abn
from slimgrad._math.tables import dynamic_size
from slimgrad.kernels import _backend
from slimgrad.ops import _derived

__all__ = ["ACTIVATIONS", "inplace_abn", "inplace_abn_sync", "check_activation"]

ACTIVATIONS = ("identity", "leaky_relu", "elu")

# NOTE [Few values per channel in InPlaceABN]
# A training call with at most _MAX_FEW values per channel that needs gradients is eager's
# BatchNorm and activation, out of place: x is left as it is and a new tensor is returned. The
# reason is BatchNorm's (NOTE [Few values per channel] in ops/batch_norm.py): at 2 values per
# channel eager's dx sums to exactly 0 over the channel (a preceding conv's bias gradient), while
# dx rebuilt from the output sums to rounding noise. tests/ops/test_abn_few_values.py sweeps 2 to 8
# values per channel (identity, leaky_relu 0.01 and 0.1, elu; float32 and bfloat16; gamma 1e-3 to
# 10; |beta| up to 3 |gamma|): the rebuilt gradients broke the error rule for every activation and
# dtype. Such a layer holds n x C values, small next to the layers whose saving matters; it keeps
# what eager's BatchNorm + in-place activation keeps (x, mean and invstd, the output the next layer
# keeps too: tests/models/test_resnet_abn.py counts it). The count is a shape fact, read per call.
# The sync variant's count is over every rank: not covered here.
_MAX_FEW = 32

# the op's plain-PyTorch forward and backward (the layout), shared with the Triton kernels'
# fallbacks from below both (NOTE [Kernels are leaves] in slimgrad._math)
_fwd_torch = _abn.fwd_torch
_bwd_torch = _abn.bwd_torch


def check_activation(api: str, activation: str, activation_param: float) -> None:
    """Refuse activations that cannot be inverted (error form)."""
    if not isinstance(activation, str):
        raise TypeError(
            f"slimgrad.{api}: activation must be a str; expected one of {ACTIVATIONS}, got "
            f"{type(activation).__name__}. Pass activation='leaky_relu'."
        )
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"slimgrad.{api}: activation must be invertible ('identity', 'leaky_relu', 'elu'), got "
            f"{activation!r}. Use activation='leaky_relu', or keep ReLU and let convert_ use the "
            "recompute path."
        )
    if activation == "identity":
        return
    if isinstance(activation_param, bool) or not isinstance(activation_param, (int, float)):
        raise TypeError(
            f"slimgrad.{api}: activation_param must be a float; expected a number > 0, got "
            f"{type(activation_param).__name__}. Pass e.g. activation_param=0.01."
        )
    if not (math.isfinite(activation_param) and activation_param > 0):
        name = "slope" if activation == "leaky_relu" else "alpha"
        raise ValueError(
            f"slimgrad.{api}: {activation} {name} must be finite and > 0 to be invertible; "
            f"expected activation_param > 0, got {activation_param}. Use e.g. 0.01 for "
            "leaky_relu, 1.0 for elu."
        )


# ----------------------------------------------------------------------------------------------
# torch.library registration (for torch.compile) and the autograd Function


def _impl(t: torch.Tensor):
    # NOTE [Kernel backend choice] in slimgrad/kernels/_backend.py: (fwd, bwd) of the Triton
    # kernels (slimgrad/kernels/inplace_abn.py) or of the PyTorch path.
    if _backend.use_triton(t):
        k = _backend.kernels("inplace_abn")
        return k._fwd_triton, k._bwd_triton
    return _fwd_torch, _bwd_torch


# The forward is three ops so that the only data-dependent shape (the side tensor's channel count)
# comes from an op that mutates nothing: inductor cannot schedule unbacked sizes produced by an
# op that also mutates its inputs.


@custom_op("inplace_abn_stats", mutates_args=("running_mean", "running_var"))
def _stats_op(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    mean, invstd, _ = _abn.stats(x, running_mean, running_var, training, momentum, eps)
    if running_mean is not None and mean.data_ptr() == running_mean.data_ptr():
        mean = mean.clone()  # eval mode: a custom op may not return an alias of an input
    return mean, invstd


@_stats_op.register_fake
def _(x, running_mean, running_var, training, momentum, eps):
    acc = _abn.acc_dtype(x.dtype)
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


@custom_op("inplace_abn_side", mutates_args=())
def _side_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = _abn.affine(weight, bias, x.shape[1], x.device, mean.dtype)
    return _abn.side_channels(x, w, b, mean, invstd, activation, (weight, bias))


@_side_op.register_fake
def _(x, weight, bias, mean, invstd, activation):
    k = dynamic_size(max=x.shape[1])  # NOTE [Side tables under FakeTensorMode and torch.compile]
    return (
        x.new_empty(k, dtype=torch.long),
        x.new_empty((x.shape[0], k, *x.shape[2:]), dtype=_abn.acc_dtype(x.dtype)),
    )


@custom_op("inplace_abn_apply_", mutates_args=("x",))
def _apply_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    activation: str,
    param: float,
) -> None:
    w, b = _abn.affine(weight, bias, x.shape[1], x.device, mean.dtype)
    if _backend.use_triton(x):  # NOTE [Kernel backend choice]; False: a layout it cannot take
        scale = w * invstd
        if _backend.kernels("inplace_abn").apply_(x, scale, b - mean * scale, activation, param):
            return
    _abn.apply_torch_(x, w, b, mean, invstd, activation, param)


@_apply_op.register_fake
def _(x, weight, bias, mean, invstd, activation, param):
    return None


@custom_op("inplace_abn_bwd", mutates_args=())
def _bwd_op(
    z: torch.Tensor,
    dz: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    invstd: torch.Tensor,
    side_idx: torch.Tensor,
    side_xhat: torch.Tensor,
    training: bool,
    eps: float,
    activation: str,
    param: float,
    need_dx: bool,
    need_dparams: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    count = z.numel() // z.shape[1] if z.shape[1] else 0
    dx, dw, db = _impl(z)[1](
        z, dz, weight, bias, invstd, side_idx, side_xhat, count, training, eps, activation, param,
        need_dx, need_dparams,
    )  # fmt: skip
    if dx is None:
        dx = z.new_empty(0)
    return dx, dw, db


@_bwd_op.register_fake
def _(z, dz, weight, bias, invstd, side_idx, side_xhat, training, eps, activation, param, need_dx,
      need_dparams):  # fmt: skip
    acc = _abn.acc_dtype(z.dtype)
    c = z.shape[1]
    dx = torch.empty_like(z) if need_dx else z.new_empty(0)
    return dx, z.new_empty(c, dtype=acc), z.new_empty(c, dtype=acc)


def _traced(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or is_fake(t)


def _op(name: str, t: torch.Tensor):
    # Under torch.compile or on fake tensors: the registered op (traced without a graph break; its
    # fake kernel sizes the side table). Eagerly: its Python implementation, called directly: the
    # custom-op dispatcher costs time per call (docs/measurements.md), and the memory tracker sees
    # the same aten ops either way (NOTE [Custom ops and the memory tracker]).
    if _traced(t):
        return getattr(torch.ops.slimgrad, name)
    impl = python_impl(f"slimgrad::{name}")
    if impl is None:
        raise internal_error(f"slimgrad::{name} has no Python implementation")
    return impl


# NOTE [Same forward as eager]
# Eagerly (not under torch.compile, not for the sync variant) y = BN(x) comes from the kernel eager
# BatchNorm runs, then is copied over x: ``torch._batch_norm_impl_index`` is what
# ``F.batch_norm`` calls and it picks the same backend (native on CPU; cuDNN on CUDA wherever
# cuDNN takes the input, native elsewhere), so the statistics, the invstd rounding and the fused
# x * alpha + beta are eager's: every element is bit for bit eager's, and so is every activation
# branch. A formula of our own that differs by one ulp flips the leaky_relu branch of the few
# pre-activations within an ulp of 0, and their input gradients then differ by (1 - slope) * dz:
# at 16x64x56x56 that broke the error rule on the 8-block chain. This holds on both kernel
# backends (NOTE [Kernel backend choice]): no kernel of ours can reproduce cuDNN's arithmetic,
# so the Triton path changes the backward (two passes, no temporaries) and the forward only where
# there is no eager kernel to match (the custom ops that torch.compile runs, the sync variant).
# Cost: one transient full-size buffer in forward (eager allocates the same y), freed at once.
def _eager_bn(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if torch.compiler.is_compiling() or x.numel() == 0:
        return None
    if training and x.numel() // x.shape[1] <= 1:
        return None  # let the stats op raise torch's own error
    if not training and (running_mean is None or running_var is None):
        return None
    with torch.no_grad():
        y, mean, invstd, _, _ = torch._batch_norm_impl_index(
            x, weight, bias, running_mean, running_var, training, momentum, eps,
            torch.backends.cudnn.enabled,
        )  # fmt: skip
    acc = _abn.acc_dtype(x.dtype)
    if not training:  # (cuDNN returns no statistics in eval mode)
        mean = running_mean.to(acc)
        invstd = 1.0 / torch.sqrt(running_var.to(acc) + eps)
    return y, mean.to(acc), invstd.to(acc)


# NOTE [InPlaceABN's output written after forward]
# InPlaceABN keeps its output z (written over x) and rebuilds BatchNorm's input from it; eager
# BatchNorm + activation keeps x and is right whatever the caller does to z afterwards. A write
# over z after forward (``z.add_(1)``) therefore gives a wrong gradient unless it is caught:
# without hooks autograd's saved-variable version check raises, turned here into slimgrad's error
# (the API, what it keeps, the fixes); under saved-tensor hooks autograd checks nothing and a hook
# handing z back (identity hooks, ``save_on_cpu`` on CPU) fed the written z to backward (off by
# 40.1 from eager BN + leaky_relu on a (4, 8, 6, 6) input): the forward records z as NOTE [A kept
# output written under saved-tensor hooks] in slimgrad/_errors.py describes (eager only; one
# hooks question per forward) and backward raises the same error. A hook copying at pack is right.
_Z_WHY = (
    "It keeps its output for backward (BatchNorm's input is rebuilt from it) where eager "
    "BatchNorm + activation keeps its input; expected the output unchanged from forward to "
    "backward, got a write over it. Write into a clone (``z = z.clone()`` first), or use "
    "torch.nn.BatchNorm2d followed by the activation."
)


def _saved(ctx, api: str, act: str) -> tuple:
    running = ctx.running
    if running is not None:  # NOTE [InPlaceABN in eval keeps the running statistics]
        for name, t, v in zip(("running_mean", "running_var"), running[:2], running[2:]):
            if t is not None and t._version != v:
                raise RuntimeError(
                    f"slimgrad.{api}: {name} was modified in place between forward and "
                    f"backward; expected its version {v} (eval mode normalises with it, and "
                    f"backward recomputes 1 / sqrt(running_var + eps) from it), got version "
                    f"{t._version}. Run backward before updating the running statistics, or "
                    "normalise with a copy."
                )
    try:
        saved = ctx.saved_tensors
    except RuntimeError as e:  # NOTE [InPlaceABN's output written after forward]
        raise_if_written(e, api, _Z_WHY)
        raise
    if ctx.z_seen is not None:
        check_seen(ctx.z_seen, saved[0], api, _Z_WHY)
    z, weight, bias, invstd = saved[:4]
    if running is not None:  # the forward's ops (_eager_bn, _abn.stats) on the same buffer
        acc = _abn.acc_dtype(z.dtype)
        invstd = 1.0 / torch.sqrt(invstd.to(acc) + ctx.cfg[1])
        saved = (*saved[:3], invstd, *saved[4:])
    # NOTE [InPlaceABN over a copy keeps x where x outlives it]
    src = _derived.whole(saved[6], z.dtype) if ctx.held else saved[6]
    if src is not None and src.numel():
        mean = _derived.whole(saved[5], invstd.dtype) if ctx.held else saved[5]
        if running is not None and not ctx.held:
            mean = mean.to(invstd.dtype)  # running_mean itself (forward: running_mean.to(acc))
        w, b = _abn.affine(weight, bias, z.shape[1], z.device, mean.dtype)
        side = _abn.side_channels(
            src.view(z.shape), w, b, mean, invstd, act, (weight, bias), uniform=ctx.held
        )
        return (*saved[:4], *side)
    if ctx.held:  # NOTE [Value-dependent saves under torch.utils.checkpoint] in ops/_derived.py
        side_idx = _derived.whole(saved[4], torch.long)
        side_xhat = _derived.whole(saved[5], _abn.acc_dtype(z.dtype))
        k = side_idx.shape[0]
        return (*saved[:4], side_idx, side_xhat.view(z.shape[0], k, *z.shape[2:]))
    return saved[:6]


def _save(
    ctx,
    x,
    weight,
    bias,
    invstd,
    side_idx,
    side_xhat,
    held: bool | None = None,
    mean=None,
    source=None,
    running=None,
) -> None:
    # the side channels' count is the values' (ELU's smallest pre-activation): held under
    # checkpoint's hooks (NOTE [Value-dependent saves under torch.utils.checkpoint] in
    # ops/_derived.py); eager only (``held``: asked already). ``source``: x itself, kept in
    # place of the side channels' x̂ (NOTE [InPlaceABN over a copy keeps x where x outlives it])
    if held is None:
        held = not torch.compiler.is_compiling() and _derived.under_checkpoint()
    ctx.held = held
    ctx.running = running  # NOTE [InPlaceABN in eval keeps the running statistics]
    if running is not None:
        invstd = running[1]  # slot 3 holds running_var, invstd recomputed in backward
        if not held:
            mean = running[0]
    if source is not None:  # slot 5 holds the batch mean (eval: the running mean), slot 6 x
        side_idx, side_xhat = side_idx.new_empty(0), mean
    if not held:
        ctx.save_for_backward(x, weight, bias, invstd, side_idx, side_xhat, source)
        return
    src = _derived.hold(source if source is not None else x.new_empty(0))
    side_idx, side_xhat = _derived.hold(side_idx), _derived.hold(side_xhat)
    ctx.save_for_backward(x, weight, bias, invstd, side_idx, side_xhat, src)


# NOTE [InPlaceABN over a copy keeps x where x outlives it]
# Where the module may not write over its input x (``ownership.owns_input`` refused: the caller, a
# residual or a checkpoint still holds x) it writes over a copy, so x outlives the op. The side
# channels' x̂ (NOTE [Invertibility]) are then a copy of values x still has. A checkpoint holds
# its region's input through the backward (non-reentrant: the recompute's input; reentrant: a
# leaf that requires grad, which its gradient accumulator holds for the graph's life), so the
# module first in a region kept z, invstd and that copy beside x, where eager's BatchNorm keeps x
# (no byte more) with mean and invstd: +544 B over eager's peak (8 channels, 2 with weight 0,
# 2x8x6x6). Outside checkpoints the same held for any x the caller or a second consumer keeps
# through backward (a residual saved by another conv, a tensor the caller holds): +544 B saved
# and peak over eager's on the same shape (issue 30). So, over a copy with side channels (train
# or eval), it keeps x and the batch mean (eval: the running mean) in place of the x̂ copy, and
# backward rebuilds the side channels from them with the forward's ops (the same bits): eager's
# set (x, z, mean, invstd) whether or not x is held elsewhere, so never more than eager's. Where
# nobody else keeps x through backward (a residual add, which saves nothing) the k/C copy would
# have been less than x; that saving is not taken, as it cannot be told at forward time. Under
# checkpoint's hooks (training only) x is a 0-element view of its storage, as a held table (NOTE
# [Value-dependent saves under torch.utils.checkpoint] in ops/_derived.py), and slot 6's storage
# tells backward which it got (empty: the side channels), so a recompute that decided otherwise
# than the forward is read as it saved. Where the side channels are known before the call
# (from the parameters) the copy call does not reach this op at all: NOTE [Side channels over a
# copy take eager's BatchNorm]; ELU's does where only x's values put channels aside (then, in
# bfloat16, the float32 batch mean it keeps is 4 B per channel above eager's bfloat16 statistics).


# NOTE [InPlaceABN in eval keeps the running statistics]
# Eager's BatchNorm in eval keeps its buffers (running_mean, running_var: no bytes of their own) and
# computes invstd in backward. This op kept the forward's invstd (4 B per channel in float32) and,
# where it keeps x (NOTE [InPlaceABN over a copy keeps x where x outlives it]), running_mean cast
# to the accumulation dtype (a copy for a 16-bit model): +32 B saved at C = 8, and at the peak in
# bfloat16. In eval (eagerly: the forward ran _eager_bn) it keeps running_var (and running_mean
# there) themselves and backward recomputes invstd = 1 / sqrt(running_var.to(acc) + eps) and
# running_mean.to(acc), the forward's own ops on the same values: the same bits. A buffer written
# in place between forward and backward through an op that bumps its version counter (``add_``,
# ``copy_``, ``fill_``) raises slimgrad's error naming it, before autograd would blame the output. A
# training-mode call of the module in between updates both inside the batch-norm kernel without a
# version bump (aten's running-statistics arguments are not marked as written): backward then
# reads the updated values, as eager's BatchNorm's backward in eval does (review35b: eager's dx
# off the forward's statistics by 4.6e-2 there; this op's dx within 6e-8 of eager's), where the
# kept invstd gave the forward's.
class _InPlaceABNFn(torch.autograd.Function):
    # Under torch.compile the side tensors are returned too (and dropped by the caller), so that
    # dynamo finds the data-dependent channel count k among the outputs. Eagerly the Function
    # returns one tensor: autograd allows no more when the input is a view modified in place.
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
        act,
        param,
        source=None,
    ):
        eager_y = _eager_bn(x, weight, bias, running_mean, running_var, training, momentum, eps)
        eager = eager_y is not None
        if eager:  # NOTE [Same forward as eager]
            y, mean, invstd = eager_y
        else:
            mean, invstd = _op("inplace_abn_stats", x)(
                x, running_mean, running_var, training, momentum, eps
            )
        held = not torch.compiler.is_compiling() and _derived.under_checkpoint()
        if any(ctx.needs_input_grad[:3]):
            if held and not is_fake(x):  # the same ops whatever the values (NOTE [Value-dependent
                # saves under torch.utils.checkpoint] in ops/_derived.py): _side_op's body
                w, b = _abn.affine(weight, bias, x.shape[1], x.device, mean.dtype)
                side_idx, side_xhat = _abn.side_channels(
                    x, w, b, mean, invstd, act, (weight, bias), uniform=True
                )
            else:
                side_idx, side_xhat = _op("inplace_abn_side", x)(x, weight, bias, mean, invstd, act)
        else:  # no backward will run (no_grad, inference_mode, frozen inputs): keep nothing
            side_idx = x.new_empty(0, dtype=torch.long)
            side_xhat = x.new_empty((x.shape[0], 0, *x.shape[2:]), dtype=mean.dtype)
        if eager_y is not None:
            with torch.no_grad():
                x.copy_(y)
                del y, eager_y
                _abn.act_(x, act, param)
        else:
            _op("inplace_abn_apply_", x)(x, weight, bias, mean, invstd, act, param)
        ctx.mark_dirty(x)
        if torch.compiler.is_compiling():
            ctx.mark_non_differentiable(side_idx, side_xhat)
            ctx.z_seen = None
        else:  # NOTE [InPlaceABN's output written after forward]
            ctx.z_seen = seen(x, dirty=True) if hooks_top(False) is not None else None
        keep_x = (  # NOTE [InPlaceABN over a copy keeps x where x outlives it]
            source is not None
            and side_idx.shape[0] > 0
            and not is_fake(x)
            and (not held or (training and _whole(source)))
        )
        running = None
        if (
            not training
            and eager
            and not running_mean.is_inference()
            and not running_var.is_inference()
        ):
            # NOTE [InPlaceABN in eval keeps the running statistics] (an inference tensor has no
            # version counter and cannot be saved for backward: invstd is kept there, as before)
            running = (running_mean, running_var, running_mean._version, running_var._version)
        ctx.cfg = (training, eps, act, param)
        _save(ctx, x, weight, bias, invstd, side_idx, side_xhat, held, mean,
              source if keep_x else None, running)  # fmt: skip
        if torch.compiler.is_compiling():
            return x, side_idx, side_xhat
        return x

    @staticmethod
    @first_order("ops.inplace_abn")
    def backward(ctx, dz, _didx=None, _dside=None):
        owned = ownership.take(dz) is not None  # first use of dz: NOTE [Gradient-buffer ownership]
        training, eps, act, param = ctx.cfg
        z, weight, bias, invstd, side_idx, side_xhat = _saved(ctx, "ops.inplace_abn", act)
        need_dx = ctx.needs_input_grad[0]
        need_dparams = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        if owned and need_dx:  # eager only (take refuses under compile): dx goes into dz's buffer
            count = z.numel() // z.shape[1] if z.shape[1] else 0
            dx, dw, db = _impl(z)[1](
                z, dz, weight, bias, invstd, side_idx, side_xhat, count, training, eps, act, param,
                need_dx, need_dparams, owned=True,
            )  # fmt: skip
        else:
            dx, dw, db = _op("inplace_abn_bwd", z)(
                z, dz, weight, bias, invstd, side_idx, side_xhat, training, eps, act, param,
                need_dx, need_dparams,
            )  # fmt: skip
        return (
            dx if need_dx else None,
            dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            db.to(bias.dtype) if ctx.needs_input_grad[2] else None,
            *([None] * 8),
        )


def _whole(t: torch.Tensor) -> bool:
    # t is exactly its contiguous storage: held by reference, no copy (_derived.hold)
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _validate(api: str, x, weight, bias, running_mean, running_var, training, activation, param):
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"slimgrad.{api}: input must be a Tensor; expected torch.Tensor, got "
            f"{type(x).__name__}. Pass a tensor of shape (N, C, ...)."
        )
    if x.dim() < 2:
        raise ValueError(
            f"slimgrad.{api}: input needs a channel dimension; expected at least 2D input "
            f"(N, C, ...), got {x.dim()}D. Add a batch dimension."
        )
    if not x.is_floating_point():
        raise TypeError(
            f"slimgrad.{api}: input must be floating point; expected float16, bfloat16, float32 "
            f"or float64, got {x.dtype}. Convert the input with .float()."
        )
    c = x.shape[1]
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                    ("running_var", running_var)):  # fmt: skip
        if t is not None and tuple(t.shape) != (c,):
            raise ValueError(
                f"slimgrad.{api}: {name} must have one value per channel; expected shape ({c},), "
                f"got {tuple(t.shape)}. Check num_features against the input's dimension 1."
            )
    check_activation(api, activation, param)
    if training:
        torch.nn.functional._verify_batch_size(x.size())


def inplace_abn(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
) -> torch.Tensor:
    """BatchNorm followed by an invertible activation, written over ``x``.

    ``z = act(weight * (x - mean) / sqrt(var + eps) + bias)`` with batch statistics when
    ``training`` (running statistics updated as ``torch.nn.functional.batch_norm`` does), else the
    running statistics.

    Memory: saves z (the output, same storage as x) + one float per channel; eager BatchNorm +
    activation saves x and z. Backward: one full-size buffer (dx) plus chunk-sized temporaries.

    Args:
        x: input (N, C, ...) of 2 to 5 dimensions; overwritten with the output. It must not be a
            leaf that requires grad, nor a tensor another op saved for backward (autograd then
            raises its in-place error).
        running_mean, running_var: per-channel buffers (updated in place when training), or None.
        weight, bias: per-channel affine parameters (any sign), or None.
        training: use batch statistics and update the running ones.
        momentum: running-statistics factor (as in ``F.batch_norm``).
        eps: added to the variance.
        activation: 'identity', 'leaky_relu' or 'elu'.
        activation_param: leaky_relu slope (> 0) or elu alpha (> 0).

    Returns:
        ``x``, now holding the output; a new tensor (``x`` left as it is) for a training call
        with at most 32 values per channel that needs gradients (NOTE [Few values per channel in
        InPlaceABN]).

    Raises:
        ValueError: non-invertible activation, bad shapes, or one value per channel in training.
        TypeError: non-tensor or integer input.

    Example:
        >>> conv, bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)
        >>> h = conv(torch.randn(2, 3, 9, 9))
        >>> z = inplace_abn(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, True)
        >>> z is h
        True
    """
    return _inplace_abn(x, running_mean, running_var, weight, bias, training, momentum, eps,
                        activation, activation_param)  # fmt: skip


def inplace_abn_copy(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
) -> torch.Tensor:
    """:func:`inplace_abn` written over a copy of ``x``; ``x`` is left as it is (NOTE [InPlaceABN
    over a copy keeps x where x outlives it])."""
    if _side_over_a_copy(x, weight, bias, activation) or _few_over_a_copy(x, weight, bias,
                                                                          training):  # fmt: skip
        # NOTE [Side channels over a copy take eager's BatchNorm]; NOTE [Few values per channel
        # in InPlaceABN] is out of place already: no copy of x for it
        _validate("ops.inplace_abn", x, weight, bias, running_mean, running_var, training,
                  activation, activation_param)  # fmt: skip
        return _eager_bn_act_(x, running_mean, running_var, weight, bias, training, momentum,
                              eps, activation, activation_param)  # fmt: skip
    source = None if torch.compiler.is_compiling() else x  # kept in place of the side x̂ copy
    return _inplace_abn(x.clone(), running_mean, running_var, weight, bias, training, momentum,
                        eps, activation, activation_param, source)  # fmt: skip


def _inplace_abn(
    x,
    running_mean,
    running_var,
    weight,
    bias,
    training,
    momentum,
    eps,
    activation,
    activation_param,
    source=None,
):
    _dtensor.refuse(
        "slimgrad.ops.inplace_abn",
        x=x,
        running_mean=running_mean,
        running_var=running_var,
        weight=weight,
        bias=bias,
    )
    _validate("ops.inplace_abn", x, weight, bias, running_mean, running_var, training, activation,
              activation_param)  # fmt: skip
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or x.is_meta:
        return _eager_abn(x, running_mean, running_var, weight, bias, training, momentum, eps,
                          activation, activation_param)  # fmt: skip
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    ):
        refuse_jit("ops.inplace_abn")
        if (
            training
            and x.numel() // max(x.shape[1], 1) <= _MAX_FEW
            and not (x.is_leaf and x.requires_grad)  # the in-place path refuses it
        ):
            # NOTE [Few values per channel in InPlaceABN]: eager's BatchNorm (it keeps x), then the
            # activation in place over its fresh output, as eager's BatchNorm +
            # LeakyReLU(inplace=True) keeps them
            return _eager_bn_act_(x, running_mean, running_var, weight, bias, True, momentum, eps,
                                  activation, activation_param)  # fmt: skip
    out = _InPlaceABNFn.apply(
        x, weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps),
        activation, float(activation_param), source,
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


# ----------------------------------------------------------------------------------------------
# Sync over torch.distributed


def _resolve_group(api: str, process_group):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"slimgrad.{api}: torch.distributed is not initialised; expected an initialised "
            "default process group in training mode, got none. Call "
            "torch.distributed.init_process_group(...) first, or use slimgrad.nn.InPlaceABN for "
            "single-process training."
        )
    return process_group if process_group is not None else dist.group.WORLD


def _make_merge(group):
    import torch.distributed as dist

    def merge(count, mean, var):
        # One collective: all_gather of [count, mean_c..., M2_c...] in float64 (exact counts,
        # stable parallel-variance merge).
        c = mean.numel()
        local = torch.cat([mean.new_full((1,), float(count)), mean, var * count]).to(torch.float64)
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        g = torch.stack(gathered)
        n_r, mean_r, m2_r = g[:, :1], g[:, 1 : 1 + c], g[:, 1 + c :]
        n = n_r.sum()
        if float(n) == 0:
            return 0, mean, var
        g_mean = (n_r * mean_r).sum(0) / n
        m2 = (m2_r + n_r * (mean_r - g_mean) ** 2).sum(0)
        return int(n), g_mean.to(mean.dtype), (m2 / n).to(var.dtype)

    return merge


def _make_allreduce(group):
    import torch.distributed as dist

    def allreduce(sum_dy, sum_dy_xhat, count):
        buf = torch.cat([sum_dy, sum_dy_xhat, sum_dy.new_full((1,), float(count))]).to(
            torch.float64
        )
        dist.all_reduce(buf, group=group)
        c = sum_dy.numel()
        return buf[:c].to(sum_dy.dtype), buf[c : 2 * c].to(sum_dy.dtype), int(buf[-1])

    return allreduce


class _InPlaceABNSyncFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, act, param, group):
        _, invstd, side_idx, side_xhat, count = _impl(x)[0](
            x, weight, bias, running_mean, running_var, True, momentum, eps, act, param,
            merge=_make_merge(group),
        )  # fmt: skip
        ctx.mark_dirty(x)
        ctx.z_seen = seen(x, dirty=True) if hooks_top(False) is not None else None
        _save(ctx, x, weight, bias, invstd, side_idx, side_xhat)
        ctx.cfg = (eps, act, param, group, count)
        return x

    @staticmethod
    @first_order("ops.inplace_abn_sync")
    def backward(ctx, dz):
        eps, act, param, group, count = ctx.cfg
        z, weight, bias, invstd, side_idx, side_xhat = _saved(ctx, "ops.inplace_abn_sync", act)
        dx, dw, db = _impl(z)[1](
            z, dz, weight, bias, invstd, side_idx, side_xhat, z.numel() // z.shape[1], True, eps,
            act, param, ctx.needs_input_grad[0], True, allreduce=_make_allreduce(group),
        )  # fmt: skip
        return (
            dx,
            dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            db.to(bias.dtype) if ctx.needs_input_grad[2] else None,
            *([None] * 7),
        )


# NOTE [Side channels over a copy take eager's BatchNorm]
# Over a copy (``ownership.owns_input`` refused) with side channels (NOTE [Invertibility]), the op
# keeps x, z and the mean (NOTE [InPlaceABN over a copy keeps x where x outlives it]): eager's
# set, so it saves nothing, and its backward's temporaries (the side channels' x̂ in float32, the
# chunks, the per-channel sums) then put its peak above eager's: bfloat16 at 2x8x6x6 with 2 of 8
# channels aside, eval 6,480 B against eager's 5,768, training 6,792 against 5,800 (and saved
# bytes +32: the float32 batch mean beside bfloat16 statistics); float32 at 2x5x7x7, +592 B in
# training. Which channels are aside is decided per parameter version for leaky_relu and identity
# (``_abn._SIDE``, the cache the op itself reads): where there are some, the copy call is eager's
# BatchNorm with the activation in place over its fresh output (what eager's BatchNorm +
# LeakyReLU(inplace=True) keeps and computes, eager's gradients); for ELU too, where γ and β put
# channels aside (bfloat16 2x8x6x6 with 2 of 8 channels at γ = 0, caller holding x: saved +32 B,
# peak +32 before; +604 B at 4x8x8x8). ELU also puts aside the channels whose smallest
# pre-activation saturates it, which only x's values tell, inside the op: where γ and β put none
# aside, it keeps the op.
def _side_over_a_copy(x, weight, bias, act) -> bool:
    if (weight is None and bias is None) or torch.compiler.is_compiling():
        return False
    if not (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (x, weight, bias))
    ):
        return False
    if x.is_meta or is_fake(x) or (weight is not None and is_fake(weight)):
        return False
    if transforms_active():
        return False
    return _abn._SIDE.lookup(weight, bias, (x.dtype, _abn.acc_dtype(x.dtype)))[1] is not None


def _few_over_a_copy(x, weight, bias, training) -> bool:
    # _inplace_abn's few-values test (its copy is eager's out-of-place BatchNorm anyway)
    return (
        training
        and x.dim() > 1
        and x.numel() // max(x.shape[1], 1) <= _MAX_FEW
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (x, weight, bias))
        and not torch.compiler.is_compiling()
        and not transforms_active()
        and not x.is_meta
    )


def _eager_bn_act_(x, running_mean, running_var, weight, bias, training, momentum, eps, act,
                   param):  # fmt: skip
    # eager's BatchNorm, then the activation in place over its fresh output (NOTE [Side channels
    # over a copy take eager's BatchNorm])
    y = torch.nn.functional.batch_norm(
        x, running_mean, running_var, weight, bias, training, momentum, eps
    )
    if act == "leaky_relu":
        return torch.nn.functional.leaky_relu_(y, param)
    if act == "elu":
        return torch.nn.functional.elu_(y, param)
    return y


def _eager_abn(x, running_mean, running_var, weight, bias, training, momentum, eps, act, param):
    # eager's BatchNorm + activation, out of place (torch.func transforms, meta tensors)
    y = torch.nn.functional.batch_norm(
        x, running_mean, running_var, weight, bias, training, momentum, eps
    )
    if act == "leaky_relu":
        return torch.nn.functional.leaky_relu(y, param)
    if act == "elu":
        return torch.nn.functional.elu(y, param)
    return y


def inplace_abn_sync(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    process_group=None,
) -> torch.Tensor:
    """:func:`inplace_abn` with batch statistics merged over a process group (training only).

    Forward merges per-rank (count, mean, M2) per channel with one ``all_gather`` (unequal batch
    sizes are fine); backward sums (sum(dy), sum(dy * xhat)) with one ``all_reduce``.
    ``process_group`` is resolved at call time (None: the default group). Weight and bias gradients
    are the local sums, as in ``torch.nn.SyncBatchNorm`` (DistributedDataParallel then averages
    them). In eval mode no collective runs.

    Memory: as :func:`inplace_abn`.

    Args:
        x, running_mean, running_var, weight, bias, training, momentum, eps, activation,
            activation_param: as :func:`inplace_abn`.
        process_group: the group to merge statistics over; None: the default group at call time.

    Returns:
        ``x``, now holding the output.

    Raises:
        RuntimeError: training while torch.distributed is not initialised.
        ValueError: as :func:`inplace_abn`.

    Example:
        >>> torch.distributed.init_process_group("gloo")  # doctest: +SKIP
        >>> z = inplace_abn_sync(conv(x), rm, rv, w, b, training=True)  # doctest: +SKIP
    """
    _dtensor.refuse(
        "slimgrad.ops.inplace_abn_sync",
        x=x,
        running_mean=running_mean,
        running_var=running_var,
        weight=weight,
        bias=bias,
    )
    if not training:
        return inplace_abn(x, running_mean, running_var, weight, bias, training, momentum, eps,
                           activation, activation_param)  # fmt: skip
    group = _resolve_group("ops.inplace_abn_sync", process_group)
    _validate("ops.inplace_abn_sync", x, weight, bias, running_mean, running_var, False, activation,
              activation_param)  # fmt: skip
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return inplace_abn(x, running_mean, running_var, weight, bias, True, momentum, eps,
                           activation, activation_param)  # fmt: skip
    if transforms_active():
        # No eager equivalent runs there either: torch.nn.SyncBatchNorm's and
        # torch.distributed.nn's collectives are autograd.Functions without setup_context.
        raise NotImplementedError(
            "slimgrad.ops.inplace_abn_sync: training-mode statistics need collectives, which "
            "torch.func transforms cannot run (torch.nn.SyncBatchNorm cannot either); expected a "
            f"call outside torch.func, got one under torch.func (grad/vmap/jacrev) over {world} "
            "ranks. Differentiate with torch.autograd (loss.backward()), or call it in eval mode "
            "(running statistics) inside the transform."
        )
    refuse_jit("ops.inplace_abn_sync")
    return _InPlaceABNSyncFn.apply(
        x, weight, bias, running_mean, running_var, float(momentum), float(eps), activation,
        float(activation_param), group,
    )  # fmt: skip

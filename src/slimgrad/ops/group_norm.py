"""GroupNorm that keeps its output, not its input (float32/float64; half precision runs eager's).

Math: x of shape ``(N, C, *)`` split into G groups of C/G channels; per (sample, group) ``mu``,
``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mu) * rstd``, ``y = xhat * gamma_c + beta_c``.
Backward with ``g = dy * gamma_c`` and means over each (sample, group):
``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``dgamma_c = sum(dy * xhat)``,
``dbeta_c = sum(dy)``, with ``xhat = (y - beta_c) / gamma_c`` rebuilt from the output; fallback
channels as in NOTE [Normalization from its output: the fallback channels] (``ops/layer_norm.py``),
with the tighter bound of NOTE [GroupNorm's fallback channels] below. The backward's sums run in
float64 (NOTE [GroupNorm dgamma in float64], ``_sums``) and dx is ``a * dy + b * y + c`` with
coefficients per (sample, channel) (NOTE [GroupNorm's backward within eager's bytes],
``_bwd_torch``); float32 CPU tensors take the same math in C (``_bwd_cpu``, the same bits).

Memory, per input dtype:
- float32/float64: saves y (the output, shared with the next layer) + mean and rstd (2 * itemsize
  B per sample and group) + the input of fallback channels (k channels: k * N * HxW * itemsize B)
  and their int64 indices (8 B each); a channel falls back where ``|beta| > |gamma|`` (layer_norm:
  ``> 2 |gamma|``), or gamma ~ 0 / non-finite; eager saves x, mean and rstd (x: 4 B/elt fp32
  extra). Groups of fewer than ``MIN_GROUP_NUMEL`` elements, shapes whose backward would not fit
  in the bytes of x it does not keep (few values per channel: ``_backward_fits``), and
  non-contiguous inputs (channels_last, transposed, sliced) run eager's group_norm (saves x, as
  eager). Backward (transient): on CPU in float32 the C kernel (``kernels/cpu/group_norm.c``)
  allocates nothing besides dx, dgamma and dbeta, as eager; elsewhere float64 copies of
  ``min(numel / 32, CHUNK_ELEMS)`` values of dy and y at a time (in dx's buffer before dx is
  written, else 0.5 B/elt at most) and per-channel and per-(sample, group) float64 sums; no
  activation-sized temporary.
- bfloat16/float16: runs eager's ``F.group_norm``, so saves exactly what eager saves: x (2 B/elt)
  + mean and rstd (2 * 2 B per sample and group). Rebuilding xhat from a half-precision output
  broke the error rule for dgamma (NOTE [RMSNorm and GroupNorm in half precision] in
  ``ops/rms_norm.py``), and keeping x instead costs what eager costs.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]; dbias is summed first); otherwise out of place.
A slimgrad SiLU or Mish applied to y keeps y as its input, as eager's does, adding no byte (NOTE
[An input its producer keeps] in ``ops/_output_act.py``).

# NOTE [GroupNorm's fallback channels]
A rebuilt ``xhat = (y - beta) / gamma`` carries the output's rounding, about ``ulp(y) / |gamma| ~
eps * (|xhat| + |beta / gamma|)`` per element, which no rebuild can undo; dgamma sums it over N *
HxW elements per channel. The OpInfo sample ``group_norm`` f32 #27 ((20, 6, 10, 10), 6 groups,
beta/gamma = 3.57, -0.61, -1.89, -2.65, -0.88, -0.82) broke the error rule in channel 2
(|beta/gamma| = 1.89, inside layer_norm's bound 2): dgamma_2 = -99.35 (ulp 7.6e-6) came out
1.022e-5 off where eager was 2.59e-6 off (bound 1.014e-5), one ulp past eager's correctly
rounded value. Of its pre-rounding error 7.0e-6, the output's rounding alone gave 2.1e-6, the
float32 rebuild arithmetic and products the rest. Sweeping 1,000 cotangents over that sample's
x with every channel at one |beta/gamma| (all rebuilt, float64 dgamma), dgamma broke the rule in
2, 2, 1, 5, 5 cases at |beta/gamma| = 0, 0.5, 1, 1.25, 1.5 (7 of 500 at 1.99): above 1 the
output's rounding adds failures. So group_norm keeps the input of channels with |beta| > |gamma|
(``BETA_OVER_GAMMA_MAX``); on sample #27 (channels 0, 2, 3 kept) dgamma then broke the rule
in 0 of 1,000 cotangents (worst err/bound 0.95), against 4 of 1,000 (worst 1.22) before. The
remaining ~0.2% at |beta/gamma| <= 1 is the rule's statistics, not bias: at beta = 0 the float32
code broke it in 0 and the float64 one in 2 of 1,000, though the float64 one's per-channel rms
error is lower in every channel (2.1-2.9e-6 against 2.7-3.2e-6; eager's: 5.4-5.9e-6).

# NOTE [GroupNorm with a non-finite gamma]
Eager's CPU backward (aten's group_norm_kernel.cpp) sums per (sample, channel) ds = sum(dy * x)
and db = sum(dy), per (sample, group) DS = sum_c gamma_c * ds_c and DB = sum_c gamma_c * db_c,
then ``dx = rstd * gamma * dy + c2 * x + c3`` with ``c2 = (DB * mu - DS) * rstd^3 / m`` and ``c3 =
-c2 * mu - DB * rstd / m``. With every value finite ours is the same math in another order; with
an infinite gamma the order decides which values are NaN and which inf: DS and DB are inf (or NaN
where a sum is 0), c2 is inf or NaN by whether gamma * ds and gamma * db * mu cancel, and each
dx is NaN or inf by the sign of its own x. So a group with a non-finite gamma keeps the input of
all its channels (``_fallback_channels``; the model is broken then, and eager keeps every x),
its G2 is ``sum_c gamma_c * sum(dy * x)``, and ``c2 = (G2 / m - c1 * mu) * rstd``: eager's
formulas up to finite factors, so every dx is finite, NaN or inf (of each sign) where eager's
is. Fallback channels take no ``b * y`` term at all (b is 0 there, and their y is inf where gamma
or beta is: 0 * inf would be NaN), so an inf or NaN beta leaves dx finite, as in eager, whose
backward never reads beta. Before: (3, 6, 10) groups 2, w[0] = inf gave 65 NaN/25 inf against
eager's 59/31, and b[1] = inf gave 30 NaN where eager's dx is finite. Which groups have a
non-finite gamma is decided once per weight version (``_bad_groups``, the key of NOTE [Fallback
channels, once per weight version] in slimgrad/_math/norms.py), as the fallback channels are: a
backward with fallback channels and every gamma finite (the usual case: ``|beta| > |gamma|``)
reads no isfinite and takes no ``torch.where``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slimgrad import _dtensor, ownership
from slimgrad._autograd import (
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._errors import hooks_top, seen
from slimgrad._library import custom_op, straight
from slimgrad._math import norms, steps
from slimgrad._math.steps import anchor, epoch
from slimgrad._math.tables import dynamic_size
from slimgrad.kernels import _backend
from slimgrad.ops._output_act import INPUT_KEPT_BY, check_output_seen
from slimgrad.ops.layer_norm import (
    _ANCHOR_APPLY,
    CHUNK_ELEMS,
    HALF_DTYPES,
    _acc_dtype,
    _rowdot,
    attach_anchor,
    autocast_inputs,
    fake_norm_grads,
    fallback_channels,
    grads_or_empty,
    make_anchor,
    norm_double,
    rebuild_xhat,
    y_written,
)

# NOTE [A policy that counts ops]
# torch's selective checkpointing asks its policy about every aten op a region dispatches. A
# policy that answers by the count of ops it was asked about (save every other op) is a function
# of the op sequence, and a converted Conv -> GroupNorm -> SiLU block dispatches another sequence
# than eager's three (convolution, native_group_norm, silu): the input anchor's aten.new_empty,
# the slimgrad.group_norm_fwd custom op, silu, and the activation's side tables (three more
# aten.new_empty). The same policy so saves other tensors in the two models, and matching eager's
# count would take dispatching eager's ops, i.e. being eager: it is not attempted. Measured with
# the tracker (2x3x8x8, C=8, 3 blocks): counted per region (apart in forward and recompute, as
# SAC requires) slimgrad peaks at 28,712 B against eager's 36,968 (0.777x; 4x32x16x16:
# 917,576 / 1,179,848); counted over the whole step, at eager's 36,936. A count that runs on
# across steps lands where each step's phase puts it (1.059x in one such run at this shape,
# 1.014x at 4x32x16x16): no bound holds for it, and tests/ops/test_group_norm_sac_count.py pins
# the two stated ones.

# NOTE [GroupNorm's fallback channels only where y is kept after it]
# With a fallback channel the output-keeping forward saves y, mean, rstd, the channels' input and
# their index table, where eager saves x, mean and rstd. That wins only where y's consumer keeps
# y itself (a Linear or convolution saving its input for its weight's gradient, a BatchNorm, an
# activation that keeps its input: NOTE [An input its producer keeps] in ops/_output_act.py): y
# is then kept once, for both. Where nothing keeps y (a ReLU, Sigmoid or Tanh keeping its own
# output, a Dropout, a pool, the loss) the channels and the table are above eager's:
# Sequential(Conv2d, GroupNorm(4, 16), ReLU, Conv2d) at 8x3x18x18 with 5 fallback channels saved
# 336,168 B against eager's 295,168. Which holds is read at ``convert_`` time as LayerNorm's
# (NOTE [LayerNorm's fallback columns only where y is kept after it] in ops/layer_norm.py;
# ``_norm_y_kept`` in slimgrad/nn/_output_act.py) and stored as
# ``slimgrad.nn.GroupNorm.y_kept_after``; a module built directly, an unknown consumer and a "not
# kept" save x where a fallback channel exists: eager's saved set, its backward
# (``native_group_norm_backward``) and its bits, found in the branch the fallback channels take
# already (no call more without them). Without a fallback channel nothing changes. The functional
# ``group_norm`` takes its y as kept (its documented contract); under torch.compile the fallback
# count is not known while tracing, and the output-keeping forward stays.

__all__ = ["BETA_OVER_GAMMA_MAX", "MIN_GROUP_NUMEL", "group_norm"]

#: A channel is rebuilt from the output only where ``|beta| <= BETA_OVER_GAMMA_MAX * |gamma|``
#: (gamma = 1 without a weight), tighter than layer_norm's 2: NOTE [GroupNorm's fallback channels].
BETA_OVER_GAMMA_MAX = 1.0
#: Groups with fewer elements (C / G * spatial) run eager's group_norm, which keeps the input: in
#: such groups rebuilding xhat from the rounded output exceeded the error rule (groups of
#: 2 and 3 elements in tests/ops/test_group_norm.py's seed sweep).
MIN_GROUP_NUMEL = 16


def _fallback_channels(weight, bias, out_dtype: torch.dtype, num_groups: int) -> torch.Tensor:
    # NOTE [GroupNorm's fallback channels]: layer_norm's fallback channels (gamma ~ 0, non-finite,
    # |beta| > 2 |gamma|) plus every channel with |beta| > BETA_OVER_GAMMA_MAX * |gamma|, plus
    # every channel of a group with a non-finite gamma (NOTE [GroupNorm with a non-finite gamma]).
    idx = fallback_channels(weight, bias, out_dtype)
    fake = torch._subclasses.fake_tensor.is_fake
    if any(t is not None and type(t) is not torch.Tensor and fake(t) for t in (weight, bias)):
        return idx  # fake weights: no values, no fallback assumed
    if bias is None and weight is None:
        return idx
    f64 = torch.float64
    ref = weight if weight is not None else bias
    wide = torch.zeros(ref.numel(), dtype=torch.bool, device=ref.device)
    # index_fill_ with a Python scalar, not ``wide[idx] = True``: that index_put_ wraps True in a
    # 1-byte tensor made outside any dispatch mode, which slimgrad.memory's tracker saw freed but
    # never allocated (a measured step 1 B below its estimate)
    wide.index_fill_(0, idx.to(wide.device), True)
    if bias is not None:
        b = bias.detach().reshape(-1).to(f64).abs()
        aw = weight.detach().reshape(-1).to(f64).abs() if weight is not None else 1.0
        wide |= b > BETA_OVER_GAMMA_MAX * aw
    if weight is not None:
        bad = ~torch.isfinite(weight.detach().reshape(num_groups, -1)).all(1, keepdim=True)
        wide.view(num_groups, -1).logical_or_(bad)
    return torch.nonzero(wide).reshape(-1)


def _fwd_torch(x, num_groups, weight, bias, eps):
    n, c = x.shape[0], x.shape[1]
    hw = math.prod(x.shape[2:])
    y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hw, num_groups, eps)
    idx = _fallback_once(weight, bias, y.dtype, num_groups).to(x.device)
    xside = x.reshape(n, c, hw).index_select(1, idx)
    return y, mean, rstd, idx, xside


def _sums(dy, y, xside, mean, rstd, weight, bias, idx, num_groups, chunk, scratch, mask):
    # NOTE [GroupNorm dgamma in float64]: the backward's reductions, each (sample, channel) row
    # summed in float64: per (sample, group) G1 = sum(g) and G2 = sum(g * xhat) with g = dy *
    # gamma, per channel S0 = sum(dy) (dbeta) and T = sum(dy * xhat) (dgamma). Rebuilt channels:
    # sum_hw dy * xhat = (sum_hw dy * y - beta * sum_hw dy) / gamma, fallback channels:
    # (sum_hw dy * x - mu * sum_hw dy) * rstd. A product of two float32 values is exact in
    # float64, so the only error left is the output's own rounding (ulp(y) / |gamma| per
    # element), which no rebuild can undo; rebuilding xhat and multiplying by dy in float32 added
    # three more roundings per element (tests/ops/test_group_norm.py, the OpInfo sample). The
    # float64 copies of dy and y (or x) go through ``scratch`` (2 * chunk float64 values), whole
    # rows at a time, or pieces of one row where a row is longer than ``chunk``.
    # mask: (G1 and G2, S0, T) wanted; returns them (None where not wanted).
    f64, dev = torch.float64, y.device
    n, c = y.shape[0], y.shape[1]
    grp, cg = num_groups, c // num_groups
    rows, hw = n * c, math.prod(y.shape[2:])
    dyr, yr = dy.reshape(rows, hw), y.reshape(rows, hw)
    w = weight.detach().reshape(c) if weight is not None else None
    beta = bias.detach().reshape(c) if bias is not None else None
    k = idx.numel()
    fb = torch.zeros(c, dtype=torch.bool, device=dev)  # the fallback channels
    fb.index_fill_(0, idx, True)  # as in _fallback_channels: no 1-byte tensor outside the tracker
    prods = mask[0] or mask[2]
    g1 = torch.zeros(n * grp, dtype=f64, device=dev) if mask[0] else None
    g2 = torch.zeros(n * grp, dtype=f64, device=dev) if mask[0] else None
    s0 = torch.zeros(c, dtype=f64, device=dev) if mask[1] else None
    t = torch.zeros(c, dtype=f64, device=dev) if mask[2] else None
    sa, sb = scratch[:chunk], scratch[chunk : 2 * chunk]
    r_step, c_step = (chunk // hw, hw) if chunk >= hw else (1, chunk)

    def row_sums(j, r, other, pick=None):
        p0 = p1 = None
        for k in range(0, hw, c_step):
            m = min(c_step, hw - k)
            part = dyr[j : j + r, k : k + m] if pick is None else dyr[:, k : k + m][pick]
            d = sa[: r * m].view(r, m).copy_(part)
            del part
            q0 = d.sum(1)
            p0 = q0 if p0 is None else p0.add_(q0)
            if prods:
                o = sb[: r * m].view(r, m).copy_(other[j : j + r, k : k + m])
                q1 = _rowdot(d, o).view(-1)
                p1 = q1 if p1 is None else p1.add_(q1)
        return p0, p1

    for j in range(0, rows, r_step):
        r = min(r_step, rows - j)
        p0, p1 = row_sums(j, r, yr)
        ch = torch.arange(j, j + r, device=dev)
        ng = ch.div(c, rounding_mode="floor").mul_(grp)
        ch.remainder_(c)
        ng.add_(ch.div(cg, rounding_mode="floor"))
        if s0 is not None:
            s0.index_add_(0, ch, p0)
        if prods:  # p1 becomes this row's sum(dy * xhat) (0 on fallback channels)
            if beta is not None:
                p1.sub_(p0 * beta[ch])
            if w is not None:
                p1.div_(w[ch])
            if k:
                p1.masked_fill_(fb[ch], 0.0)
            if t is not None:
                t.index_add_(0, ch, p1)
        if g1 is not None:
            if w is not None:
                gam = w[ch]
                p0.mul_(gam)
                p1.mul_(gam)
                if k:  # 0 again on fallback rows where gamma is inf (0 * inf is NaN)
                    p1.masked_fill_(fb[ch], 0.0)
            g1.index_add_(0, ng, p0)
            g2.index_add_(0, ng, p1)
    if prods and k:
        # groups with a non-finite gamma: G2 = sum_c gamma_c * sum_hw(dy * x), the mean and rstd
        # applied after (NOTE [GroupNorm with a non-finite gamma])
        bad = None
        if g2 is not None and w is not None:
            bad = _bad_groups(weight, grp)
        if bad is not None:
            bad = bad.view(grp, 1).expand(grp, cg).reshape(c)[idx].repeat(n)
        xr = xside.reshape(n * k, hw)
        ar = torch.arange(n, device=dev).unsqueeze(1)
        krows = (ar * c + idx).reshape(-1)
        kng = (ar * grp + idx.div(cg, rounding_mode="floor")).reshape(-1)
        kch = idx.repeat(n)
        for j in range(0, n * k, r_step):
            r = min(r_step, n * k - j)
            p0, p1 = row_sums(j, r, xr, pick=krows[j : j + r])
            ng, ch = kng[j : j + r], kch[j : j + r]
            raw = p1.clone() if bad is not None else None
            p1.sub_(p0.mul_(mean.reshape(-1)[ng])).mul_(rstd.reshape(-1)[ng])
            if t is not None:
                t.index_add_(0, ch, p1)
            if raw is not None:
                p1 = torch.where(bad[j : j + r], raw, p1)
            if g2 is not None:
                g2.index_add_(0, ng, p1.mul_(w[ch]) if w is not None else p1)
    return g1, g2, s0, t


def _bwd_torch(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out=None):
    # NOTE [GroupNorm's backward within eager's bytes]
    # Eager's backward holds x, dy and dx; this one holds y, dy and dx, so what it adds must fit
    # in eager's dx where dx is written into dy's buffer (NOTE [Gradient-buffer ownership]).
    # Two passes, neither with an activation-sized temporary:
    # 1. the float64 sums of NOTE [GroupNorm dgamma in float64], through float64 copies of
    #    ``chunk = min(numel / 32, CHUNK_ELEMS)`` values of dy and y at a time (0.5 B per float32
    #    element at most): in dx's own buffer while it holds nothing yet, else in a buffer of
    #    their own; the same chunks either way, so the same bits with and without the grant;
    # 2. dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, written as
    #    ``dx = a * dy + b * y + c`` (rebuilt channels: xhat = (y - beta) / gamma, so a = rstd *
    #    gamma, b = -rstd * c2 / gamma, c = rstd * (c2 * beta / gamma - c1), with c1 = mean(g),
    #    c2 = mean(g * xhat) per (sample, group)) and ``a * dy + b' * x + c'`` (fallback channels:
    #    b' = -rstd^2 * c2, c' = rstd * (c2 * mu * rstd - c1)): the coefficients per (sample,
    #    channel) in float64, rounded once to y's dtype, then three in-place passes over dx.
    # What is left grows with the channels and groups, not the values: per-channel and
    # per-(sample, group) float64 sums, the block's per-row sums, autograd's zero gradients for
    # mean and rstd. Where few values share a channel these outweigh the x that keeping y saves,
    # and ``group_norm`` runs eager's kernel instead (``_backward_fits``: 16 B per chunk value, 48
    # per row of a block, 24 per (sample, group), 17 per channel and 256 B, against x's bytes; it
    # held for the 290 fitting shapes of a sweep of N 1-8, C 1-32, groups 1, C/2, C and 1-49
    # values per channel, alone and before a 1x1 conv). Before, the backward rebuilt float32
    # xhat and g and copied dy and y to float64 for up to a sixteenth of the batch (at least
    # CHUNK_ELEMS values): Conv1x1 -> GroupNorm(1, 16) on (4, 16, 7, 7) peaked at 77,319 B
    # against eager's 37,800 (now 27,166; before a 1x1 conv: 77,319 -> 38,759, eager 51,304).
    # Where dx cannot take dy's buffer and nothing else keeps y (a residual add after the norm),
    # the backward holds y, dy and dx where eager holds x, dy and dx: it may allocate nothing but
    # dx, dgamma and dbeta. The C kernel (float32 CPU, ``_bwd_cpu``) does that: its sums live in
    # registers (each group's row sums computed twice: once for dgamma and dbeta per channel, once
    # for dx), and _GroupNormFn does not materialize gradients for mean and rstd. This PyTorch
    # path (CUDA, float64, no C compiler) still holds its sums on top in that case.
    f64 = torch.float64
    n, c = y.shape[0], y.shape[1]
    hw = math.prod(y.shape[2:])
    grp, cg = num_groups, c // num_groups
    numel = n * c * hw
    # dy may come in any layout (channels_last, transposed, expanded): the flat (sample, channel)
    # rows below need it contiguous (y is: the forward's output).
    dy = dy.contiguous()
    need_dx, need_dw = output_mask[0], weight is not None and output_mask[1]
    need_db = bias is not None and output_mask[2]
    dx = None
    if need_dx:
        dx = out if out is not None else torch.empty_like(y, memory_format=torch.contiguous_format)
    chunk = _chunk(numel)  # the same chunks with and without out: the same bits
    if dx is not None and out is None and 16 * chunk <= numel * y.element_size():
        scratch = dx.view(-1)[: 16 * chunk // y.element_size()].view(f64)  # dx's bytes, unused yet
    else:
        scratch = torch.empty(2 * chunk, dtype=f64, device=y.device)
    mask = (need_dx, need_db, need_dw)
    g1, g2, s0, t = _sums(dy, y, xside, mean, rstd, weight, bias, idx, grp, chunk, scratch, mask)
    del scratch
    db = s0.to(bias.dtype).reshape(bias.shape) if need_db else None
    dw = t.to(weight.dtype).reshape(weight.shape) if need_dw else None
    del s0, t
    if not need_dx:
        return None, dw, db
    m = cg * hw
    c1, c2 = g1.view(n, grp, 1).div_(m), g2.view(n, grp, 1).div_(m)
    k = idx.numel()
    gidx = idx.div(cg, rounding_mode="floor")
    w = weight.detach().view(1, grp, cg) if weight is not None else None
    beta = bias.detach().view(1, grp, cg) if bias is not None else None
    dy4, y4, dx4 = dy.view(n, grp, cg, hw), y.view(n, grp, cg, hw), dx.view(n, grp, cg, hw)
    dt = dy.dtype
    step = max(1, 16 * chunk // (24 * c + 4 * k * hw + 1))
    # groups with a non-finite gamma (all their channels fall back): NOTE [GroupNorm with a
    # non-finite gamma]
    bad = _bad_groups(weight, grp) if k and w is not None else None
    if bad is not None:
        bad = bad.view(1, grp, 1)
    for i in range(0, n, step):
        sl = slice(i, i + step)
        rr = rstd[sl].view(-1, grp, 1).to(f64)
        if bad is not None:  # there c2 = (mean(g * x) - c1 * mu) * rstd
            fix = c2[sl].sub(c1[sl] * mean[sl].view(-1, grp, 1).to(f64)).mul_(rr)
            c2[sl].copy_(torch.where(bad, fix, c2[sl]))
            del fix
        rc2 = c2[sl].mul_(rr)  # rstd * c2 (c2 is not needed past this chunk)
        a = q = (rr * w if w is not None else rr.expand(-1, grp, cg)).to(dt)
        # fallback channels take a * dy alone (below): their dy, before dx may overwrite it
        dyk = dy.view(n, c, hw)[sl].index_select(1, idx) if k else None
        torch.mul(dy4[sl], q.unsqueeze(-1), out=dx4[sl])  # a * dy
        # rstd * c2 / gamma on rebuilt channels, 0 on fallback ones
        u = rc2 / w if w is not None else rc2.expand(-1, grp, cg).clone()
        if k:
            u.view(-1, c).index_fill_(1, idx, 0.0)
        q = u.neg().to(dt)
        dx4[sl].addcmul_(y4[sl], q.unsqueeze(-1))  # + b * y
        del q
        if k:  # a * dy again on fallback channels: no y term (y may be inf there; 0 * inf is NaN)
            ak = a.reshape(-1, c).index_select(1, idx).unsqueeze(-1)
            dx.view(n, c, hw)[sl].index_copy_(1, idx, dyk.mul_(ak))
            del dyk, ak
        cc = u.mul_(beta) if beta is not None else u.zero_()  # rstd * c2 * beta / gamma
        if k:  # fallback channels: rstd^2 * c2 * mu
            cf = (rc2 * mean[sl].view(-1, grp, 1).to(f64)).mul_(rr)
            cc.view(-1, c).index_copy_(1, idx, cf.view(-1, grp).index_select(1, gidx))
            del cf
        cc.sub_(c1[sl].mul_(rr))
        dx4[sl].add_(cc.to(dt).unsqueeze(-1))  # + c
        del cc, u
        if k:
            bk = rc2.mul_(rr).neg_().view(-1, grp).index_select(1, gidx).to(dt).unsqueeze(-1)
            dx.view(n, c, hw)[sl].index_add_(1, idx, xside[sl] * bk)  # + b' * x
    return dx, dw, db


def _c_signatures(C):
    p, i64, i = C.c_void_p, C.c_int64, C.c_int
    return {"bwd": ("group_norm_bwd_f32", [p] * 12 + [i64] * 5 + [i, i], None)}


def _bwd_cpu(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out=None):
    # The compiled kernel (kernels/cpu/group_norm.c): the float64 row sums of NOTE [GroupNorm
    # dgamma in float64] in registers (no float64 copies of dy and y), dgamma and dbeta per
    # channel and dx per (sample, group) from the coefficients of NOTE [GroupNorm's backward
    # within eager's bytes]. The row sums (16 B per row) are kept between the two where that
    # costs no bytes above eager's: in a buffer of their own when dx takes dy's buffer (eager
    # allocates dx there; mode 1: one read of dy and y) or in dx's own rows before dx is written
    # (mode 2: two reads); else computed twice (mode 0: three reads, nothing but dx, dgamma and
    # dbeta, for a shared dy with rows of fewer than 4 values). Contiguous float32 on CPU; else
    # the PyTorch path.
    lib = _backend.use_cpu(y, "group_norm")
    f32 = torch.float32
    if (
        lib is None
        or dy.dtype != f32
        or (weight is not None and weight.dtype != f32)
        or (bias is not None and bias.dtype != f32)
        or mean.dtype != f32
        or rstd.dtype != f32
        or not y.is_contiguous()
        or not mean.is_contiguous()
        or not rstd.is_contiguous()
        or (idx.shape[0] and (xside.dtype != f32 or not xside.is_contiguous()))
        or (out is not None and out is not dy and not out.is_contiguous())
    ):
        return _bwd_torch(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out)
    if not dy.is_contiguous():  # any layout may come in (channels_last, expanded)
        dy = dy.contiguous()
    n, c = y.shape[0], y.shape[1]
    hw = y.numel() // (n * c) if n * c else 0
    need_dx, need_dw = output_mask[0], weight is not None and output_mask[1]
    need_db = bias is not None and output_mask[2]
    # hold every buffer in a variable until the call returns (NOTE [CPU C kernels])
    dx = (out if out is not None else torch.empty_like(y)) if need_dx else None
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(bias) if need_db else None
    if n * c and hw:
        w = None if weight is None else weight.contiguous()  # (c,): itself, as a rule
        b = None if bias is None else bias.contiguous()
        try:  # bound once per library (kernels/_cpu.functions), then an attribute
            fns = lib._slimgrad_fns
        except AttributeError:
            from slimgrad.kernels._cpu import functions

            fns = functions(lib, _c_signatures)
        k = idx.shape[0]
        ix = idx if idx.is_contiguous() else idx.contiguous()
        st, mode = None, 0
        if need_dx and (need_dw or need_db):
            if out is not None and hw >= 4:
                st, mode = torch.empty(2 * n * c, dtype=torch.float64), 1
            elif out is None and hw >= 4:
                mode = 2
        fns["bwd"](
            dy.data_ptr(),
            y.data_ptr(),
            mean.data_ptr(),
            rstd.data_ptr(),
            None if w is None else w.data_ptr(),
            None if b is None else b.data_ptr(),
            xside.data_ptr() if k else None,
            ix.data_ptr() if k else None,
            None if dx is None else dx.data_ptr(),
            None if dw is None else dw.data_ptr(),
            None if db is None else db.data_ptr(),
            None if st is None else st.data_ptr(),
            n,
            c,
            hw,
            num_groups,
            k,
            mode,
            torch.get_num_threads(),
        )
        del st
    elif n * c == 0:  # no values: zero gradients for the parameters
        for t in (dw, db):
            if t is not None:
                t.zero_()
    return dx, dw, db


def _bwd(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out=None):
    # NOTE [Kernel backend choice] in slimgrad/kernels/_backend.py: the C kernel for CPU tensors
    if y.device.type == "cpu":
        return _bwd_cpu(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out)
    return _bwd_torch(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out)


@custom_op("group_norm_fwd", mutates_args=())
def _group_norm_fwd(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_torch(x, num_groups, weight, bias, eps)


@_group_norm_fwd.register_fake
def _(x, num_groups, weight, bias, eps):
    # NOTE [Side tables under FakeTensorMode and torch.compile] in slimgrad/_math/tables.py
    k = dynamic_size(max=x.shape[1])
    n = x.shape[0]
    acc = _acc_dtype(x.dtype)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty((n, num_groups), dtype=acc),
        x.new_empty((n, num_groups), dtype=acc),
        x.new_empty((k,), dtype=torch.int64),
        x.new_empty((n, k, math.prod(x.shape[2:]))),
    )


@custom_op("group_norm_bwd", mutates_args=())
def _group_norm_bwd(
    dy: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    idx: torch.Tensor,
    xside: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    output_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _bwd(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask)
    return grads_or_empty(y, dx, dw, db)


@_group_norm_bwd.register_fake
def _(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask):
    return fake_norm_grads(y, weight, bias, output_mask)


def _rebuild_input(y, mean, rstd, idx, xside, weight, bias, num_groups):
    # x = xhat / rstd + mean per (sample, group); fallback channels are their kept input
    # (NOTE [Second derivatives of an op that keeps its output] in ops/layer_norm.py).
    if y is None:  # x itself was kept (_GroupNormFn.forward without y_kept_after)
        return xside.detach()
    acc = _acc_dtype(y.dtype)
    n, c = y.shape[0], y.shape[1]
    hw = math.prod(y.shape[2:])
    grp, cg = num_groups, c // num_groups
    w = weight.detach().reshape(1, grp, cg, 1).to(acc) if weight is not None else None
    b = bias.detach().reshape(1, grp, cg, 1).to(acc) if bias is not None else None
    xh = rebuild_xhat(y.reshape(n, grp, cg, hw), w, b, acc)
    x = xh.div_(rstd.reshape(n, grp, 1, 1).to(acc)).add_(mean.reshape(n, grp, 1, 1).to(acc))
    if idx.numel():
        x.view(n, c, hw).index_copy_(1, idx, xside.to(acc))
    return x.to(y.dtype).reshape(y.shape)


def _eager(x, num_groups, weight, bias, eps):
    return F.group_norm(x, num_groups, weight, bias, eps)


_DOUBLE = norm_double("ops.group_norm", _eager, _rebuild_input)
_TORCH = object()  # _GroupNormFn's ``direct`` for the straight path (PyTorch forward, cached idx)


def _double(ctx, dy, *rest):
    if dy is None:  # grads are not materialized (_GroupNormFn.forward)
        return None, None, None, None, None, None, None
    return (*_DOUBLE(ctx, dy, *rest), None)  # forward's y_kept_after


class _GroupNormFn(torch.autograd.Function):
    # An output-keeping norm's Function (ops/layer_norm.py, affine_norm_function) with GroupNorm's
    # straight forward (direct=_TORCH: eager, plain tensors, NOTE [One gate per call] in
    # slimgrad/_library.py) and without materialized gradients: autograd would hand backward a
    # zero tensor for each of mean and rstd (8 B per (sample, group)), the only bytes above
    # eager's in a step whose incoming gradient is shared (NOTE [GroupNorm's backward within
    # eager's bytes]).
    @staticmethod
    def forward(ctx, x, arg, weight, bias, eps, direct=False, y_kept_after=True):
        # y_kept_after: NOTE [GroupNorm's fallback channels only where y is kept after it]
        ctx.set_materialize_grads(False)
        ctx.arg, ctx.eps = arg, eps
        if direct is _TORCH:
            y, mean, rstd, idx, xside = _fwd_straight(x, arg, weight, bias, eps)
        else:
            fwd = _group_norm_fwd.impl if direct else _group_norm_fwd
            y, mean, rstd, idx, xside = fwd(x, arg, weight, bias, eps)
        if not y_kept_after and idx.shape[0] and (direct or not compiling()):
            # eager's saved set (x, mean, rstd) and backward; y's slot holds None: the mark
            ctx.y_seen = None
            ctx.save_for_backward(None, mean, rstd, None, x, weight, bias)
            ctx.mark_non_differentiable(mean, rstd, idx, xside)
            return y, mean, rstd, idx, xside
        # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py; eager only
        # (``direct``: past the gate)
        ctx.y_seen = (
            seen(y) if (direct or not compiling()) and hooks_top(False) is not None else None
        )
        ctx.save_for_backward(y, mean, rstd, idx, xside, weight, bias)
        ctx.mark_non_differentiable(mean, rstd, idx, xside)
        return y, mean, rstd, idx, xside

    @staticmethod
    @first_order("ops.group_norm", double=_double)
    def backward(ctx, dy, *_):
        if dy is None:
            return None, None, None, None, None, None, None
        try:
            y, mean, rstd, idx, xside, weight, bias = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, "ops.group_norm")
            raise
        if y is None:  # x kept: NOTE [GroupNorm's fallback channels only where y is kept after it]
            return _eager_bwd(ctx, dy, xside, mean, rstd, weight, bias)
        buf = ownership.take(dy)  # first use of dy: NOTE [Gradient-buffer ownership]
        if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
            check_output_seen(ctx, y, "ops.group_norm", "ConvertConfig(norms=False)")
        need = ctx.needs_input_grad
        mask = [need[0], need[2], need[3]]
        # _bwd(y), inline: the C kernel for CPU tensors (NOTE [Kernel backend choice])
        impl = _bwd_cpu if y.is_cpu else _bwd_torch
        if (  # owns_layout(buf, y), inline; eager only (take refuses under torch.compile)
            mask[0]
            and buf is not None
            and buf.shape == y.shape
            and buf.dtype == y.dtype
            and buf.is_contiguous()
        ):
            dx, dw, db = impl(buf, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask, out=buf)
        elif straight():  # the custom op's implementation past the gate (NOTE [One gate per call])
            dx, dw, db = impl(dy, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask)
        else:
            dx, dw, db = _group_norm_bwd(dy, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask)
        return (
            dx if mask[0] else None,
            None,
            dw if weight is not None and mask[1] else None,
            db if bias is not None and mask[2] else None,
            None,
            None,
            None,
        )


def _eager_bwd(ctx, dy, x, mean, rstd, weight, bias):
    # eager's backward on the kept x (aten's derivative of native_group_norm: the same call)
    need = ctx.needs_input_grad
    mask = [need[0], weight is not None and need[2], bias is not None and need[3]]
    n, c = x.shape[0], x.shape[1]
    hw = x.numel() // (n * c) if n * c else math.prod(x.shape[2:])
    dx, dw, db = torch.ops.aten.native_group_norm_backward(
        dy.contiguous(), x, mean, rstd, weight, n, c, hw, ctx.arg, mask
    )
    return (
        dx if mask[0] else None,
        None,
        dw if mask[1] else None,
        db if mask[2] else None,
        None,
        None,
        None,
    )


_GN_APPLY = direct_apply(_GroupNormFn)
# every call keeps y through save_for_backward: an activation applied to y keeps it as its input
# (NOTE [An input its producer keeps] in ops/_output_act.py)
INPUT_KEPT_BY.add(_GroupNormFn._backward_cls)


def group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Group normalization (as ``F.group_norm``) that keeps its output instead of its input.

    ``y = (x - mean_g) / sqrt(var_g + eps) * weight_c + bias_c`` per sample and group of channels.

    Memory: fp32: saves y (shared with the next layer) + 8 B per (sample, group) + the input
    of fallback channels (``|bias| > |weight|``, weight ~ 0 or non-finite); eager saves x + 8 B
    per (sample, group). Shapes with few values per channel, groups of fewer than 16 values and
    non-contiguous inputs run ``F.group_norm`` (saves what eager saves). bf16/fp16: runs
    ``F.group_norm`` (saves x + 4 B per (sample, group), as eager).

    Args:
        input: ``(N, C, *)``.
        num_groups: number of groups; must divide C.
        weight, bias: optional ``(C,)`` affine parameters.
        eps: added to the variance.

    Returns:
        Tensor like ``input``.

    Raises:
        RuntimeError: ``input`` has fewer than 2 dims, or ``num_groups`` does not divide C (as
            torch).

    Example:
        >>> y = group_norm(torch.randn(2, 6, 5, requires_grad=True), 3)
    """
    return group_norm_kept(input, num_groups, weight, bias, eps, True)


def group_norm_kept(input, num_groups: int, weight, bias, eps: float, y_kept_after: bool):
    # group_norm with the module's y_kept_after (NOTE [GroupNorm's fallback channels only where y
    # is kept after it]; the functional's y is taken as kept: its documented contract)
    if (  # the straight path: NOTE [One gate per call] in slimgrad/_library.py
        type(input) in _PLAIN
        and type(weight) in _PLAIN_OR_NONE
        and type(bias) in _PLAIN_OR_NONE
        and not input.is_meta
        and not _any_autocast()
        and straight()
        and input.is_contiguous()
    ):
        key = (input.shape, num_groups, input.dtype)
        lean = _LEAN[key] if key in _LEAN else _lean(key)
        if lean:
            return _group_norm_straight(input, num_groups, weight, bias, eps, y_kept_after)
    _dtensor.refuse("slimgrad.ops.group_norm", input=input, weight=weight, bias=bias)
    if input.dim() < 2 or num_groups <= 0 or input.shape[1] % num_groups:
        raise RuntimeError(
            "slimgrad.ops.group_norm: channels must split into groups; expected input (N, C, *) "
            f"with C divisible by num_groups, got shape {tuple(input.shape)} and num_groups="
            f"{num_groups}. Pick num_groups dividing the channel count."
        )
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta:
        return F.group_norm(input, num_groups, weight, bias, eps)
    dev = input.device.type
    autocast = torch.is_autocast_enabled(dev)
    probe = F.group_norm(input.new_empty((0, *input.shape[1:])), num_groups) if autocast else input
    if (
        math.prod(input.shape[1:]) // num_groups < MIN_GROUP_NUMEL
        or probe.dtype in HALF_DTYPES
        or not _backward_fits(input.shape, num_groups, probe.dtype.itemsize)
        or not input.is_contiguous()
    ):
        # Tiny groups: xhat is too poorly determined by the rounded output (a group of 2 is +-1);
        # half precision: NOTE [RMSNorm and GroupNorm in half precision]. Non-contiguous input
        # (channels_last, transposed, sliced): eager picks the output's memory format and its
        # kernels for that layout; taking eager's path keeps its output strides exactly. All keep
        # eager's saving of the input (same memory as eager, exact).
        if not input.is_contiguous() and _crashes_eager(input, weight, bias):
            fmt = _memory_format(input)
            y = F.group_norm(input.contiguous(), num_groups, weight, bias, eps)
            return y.contiguous(memory_format=fmt)  # eager's output layout
        return F.group_norm(input, num_groups, weight, bias, eps)
    if autocast:
        if probe.dtype != input.dtype:
            input, weight, bias = autocast_inputs(probe.dtype, input, weight, bias)
        with torch.autocast(dev, enabled=False):
            return _group_norm(input, int(num_groups), weight, bias, float(eps), y_kept_after)
    return _group_norm(input, int(num_groups), weight, bias, float(eps), y_kept_after)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, type(None))
_any_autocast = torch._C._is_any_autocast_enabled
_grad_on = torch._C.is_grad_enabled
# {(shape, num_groups, dtype): whether a contiguous input of that shape takes the output-keeping
# path}: integer facts of the shape, decided once per shape (CONTRIBUTING.md, "Decide once")
_LEAN: dict[tuple, bool] = {}


def _lean(key) -> bool:
    # the general path's conditions for a contiguous input outside autocast: no error to raise,
    # groups of at least MIN_GROUP_NUMEL, not half precision, _backward_fits
    shape, g, dtype = key
    ok = (
        type(g) is int
        and len(shape) >= 2
        and g > 0
        and shape[1] % g == 0
        and math.prod(shape[1:]) // g >= MIN_GROUP_NUMEL
        and dtype not in HALF_DTYPES
        and dtype.is_floating_point
        and _backward_fits(shape, g, dtype.itemsize)
    )
    if len(_LEAN) >= 4096:  # shapes that keep changing: forget, decide again
        _LEAN.clear()
    _LEAN[key] = ok
    return ok


def _group_norm_straight(input, num_groups: int, weight, bias, eps, kept=True) -> torch.Tensor:
    # _group_norm past the gate: no transform, trace, compile, mode or autocast, plain tensors, a
    # contiguous input of a shape _lean accepted
    x = unwrap_if_dead(input)
    anchor = None
    if input.requires_grad and _grad_on():  # make_anchor's eager case
        box: list = []
        anchor = _ANCHOR_APPLY(x, box), box
    if type(weight) is not torch.nn.Parameter and weight is not None:
        weight = unwrap_if_dead(weight)
    if type(bias) is not torch.nn.Parameter and bias is not None:
        bias = unwrap_if_dead(bias)
    y = _GN_APPLY(x, num_groups, weight, bias, float(eps), _TORCH, kept)[0]
    if anchor is not None and y.grad_fn is not None:  # attach_anchor
        y.grad_fn._slimgrad_anchor = anchor
    return y


def _fwd_straight(x, num_groups, weight, bias, eps):
    # _fwd_torch with the fallback channels found once per parameter version
    n, c = x.shape[0], x.shape[1]
    hw = x.numel() // (n * c) if n * c else math.prod(x.shape[2:])
    y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hw, num_groups, eps)
    idx = _fallback_cached(weight, bias, y.dtype, num_groups)
    if idx.device != x.device:
        idx = idx.to(x.device)
    if idx.shape[0]:
        xside = x.view(n, c, hw).index_select(1, idx)
    else:
        xside = x.new_empty((n, 0, hw))
    return y, mean, rstd, idx, xside


_FB: dict[int, tuple] = {}


def _fallback_once(weight, bias, out_dtype: torch.dtype, num_groups: int) -> torch.Tensor:
    # the general path's fallback channels: once per parameter version (_fallback_cached) for
    # plain tensors outside compilation, as the straight path; fake, subclass and traced weights
    # find them each call (_fallback_channels: fake weights assume none, as layer_norm's)
    if (
        type(weight) in _PLAIN_OR_NONE
        and type(bias) in _PLAIN_OR_NONE
        and (weight is not None or bias is not None)
        and not compiling()
    ):
        return _fallback_cached(weight, bias, out_dtype, num_groups)
    return _fallback_channels(weight, bias, out_dtype, num_groups)


def _fallback_cached(weight, bias, out_dtype: torch.dtype, num_groups: int) -> torch.Tensor:
    # _fallback_channels once per version of weight and bias, keyed as NOTE [Fallback channels,
    # once per weight version] (slimgrad/_math/norms.py) keys LayerNorm's; a tensor of the
    # caller's own on each call
    ref = weight if weight is not None else bias
    if ref is None:
        return torch.empty(0, dtype=torch.int64)
    if (
        weight is not None and type(weight) is not torch.nn.Parameter and not weight.requires_grad
    ) or (bias is not None and type(bias) is not torch.nn.Parameter and not bias.requires_grad):
        # a tensor nothing pins (NOTE [Caches that hold no reference to a parameter] in
        # slimgrad/_math/steps.py): searched each call
        return _fallback_channels(weight, bias, out_dtype, num_groups)
    try:  # an inference tensor has no version counter: reading _version raises
        w_key, b_key = norms._norm_key(weight, bias)  # the extension's once it is loaded
    except RuntimeError:  # "Inference tensors do not track version counter"
        return _fallback_channels(weight, bias, out_dtype, num_groups)
    key = (w_key, b_key, out_dtype, num_groups, steps._count[0] if steps._hooked[0] else epoch())
    slot = id(ref)
    hit = _FB[slot] if slot in _FB else None
    if hit is None or hit[1] != key:
        # NOTE [A search the modes never see] in slimgrad/_math/norms.py
        idx = norms.unseen(_fallback_channels, weight, bias, out_dtype, num_groups)
        # anchored on the storages, no reference to weight or bias (NOTE [Caches that hold no
        # reference to a parameter] in slimgrad/_math/steps.py)
        hit = _FB[slot] = ((anchor(_FB, slot, weight), anchor(_FB, slot, bias)), key, idx)
    idx = hit[2]
    if idx.shape[0]:
        return idx.clone()
    return torch.empty(0, dtype=torch.int64, device=idx.device)


_BAD: dict[int, tuple] = {}


def _bad_groups(weight, num_groups: int) -> torch.Tensor | None:
    # NOTE [GroupNorm with a non-finite gamma]: the groups with a non-finite gamma, a (groups,)
    # bool tensor, or None where none is (the caller's torch.where would change nothing). Once
    # per weight version for a plain tensor outside compilation (the fallback channels' key);
    # fake, subclass, inference and traced weights: a mask each call (no host read of its values)
    if (
        type(weight) in _PLAIN_OR_NONE
        and (type(weight) is torch.nn.Parameter or weight.requires_grad)  # pinned: NOTE in steps
        and not compiling()
    ):
        try:
            w_key, _ = norms._norm_key(weight, None)  # the extension's once it is loaded
        except RuntimeError:  # an inference tensor has no version counter
            w_key = None
        if w_key is not None:
            key = (w_key, num_groups, steps._count[0] if steps._hooked[0] else epoch())
            slot = id(weight)
            hit = _BAD[slot] if slot in _BAD else None
            if hit is None or hit[1] != key:
                # NOTE [A search the modes never see] in slimgrad/_math/norms.py
                bad = norms.unseen(_bad_search, weight, num_groups)
                hit = _BAD[slot] = (anchor(_BAD, slot, weight), key, bad)
            return hit[2]
    return ~torch.isfinite(weight.detach().reshape(num_groups, -1)).all(1)


def _bad_search(weight, num_groups: int) -> torch.Tensor | None:
    bad = ~torch.isfinite(weight.detach().reshape(num_groups, -1)).all(1)
    return bad if bool(bad.any()) else None


def _chunk(numel: int) -> int:
    # values of dy and y copied to float64 at a time (NOTE [GroupNorm's backward within eager's
    # bytes])
    return max(1, min(numel // 32, CHUNK_ELEMS))


def _backward_fits(shape, num_groups: int, itemsize: int) -> bool:
    # NOTE [GroupNorm's backward within eager's bytes]: what the backward holds beyond y, dy and
    # dx (eager: x, dy and dx) fits in the bytes of x that the output-keeping forward does not
    # keep. Integer arithmetic on the shape, no tensor touched.
    n, c = shape[0], shape[1]
    hw = math.prod(shape[2:])
    numel = n * c * hw
    chunk = _chunk(numel)
    rows = max(1, chunk // max(hw, 1))
    extra = 16 * chunk + 48 * rows + 24 * n * num_groups + 17 * c + 256
    return extra <= itemsize * numel


def _crashes_eager(x, weight, bias) -> bool:
    # torch 2.13's CPU GroupNorm backward segfaults for a channels_last input that needs no
    # gradient while weight or bias does (tests/opinfo finding): run eager's contiguous kernels.
    return (
        x.device.type == "cpu"
        and torch.is_grad_enabled()
        and not x.requires_grad
        and any(t is not None and t.requires_grad for t in (weight, bias))
    )


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    # the layout eager's group_norm gives its output: channels_last(_3d) inputs keep it
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _group_norm(input, num_groups: int, weight, bias, eps: float, kept=True) -> torch.Tensor:
    refuse_jit("ops.group_norm")
    anchor = make_anchor(input)
    y = _GroupNormFn.apply(input, num_groups, weight, bias, eps, False, kept)[0]
    attach_anchor(y, anchor)
    return y

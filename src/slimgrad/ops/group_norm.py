"""GroupNorm that keeps its output, not its input (float32/float64; half precision runs eager's).

Math: x of shape ``(N, C, *)`` split into G groups of C/G channels; per (sample, group) ``mu``,
``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mu) * rstd``, ``y = xhat * gamma_c + beta_c``.
Backward with ``g = dy * gamma_c`` and means over each (sample, group):
``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``dgamma_c = sum(dy * xhat)``,
``dbeta_c = sum(dy)``, with ``xhat = (y - beta_c) / gamma_c`` rebuilt from the output; fallback
channels as in NOTE [Normalization from its output: the fallback channels] (``ops/layer_norm.py``),
with the tighter bound of NOTE [GroupNorm's fallback channels] below. dgamma is summed from float64
products (NOTE [GroupNorm dgamma in float64], ``_dgamma_rows``).

Memory, per input dtype:
- float32/float64: saves y (the output, shared with the next layer) + mean and rstd (2 * itemsize
  B per sample and group) + the input of fallback channels (k channels: k * N * HxW * itemsize B)
  and their int64 indices (8 B each); a channel falls back where ``|beta| > |gamma|`` (layer_norm:
  ``> 2 |gamma|``), or gamma ~ 0 / non-finite; eager saves x, mean and rstd (x: 4 B/elt fp32
  extra). Groups of fewer than ``MIN_GROUP_NUMEL`` elements, and non-contiguous inputs
  (channels_last, transposed, sliced), run eager's group_norm (saves x, as eager). Backward's
  float64 dgamma copies ``CHUNK_ELEMS`` elements of dy and y at a time (512 KiB, or one (sample,
  channel) row if larger; transient).
- bfloat16/float16: runs eager's ``F.group_norm``, so saves exactly what eager saves: x (2 B/elt)
  + mean and rstd (2 * 2 B per sample and group). Rebuilding xhat from a half-precision output
  broke the error rule for dgamma (NOTE [RMSNorm and GroupNorm in half precision] in
  ``ops/rms_norm.py``), and keeping x instead costs what eager costs.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]; dbias is summed first); otherwise out of place.

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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slimgrad import _dtensor
from slimgrad._autograd import refuse_jit, transforms_active
from slimgrad._library import custom_op
from slimgrad._math.tables import dynamic_size
from slimgrad.ops.layer_norm import (
    CHUNK_ELEMS,
    HALF_DTYPES,
    _acc_dtype,
    _rowdot,
    affine_norm_function,
    attach_anchor,
    autocast_inputs,
    fake_norm_grads,
    fallback_channels,
    grads_or_empty,
    make_anchor,
    norm_double,
    rebuild_xhat,
)

__all__ = ["BETA_OVER_GAMMA_MAX", "MIN_GROUP_NUMEL", "group_norm"]

#: A channel is rebuilt from the output only where ``|beta| <= BETA_OVER_GAMMA_MAX * |gamma|``
#: (gamma = 1 without a weight), tighter than layer_norm's 2: NOTE [GroupNorm's fallback channels].
BETA_OVER_GAMMA_MAX = 1.0
#: Groups with fewer elements (C / G * spatial) run eager's group_norm, which keeps the input: in
#: such groups rebuilding xhat from the rounded output exceeded the error rule (groups of
#: 2 and 3 elements in tests/ops/test_group_norm.py's seed sweep).
MIN_GROUP_NUMEL = 16


def _fallback_channels(weight, bias, out_dtype: torch.dtype) -> torch.Tensor:
    # NOTE [GroupNorm's fallback channels]: layer_norm's fallback channels (gamma ~ 0, non-finite,
    # |beta| > 2 |gamma|) plus every channel with |beta| > BETA_OVER_GAMMA_MAX * |gamma|.
    idx = fallback_channels(weight, bias, out_dtype)
    if bias is None or (
        type(bias) is not torch.Tensor and torch._subclasses.fake_tensor.is_fake(bias)
    ):
        return idx  # no beta: nothing to add; fake weights: no values, no fallback assumed
    b = bias.detach().reshape(-1).to(torch.float64).abs()
    aw = weight.detach().reshape(-1).to(torch.float64).abs() if weight is not None else 1.0
    wide = b > BETA_OVER_GAMMA_MAX * aw
    wide[idx.to(wide.device)] = True
    return torch.nonzero(wide).reshape(-1)


def _fwd_torch(x, num_groups, weight, bias, eps):
    n, c = x.shape[0], x.shape[1]
    hw = math.prod(x.shape[2:])
    y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hw, num_groups, eps)
    idx = _fallback_channels(weight, bias, y.dtype).to(x.device)
    xside = x.reshape(n, c, hw).index_select(1, idx)
    return y, mean, rstd, idx, xside


def _dgamma_rows(dy, y, xside, mu, r, w64, b64, idx, gidx):
    # NOTE [GroupNorm dgamma in float64]: sum over this chunk's samples of dgamma's terms, (C,)
    # float64. Rebuilt channels: sum_hw dy * xhat = (sum_hw dy * y - beta * sum_hw dy) / gamma,
    # fallback channels: (sum_hw dy * x - mu * sum_hw dy) * rstd. A product of two float32 values
    # is exact in float64, so the only error left is the output's own rounding (ulp(y) / |gamma|
    # per element), which no rebuild can undo; rebuilding xhat and multiplying by dy in float32
    # added three more roundings per element (tests/ops/test_group_norm.py, the OpInfo sample).
    # The float64 copies are made CHUNK_ELEMS elements (whole rows) at a time.
    m, c = dy.shape[0], w64.numel()
    rows = m * c
    hw = dy.numel() // max(rows, 1)
    f64 = torch.float64
    dyr, yr = dy.reshape(rows, hw), y.reshape(rows, hw)
    s0 = torch.empty(rows, dtype=f64, device=dy.device)
    s1 = torch.empty(rows, dtype=f64, device=dy.device)
    step = max(1, CHUNK_ELEMS // max(hw, 1))
    for j in range(0, rows, step):
        d = dyr[j : j + step].to(f64)
        s0[j : j + step] = d.sum(1)
        s1[j : j + step] = _rowdot(d, yr[j : j + step].to(f64)).view(-1)
    s0, s1 = s0.view(m, c), s1.view(m, c)
    t = (s1 - b64 * s0 if b64 is not None else s1).div_(w64)
    if idx.numel():
        k = idx.numel()
        krows = (torch.arange(m, device=dy.device).unsqueeze(1) * c + idx).reshape(-1)
        xr = xside.reshape(m * k, hw)
        sx = torch.empty(m * k, dtype=f64, device=dy.device)
        for j in range(0, m * k, step):
            d = dyr.index_select(0, krows[j : j + step]).to(f64)
            sx[j : j + step] = _rowdot(d, xr[j : j + step].to(f64)).view(-1)
        m_k = mu.index_select(1, gidx).to(f64)
        r_k = r.index_select(1, gidx).to(f64)
        t.index_copy_(1, idx, (sx.view(m, k) - m_k * s0.index_select(1, idx)) * r_k)
    return t.sum(0)


def _bwd_torch(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask, out=None):
    # Chunks of samples bound the fp32 temporaries, as in ops/layer_norm.py's backward (no grad
    # mode here: double backward runs norm_double instead, so in-place updates of the temporaries
    # are safe).
    # out: dy itself (contiguous, y's dtype) when slimgrad.ownership proved its buffer dead; each
    # chunk of dx is written after that chunk of dy is read, and dbias is summed first.
    acc = _acc_dtype(y.dtype)
    n, c = y.shape[0], y.shape[1]
    hw = math.prod(y.shape[2:])
    grp, cg = num_groups, c // num_groups
    # dy may come in any layout (channels_last, transposed, expanded): the flat (sample, group)
    # views below need it contiguous (y is: the forward's output).
    dy = dy.contiguous()
    y4, dy4 = y.reshape(n, grp, cg, hw), dy.reshape(n, grp, cg, hw)
    mu, r = mean.reshape(n, grp).to(acc), rstd.reshape(n, grp).to(acc)
    w = weight.reshape(1, grp, cg, 1).to(acc) if weight is not None else None
    b = bias.reshape(1, grp, cg, 1).to(acc) if bias is not None else None
    gidx = idx // cg
    need_dx, need_dw = output_mask[0], weight is not None and output_mask[1]
    db = None
    if bias is not None and output_mask[2]:
        db = dy4.sum((0, 3), dtype=torch.float64).to(bias.dtype).reshape(bias.shape)
    dx = None
    if need_dx:
        dx = out.view(n, grp, cg, hw) if out is not None else y.new_empty((n, grp, cg, hw))
    dw = torch.zeros(c, dtype=torch.float64, device=y.device) if need_dw else None
    if need_dw:
        w64 = weight.detach().reshape(c).to(torch.float64)
        b64 = bias.detach().reshape(c).to(torch.float64) if bias is not None else None
    per_sample = max(c * hw, 1)
    step = max(1, max(CHUNK_ELEMS, (n * per_sample) // 16) // per_sample)
    for i in range(0, n, step):
        sl = slice(i, i + step)
        if need_dw:
            dw += _dgamma_rows(dy4[sl], y4[sl], xside[sl], mu[sl], r[sl], w64, b64, idx, gidx)
        xh = rebuild_xhat(y4[sl], w, b, acc)
        rc = r[sl].view(-1, grp, 1, 1)
        if idx.numel():
            m_k = mu[sl].index_select(1, gidx).unsqueeze(-1)
            r_k = r[sl].index_select(1, gidx).unsqueeze(-1)
            xh.view(-1, c, hw).index_copy_(1, idx, (xside[sl].to(acc) - m_k) * r_k)
        dyc = dy4[sl].to(acc)
        if need_dx:
            g = dyc * w if w is not None else dyc.clone()
            c1 = g.mean((2, 3), keepdim=True)
            c2 = (
                _rowdot(g.view(-1, cg * hw), xh.view(-1, cg * hw))
                .div_(cg * hw)
                .view(g.shape[:2] + (1, 1))
            )
            dx[sl] = g.sub_(c1).sub_(xh.mul_(c2)).mul_(rc)
            del g
        del xh, dyc
    if need_dx:
        dx = dx.reshape(y.shape)
    if need_dw:
        dw = dw.to(weight.dtype).reshape(weight.shape)
    return dx, dw, db


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
    dx, dw, db = _bwd_torch(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask)
    return grads_or_empty(y, dx, dw, db)


@_group_norm_bwd.register_fake
def _(dy, y, mean, rstd, idx, xside, weight, bias, num_groups, output_mask):
    return fake_norm_grads(y, weight, bias, output_mask)


def _rebuild_input(y, mean, rstd, idx, xside, weight, bias, num_groups):
    # x = xhat / rstd + mean per (sample, group); fallback channels are their kept input
    # (NOTE [Second derivatives of an op that keeps its output] in ops/layer_norm.py).
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


_GroupNormFn = affine_norm_function(
    "_GroupNormFn",
    "group_norm",
    _group_norm_fwd,
    _group_norm_bwd,
    _bwd_torch,
    double=norm_double("ops.group_norm", _eager, _rebuild_input),
)


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
    per (sample, group). bf16/fp16: runs ``F.group_norm``
    (saves x + 4 B per (sample, group), as eager).

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
    _dtensor.refuse("slimgrad.ops.group_norm", input=input, weight=weight, bias=bias)
    if input.dim() < 2 or num_groups <= 0 or input.shape[1] % num_groups:
        raise RuntimeError(
            "slimgrad.ops.group_norm: channels must split into groups; expected input (N, C, *) "
            f"with C divisible by num_groups, got shape {tuple(input.shape)} and num_groups="
            f"{num_groups}. Pick num_groups dividing the channel count."
        )
    if transforms_active():  # NOTE [torch.func transforms] in slimgrad/_autograd.py
        return F.group_norm(input, num_groups, weight, bias, eps)
    dev = input.device.type
    autocast = torch.is_autocast_enabled(dev)
    probe = F.group_norm(input.new_empty((0, *input.shape[1:])), num_groups) if autocast else input
    if (
        math.prod(input.shape[1:]) // num_groups < MIN_GROUP_NUMEL
        or probe.dtype in HALF_DTYPES
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
            return _group_norm(input, int(num_groups), weight, bias, float(eps))
    return _group_norm(input, int(num_groups), weight, bias, float(eps))


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


def _group_norm(input, num_groups: int, weight, bias, eps: float) -> torch.Tensor:
    refuse_jit("ops.group_norm")
    anchor = make_anchor(input)
    y = _GroupNormFn.apply(input, num_groups, weight, bias, eps)[0]
    attach_anchor(y, anchor)
    return y

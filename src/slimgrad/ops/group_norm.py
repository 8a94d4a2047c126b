"""GroupNorm that keeps its output, not its input (float32/float64; half precision runs eager's).

Math: x of shape ``(N, C, *)`` split into G groups of C/G channels; per (sample, group) ``mu``,
``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mu) * rstd``, ``y = xhat * gamma_c + beta_c``.
Backward with ``g = dy * gamma_c`` and means over each (sample, group):
``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``dgamma_c = sum(dy * xhat)``,
``dbeta_c = sum(dy)``, with ``xhat = (y - beta_c) / gamma_c`` rebuilt from the output; fallback
channels as in NOTE [Normalization from its output: the fallback channels] (``ops/layer_norm.py``).

Memory, per input dtype:
- float32/float64: saves y (the output, shared with the next layer) + mean and rstd (2 * itemsize
  B per sample and group) + the input of fallback channels (k channels: k * N * HxW * itemsize B)
  and their int64 indices (8 B each); eager saves x, mean and rstd (x: 4 B/elt fp32 extra). Groups
  of fewer than ``MIN_GROUP_NUMEL`` elements, and non-contiguous inputs (channels_last,
  transposed, sliced), run eager's group_norm (saves x, as eager).
- bfloat16/float16: runs eager's ``F.group_norm``, so saves exactly what eager saves: x (2 B/elt)
  + mean and rstd (2 * 2 B per sample and group). Rebuilding xhat from a half-precision output
  broke the GUIDE.md rule for dgamma (NOTE [RMSNorm and GroupNorm in half precision] in
  ``ops/rms_norm.py``), and keeping x instead costs what eager costs.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]; dbias is summed first); otherwise out of place.
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

__all__ = ["MIN_GROUP_NUMEL", "group_norm"]

#: Groups with fewer elements (C / G * spatial) run eager's group_norm, which keeps the input: in
#: such groups rebuilding xhat from the rounded output exceeded the GUIDE.md error rule (groups of
#: 2 and 3 elements in tests/ops/test_group_norm.py's seed sweep).
MIN_GROUP_NUMEL = 16


def _fwd_torch(x, num_groups, weight, bias, eps):
    n, c = x.shape[0], x.shape[1]
    hw = math.prod(x.shape[2:])
    y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hw, num_groups, eps)
    idx = fallback_channels(weight, bias, y.dtype).to(x.device)
    xside = x.reshape(n, c, hw).index_select(1, idx)
    return y, mean, rstd, idx, xside


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
    dw = torch.zeros((grp, cg), dtype=torch.float64, device=y.device) if need_dw else None
    per_sample = max(c * hw, 1)
    step = max(1, max(CHUNK_ELEMS, (n * per_sample) // 16) // per_sample)
    for i in range(0, n, step):
        sl = slice(i, i + step)
        xh = rebuild_xhat(y4[sl], w, b, acc)
        rc = r[sl].view(-1, grp, 1, 1)
        if idx.numel():
            m_k = mu[sl].index_select(1, gidx).unsqueeze(-1)
            r_k = r[sl].index_select(1, gidx).unsqueeze(-1)
            xh.view(-1, c, hw).index_copy_(1, idx, (xside[sl].to(acc) - m_k) * r_k)
        dyc = dy4[sl].to(acc)
        if need_dw:
            dw += (dyc * xh).sum((0, 3), dtype=torch.float64)
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

    Memory: fp32: saves y (shared with the next layer) + 8 B per (sample, group) + fallback
    input channels; eager saves x + 8 B per (sample, group). bf16/fp16: runs ``F.group_norm``
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

"""Triton kernels for In-Place ABN: fused normalise+activation (in place) and a two-pass backward.

Same signatures as ``slimgrad._math.abn.fwd_torch`` / ``bwd_torch``; the op picks them
through NOTE [Kernel backend choice] (``slimgrad/kernels/_backend.py``). The backward reduction
recomputes y = act^-1(z), dy and x̂ per element in registers, so it needs no temporaries (the
PyTorch path needs chunk-sized ones); it runs on (channel, part) programs whose float64 partial
sums are added in a fixed order (deterministic); the elementwise pass then writes
dx = k*dy + p*y + q into the one dx buffer (dz's own when ``owned``). Channels kept in the side
tensor (NOTE [Invertibility] in ``slimgrad/ops/inplace_abn.py``) and batch statistics go through
the PyTorch helpers. Inputs whose dimensions after the channel cannot be flattened into one strided
dimension (not NCHW- or channels_last-like) and float64 inputs use the PyTorch path.

The eager forward of ``slimgrad.ops.inplace_abn`` does not use :func:`apply_`: it runs eager
BatchNorm's own kernel on either backend, for bit-identical outputs (NOTE [Same forward as eager]
there). :func:`apply_` serves the custom op that torch.compile runs and the sync variant.

Imported lazily: nothing here runs at ``import slimgrad``. Tested under ``TRITON_INTERPRET=1`` and
compiled for sm_90 without a GPU (``tests/kernels/test_inplace_abn.py``).

Memory: as ``slimgrad.ops.inplace_abn`` (saves z + invstd); backward allocates dx and 2 float64 per
(channel, part) of the reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from slimgrad._math import abn as _ref
from slimgrad.kernels._common import add, cast_out, expm1

_ACT = {"identity": 0, "leaky_relu": 1, "elu": 2}
_BLOCK = 1024
_PROGRAMS = 1024  # backward reduction: programs in all (a few per SM on an H100's 132)


def _flat3(t: torch.Tensor) -> torch.Tensor | None:
    # (N, C, *S) -> (N, C, S) as a view, or None when the trailing dims cannot merge.
    if t.dim() == 2:
        return t.unsqueeze(-1)
    try:
        return t.view(t.shape[0], t.shape[1], -1)
    except RuntimeError:
        return None


@triton.jit
def _act_fwd(y, ACT: tl.constexpr, param):
    if ACT == 1:
        y = tl.where(y >= 0, y, y * param)
    elif ACT == 2:
        y = tl.where(y >= 0, y, param * expm1(y))
    return y


@triton.jit
def _log1p(x):
    # log(1 + x) without the cancellation of 1 + x near 0 (the PyTorch path uses torch.log1p):
    # log(u) * x / (u - 1) with u = 1 + x rounded, x where u rounds to 1. u is kept >= the smallest
    # normal float32 (a literal below it would be typed float64 and break compilation); ELU's
    # saturated channels (u ~ 0) are side channels anyway (NOTE [Invertibility]).
    u = tl.maximum(1.0 + x, 1.1754943508222875e-38)
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _rebuild(z, dz, ACT: tl.constexpr, param):
    # returns (y, dy): the pre-activation and its gradient, from the output z and its gradient dz
    if ACT == 1:
        y = tl.where(z >= 0, z, z / param)
        dy = tl.where(z > 0, dz, dz * param)
    elif ACT == 2:
        neg = z < 0
        y = tl.where(neg, _log1p(z / param), z)
        dy = tl.where(neg, dz * (z + param), dz)
    else:
        y = z
        dy = dz
    return y, dy


@triton.jit
def _apply_kernel(
    x_ptr, scale_ptr, shift_ptr, S, NS, sN, sC, sS, param,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < NS
    off = (i // S) * sN + c * sC + (i % S) * sS
    x = tl.load(x_ptr + off, mask=m).to(tl.float32)
    y = x * tl.load(scale_ptr + c) + tl.load(shift_ptr + c)
    y = _act_fwd(y, ACT, param)
    tl.store(x_ptr + off, cast_out(y, x_ptr.dtype.element_ty), mask=m)  # (bf16: rounded)


@triton.jit
def _reduce_kernel(
    z_ptr, dz_ptr, mean_ptr, invstd_ptr, sdy_ptr, sdyx_ptr,
    S, NS, PER, zN, zC, zS, gN, gC, gS, param,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # program (c, p): partial sums of channel c over its values [p * PER, (p + 1) * PER), stored
    # at [c, p] in float64 (summed by the caller: a fixed order, so the result is deterministic)
    c = tl.program_id(0)
    p = tl.program_id(1)
    mean = tl.load(mean_ptr + c)
    invstd = tl.load(invstd_ptr + c)
    # core builtins only (tl.full, tl.reduce with _common.add): triton's standard-library helpers
    # (tl.zeros, tl.sum) stay compiled when triton was imported before TRITON_INTERPRET was set.
    # Sums in float64, as aten's CPU BatchNorm backward accumulates: float32 sums lost ~sqrt(n) u
    # of sum |dy * x̂| and put dweight past the error rule's bound against CPU eager (1.16x at 140
    # values per channel). Two float64 adds per element: ~2% of an H100's float64 rate at copy
    # bandwidth (more of a consumer GPU's, whose float64 rate is 1/64 of float32).
    acc_dy = tl.full([BLOCK], 0.0, tl.float64)
    acc_dyx = tl.full([BLOCK], 0.0, tl.float64)
    # (a while loop: the interpreter cannot turn a runtime bound into range()'s int)
    start = p * PER
    end = tl.minimum(start + PER, NS)
    while start < end:
        i = start + tl.arange(0, BLOCK)
        m = i < end
        n = i // S
        s = i % S
        z = tl.load(z_ptr + n * zN + c * zC + s * zS, mask=m, other=0.0).to(tl.float32)
        dz = tl.load(dz_ptr + n * gN + c * gC + s * gS, mask=m, other=0.0).to(tl.float32)
        y, dy = _rebuild(z, dz, ACT, param)
        xhat = (y - mean) * invstd
        acc_dy += tl.where(m, dy, 0.0).to(tl.float64)
        acc_dyx += tl.where(m, dy * xhat, 0.0).to(tl.float64)
        start += BLOCK
    nprog = tl.num_programs(1)
    tl.store(sdy_ptr + c * nprog + p, tl.reduce(acc_dy, 0, add))
    tl.store(sdyx_ptr + c * nprog + p, tl.reduce(acc_dyx, 0, add))


def _split(c: int, ns: int) -> tuple[int, int]:
    # (programs per channel, values per program, a multiple of _BLOCK): about _PROGRAMS programs
    # in all, so that a few wide channels still fill the GPU, each with at least 4 blocks of work
    per_channel = max(1, min(triton.cdiv(_PROGRAMS, max(c, 1)), triton.cdiv(ns, 4 * _BLOCK)))
    per = triton.cdiv(triton.cdiv(ns, per_channel), _BLOCK) * _BLOCK
    return triton.cdiv(ns, per), per


@triton.jit
def _dx_kernel(
    z_ptr, dz_ptr, dx_ptr, k_ptr, p_ptr, q_ptr,
    S, NS, zN, zC, zS, gN, gC, gS, xN, xC, xS, param,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < NS
    n = i // S
    s = i % S
    z = tl.load(z_ptr + n * zN + c * zC + s * zS, mask=m, other=0.0).to(tl.float32)
    dz = tl.load(dz_ptr + n * gN + c * gC + s * gS, mask=m, other=0.0).to(tl.float32)
    y, dy = _rebuild(z, dz, ACT, param)
    dx = dy * tl.load(k_ptr + c) + y * tl.load(p_ptr + c) + tl.load(q_ptr + c)
    tl.store(dx_ptr + n * xN + c * xC + s * xS, cast_out(dx, dx_ptr.dtype.element_ty), mask=m)


def apply_(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, activation: str, param: float
):
    """x <- act(x * scale + shift) per channel, in place (float32 arithmetic). Returns False when
    x's layout or dtype (float64) is not supported: the caller then uses PyTorch."""
    x3 = _flat3(x) if x.dtype != torch.float64 else None
    if x3 is None:
        return False
    n, c, s = x3.shape
    if n * s == 0:
        return True
    grid = (c, triton.cdiv(n * s, _BLOCK))
    _apply_kernel[grid](
        x3, scale.float().contiguous(), shift.float().contiguous(), s, n * s, *x3.stride(),
        float(param), ACT=_ACT[activation], BLOCK=_BLOCK,
    )  # fmt: skip
    return True


def _fwd_triton(
    x, weight, bias, running_mean, running_var, training, momentum, eps, activation, param,
    merge: Callable | None = None,
):  # fmt: skip
    """``slimgrad._math.abn.fwd_torch`` with the normalise+activation pass as one Triton kernel."""
    if _flat3(x) is None or x.dtype == torch.float64 or x.numel() == 0:
        return _ref.fwd_torch(
            x, weight, bias, running_mean, running_var, training, momentum, eps, activation,
            param, merge,
        )  # fmt: skip
    # statistics, running stats, side tensors: the PyTorch helper with an identity activation on
    # a zero-size slice would be wasteful; reuse its pieces instead.
    stats = _ref.stats(x, running_mean, running_var, training, momentum, eps, merge)
    mean, invstd, count = stats
    acc = _ref.acc_dtype(x.dtype)
    w, b = _ref.affine(weight, bias, x.shape[1], x.device, acc)
    side_idx, side_xhat = _ref.side_channels(x, w, b, mean, invstd, activation, (weight, bias))
    scale = w * invstd
    shift = b - mean * scale
    apply_(x, scale, shift, activation, param)
    return mean, invstd, side_idx, side_xhat, count


def _bwd_triton(
    z, dz, weight, bias, invstd, side_idx, side_xhat, count, training, eps, activation, param,
    need_dx=True, need_dparams=True, allreduce: Callable | None = None, owned: bool = False,
):  # fmt: skip
    """``_math.abn.bwd_torch`` as two Triton passes (reduction, then dx); side channels in torch."""
    z3, dz3 = _flat3(z), _flat3(dz)
    if z3 is None or dz3 is None or z.dtype == torch.float64 or z.numel() == 0:
        return _ref.bwd_torch(
            z, dz, weight, bias, invstd, side_idx, side_xhat, count, training, eps, activation,
            param, need_dx, need_dparams, allreduce, owned,
        )  # fmt: skip
    n, c, s = z3.shape
    acc = _ref.acc_dtype(z.dtype)
    w, b = _ref.affine(weight, bias, c, z.device, acc)
    mean_p, invstd_p = b.clone(), 1.0 / w
    has_side = side_idx.numel() > 0
    if has_side:
        mean_p[side_idx] = 0
        invstd_p[side_idx] = 1
        invstd_p = torch.nan_to_num(invstd_p, nan=1.0, posinf=1.0, neginf=1.0)
    parts, per = _split(c, n * s)
    sdy = torch.empty(c, parts, device=z.device, dtype=torch.float64)
    sdyx = torch.empty(c, parts, device=z.device, dtype=torch.float64)
    act = _ACT[activation]
    _reduce_kernel[(c, parts)](
        z3, dz3, mean_p.float().contiguous(), invstd_p.float().contiguous(), sdy, sdyx,
        s, n * s, per, *z3.stride(), *dz3.stride(), float(param), ACT=act, BLOCK=_BLOCK,
    )  # fmt: skip
    sdy, sdyx = sdy.sum(1).to(acc), sdyx.sum(1).to(acc)  # a fixed order: deterministic
    if has_side:
        # exact sums for the kept channels, from their x̂
        dz_side = dz.index_select(1, side_idx).to(acc)
        dy_side = _ref.act_grad(dz_side, z.index_select(1, side_idx).to(acc), activation, param)
        dims = [0] + list(range(2, z.dim()))
        sdy[side_idx] = dy_side.sum(dims)
        sdyx[side_idx] = (dy_side * side_xhat).sum(dims)
    g_sdy, g_sdyx, g_count = (
        (sdy, sdyx, count) if allreduce is None else allreduce(sdy, sdyx, count)
    )
    dx = None
    if need_dx:
        dx = dz if owned else torch.empty_like(z)
        k = w * invstd
        if training:
            m2 = g_sdyx / g_count
            p = -k * m2 * invstd_p
            q = -p * mean_p - k * (g_sdy / g_count)
        else:
            p = torch.zeros_like(k)
            q = torch.zeros_like(k)
        dx3 = _flat3(dx)
        grid = (c, triton.cdiv(n * s, _BLOCK))
        _dx_kernel[grid](
            z3, dz3, dx3, k.float().contiguous(), p.float().contiguous(), q.float().contiguous(),
            s, n * s, *z3.stride(), *dz3.stride(), *dx3.stride(), float(param),
            ACT=act, BLOCK=_BLOCK,
        )  # fmt: skip
        if has_side:
            shape = _ref.bshape(z)
            res = dy_side * k[side_idx].view(shape)
            if training:
                res = res + p[side_idx].view(shape) * side_xhat + q[side_idx].view(shape)
            dx.index_copy_(1, side_idx, res.to(dx.dtype))
    return dx, sdyx, sdy

"""Triton kernels for LayerNorm (and RMSNorm, ``kernels/rms_norm.py``) from the output.

Same signatures as ``slimgrad._math.norms.layer_norm_fwd_torch`` / ``layer_norm_bwd_torch`` (the
op's ``_fwd_torch`` / ``_bwd_torch``).

Forward: one program per row, the row in registers (rows longer than ``FWD_TILE`` loop over
tiles): mean, then the variance of the centred row (two-pass, as eager), in float32, then
y = (x - mean) * rstd * gamma + beta in one store; mean and rstd come out in
float32 (the op's fake kernel's dtype; CUDA eager's too). The fallback channels (NOTE
[Normalization from its output: the fallback channels] in ``ops/layer_norm.py``) and their input
columns are chosen exactly as in the PyTorch path.

Backward: a persistent grid of P programs, each walking rows pid, pid + P, ...: per row it rebuilds
xhat = (y - beta) / gamma in registers (the fallback columns from their kept input instead), forms
dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, and accumulates dgamma and
dbeta partial sums in float32 registers; one (P, D) partial buffer per parameter is summed by
PyTorch at the end. One read of y and dy, one write of dx: no temporaries of the row size (the
PyTorch path needs chunked float32 copies). Rows longer than ``MAX_D`` and float64 take the
PyTorch path.

Memory: as ``slimgrad.ops.layer_norm`` (saves y + mean + rstd + fallback columns).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from slimgrad._math import norms as _ref
from slimgrad.kernels._common import add, cast_out, next_power_of_2, num_warps

MAX_D = 16384  # one row per register tile in backward
FWD_TILE = 8192  # forward: rows up to this stay in registers; longer rows loop over tiles
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _fwd_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, d, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip

    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * d
    yr = y_ptr + row * d
    cols = tl.arange(0, BLOCK_D)
    if ONE_TILE:  # the row stays in registers: one read of x, one write of y
        m = cols < d
        x = tl.load(xr + cols, mask=m, other=0.0).to(tl.float32)
        mean = 0.0
        if not RMS:
            mean = tl.reduce(x, 0, add) / d
        xc = tl.where(m, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.reduce(xc * xc, 0, add) / d + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(yr + cols, cast_out(y, y_ptr.dtype.element_ty), mask=m)
    else:  # long rows: tiles, three reads of x (mean, variance, output), as eager's two-pass
        mean = 0.0
        if not RMS:
            acc = tl.full([BLOCK_D], 0.0, tl.float32)
            start = d * 0
            while start < d:
                c = start + cols
                acc += tl.load(xr + c, mask=c < d, other=0.0).to(tl.float32)
                start += BLOCK_D
            mean = tl.reduce(acc, 0, add) / d
        acc = tl.full([BLOCK_D], 0.0, tl.float32)
        start = d * 0
        while start < d:
            c = start + cols
            m = c < d
            xc = tl.where(m, tl.load(xr + c, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
            acc += xc * xc
            start += BLOCK_D
        rstd = 1.0 / tl.sqrt(tl.reduce(acc, 0, add) / d + eps)
        start = d * 0
        while start < d:
            c = start + cols
            m = c < d
            y = (tl.load(xr + c, mask=m, other=0.0).to(tl.float32) - mean) * rstd
            if HAS_W:
                y = y * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
            tl.store(yr + c, cast_out(y, y_ptr.dtype.element_ty), mask=m)
            start += BLOCK_D
    if not RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_kernel(
    dy_ptr, y_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, side_ptr, col2k_ptr, dx_ptr,
    dw_ptr, db_ptr, n, d, k, n_prog,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SIDE: tl.constexpr, RMS: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    m = c < d
    if HAS_W:
        w = tl.load(w_ptr + c, mask=m, other=1.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_D], 1.0, tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
    else:
        b = tl.full([BLOCK_D], 0.0, tl.float32)
    if HAS_SIDE:
        kcol = tl.load(col2k_ptr + c, mask=m, other=-1)
        is_side = kcol >= 0
        kcol = tl.maximum(kcol, 0)
    dw_acc = tl.full([BLOCK_D], 0.0, tl.float32)
    db_acc = tl.full([BLOCK_D], 0.0, tl.float32)
    row = pid.to(tl.int64)
    while row < n:
        y = tl.load(y_ptr + row * d + c, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * d + c, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xh = (y - b) / w
        if HAS_SIDE:
            xs = tl.load(side_ptr + row * k + kcol, mask=m & is_side, other=0.0).to(tl.float32)
            if RMS:
                xh = tl.where(is_side, xs * rstd, xh)
            else:
                xh = tl.where(is_side, (xs - tl.load(mean_ptr + row)) * rstd, xh)
        xh = tl.where(m, xh, 0.0)
        if NEED_DX:
            g = dy * w
            c2 = tl.reduce(g * xh, 0, add) / d
            if RMS:
                dx = (g - xh * c2) * rstd
            else:
                c1 = tl.reduce(g, 0, add) / d
                dx = (g - c1 - xh * c2) * rstd
            tl.store(dx_ptr + row * d + c, cast_out(dx, dx_ptr.dtype.element_ty), mask=m)
        if NEED_DW:
            dw_acc += dy * xh
        if NEED_DB:
            db_acc += dy
        row += n_prog
    if NEED_DW:
        tl.store(dw_ptr + pid * d + c, dw_acc, mask=m)
    if NEED_DB:
        tl.store(db_ptr + pid * d + c, db_acc, mask=m)


def _dense(t):
    # t itself when contiguous (the kernels read flat memory), else a contiguous copy
    return t if t is None or t.is_contiguous() else t.contiguous()


def _row_block(d: int) -> int:
    return max(16, next_power_of_2(max(d, 1)))


_CAPS: dict[torch.device, int] = {}


def _n_programs(n: int, device: torch.device) -> int:
    cap = _CAPS.get(device)
    if cap is None:
        if device.type == "cuda":
            # two programs per SM: enough rows in flight, few (P, D) partials to sum (asked once
            # per device: the query is not free)
            cap = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        else:
            cap = 4  # the interpreter runs programs one after another
        _CAPS[device] = cap
    return max(1, min(n, cap))


def norm_fwd(x, normalized_shape, weight, bias, eps, rms: bool):
    """(y, mean or None, rstd) with y of shape x.shape (contiguous), stats (*batch, 1...) float32;
    None when unsupported (the caller takes the PyTorch path)."""
    nd = len(normalized_shape)
    d = math.prod(normalized_shape)
    if (
        x.dtype not in _DTYPES
        or x.numel() == 0
        or tuple(x.shape[x.dim() - nd :]) != tuple(normalized_shape)
    ):
        return None
    n = x.numel() // d
    # the kernels index flat memory: any contiguous tensor will do, whatever its shape (no
    # reshape per call)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # as eager, whatever weight's dtype
    stat_shape = tuple(x.shape[: x.dim() - nd]) + (1,) * nd
    mean = None if rms else torch.empty(stat_shape, dtype=torch.float32, device=x.device)
    rstd = torch.empty(stat_shape, dtype=torch.float32, device=x.device)
    block = min(_row_block(d), FWD_TILE)
    w, b = _dense(weight), _dense(bias)
    _fwd_kernel[(n,)](
        _dense(x), y, w, b, mean if mean is not None else rstd, rstd, d, float(eps),
        HAS_W=w is not None, HAS_B=b is not None, RMS=rms, ONE_TILE=d <= block, BLOCK_D=block,
        num_warps=num_warps(block),
    )  # fmt: skip
    return y, mean, rstd


def norm_bwd(
    dy, y, mean, rstd, idx, xside, weight, bias, normalized_shape, output_mask, rms, out=None
):
    """(dx, dw, db) as the PyTorch paths return them, or None when unsupported. ``out``: a
    contiguous buffer of y's dtype and shape for dx, possibly dy itself (each row is read whole
    before its dx is written)."""
    d = math.prod(normalized_shape)
    if y.dtype not in _DTYPES or y.numel() == 0 or d > MAX_D:
        return None
    n = y.numel() // d
    need_dx = bool(output_mask[0])
    need_dw = weight is not None and bool(output_mask[1])
    need_db = (not rms) and bias is not None and bool(output_mask[2])
    dev = y.device
    w, b = _dense(weight), _dense(bias)
    k = idx.numel()
    col2k = side = None
    if k:
        col2k = torch.full((d,), -1, dtype=torch.int32, device=dev)
        col2k[idx.to(dev)] = torch.arange(k, dtype=torch.int32, device=dev)
        side = xside.reshape(n, k).contiguous()
    p = _n_programs(n, dev)
    dx = None
    if need_dx:
        dx = out if out is not None else torch.empty(y.shape, dtype=y.dtype, device=dev)
    dw_part = torch.empty((p, d), dtype=torch.float32, device=dev) if need_dw else None
    db_part = torch.empty((p, d), dtype=torch.float32, device=dev) if need_db else None
    stat = _dense(rstd)
    block = _row_block(d)
    _bwd_kernel[(p,)](
        _dense(dy), _dense(y), _dense(mean) if mean is not None else stat, stat, w, b, side, col2k,
        dx,
        dw_part, db_part, n, d, k, p,
        HAS_W=w is not None, HAS_B=b is not None, HAS_SIDE=k > 0, RMS=rms,
        NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db, BLOCK_D=block,
        num_warps=num_warps(block),
    )  # fmt: skip
    # per-program float32 partials, summed in float64 (as the PyTorch path accumulates dw, db)
    dw = (
        dw_part.sum(0, dtype=torch.float64).to(weight.dtype).reshape(weight.shape)
        if need_dw
        else None
    )
    db = db_part.sum(0, dtype=torch.float64).to(bias.dtype).reshape(bias.shape) if need_db else None
    return dx, dw, db


def _fwd_triton(x, normalized_shape, weight, bias, eps):
    """``_math.norms.layer_norm_fwd_torch`` with the statistics and the output in one kernel."""
    out = norm_fwd(x, list(normalized_shape), weight, bias, eps, rms=False)
    if out is None:
        return _ref.layer_norm_fwd_torch(x, normalized_shape, weight, bias, eps)
    y, mean, rstd = out
    idx, xside = side_columns(x, normalized_shape, weight, bias, y.dtype, _ref.layer_norm_gamma)
    return y, mean, rstd, idx, xside


def side_columns(x, normalized_shape, weight, bias, out_dtype, gamma_of=None):
    """(idx, xside): the fallback channels (of the scale ``gamma_of(weight)`` where given) and x's
    columns of them, (rows, k); no gather when there are none (the usual case)."""
    idx = _ref.fallback_channels(weight, bias, out_dtype, gamma_of)
    if idx.device != x.device:
        idx = idx.to(x.device)
    return idx, _ref.side_columns(x, math.prod(normalized_shape), idx)


def _bwd_triton(
    dy, y, mean, rstd, idx, xside, weight, bias, normalized_shape, output_mask, out=None
):
    """``_math.norms.layer_norm_bwd_torch`` in one pass over y and dy (``out``: dx's buffer, e.g.
    dy's own when ``slimgrad.ownership`` grants it)."""
    args = (dy, y, mean, rstd, idx, xside, weight, bias, list(normalized_shape), output_mask)
    if idx.shape[0] and idx.shape[0] == math.prod(normalized_shape):
        # every channel kept its input: eager's backward (NOTE [LayerNorm with a non-finite gamma])
        return _ref.layer_norm_bwd_torch(*args, out=out)
    res = norm_bwd(*args, False, out=out)
    if res is None:
        return _ref.layer_norm_bwd_torch(*args, out=out)
    if out is not None and output_mask[0]:
        torch.autograd.graph.increment_version(out)  # a raw write: autograd must see it
    return res

"""Triton kernels for the softmax part of the fused linear + cross-entropy.

Same signatures as ``slimgrad._math.linear_cross_entropy._fwd_torch`` / ``_bwd_torch``. The chunk
loop and its matmuls stay in PyTorch (cuBLAS); what runs between them is one kernel per direction,
one program per token row:

* forward, :func:`ce_fwd_chunk`: logits chunk -> lse (online max / rescaled sum over V tiles) and
  the token's loss ``lse - (1 - eps) z_t - (eps / V) sum_j z_j`` in one read of the chunk (eager:
  logsumexp's two or three passes, then a gather and a sum);
* backward, :func:`ce_grad_chunk_`: the chunk's logits become ``dz = s_i (softmax(z) - (1 - eps)
  onehot(t) - eps / V)`` in place, one read and one write (the PyTorch path: four passes).

Ignored tokens (``target == ignore_index``) read class 0 and get loss 0 / scale 0, as in the PyTorch
path. Statistics in float32 (float64 inputs take the PyTorch path).

Memory: as ``slimgrad.ops.linear_cross_entropy`` (saves hidden + lse + target; one chunk of logits
transient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimgrad._math import linear_cross_entropy as _ref
from slimgrad.kernels._common import add, cast_out, maximum, num_warps

_BLOCK_V = 4096


@triton.jit
def _ce_fwd_kernel(
    z_ptr, t_ptr, loss_ptr, lse_ptr, scale_ptr, v, stride, ignore_index, eps,
    HAS_EPS: tl.constexpr, GRAD: tl.constexpr, SCALE: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip

    row = tl.program_id(0).to(tl.int64)
    zr = z_ptr + row * stride
    cols = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s_vec = tl.full([BLOCK_V], 0.0, tl.float32)
    sum_vec = tl.full([BLOCK_V], 0.0, tl.float32)
    start = v * 0
    while start < v:
        c = start + cols
        msk = c < v
        z = tl.load(zr + c, mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, z)
        keep = m_new == float("-inf")  # nothing finite seen in this lane yet
        s_vec = tl.where(keep, 0.0, s_vec * tl.exp(m_vec - m_new) + tl.exp(z - m_new))
        m_vec = m_new
        if HAS_EPS:
            sum_vec += tl.where(msk, z, 0.0)
        start += BLOCK_V
    m = tl.reduce(m_vec, 0, maximum)
    s = tl.reduce(tl.where(m_vec == float("-inf"), 0.0, s_vec * tl.exp(m_vec - m)), 0, add)
    lse = m + tl.log(s)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    zt = tl.load(zr + tl.where(valid, t, 0)).to(tl.float32)
    loss = lse - (1.0 - eps) * zt
    if HAS_EPS:
        loss = loss - (eps / v) * tl.reduce(sum_vec, 0, add)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if GRAD:  # second pass: the chunk's gradient in place
        s = 1.0
        if SCALE:
            s = tl.load(scale_ptr + row)
        _grad_row(zr, cols, v, lse, s, tl.where(valid, t, 0), eps, z_ptr.dtype.element_ty, BLOCK_V)


@triton.jit
def _grad_row(zr, cols, v, lse, s, t, eps, out_ty: tl.constexpr, BLOCK_V: tl.constexpr):
    # z <- s (softmax(z) - (1 - eps) onehot(t) - eps / V) over one row of logits, in place
    start = v * 0
    while start < v:
        c = start + cols
        msk = c < v
        z = tl.load(zr + c, mask=msk, other=0.0).to(tl.float32)
        p = tl.exp(z - lse) - eps / v
        p = tl.where(c == t, p - (1.0 - eps), p)
        tl.store(zr + c, cast_out(p * s, out_ty), mask=msk)
        start += BLOCK_V


@triton.jit
def _ce_grad_kernel(
    z_ptr, t_ptr, lse_ptr, scale_ptr, v, stride, ignore_index, eps,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    _grad_row(
        z_ptr + row * stride, tl.arange(0, BLOCK_V), v, tl.load(lse_ptr + row),
        tl.load(scale_ptr + row), tl.where(t != ignore_index, t, 0), eps,
        z_ptr.dtype.element_ty, BLOCK_V,
    )  # fmt: skip


def _block_v(v: int) -> int:
    return min(_BLOCK_V, max(16, triton.next_power_of_2(v)))


def ce_fwd_chunk(
    z: torch.Tensor, target: torch.Tensor, ignore_index: int, eps: float, loss=None, lse=None
):
    """(loss, lse) float32 per row of the logits chunk z (rows, V), one pass; written into
    ``loss`` / ``lse`` (contiguous float32, rows elements) when given."""
    rows, v = z.shape
    if loss is None:
        loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    if lse is None:
        lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        _ce_fwd_kernel[(rows,)](
            z, target, loss, lse, None, v, z.stride(0), int(ignore_index), float(eps),
            HAS_EPS=bool(eps), GRAD=False, SCALE=False, BLOCK_V=_block_v(v),
            num_warps=num_warps(_block_v(v)),
        )  # fmt: skip
    return loss, lse


def ce_fwd_grad_chunk_(z, target, ignore_index: int, eps: float, loss, scale=None):
    """Loss per row into ``loss`` and, in place, z <- [scale *] (softmax(z) - (1 - eps)
    onehot(target) - eps / V): lse, loss and the logits' gradient in one kernel (two reads of
    the row, one write). Returns z."""
    rows, v = z.shape
    if rows:
        lse = torch.empty(rows, dtype=torch.float32, device=z.device)
        _ce_fwd_kernel[(rows,)](
            z, target, loss, lse, scale, v, z.stride(0), int(ignore_index), float(eps),
            HAS_EPS=bool(eps), GRAD=True, SCALE=scale is not None, BLOCK_V=_block_v(v),
            num_warps=num_warps(_block_v(v)),
        )  # fmt: skip
    return z


def ce_grad_chunk_(z, target, lse, scale, ignore_index: int, eps: float) -> torch.Tensor:
    """z <- scale * (softmax(z) - (1 - eps) onehot(target) - eps / V), in place; returns z."""
    rows, v = z.shape
    if rows:
        _ce_grad_kernel[(rows,)](
            z, target, lse, scale, v, z.stride(0), int(ignore_index), float(eps),
            BLOCK_V=_block_v(v), num_warps=num_warps(_block_v(v)),
        )  # fmt: skip
    return z


def _supported(h: torch.Tensor) -> bool:
    return h.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _fwd_triton(h, weight, bias, target, ignore_index, eps, chunk):
    """``_fwd_torch`` with the per-chunk logsumexp + loss as one kernel."""
    if not _supported(h):
        return _ref._fwd_torch(h, weight, bias, target, ignore_index, eps, chunk)
    n = h.shape[0]
    t = target.contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=h.device)
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        z = torch.nn.functional.linear(h[s:e], weight, bias)
        if z.stride(-1) != 1:
            z = z.contiguous()
        ce_fwd_chunk(z, t[s:e], ignore_index, eps, loss[s:e], lse[s:e])
        del z
    return loss, lse


def _bwd_triton(h, weight, bias, target, lse, scale, ignore_index, eps, chunk, need, dh_out=None):
    """``_bwd_torch`` with each chunk's logits turned into dz in place by one kernel."""
    if not _supported(h):
        return _ref._bwd_torch(
            h, weight, bias, target, lse, scale, ignore_index, eps, chunk, need, dh_out
        )
    n = h.shape[0]
    t = target.contiguous()
    lse = lse.float().contiguous()
    scale = scale.float().contiguous()
    need_dh, need_dw, need_db = need
    dh = (dh_out if dh_out is not None else torch.empty_like(h)) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_dw else None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_db else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        hc = h[s:e]
        z = torch.nn.functional.linear(hc, weight, bias).float()
        ce_grad_chunk_(z, t[s:e], lse[s:e], scale[s:e], ignore_index, eps)
        if need_db:
            db += z.sum(0)
        if need_dw:
            dw.addmm_(z.t(), hc.float())
        if need_dh:
            torch.mm(z.to(h.dtype), weight, out=dh[s:e])
        del z
    return dh, dw, db


def _fwd_grad_triton(h, weight, bias, target, scale, ignore_index, eps, chunk, need):
    """``_fwd_grad_torch``: (loss, dh, dW, db) with each chunk's lse, loss and dz from one
    kernel between the matmuls."""
    if not _supported(h) or not hasattr(_ref, "_fwd_grad_torch"):
        return _ref._fwd_grad_torch(h, weight, bias, target, scale, ignore_index, eps, chunk, need)
    n, v = h.shape[0], weight.shape[0]
    full = h.dtype == torch.float32
    t = target.contiguous()
    scale = scale.float().contiguous()
    need_dh, need_dw, need_db = need
    loss = torch.empty(n, dtype=torch.float32, device=h.device)
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=h.device) if need_db else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        hc, sc = h[s:e], scale[s:e]
        z = torch.nn.functional.linear(hc, weight, bias).float()
        # full precision: s_i scales hc / dh rows (as the PyTorch path); low: dz in float32
        ce_fwd_grad_chunk_(z, t[s:e], ignore_index, eps, loss[s:e], None if full else sc)
        if need_db:
            if full:
                db.addmv_(z.t(), sc)
            else:
                db += z.sum(0)
        if need_dw:
            dw.addmm_(z.t(), hc * sc[:, None] if full else hc.float())
        if need_dh:
            dc = torch.mm(z.to(h.dtype), weight)
            if full:
                dc.mul_(sc[:, None])
            dh[s:e] = dc
            del dc
        del z
    return loss, dh, dw, db

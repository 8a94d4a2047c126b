"""The PyTorch chunk math of ``slimgrad.ops.linear_cross_entropy``, shared with its Triton kernels.

``_fwd_torch`` / ``_bwd_torch`` / ``_fwd_grad_torch`` walk the tokens in chunks of logits (see the
op's docstring for the math and what is kept); ``slimgrad.kernels.linear_cross_entropy`` falls
back to them (logit transforms, CPU) and has the same signatures. Leaf module: imports torch only.
"""

from __future__ import annotations

import torch

__all__ = [
    "_acc_dtype",
    "_bwd_rows_torch",
    "_bwd_torch",
    "_fwd_grad_torch",
    "_fwd_torch",
    "_logits_t",
    "_transform_",
    "_transform_grad_",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# NOTE [Logits as V x chunk]
# Each chunk's logits are computed transposed, zT = W hcᵀ (+ b) of shape (V, chunk), never
# z = hc Wᵀ (chunk, V): with W (V, H) row-major as the left operand, the CPU GEMM runs about 30%
# faster than with W transposed on the right (docs/measurements.md; eager's own F.linear pays the
# slow layout), and both gradient matmuls take zT as it
# is: dW += zT hc (V x chunk times chunk x H) and dh = zTᵀ W. The softmax statistics reduce over
# dim 0. Same sums in another order: exact up to summation order, like the chunking itself.


def _logits_t(hc, weight, bias, acc):
    zt = torch.mm(weight, hc.t())
    if bias is not None:
        zt += bias[:, None]
    return zt.to(acc)


# NOTE [Logit transforms]
# Some LM heads map the logits z elementwise before the loss: Cohere multiplies by a scale
# (logit_scale), Granite divides by one (logits_scaling: scale = 1 / logits_scaling), Gemma2/3
# soft-cap them, y = c·tanh(z / c) (final_logit_softcapping). The chunk's logits are mapped in place
# with the same operations in the same order as HF (z·scale, then / c, tanh, · c), in the
# accumulation dtype; the loss is the cross-entropy of y. Backward: dz = dy · scale · (1 − tanh²),
# the tanh kept for the chunk only (one more chunk-sized transient, never saved).


def _transform_(zt, scale, cap, keep_tanh=False):
    # y = cap·tanh(scale·z / cap) in place (NOTE [Logit transforms]); with keep_tanh, also the tanh
    # (then y is a new chunk buffer)
    if scale != 1.0:
        zt.mul_(scale)
    if cap is None:
        return zt, None
    th = zt.div_(cap).tanh_()
    if keep_tanh:
        return th * cap, th
    return th.mul_(cap), None


def _transform_grad_(dy, th, scale):
    # dy (the chunk's gradient w.r.t. the mapped logits) -> dz, in place; th is consumed
    if th is not None:
        dy.mul_(th.mul_(th).neg_().add_(1.0))
    if scale != 1.0:
        dy.mul_(scale)
    return dy


def _spans(n, size):
    # (start, end) of the blocks of ``size`` that cover range(n)
    for s in range(0, n, size):
        yield s, min(s + size, n)


def _targets(target, ignore_index):
    # (valid, safe_t): the tokens that count and the targets with ignored ones mapped to class 0
    valid = target != ignore_index
    return valid, torch.where(valid, target, torch.zeros_like(target))


def _chunk_logits(h, weight, bias, acc, chunk, lscale, cap, keep_tanh=False):
    # (s, e, hc, zT, th) for each chunk hc = h[s:e] of tokens: its logits zT (V x chunk, NOTE
    # [Logits as V x chunk]) mapped by the logit transform (NOTE [Logit transforms]); th as
    # _transform_ returns it. Nothing here keeps a yielded chunk alive: the caller frees zT (and
    # th) before asking for the next one, so one chunk of logits is live at a time.
    for s, e in _spans(h.shape[0], chunk):
        hc = h[s:e]
        yield (s, e, hc, *_transform_(_logits_t(hc, weight, bias, acc), lscale, cap, keep_tanh))


def _dlogits_(zt, th, lse, index, add, eps, v, lscale):
    # zT -> dzT in place: softmax (from the chunk's lse), minus the smoothed one-hot (``add``, i.e.
    # eps - 1, scattered at ``index``), through the logit transform (th is consumed)
    zt.sub_(lse).exp_()
    if eps:
        zt.sub_(eps / v)
    zt.scatter_add_(0, index, add)
    return _transform_grad_(zt, th, lscale)


def _fwd_torch(h, weight, bias, target, ignore_index, eps, chunk, scale=1.0, cap=None):
    """Per-token loss (accumulation dtype, 0 where ignored) and lse (float32, float64 for fp64).

    h: (N, H), weight (V, H), bias: in the compute dtype; target: (N,) int64. ``scale``, ``cap``:
    the logit transform (NOTE [Logit transforms]).
    """
    n, v = h.shape[0], weight.shape[0]
    acc = _acc_dtype(h.dtype)
    valid, safe_t = _targets(target, ignore_index)
    loss = torch.empty(n, dtype=acc, device=h.device)
    lse = torch.empty(n, dtype=acc, device=h.device)
    for s, e, _, zt, _ in _chunk_logits(h, weight, bias, acc, chunk, scale, cap):
        li = zt.gather(0, safe_t[None, s:e]).squeeze(0).mul_(-(1.0 - eps))
        if eps:
            li.sub_(zt.sum(0), alpha=eps / v)
        # logsumexp over dim 0 as torch.logsumexp computes it (an infinite max shifts by 0), but
        # in place: the chunk's logits are not needed afterwards
        m = zt.amax(0)
        m.masked_fill_(m.abs() == float("inf"), 0)
        lse_c = zt.sub_(m).exp_().sum(0).log_().add_(m)
        loss[s:e] = li.add_(lse_c)
        lse[s:e] = lse_c
        del zt
    loss.masked_fill_(~valid, 0)
    return loss, lse


def _bwd_torch(
    h,
    weight,
    bias,
    target,
    lse,
    scale,
    ignore_index,
    eps,
    chunk,
    need,
    dh_out=None,
    lscale=1.0,
    cap=None,
):
    """Gradients (dh, dW, db) for s_i = ``scale`` (accumulation dtype, 0 where ignored).

    ``need``: which of (dh, dW, db) to compute. dh is in h's dtype; dW and db in the accumulation
    dtype (float32 for low precision). ``dh_out``: optional (N, H) buffer in h's dtype that may
    alias h: each chunk's rows of h are read before the same rows of dh are written. ``lscale``,
    ``cap``: the logit transform (NOTE [Logit transforms]).
    """
    v = weight.shape[0]
    acc = _acc_dtype(h.dtype)
    _, safe_t = _targets(target, ignore_index)
    need_dh, need_dw, need_db = need
    dh = (dh_out if dh_out is not None else torch.empty_like(h)) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=h.device) if need_db else None
    for s, e, hc, zt, th in _chunk_logits(h, weight, bias, acc, chunk, lscale, cap, True):
        # zT becomes dzT in place: softmax, minus the smoothed one-hot, times s_i
        add = zt.new_full((1, e - s), eps - 1.0)
        zt = _dlogits_(zt, th, lse[None, s:e], safe_t[None, s:e], add, eps, v, lscale)
        del th, add
        zt.mul_(scale[None, s:e])
        if need_db:
            db += zt.sum(1)
        if need_dw:
            dw.addmm_(zt, hc.to(acc))
        if need_dh:
            torch.mm(zt.to(h.dtype).t(), weight, out=dh[s:e])
        del zt
    return dh, dw, db


# NOTE [Head gradient by vocabulary blocks]
# The token-chunk loop of _bwd_torch completes no row of dW before its last chunk: the whole V x H
# dW lives from its first chunk to the end of the op. _bwd_rows_torch walks the vocabulary in
# blocks of ``rows`` rows (outer) and the tokens in chunks (inner), from the lse saved in forward:
# block v's logits zT_v = W_v hcᵀ (+ b_v) give dz_v, then dW_v = Σ_chunks dz_v hc is complete
# (over every token) when the block ends, and dh = Σ_v dz_vᵀ W_v accumulates over the blocks. Each
# block's dW_v is computed into its own (rows, H) buffer and handed to ``take_rows(v0, v1, dW_v)``
# when given (slimgrad.step_in_backward updates those rows of the parameter and frees the buffer:
# only one block of dW is alive), else copied into the full dW. Both ways run the same arithmetic
# on the same buffers, so the bits do not depend on who takes the rows. W_v is read for dh before
# take_rows is called, and no later block reads it. dh cannot share storage with h when there is
# more than one block (every block reads all of h): ``dh_out`` must not alias h then.
# Full precision only (dh accumulates in h's dtype). Memory: one block of logits (rows x tokens)
# and one of dW (rows x H) instead of chunk x V and V x H. ``tokens`` (the inner chunk) is the
# largest that holds no more logits than forward's chunk did (chunk x V), at most N: a block is then
# one pass over all tokens at the usual sizes (GPT-2 small 4x256: 37 blocks of 1365 rows x 1024
# tokens, where chunks of 256 tokens made 148 block-chunk pairs of ~17 ops each). The targets'
# one-hot inside a block is computed once per block for all tokens, not per chunk.


def _bwd_rows_torch(
    h,
    weight,
    bias,
    target,
    lse,
    scale,
    ignore_index,
    eps,
    chunk,
    rows,
    need,
    dh_out=None,
    lscale=1.0,
    cap=None,
    take_rows=None,
):
    """:func:`_bwd_torch` by vocabulary blocks of ``rows`` rows (NOTE [Head gradient by vocabulary
    blocks]): (dh, dW, db), dW None when ``take_rows`` took every block. Full precision only."""
    v = weight.shape[0]
    acc = _acc_dtype(h.dtype)
    if acc != h.dtype:
        raise ValueError("_bwd_rows_torch: full precision only; this is a slimgrad bug")
    _, safe_t = _targets(target, ignore_index)
    need_dh, need_dw, need_db = need
    dh = (dh_out if dh_out is not None else torch.empty_like(h)) if need_dh else None
    dw = None
    if need_dw and take_rows is None:
        dw = torch.empty(weight.shape, dtype=acc, device=h.device)
    db = torch.zeros(v, dtype=acc, device=h.device) if need_db else None
    n = h.shape[0]
    tokens = min(n, max(chunk, chunk * v // max(rows, 1)))  # NOTE: no more logits than forward's
    lse_t, scale_t = lse[None], scale[None]
    for v0, v1 in _spans(v, rows):
        wv = weight[v0:v1]
        bv = bias[v0:v1] if bias is not None else None
        gw = torch.empty((v1 - v0, h.shape[1]), dtype=acc, device=h.device) if need_dw else None
        # the smoothed one-hot of the targets inside this block (others add 0), for every token
        local = safe_t - v0
        inside = (local >= 0) & (local < v1 - v0)
        add = torch.zeros((1, n), dtype=acc, device=h.device).masked_fill_(inside[None], eps - 1.0)
        index = torch.where(inside, local, 0)[None]
        del local, inside
        for s, e, hc, zt, th in _chunk_logits(h, wv, bv, acc, tokens, lscale, cap, True):
            whole = s == 0 and e == n
            zt = _dlogits_(
                zt, th, lse_t if whole else lse_t[:, s:e], index if whole else index[:, s:e],
                add if whole else add[:, s:e], eps, v, lscale,
            )  # fmt: skip
            del th
            zt.mul_(scale_t if whole else scale_t[:, s:e])
            if need_db:
                db[v0:v1] += zt.sum(1)
            if need_dw:
                if s == 0:
                    torch.mm(zt, hc, out=gw)
                else:
                    gw.addmm_(zt, hc)
            if need_dh:
                if v0 == 0:
                    torch.mm(zt.t(), wv, out=dh[s:e])
                else:
                    dh[s:e].addmm_(zt.t(), wv)
            del zt
        del add, index
        if need_dw:
            if take_rows is not None:
                take_rows(v0, v1, gw)
            else:
                dw[v0:v1] = gw
            del gw
    return dh, dw, db


def _fwd_grad_torch(
    h,
    weight,
    bias,
    target,
    scale,
    ignore_index,
    eps,
    chunk,
    need,
    dh_out=None,
    lscale=1.0,
    cap=None,
):
    """Forward and gradients in one pass: (loss, dh, dW, db) for the per-token weights ``scale``.

    loss as :func:`_fwd_torch`; (dh, dW, db) as :func:`_bwd_torch` with s_i = ``scale`` (the
    reduction's weight, known in forward for 'mean'/'sum'), so backward only multiplies them by
    the incoming scalar. Each chunk's logits are computed once and consumed by the two gradient
    matmuls right away: 3 big matmuls in all, like eager. In full precision (float32/64) s_i
    scales the chunk's hidden rows (dW) and dh rows, never the chunk×V buffer; in low precision
    it scales dz in float32 before the cast, as :func:`_bwd_torch` does. ``dh_out``: an (N, H)
    contiguous buffer in h's dtype to write dh into (else a fresh one). ``lscale``, ``cap``: the
    logit transform (NOTE [Logit transforms]).
    """
    n, v = h.shape[0], weight.shape[0]
    acc = _acc_dtype(h.dtype)
    full = acc == h.dtype
    valid, safe_t = _targets(target, ignore_index)
    need_dh, need_dw, need_db = need
    loss = torch.empty(n, dtype=acc, device=h.device)
    # dh contiguous whatever h's strides
    if need_dh:
        dh = dh_out if dh_out is not None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    else:
        dh = None
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=h.device) if need_db else None
    for s, e, hc, zt, th in _chunk_logits(h, weight, bias, acc, chunk, lscale, cap, True):
        tc = safe_t[None, s:e]
        row = scale[None, s:e]  # s_i per column of zT
        col = scale[s:e, None]  # s_i per row of hc / dh
        lse = torch.logsumexp(zt, dim=0, keepdim=True)
        li = lse - (1.0 - eps) * zt.gather(0, tc)
        if eps:
            li = li - (eps / v) * zt.sum(0, keepdim=True)
        loss[s:e] = li.squeeze(0)
        # zT becomes dzT in place: softmax minus the smoothed one-hot (times s_i in low precision)
        add = torch.full_like(lse, eps - 1.0)
        zt = _dlogits_(zt, th, lse, tc, add, eps, v, lscale)
        del th, add
        if not full:
            zt.mul_(row)
        if need_db:
            if full:
                db.addmv_(zt, row.squeeze(0))
            else:
                db += zt.sum(1)
        if need_dw:
            hs = hc * col if full else hc.to(acc)
            dw.addmm_(zt, hs)
            del hs
        if need_dh:
            dc = torch.mm(zt.to(h.dtype).t(), weight)
            if full:
                dc.mul_(col)
            dh[s:e] = dc
            del dc
        del zt
    loss.masked_fill_(~valid, 0)
    return loss, dh, dw, db

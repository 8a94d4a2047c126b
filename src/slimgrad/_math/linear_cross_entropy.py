"""The PyTorch chunk math of ``slimgrad.ops.linear_cross_entropy``, shared with its Triton kernels.

``_fwd_torch`` / ``_bwd_torch`` / ``_fwd_grad_torch`` walk the tokens in chunks of logits (see the
op's docstring for the math and what is kept); ``slimgrad.kernels.linear_cross_entropy`` falls
back to them (logit transforms, CPU) and has the same signatures. Leaf module: imports torch only.
"""

from __future__ import annotations

import torch

__all__ = [
    "_acc_dtype",
    "_bwd_one_torch",
    "_bwd_rows_torch",
    "_bwd_torch",
    "_fwd_grad_torch",
    "_fwd_torch",
    "_logits_t",
    "_loss_traced",
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


def _logits_t(hc, weight, bcol, acc, hct=None):
    # zT of one chunk; bcol: the bias as a (V, 1) column; hct: hc.t() when the caller has it
    zt = torch.mm(weight, hc.t() if hct is None else hct)
    if bcol is not None:
        zt += bcol
    return zt if zt.dtype == acc else zt.to(acc)


# NOTE [Logit transforms]
# Some LM heads map the logits z elementwise before the loss: Cohere multiplies by a scale
# (logit_scale), Granite divides by one (logits_scaling: scale = 1 / logits_scaling), Gemma2/3
# soft-cap them, y = c·tanh(z / c) (final_logit_softcapping). The chunk's logits are mapped in place
# with the same operations in the same order as HF (z·scale, then / c, tanh, · c), in the
# accumulation dtype; the loss is the cross-entropy of y. Backward: dz = dy · scale · (1 − tanh²),
# the tanh kept for the chunk only (one more chunk-sized transient, never saved).


def _transform_(zt, scale, cap, keep_tanh=False):
    # y = cap·tanh(scale·z / cap) in place (NOTE [Logit transforms]); with keep_tanh, also the tanh
    # (then the tanh is a new chunk buffer and y stays in zt's)
    if scale != 1.0:
        zt.mul_(scale)
    if cap is None:
        return zt, None
    if keep_tanh:
        th = torch.tanh(zt.div_(cap))
        return torch.mul(th, cap, out=zt), th
    return zt.div_(cap).tanh_().mul_(cap), None


def _transform_grad_(dy, th, scale):
    # dy (the chunk's gradient w.r.t. the mapped logits) -> dz, in place; th is consumed
    if th is not None:
        dy.mul_(th.mul_(th).neg_().add_(1.0))
    if scale != 1.0:
        dy.mul_(scale)
    return dy


def _targets(target, ignore_index):
    # (ignored, safe_t): the tokens that do not count and the targets with them mapped to class 0
    ignored = target == ignore_index
    return ignored, torch.where(ignored, 0, target)


def _dlogits_(zt, th, lse, index, add, eps, v, lscale):
    # zT -> dzT in place: softmax (from the chunk's lse), minus the smoothed one-hot (``add``, i.e.
    # eps - 1, scattered at ``index``), through the logit transform (th is consumed)
    zt.sub_(lse).exp_()
    if eps:
        zt.sub_(eps / v)
    zt.scatter_add_(0, index, add)
    return _transform_grad_(zt, th, lscale)


def _split(t, size, dim=0):
    # t in blocks of ``size`` along ``dim`` (views): one op for all of them, none when one block
    # covers t (NOTE [Whole-chunk ops])
    return (t,) if t.shape[dim] <= size else t.split(size, dim)


# NOTE [Whole-chunk ops]
# Every loop below issues a fixed number of ops per chunk (per vocabulary block and token chunk in
# _bwd_rows_torch), none per token or row, and nothing per chunk that does not depend on its logits:
# on a GPU each op is a launch. The chunk views (hidden rows, target columns, lse, s_i, loss / dh /
# dW / db rows, weight blocks) come from one ``split`` per tensor before the loop (none when one
# chunk covers the tensor); the smoothed one-hot's values (eps - 1 at each token's target) are one
# (1, N) tensor. _bwd_rows_torch keeps each token's block (t // rows) and its row inside the block
# (t mod rows, the same for every block): block k's 0/1 indicator (block == k) is one op into one
# (N,) buffer, and index_add_ adds it times alpha = eps - 1 at each token's flat position
# (row · width + column) in the block's logits, one buffer for all blocks (NOTE [One logits buffer
# for the vocabulary blocks]); with take_rows, each block's own logits and a scatter of the values
# (block == k) · (eps - 1), with the rows clamped into a shorter last block. A token outside the
# block adds ±0 at its position, which leaves that softmax entry (non-negative,
# never -0.0) as it was. Results go straight into their rows of the output (``out=``) where a copy
# used to follow; dh's GEMM takes the transposed operands (dhᵀ += W_vᵀ dz_v for dh += dz_vᵀ W_v: the
# same BLAS call, so the same bits) so that W_vᵀ is a view made once. Same arithmetic on the same
# values as one chunk at a time with slices: the same bits
# (tests/ops/test_linear_cross_entropy_blocks.py compares them with the slice-by-slice loops).


def _fwd_torch(h, weight, bias, target, ignore_index, eps, chunk, scale=1.0, cap=None):
    """Per-token loss (accumulation dtype, 0 where ignored) and lse (float32, float64 for fp64).

    h: (N, H), weight (V, H), bias: in the compute dtype; target: (N,) int64. ``scale``, ``cap``:
    the logit transform (NOTE [Logit transforms]).
    """
    n, v = h.shape[0], weight.shape[0]
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32  # _acc_dtype
    ignored, safe_t = _targets(target, ignore_index)
    loss = torch.empty(n, dtype=acc, device=h.device)
    lse = torch.empty(n, dtype=acc, device=h.device)
    bcol = bias[:, None] if bias is not None else None
    # every per-token value as a (1, chunk) row of zT's columns: no squeeze per chunk
    if n <= chunk:  # one chunk: the views without the splits (NOTE [One block, one chunk])
        parts = ((h, safe_t[None], loss[None], lse[None]),)
    else:
        parts = zip(
            _split(h, chunk),
            _split(safe_t[None], chunk, 1),
            _split(loss[None], chunk, 1),
            _split(lse[None], chunk, 1),
            strict=True,
        )
    transform = scale != 1.0 or cap is not None
    for hc, tc, loss_c, lse_c in parts:
        zt = _logits_t(hc, weight, bcol, acc)
        if transform:
            zt, _ = _transform_(zt, scale, cap)
        li = zt.gather(0, tc)
        if eps:
            li.mul_(-(1.0 - eps)).sub_(zt.sum(0, keepdim=True), alpha=eps / v)
        # logsumexp over dim 0 as torch.logsumexp computes it (an infinite max shifts by 0), but
        # in place: the chunk's logits are not needed afterwards
        m = zt.amax(0, keepdim=True)
        m.masked_fill_(m.isinf(), 0)
        torch.sum(zt.sub_(m).exp_(), 0, keepdim=True, out=lse_c).log_().add_(m)
        del zt
        # loss = lse - z_t (eps = 0: lse + (-z_t) in IEEE arithmetic), else lse + li
        if eps:
            torch.add(li, lse_c, out=loss_c)
        else:
            torch.sub(lse_c, li, out=loss_c)
    loss.masked_fill_(ignored, 0)
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
    n, v = h.shape[0], weight.shape[0]
    acc = _acc_dtype(h.dtype)
    _, safe_t = _targets(target, ignore_index)
    need_dh, need_dw, need_db = need
    dh = (dh_out if dh_out is not None else torch.empty_like(h)) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=h.device) if need_db else None
    bcol = bias[:, None] if bias is not None else None
    add = torch.full((1, n), eps - 1.0, dtype=acc, device=h.device)  # the smoothed one-hot
    for hc, tc, lc, sc, ac, dc in zip(
        _split(h, chunk),
        _split(safe_t[None], chunk, 1),
        _split(lse[None], chunk, 1),
        _split(scale[None], chunk, 1),
        _split(add, chunk, 1),
        _split(dh, chunk) if need_dh else _nones(n, chunk),
        strict=True,
    ):
        zt, th = _transform_(_logits_t(hc, weight, bcol, acc), lscale, cap, True)
        # zT becomes dzT in place: softmax, minus the smoothed one-hot, times s_i
        zt = _dlogits_(zt, th, lc, tc, ac, eps, v, lscale)
        del th
        zt.mul_(sc)
        if need_db:
            db += zt.sum(1)
        if need_dw:
            dw.addmm_(zt, hc.to(acc))
        if need_dh:
            torch.mm(zt.to(h.dtype).t(), weight, out=dc)
        del zt
    return dh, dw, db


def _nones(n, size):
    # one None per chunk of ``size`` over range(n), as many as _split makes
    return (None,) * (1 if n <= size else -(-n // size))


# NOTE [Head gradient by vocabulary blocks]
# The token-chunk loop of _bwd_torch completes no row of dW before its last chunk: the whole V x H
# dW lives from its first chunk to the end of the op. _bwd_rows_torch walks the vocabulary in
# blocks of ``rows`` rows (outer) and the tokens in chunks (inner), from the lse saved in forward:
# block v's logits zT_v = W_v hcᵀ (+ b_v) give dz_v, then dW_v = Σ_chunks dz_v hc is complete
# (over every token) when the block ends, and dh = Σ_v dz_vᵀ W_v accumulates over the blocks. Each
# block's dW_v is computed into its own (rows, H) buffer and handed to ``take_rows(v0, v1, dW_v)``
# when given (slimgrad.step_in_backward updates those rows of the parameter and frees the buffer:
# only one block of dW is alive), else straight into its rows of the full dW. Both ways run the
# same arithmetic, so the bits do not depend on who takes the rows. W_v is read for dh before
# take_rows is called, and no later block reads it. dh cannot share storage with h when there is
# more than one block (every block reads all of h): ``dh_out`` must not alias h then.
# Full precision only (dh accumulates in h's dtype). Memory: one block of logits (rows x tokens)
# instead of chunk x V, and with take_rows one block of dW (rows x H) instead of V x H.
# ``tokens`` (the inner chunk) is the largest that holds no more logits than forward's chunk did
# (chunk x V), at most N: a block is then one pass over all tokens at the usual sizes (GPT-2
# small 4x256: 37 blocks of 1365 rows x 1024 tokens, where chunks of 256 tokens made 148
# block-chunk pairs). Each block-chunk pair issues a fixed handful of ops (NOTE [Whole-chunk ops]).


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
    rows = max(rows, 1)
    # NOTE: no more logits than forward's
    tokens = max(1, min(n, max(chunk, chunk * v // rows)))
    blocks = -(-v // rows)
    # the targets' smoothed one-hot by blocks (NOTE [Whole-chunk ops]): token i adds eps - 1 in
    # block t_i // rows, at row t_i mod rows; other blocks add ±0 there. safe_t is this function's
    # own: it becomes that row in place.
    blk = torch.div(safe_t, rows, rounding_mode="floor")
    index = safe_t.remainder_(rows)
    add = torch.empty(n, dtype=acc, device=h.device)  # block k's indicator (or one-hot values)
    adds = _split(add, tokens)
    hcs = _split(h, tokens)
    hts = [hc.t() for hc in hcs]
    lses = _split(lse[None], tokens, 1)
    scales = _split(scale[None], tokens, 1)
    # dh's chunks transposed: dhᵀ += W_vᵀ dz_v is the GEMM that dh += dz_vᵀ W_v runs (same bits),
    # with W_vᵀ a view made once instead of dz_vᵀ one per block
    dhts = [dc.t() for dc in _split(dh, tokens)] if need_dh else None
    wvs = _split(weight, rows)
    wts = _split(weight.t(), rows, 1) if need_dh else None
    bvs = _split(bias[:, None], rows) if bias is not None else (None,) * blocks
    dbs = _split(db, rows) if need_db else None
    dws = _split(dw, rows) if dw is not None else None
    # NOTE [One logits buffer for the vocabulary blocks]: without take_rows nothing runs between two
    # blocks, so every block's logits go into one buffer of the first block's size (r0 x c0,
    # allocated where the first block's own would be, freed after the last: the same bytes at every
    # moment), viewed (r, c) for each block and chunk shape (the last block and chunk may be
    # shorter). Token i's one-hot entry is at flat position (t_i mod rows) · c + its column in the
    # chunk's first r0 x c elements: inside the block's (r, c) view where t_i is in the block;
    # where it is not, a position that gets ±0 (or one past a short last block's view, unread).
    # One index_add_ with alpha = eps - 1 adds the block's 0/1 indicator there: the values
    # (block == k) · (eps - 1) the scatter added, one op fewer per block. The flat positions are
    # written into index in place, before the buffer is allocated (each chunk's arange is no
    # larger than the buffer, r0 >= 2). With take_rows, the sink runs between blocks and may
    # allocate: each block's logits are freed before it, as before, and the one-hot is scattered
    # (rows clamped into a shorter last block); so it is with one row per block (r0 = 1).
    r0, c0 = wvs[0].shape[0], hcs[0].shape[0]
    buffered = take_rows is None and r0 > 1
    if buffered:
        fidx = _split(index, tokens)
        for hc, ic in zip(hcs, fidx, strict=True):
            torch.add(torch.arange(hc.shape[0], device=h.device), ic, alpha=hc.shape[0], out=ic)
        zbuf = torch.empty(r0 * c0, dtype=acc, device=h.device)
        flats = {c0: zbuf}  # chunk width -> its r0 x c elements, flat
        for hc in hcs[1:]:
            flats[hc.shape[0]] = zbuf[: r0 * hc.shape[0]]
        views = {}  # (r, c) -> a block's logits
        alpha = eps - 1.0
    else:
        idx = _split(index[None], tokens, 1)
        adds2 = _split(add[None], tokens, 1)
    transform = lscale != 1.0 or cap is not None  # NOTE [Logit transforms]
    for k, (wv, bv) in enumerate(zip(wvs, bvs, strict=True)):
        r = wv.shape[0]
        v0, v1 = k * rows, k * rows + r
        torch.eq(blk, k, out=add)  # 1 in the block, else 0
        if not buffered:
            add.mul_(eps - 1.0)  # eps - 1 in the block, else (-)0
            if k == blocks - 1 and k and r < rows:
                index.clamp_max_(r - 1)
        if dws is not None:
            gw = dws[k]
        elif need_dw:  # its own buffer, handed to take_rows
            gw = torch.empty((r, h.shape[1]), dtype=acc, device=h.device)
        else:
            gw = None
        for j, hc in enumerate(hcs):
            if buffered:
                c = hc.shape[0]
                try:
                    zv = views[r, c]
                except KeyError:
                    zv = views[r, c] = (zbuf if r == r0 and c == c0 else zbuf[: r * c]).view(r, c)
                zt = torch.mm(wv, hts[j], out=zv)
            else:
                zt = torch.mm(wv, hts[j])
            if bv is not None:
                zt += bv
            if transform:
                zt, th = _transform_(zt, lscale, cap, True)  # zT stays in its buffer
            # zT becomes dzT in place: softmax, minus the smoothed one-hot (_dlogits_), times s_i
            zt.sub_(lses[j]).exp_()
            if eps:
                zt.sub_(eps / v)
            if buffered:
                flats[c].index_add_(0, fidx[j], adds[j], alpha=alpha)
            else:
                zt.scatter_add_(0, idx[j], adds2[j])
            if transform:
                zt = _transform_grad_(zt, th, lscale)
                del th
            zt.mul_(scales[j])
            if need_db:
                dbs[k].add_(zt.sum(1))
            if need_dw:
                if j == 0:
                    torch.mm(zt, hc, out=gw)
                else:
                    gw.addmm_(zt, hc)
            if need_dh:
                if k == 0:
                    torch.mm(wts[k], zt, out=dhts[j])
                else:
                    dhts[j].addmm_(wts[k], zt)
            del zt
        if need_dw and take_rows is not None:
            take_rows(v0, v1, gw)
        del gw
    return dh, dw, db


# NOTE [One block, one chunk]
# At small shapes (tiny models, short sequences: V <= ``rows`` and N <= ``chunk``) the backward by
# vocabulary blocks is one block of one chunk, and its set-up (each token's block and row, the
# flat one-hot positions, a shared logits buffer, a dozen splits) costs more host time and ops
# than the block itself. _bwd_one_torch is that single block written straight: the same ops on
# the same values in the same order as _bwd_rows_torch's one iteration (logits, bias, transform,
# softmax, -eps/V, the one-hot, the transform's gradient, s_i, db, dW, then dh), so the same bits
# (tests/ops/test_linear_cross_entropy_blocks.py compares them). The one-hot is one scatter of
# the scalar eps - 1 at each token's target row of its own column (each column gets one add, so
# no two adds meet): x + (eps - 1), as the indicator times alpha = eps - 1 added there. The
# caller passes safe_t (ignored tokens at class 0), which it has from its own mask. The one chunk
# of _fwd_torch and _fwd_grad_torch likewise takes its views without the splits and the zip.


def _bwd_one_torch(
    h, weight, bias, safe_t, lse, scale, eps, need, dh_out=None, lscale=1.0, cap=None,
    take_rows=None,
):  # fmt: skip
    """:func:`_bwd_rows_torch` when one block holds the vocabulary and one chunk the tokens
    (NOTE [One block, one chunk]): (dh, dW, db), dW None when ``take_rows`` took it."""
    v = weight.shape[0]
    need_dh, need_dw, need_db = need
    zt = torch.mm(weight, h.t())
    if bias is not None:
        zt += bias[:, None]
    transform = lscale != 1.0 or cap is not None  # NOTE [Logit transforms]
    if transform:
        zt, th = _transform_(zt, lscale, cap, True)
    zt.sub_(lse[None]).exp_()
    if eps:
        zt.sub_(eps / v)
    zt.scatter_(0, safe_t[None], eps - 1.0, reduce="add")
    if transform:
        zt = _transform_grad_(zt, th, lscale)
        del th
    zt.mul_(scale[None])
    db = None
    if need_db:
        db = torch.zeros(v, dtype=zt.dtype, device=h.device)
        db.add_(zt.sum(1))
    dw = torch.mm(zt, h) if need_dw else None
    dh = None
    if need_dh:
        # dhᵀ = Wᵀ dz, the GEMM _bwd_rows_torch runs; after dW, which reads h (dh may alias it)
        dh = dh_out if dh_out is not None else torch.empty_like(h)
        torch.mm(weight.t(), zt, out=dh.t())
    del zt
    if dw is not None and take_rows is not None:
        take_rows(0, v, dw)
        dw = None
    return dh, dw, db


# NOTE [The fused loss traced under torch.compile]
# Compiled, the loss is :func:`_loss_traced`: plain differentiable ops per chunk (z = hc Wᵀ + b,
# chunk x V, the logit transform, torch.logsumexp over the vocabulary, the smoothing term) and the
# target's logit as the dot product of its weight row with the hidden (N x H work in forward and
# backward: gathered from the logits, its backward was a zero chunk x V buffer and a scatter),
# called inside a non-reentrant checkpoint (``recompute_in_backward`` in slimgrad/_compile.py).
# Autograd differentiates them, inductor fuses forward's and backward's elementwise work and
# reductions around the matmuls, and the checkpoint tags every value made inside "recompute": the
# min-cut partitioner keeps only the checkpoint's inputs (hidden, weight, bias, target) and makes
# each chunk's logits again in backward, so no chunk x V value is kept (NOTE [slimgrad ops under
# torch.compile] in slimgrad/_compile.py). The same matmuls as the
# uncompiled recompute path (forward's, backward's recompute and the two gradient matmuls), with
# no custom op and no eager chunk ops in the step; the lse is recomputed rather than kept (4
# B/token less). The same sums as _fwd_torch in another order: within the error rule. Not the
# V x chunk layout of NOTE [Logits as V x chunk]: inductor's CPU kernels reduce along a row far
# faster than down a column (the loss alone at 512 tokens, H 128, V 2048, fwd + bwd, 1 thread:
# 1.13x the eager chunk path with zT and a reduction over dim 0, 1.02x with z).


def _loss_traced(h, weight, bias, target, ignore_index, eps, chunk, reduction, scale, cap):
    """The loss from plain differentiable ops, chunk by chunk (NOTE [The fused loss traced under
    torch.compile]): per-token (``'none'``, target's flat shape) or reduced, in the accumulation
    dtype. h: (N, H), weight (V, H), bias: one dtype; target: (N,) int64."""
    v = weight.shape[0]
    acc = _acc_dtype(h.dtype)
    valid = target != ignore_index
    safe_t = torch.where(valid, target, 0)
    # the target's logit from its weight row (N x H work, and N x H in backward), not gathered
    # from z (whose backward is a zero chunk x V buffer and a scatter)
    zs = (weight.index_select(0, safe_t).to(acc) * h.to(acc)).sum(1)
    if bias is not None:
        zs = zs + bias.index_select(0, safe_t).to(acc)
    wt = weight.t()
    losses = []
    for hc, z_t in zip(_split(h, chunk), _split(zs, chunk), strict=True):
        # chunk x V, reduced over its rows (NOTE [The fused loss traced under torch.compile])
        z = torch.mm(hc, wt) if bias is None else torch.addmm(bias, hc, wt)
        if z.dtype != acc:
            z = z.to(acc)
        if scale != 1.0:
            z, z_t = z * scale, z_t * scale
        if cap is not None:
            z, z_t = torch.tanh(z / cap) * cap, torch.tanh(z_t / cap) * cap
        lse = torch.logsumexp(z, 1)
        if eps:
            losses.append(lse - (1.0 - eps) * z_t - (eps / v) * z.sum(1))
        else:
            losses.append(lse - z_t)
    loss = losses[0] if len(losses) == 1 else torch.cat(losses)
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


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
    ignored, safe_t = _targets(target, ignore_index)
    need_dh, need_dw, need_db = need
    loss = torch.empty(n, dtype=acc, device=h.device)
    # dh contiguous whatever h's strides
    if need_dh:
        dh = dh_out if dh_out is not None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    else:
        dh = None
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=h.device) if need_db else None
    bcol = bias[:, None] if bias is not None else None
    add = torch.full((1, n), eps - 1.0, dtype=acc, device=h.device)  # the smoothed one-hot
    if n <= chunk:  # one chunk: the views without the splits (NOTE [One block, one chunk])
        parts = ((h, safe_t[None], scale[None], scale[:, None], loss[None], add, dh),)
    else:
        parts = zip(
            _split(h, chunk),
            _split(safe_t[None], chunk, 1),
            _split(scale[None], chunk, 1),  # s_i per column of zT
            _split(scale[:, None], chunk),  # s_i per row of hc / dh
            _split(loss[None], chunk, 1),
            _split(add, chunk, 1),
            _split(dh, chunk) if need_dh else _nones(n, chunk),
            strict=True,
        )
    for hc, tc, row, col, lc, ac, dc in parts:
        zt, th = _transform_(_logits_t(hc, weight, bcol, acc), lscale, cap, True)
        lse = torch.logsumexp(zt, dim=0, keepdim=True)
        li = lse - (1.0 - eps) * zt.gather(0, tc)
        if eps:
            li = li - (eps / v) * zt.sum(0, keepdim=True)
        lc.copy_(li)
        del li
        # zT becomes dzT in place: softmax minus the smoothed one-hot (times s_i in low precision)
        zt = _dlogits_(zt, th, lse, tc, ac, eps, v, lscale)
        del th
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
            torch.mm(zt.to(h.dtype).t(), weight, out=dc)
            if full:
                dc.mul_(col)
        del zt
    loss.masked_fill_(ignored, 0)
    return loss, dh, dw, db

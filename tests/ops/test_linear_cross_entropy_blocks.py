"""The fused loss's backward by vocabulary blocks walks all tokens of a block in one pass when
that holds no more logits than forward's chunk (NOTE [Head gradient by vocabulary blocks] in
slimgrad/_math/linear_cross_entropy.py): O(blocks) ops, not O(blocks x chunks); a fixed handful
of ops per block or chunk with the bits of slice-by-slice loops (NOTE [Whole-chunk ops])."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad._math import linear_cross_entropy as _math
from slimgrad.ops.linear_cross_entropy import linear_cross_entropy
from slimgrad.testing import OpObserver

lce_ops = importlib.import_module("slimgrad.ops.linear_cross_entropy")
MM = {"aten.mm.default", "aten.mm.out", "aten.addmm.default", "aten.addmm_.default"}


class _Matmuls(TorchDispatchMode):
    # stores no result: ops keep their own paths under it (NOTE [The fused loss under a mode
    # that stores results] in slimgrad/ops/linear_cross_entropy.py)
    _slimgrad_reads_ops = True

    def __init__(self) -> None:
        super().__init__()
        self.outs: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in MM:
            self.outs.append(tuple(out.shape))
        return out


def _case(n=64, h=8, v=97, bias=True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[::7] = -100
    return hidden, weight, b, target


def _backward_matmuls(monkeypatch, rows, chunk, **kw):
    monkeypatch.setattr(lce_ops, "vocab_block_rows", lambda hidden_size: rows)
    hidden, weight, bias, target = _case(**kw)
    loss = linear_cross_entropy(hidden, weight, target, bias=bias, chunk_size=chunk)
    with _Matmuls() as mm:
        loss.backward()
    want = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(hidden, weight, bias), target
    )
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    grads = torch.autograd.grad(want, inputs)
    assert_close(loss, want)
    for t, ref in zip(inputs, grads, strict=True):
        assert_close(t.grad, ref)
    return mm.outs


@pytest.mark.parametrize("bias", [True, False])
def test_one_pass_per_block(monkeypatch, bias):
    # V = 97 in blocks of 20 rows: 5 blocks; chunk 16 x V = 1552 logits >= 20 rows x 64 tokens,
    # so each block is one pass: its logits, dW rows and dh, 3 matmuls (chunks of 16: 4 x 3)
    outs = _backward_matmuls(monkeypatch, rows=20, chunk=16, bias=bias)
    assert len(outs) == 5 * 3
    logits = [s for s in outs if 8 not in s]  # dW rows (., H = 8) and dh, transposed (H, .)
    assert logits == [(20, 64)] * 4 + [(17, 64)]


def test_small_chunk_keeps_its_memory_bound(monkeypatch):
    # chunk 4 x V = 388 logits < 90 rows x 64 tokens: the block walks tokens in 4s and no matmul
    # output holds more logits than forward's chunk did
    outs = _backward_matmuls(monkeypatch, rows=90, chunk=4)
    logits = [s for s in outs if 8 not in s]
    assert max(a * b for a, b in logits) <= 4 * 97
    assert len(outs) == 2 * 16 * 3  # 2 blocks x 16 chunks x 3 matmuls


# NOTE [Whole-chunk ops]: the loops issue a fixed number of ops per chunk (per vocabulary block in
# the row-wise backward), none per token; and the same bits as slice-by-slice loops.


class _Ops(OpObserver):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def see(self, func, args, kwargs) -> None:
        self.n += 1


def _ops(fn):
    with _Ops() as c:
        fn()
    return c.n


@pytest.mark.parametrize("bias, per_block, five_blocks", [(False, 8, 73), (True, 11, 93)])
def test_backward_ops_per_vocabulary_block(monkeypatch, bias, per_block, five_blocks):
    # each block: where its targets are, logits (into the one buffer), softmax (2), one-hot (one
    # index_add_), s_i, dW rows, dh (+ the bias, and db's sum and add), exactly; before: ~25,
    # slicing and rebuilding the one-hot per block, then 9 (12 with the bias), the one-hot's
    # values made per block and scattered (NOTE [One logits buffer for the vocabulary blocks])
    def backward_ops(rows):
        monkeypatch.setattr(lce_ops, "vocab_block_rows", lambda hidden_size: rows)
        hidden, weight, b, target = _case(bias=bias)
        linear_cross_entropy(hidden, weight, target, bias=b).backward()  # one-time set-up
        loss = linear_cross_entropy(hidden, weight, target, bias=b)
        return _ops(loss.backward)

    few, many = backward_ops(20), backward_ops(5)  # 5 and 20 blocks of V = 97, last short
    assert (many - few) / 15 == per_block
    assert few == five_blocks


def test_forward_ops_per_chunk():
    # each chunk: logits (2), target logit (2), logsumexp in place (8), loss; before: ~21
    hidden, weight, _, target = _case()
    with torch.no_grad():
        linear_cross_entropy(hidden, weight, target)  # one-time set-up
        a = _ops(lambda: linear_cross_entropy(hidden, weight, target, chunk_size=16))
        b = _ops(lambda: linear_cross_entropy(hidden, weight, target, chunk_size=4))
    assert (b - a) / 12 <= 14  # 4 and 16 chunks


def _rows_by_slices(h, w, b, t, lse, scale, ignore, eps, chunk, rows, need, lscale, cap, take):
    # the row-wise backward one block and one chunk at a time by slices, the one-hot rebuilt for
    # each block, each dW block copied into dW: the reference the whole-chunk loops must match
    v, n = w.shape[0], h.shape[0]
    safe = torch.where(t != ignore, t, 0)
    dh = torch.empty_like(h) if need[0] else None
    dw = torch.empty_like(w) if need[1] and take is None else None
    db = torch.zeros(v, dtype=h.dtype) if need[2] else None
    tokens = min(n, max(chunk, chunk * v // rows))
    for v0 in range(0, v, rows):
        v1 = min(v0 + rows, v)
        local = safe - v0
        inside = (local >= 0) & (local < v1 - v0)
        add = torch.zeros((1, n), dtype=h.dtype).masked_fill_(inside[None], eps - 1.0)
        index = torch.where(inside, local, 0)[None]
        gw = torch.empty((v1 - v0, h.shape[1]), dtype=h.dtype) if need[1] else None
        for s in range(0, n, tokens):
            e = min(s + tokens, n)
            hc = h[s:e]
            zt = torch.mm(w[v0:v1], hc.t())
            if b is not None:
                zt += b[v0:v1, None]
            th = None
            if lscale != 1.0:
                zt.mul_(lscale)
            if cap is not None:
                th = zt.div_(cap).tanh_()
                zt = th * cap
            zt.sub_(lse[None, s:e]).exp_()
            if eps:
                zt.sub_(eps / v)
            zt.scatter_add_(0, index[:, s:e], add[:, s:e])
            if th is not None:
                zt.mul_(th.mul_(th).neg_().add_(1.0))
            if lscale != 1.0:
                zt.mul_(lscale)
            zt.mul_(scale[None, s:e])
            if need[2]:
                db[v0:v1] += zt.sum(1)
            if need[1]:
                if s == 0:
                    torch.mm(zt, hc, out=gw)
                else:
                    gw.addmm_(zt, hc)
            if need[0]:
                if v0 == 0:
                    torch.mm(zt.t(), w[v0:v1], out=dh[s:e])
                else:
                    dh[s:e].addmm_(zt.t(), w[v0:v1])
        if need[1]:
            if take is not None:
                take(v0, v1, gw)
            else:
                dw[v0:v1] = gw
    return dh, dw, db


def _taker(blocks):
    # a take_rows that keeps a copy of every block it is handed
    return lambda v0, v1, gw: blocks.append((v0, v1, gw.clone()))


def _bitwise(a, b):
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps, tf", [(0.0, (1.0, None)), (0.1, (0.5, 3.0))])
@pytest.mark.parametrize("rows, chunk", [(20, 16), (7, 4), (97, 4), (200, 1000)])
@pytest.mark.parametrize("sink", [False, True])
def test_whole_chunk_row_backward_has_the_slice_by_slice_bits(dtype, bias, eps, tf, rows, chunk,
                                                               sink):  # fmt: skip
    g = torch.Generator().manual_seed(rows + chunk)
    n, hs, v = 37, 8, 97
    h = torch.randn(n, hs, generator=g, dtype=torch.float64).to(dtype) * 2
    w = torch.randn(v, hs, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    t[1] = v - 1  # a target in the (short) last block
    lse = _math._fwd_torch(h, w, b, t, -100, eps, chunk, *tf)[1]
    scale = torch.rand(n, generator=g, dtype=torch.float64).to(dtype).masked_fill_(t == -100, 0)
    for need in [(True, True, bias), (True, False, False), (False, True, bias)]:
        taken = {"new": [], "ref": []}
        got = _math._bwd_rows_torch(
            h, w, b, t, lse, scale, -100, eps, chunk, rows, need, None, *tf,
            take_rows=_taker(taken["new"]) if sink else None,
        )  # fmt: skip
        want = _rows_by_slices(
            h, w, b, t, lse, scale, -100, eps, chunk, rows, need, *tf,
            _taker(taken["ref"]) if sink else None,
        )  # fmt: skip
        for x, y in zip(got, want, strict=True):
            assert _bitwise(x, y)
        assert [x[:2] for x in taken["new"]] == [x[:2] for x in taken["ref"]]
        for x, y in zip(taken["new"], taken["ref"], strict=True):
            assert _bitwise(x[2], y[2])


# NOTE [One block, one chunk]: the single block written straight has the bits of the general loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps, tf", [(0.0, (1.0, None)), (0.1, (0.5, 3.0)), (0.3, (1.0, 2.0))])
@pytest.mark.parametrize("sink", [False, True])
def test_one_block_one_chunk_has_the_row_backward_bits(dtype, bias, eps, tf, sink):
    g = torch.Generator().manual_seed(7)
    n, hs, v = 37, 8, 97
    h = torch.randn(n, hs, generator=g, dtype=torch.float64).to(dtype) * 2
    w = torch.randn(v, hs, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    t[1], t[2] = v - 1, 0
    lse = _math._fwd_torch(h, w, b, t, -100, eps, n, *tf)[1]
    scale = torch.rand(n, generator=g, dtype=torch.float64).to(dtype).masked_fill_(t == -100, 0)
    scale[3] = -scale[3]  # a negative weight: signed zeros where it meets a zero
    safe = torch.where(t != -100, t, 0)
    for need in [(True, True, bias), (True, False, False), (False, True, bias)]:
        taken = {"new": [], "ref": []}
        for rows in (v, 4 * v):
            got = _math._bwd_one_torch(
                h, w, b, safe, lse, scale, eps, need, None, *tf,
                take_rows=_taker(taken["new"]) if sink else None,
            )  # fmt: skip
            want = _math._bwd_rows_torch(
                h, w, b, t, lse, scale, -100, eps, n, rows, need, None, *tf,
                take_rows=_taker(taken["ref"]) if sink else None,
            )  # fmt: skip
            for x, y in zip(got, want, strict=True):
                assert _bitwise(x, y)
        assert [x[:2] for x in taken["new"]] == [x[:2] for x in taken["ref"]]
        for x, y in zip(taken["new"], taken["ref"], strict=True):
            assert _bitwise(x[2], y[2])


def test_one_block_one_chunk_dh_may_overwrite_hidden():
    # dh_out aliasing h (the saved hidden the op's backward may be granted): h is read by both
    # matmuls before dh's rows are written
    g = torch.Generator().manual_seed(3)
    n, hs, v = 16, 8, 50
    h = torch.randn(n, hs, generator=g)
    w = torch.randn(v, hs, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    lse = _math._fwd_torch(h, w, None, t, -100, 0.0, n)[1]
    scale = torch.full((n,), 1.0 / n)
    want = _math._bwd_one_torch(h, w, None, t, lse, scale, 0.0, (True, True, False))
    alias = h.clone()
    got = _math._bwd_one_torch(alias, w, None, t, lse, scale, 0.0, (True, True, False), alias)
    assert got[0] is alias
    assert _bitwise(got[0], want[0]) and _bitwise(got[1], want[1])

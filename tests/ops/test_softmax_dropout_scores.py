"""``scores_softmax_dropout_matmul``: P recomputed in backward, eager's bits, q/k/v + bits kept.

NOTE [Attention probabilities recomputed in backward] in ``slimgrad/ops/softmax_dropout.py``.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.softmax_dropout import scores_softmax_dropout_matmul
from slimgrad.testing import OpObserver


def _eager(q, kt, v, p, causal=False, mask=None, matmul_dtype=None):
    # SDPA's math path after the scaling: S = q @ k^T, -inf where masked, safe softmax, dropout
    s = q @ kt
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    probs = torch.ops.aten._safe_softmax(s, -1)
    dropped = F.dropout(probs, p, True)
    mm = matmul_dtype or v.dtype
    return dropped.to(mm) @ v.to(mm)


def _run(fn, q, kt, v, g, seed=3, need=(True, True, True), **kw):
    leaves = [t.clone().requires_grad_(r) for t, r in zip((q, kt, v), need)]
    torch.manual_seed(seed)
    y = fn(*leaves, **kw)
    y.backward(g)
    return [y.detach(), *(t.grad for t in leaves)]


def _inputs(b, h, tq, tk, d, dtype, v_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h, tk, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, tk, 5, generator=gen, dtype=torch.float64).to(v_dtype or dtype)
    return q, k.mT, v


def _pad(b, tq, tk):
    keep = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    keep[0, :, :, :2] = False  # left padding
    keep[-1, :, 0, :] = False  # a row that sees nothing
    return keep


@pytest.mark.parametrize(
    "dtype,v_dtype", [(torch.float32, None), (torch.float64, None), (torch.float32, torch.bfloat16)]
)
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("kind", ["none", "causal", "mask", "mask_causal"])
@pytest.mark.parametrize("tq,tk", [(7, 7), (13, 3)])
def test_matches_eager_bit_for_bit(dtype, v_dtype, p, kind, tq, tk):
    q, kt, v = _inputs(2, 3, tq, tk, 8, dtype, v_dtype)
    kw = dict(p=p, causal="causal" in kind, mask=_pad(2, tq, tk) if "mask" in kind else None)
    if v_dtype is not None:
        kw["matmul_dtype"] = dtype
    g = torch.linspace(-1, 1, 2 * 3 * tq * 5, dtype=dtype).view(2, 3, tq, 5)
    ours = _run(scores_softmax_dropout_matmul, q, kt, v, g, **kw)
    ref = _run(_eager, q, kt, v, g, **kw)
    for o, r in zip(ours, ref):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True)])
def test_needs_input_grad_subsets(need):
    q, kt, v = _inputs(1, 2, 6, 6, 4, torch.float32)
    g = torch.randn(1, 2, 6, 5)
    ours = _run(scores_softmax_dropout_matmul, q, kt, v, g, need=need, p=0.2, causal=True)
    ref = _run(_eager, q, kt, v, g, need=need, p=0.2, causal=True)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_gradcheck(p):
    q, kt, v = (t.requires_grad_() for t in _inputs(1, 2, 4, 5, 3, torch.float64))
    mask = _pad(1, 4, 5)
    mask[0, :, 0, :] = True  # gradcheck's finite differences need every row alive

    def f(q, kt, v):
        torch.manual_seed(11)
        return scores_softmax_dropout_matmul(q, kt, v, p, mask=mask)

    assert torch.autograd.gradcheck(f, (q, kt, v))


def test_memory_contract_nothing_t_by_t():
    # saved: q, k_t and value as given (no copy) + 1 bit per score + the bool mask; eager: also
    # P, the noise and the dropped P (float32, T x T each)
    b, h, t, d = 2, 4, 32, 8
    q, kt, v = (x.requires_grad_() for x in _inputs(b, h, t, t, d, torch.float32))
    mask = _pad(b, t, t)
    saved = {}
    for fn in (scores_softmax_dropout_matmul, _eager):
        torch.manual_seed(0)
        m = measure(lambda fn=fn: fn(q, kt, v, 0.1, mask=mask).sum())
        saved[fn] = (m.saved_bytes, m.saved_input_bytes)
    scores = b * h * t * t
    assert saved[scores_softmax_dropout_matmul][0] == scores // 8
    assert saved[scores_softmax_dropout_matmul][1] == (q.numel() + kt.numel() + v.numel()) * 4 + (
        mask.numel()
    )
    assert saved[_eager][0] >= 3 * scores * 4


def test_retain_graph_second_backward_and_no_grad():
    q, kt, v = (x.requires_grad_() for x in _inputs(1, 2, 5, 5, 4, torch.float32))
    torch.manual_seed(1)
    y = scores_softmax_dropout_matmul(q, kt, v, 0.3, causal=True)
    y.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in (q, kt, v)]
    for t in (q, kt, v):
        t.grad = None
    y.sum().backward()
    for a, t in zip(first, (q, kt, v)):
        torch.testing.assert_close(t.grad, a, rtol=0, atol=0)
    with torch.no_grad():
        torch.manual_seed(1)
        z = scores_softmax_dropout_matmul(q, kt, v, 0.3, causal=True)
    torch.testing.assert_close(z, y.detach(), rtol=0, atol=0)


def test_inplace_on_saved_query_raises():
    q, kt, v = _inputs(1, 2, 5, 5, 4, torch.float32)
    leaf = q.clone().requires_grad_()
    q2 = leaf * 1.0
    y = scores_softmax_dropout_matmul(q2, kt, v.requires_grad_(), 0.2)
    q2.add_(1.0)  # P would be recomputed from a changed q: autograd must refuse
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_create_graph_raises_clear_error():
    q, kt, v = (x.requires_grad_() for x in _inputs(1, 1, 3, 3, 2, torch.float64))
    y = scores_softmax_dropout_matmul(q, kt, v, 0.2)
    (gq,) = torch.autograd.grad(y.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.ops.scores_softmax_dropout_matmul"):
        gq.sum().backward()


def test_errors():
    q, kt, v = _inputs(1, 2, 3, 3, 4, torch.float32)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        scores_softmax_dropout_matmul(q, kt, v, 0.1, mask=torch.zeros(1, 1, 3, 3))
    with pytest.raises(TypeError, match="one dtype"):
        scores_softmax_dropout_matmul(q, kt.double(), v, 0.1)
    with pytest.raises(ValueError, match="broadcast"):
        scores_softmax_dropout_matmul(q, kt, v, 0.1, mask=torch.ones(1, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError):
        scores_softmax_dropout_matmul(q, kt, v, 1.5)


# NOTE [Attention matmuls as bmm]: the op's products reshape to bmm without torch.matmul's expands.


class _OpNames(OpObserver):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def see(self, func, args, kwargs) -> None:
        self.counts[str(func)] += 1


@pytest.mark.parametrize("causal", [False, True])
def test_ops_per_call_hf_layout(causal):
    # HF's layout: q, k and v are (B, T, H, d) views transposed to (B, H, T, d), so q and the
    # incoming gradient do not fold into (B·H, T, d) (a copy each), k_t does. Forward 12 (+3 for
    # the causal mask), backward 36 (+3): S again, dV, dD, dS, dq, dk. Before: 16 and 46 (two
    # expands per torch.matmul, two casts to the dtype the tensors already had).
    gen = torch.Generator().manual_seed(0)

    def leaf(shape):
        x = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=gen)
        return x.transpose(1, 2).detach().requires_grad_()

    q, k, v = leaf((2, 3, 8, 4)), leaf((2, 3, 8, 4)), leaf((2, 3, 8, 5))
    kt = k.mT
    g = torch.randn(2, 8, 3, 5, generator=gen).transpose(1, 2)
    scores_softmax_dropout_matmul(q, kt, v, 0.1, causal=causal).backward(g)  # one-time set-up
    with _OpNames() as fwd:
        y = scores_softmax_dropout_matmul(q, kt, v, 0.1, causal=causal)
    with _OpNames() as bwd:
        y.backward(g)
    extra = 3 if causal else 0
    assert "aten.expand.default" not in fwd.counts | bwd.counts
    assert fwd.counts["aten.bmm.default"] + fwd.counts["aten.matmul.default"] == 2
    assert bwd.counts["aten.bmm.default"] == 5
    assert (fwd.counts.total(), bwd.counts.total()) == (12 + extra, 36 + extra)

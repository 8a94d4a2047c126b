"""The scores op's custom ops on HF GPT-2's compiled operands (NOTE [The compiled attention's
products folded] in ``slimgrad/ops/softmax_dropout.py``): the same outputs, bits and gradients as
the general implementation, bit for bit and stride for stride, in fewer ATen ops.

The operands are laid out as a compiled converted HF GPT-2 hands them over (recorded from
``benchmarks/compile_step.py``'s model): q and k^T strided views of a (B, T, H, d) buffer whose
batch dims do not fold, v contiguous, dO laid out as q.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import slimgrad.ops.softmax_dropout as sd

FWD = torch.ops.slimgrad.scores_softmax_dropout_matmul.default
BWD = torch.ops.slimgrad.scores_softmax_dropout_matmul_bwd.default


def _operands(b, h, t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.empty_strided((b, h, t, d), (t * h * d, d, h * d, 1))
    q.copy_(torch.randn(b, h, t, d, generator=g))
    k_t = torch.empty_strided((b, h, d, t), (t * h * d, d, 1, h * d))
    k_t.copy_(torch.randn(b, h, d, t, generator=g))
    v = torch.randn(b, h, t, d, generator=g)
    d_out = torch.empty_strided((b, h, t, d), (t * h * d, d, h * d, 1))
    d_out.copy_(torch.randn(b, h, t, d, generator=g))
    return q, k_t, v, d_out


def _step(q, k_t, v, d_out, p, causal, needs=(True, True, True)):
    torch.manual_seed(7)
    with torch.no_grad():
        out, bits = FWD(q, k_t, v, p, torch.float32, causal, None)
        grads = BWD(d_out, q, k_t, v, bits, None, p, torch.float32, causal, False, list(needs))
    return (out, bits, *grads)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 4, 64, 16), (1, 3, 17, 5), (3, 2, 9, 8)])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
def test_folded_is_the_general_path_bit_for_bit(monkeypatch, shape, causal, p, needs):
    ops = _operands(*shape)
    got = _step(*ops, p, causal, needs)
    monkeypatch.setattr(sd, "_folds", lambda *a: False)  # the general implementation
    want = _step(*ops, p, causal, needs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.numel():
            assert g.stride() == w.stride()
        assert torch.equal(g, w)


def test_not_folded_where_batch_dims_differ():
    # broadcast batch dims: the general implementation (sum_to_size of dv, torch.matmul)
    q, k_t, v, _ = _operands(2, 4, 8, 4)
    assert not sd._folds(q, k_t[:1], v, torch.float32)
    assert not sd._folds(q, k_t, v.double(), torch.float32)
    assert not sd._folds(q, k_t, v, torch.float64)
    assert sd._folds(q, k_t, v, torch.float32)


def _aten_ops(fn) -> int:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name.startswith("aten::") for e in prof.events())


def test_fewer_aten_ops_per_layer():
    # a compiled GPT-2 layer's attention (tiny bench shape, causal, p = 0.1): forward and
    # backward custom ops together took 138 ATen ops; folded 108
    ops = _operands(2, 4, 64, 16)
    n = _aten_ops(lambda: _step(*ops, 0.1, True))
    assert n <= 108, n
    counts = collections.Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(*ops, 0.1, True)
    counts.update(e.name for e in prof.events())
    assert counts["aten::triu_"] == 0  # the causal mask is the kept one

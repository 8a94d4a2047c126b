"""The fused loss's backward by vocabulary blocks walks all tokens of a block in one pass when
that holds no more logits than forward's chunk (NOTE [Head gradient by vocabulary blocks] in
slimgrad/_math/linear_cross_entropy.py): O(blocks) ops, not O(blocks x chunks)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad.ops.linear_cross_entropy import linear_cross_entropy

lce_ops = importlib.import_module("slimgrad.ops.linear_cross_entropy")
MM = {"aten.mm.default", "aten.mm.out", "aten.addmm.default", "aten.addmm_.default"}


class _Matmuls(TorchDispatchMode):
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
    logits = [s for s in outs if s[1] != 8]  # dW rows and dh are (., H = 8)
    assert logits == [(20, 64)] * 4 + [(17, 64)]


def test_small_chunk_keeps_its_memory_bound(monkeypatch):
    # chunk 4 x V = 388 logits < 90 rows x 64 tokens: the block walks tokens in 4s and no matmul
    # output holds more logits than forward's chunk did
    outs = _backward_matmuls(monkeypatch, rows=90, chunk=4)
    logits = [s for s in outs if s[1] != 8]
    assert max(a * b for a, b in logits) <= 4 * 97
    assert len(outs) == 2 * 16 * 3  # 2 blocks x 16 chunks x 3 matmuls

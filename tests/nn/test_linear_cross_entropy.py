"""slimgrad.nn.LinearCrossEntropyLoss against nn.CrossEntropyLoss on an nn.Linear head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimgrad.nn.linear_cross_entropy import LinearCrossEntropyLoss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_from_torch_matches_eager(reduction):
    torch.manual_seed(1)
    head = nn.Linear(13, 41)
    ce = nn.CrossEntropyLoss(ignore_index=3, reduction=reduction, label_smoothing=0.05)
    fused = LinearCrossEntropyLoss.from_torch(ce, chunk_size=5)
    h = torch.randn(2, 9, 13)
    t = torch.randint(0, 41, (2, 9))
    t[0, 0] = 3
    grads = []
    for fn in ("eager", "fused"):
        head.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_()
        if fn == "eager":
            out = ce(head(x).reshape(-1, 41), t.reshape(-1))
            out = out.reshape(t.shape) if reduction == "none" else out
        else:
            out = fused(x, head.weight, t, head.bias)
        out.sum().backward()
        grads.append((out.detach(), x.grad, head.weight.grad, head.bias.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a)


def test_state_dict_and_repr_like_torch():
    fused = LinearCrossEntropyLoss.from_torch(nn.CrossEntropyLoss())
    assert list(fused.state_dict()) == []
    assert list(fused.parameters()) == []
    assert "reduction='mean'" in repr(fused)


def test_errors():
    with pytest.raises(ValueError, match="slimgrad.nn.LinearCrossEntropyLoss: unknown reduction"):
        LinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing out of range"):
        LinearCrossEntropyLoss(label_smoothing=-0.1)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        LinearCrossEntropyLoss(chunk_size=0)
    with pytest.raises(NotImplementedError, match="class weights are not supported"):
        LinearCrossEntropyLoss.from_torch(nn.CrossEntropyLoss(weight=torch.ones(3)))
    with pytest.raises(TypeError, match="expected nn.CrossEntropyLoss"):
        LinearCrossEntropyLoss.from_torch(nn.NLLLoss())

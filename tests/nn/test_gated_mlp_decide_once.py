"""NOTE [The gated MLP's general-path decision, once per facts] (slimgrad/nn/gated_mlp.py): off
the straight path the lean-or-eager decision runs once per tuple of the facts it reads, and again
when one changes; the module computes what it computed when it decided per call."""

from __future__ import annotations

import pytest
import torch

import slimgrad
import slimgrad.nn.gated_mlp as ngm
from slimgrad.nn.gated_mlp import GatedMLP
from tests._counting import count_calls


def _mlp(d=16, i=48):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(d), GatedMLP(d, i))
    slimgrad.convert_(m)
    return m


def _run(m, x, dtype=torch.bfloat16):
    with torch.autocast("cpu", dtype=dtype):
        y = m(x)
    grads = torch.autograd.grad(
        y.float().square().sum(), [t for t in (x, *m.parameters()) if t.requires_grad]
    )
    return y.detach(), grads


def test_decided_once_per_facts(monkeypatch):
    m = _mlp()
    n = count_calls(monkeypatch, ngm, "lean_wins")
    x = torch.randn(2, 7, 16, requires_grad=True)
    for _ in range(3):
        _run(m, x)
    assert n[0] == 1  # once per call before
    _run(m, x, torch.float16)  # autocast's dtype
    assert n[0] == 2
    _run(m, torch.randn(2, 9, 16, requires_grad=True))  # x's shape
    assert n[0] == 3
    m[1].up_proj.weight.requires_grad_(False)  # a weight's gradient flag
    _run(m, torch.randn(2, 9, 16, requires_grad=True))
    assert n[0] == 4
    m[1].up_proj.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m[1](torch.randn(2, 9, 16, requires_grad=True))  # a leaf x
    assert n[0] == 5


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_same_values_as_deciding_per_call(tokens, monkeypatch):
    m = _mlp()
    x = torch.randn(1, tokens, 16, requires_grad=True)
    y, g = _run(m, x)
    y2, g2 = _run(m, x)  # the stored decision

    real = GatedMLP._general_lean_of

    def per_call(self, *a):
        self.__dict__["_general_key"] = None
        return real(self, *a)

    monkeypatch.setattr(GatedMLP, "_general_lean_of", per_call)
    y3, g3 = _run(m, x)
    for a, b in ((y, y2), (y, y3), *zip(g, g2, strict=True), *zip(g, g3, strict=True)):
        assert torch.equal(a, b)

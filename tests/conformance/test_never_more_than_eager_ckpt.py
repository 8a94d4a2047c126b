"""Issue 30 inside checkpoint regions: Conv-BN-ReLU blocks under a reentrant checkpoint peak at no
more than eager, with gradients equal to eager's.

The reentrant recompute keeps the region's outputs r = relu(b) alive through the region's
backward; the derived record of r (NOTE [Derived saved inputs] in ops/_derived.py) held b past
the BatchNorm's backward, one activation above eager's peak in the conv's backward (4x32x16x16:
954,376 B against eager's 918,024; NOTE [Dropped at b's backward]).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import measure


def _model(c: int, act: str) -> nn.Sequential:
    torch.manual_seed(c)

    def blk():
        a = nn.ReLU(inplace=True) if act == "relu" else nn.SiLU()
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), a)

    return nn.Sequential(nn.Conv2d(3, c, 1), blk(), blk(), nn.Conv2d(c, 4, 1))


def _step(model, x, w):
    h = model[0](x)
    for b in (model[1], model[2]):
        h = checkpoint(b, h, use_reentrant=True)
    return (model[-1](h) * w).sum()


@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize("n,c,s", [(2, 8, 6), (4, 32, 16)])
def test_reentrant_checkpoint_of_conv_bn_act_blocks_peaks_at_most_eager(n, c, s, act):
    eager = _model(c, act)
    slim = copy.deepcopy(eager)
    slimgrad.convert_(slim)
    torch.manual_seed(1)
    x = torch.randn(n, 3, s, s, requires_grad=True)
    w = torch.randn(n, 4, s, s)
    for m in (eager, slim):  # warm-up (steady state)
        _step(m, x, w).backward()
    se = measure(lambda: _step(eager, x, w), module=eager, timeline=False)
    ss = measure(lambda: _step(slim, x, w), module=slim, timeline=False)
    assert ss.peak_bytes <= se.peak_bytes, (ss.peak_bytes, se.peak_bytes, ss.peak_op)
    for m in (eager, slim):
        m.zero_grad(set_to_none=True)
    x.grad = None
    _step(eager, x, w).backward()
    ge = [p.grad.clone() for p in eager.parameters()] + [x.grad.clone()]
    x.grad = None
    _step(slim, x, w).backward()
    gs = [p.grad for p in slim.parameters()] + [x.grad]
    for a, b in zip(ge, gs):
        # BatchNorm's backward from its output: eager's values to float32 rounding
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)

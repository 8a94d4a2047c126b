"""Issue 30 class 7, round 34b: left-overs under checkpoints, each saving and peaking no higher than
eager, with ``slimgrad.memory.estimate`` giving the tracker's bytes.

- Hardsigmoid whose input is recomputed just before its backward (a non-reentrant checkpoint): the
  backward held its stand-in input and dx apart, the bits above eager's peak (NOTE [Hardsigmoid's
  stand-in is dx's buffer] in slimgrad/ops/hardsigmoid.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import estimate, measure


def _step(m, x, reentrant):
    return lambda: checkpoint(m, x, use_reentrant=reentrant).square().sum()


def _bytes(forward, m):
    for _ in range(2):  # steady state
        forward().backward()
    m.zero_grad(set_to_none=True)
    r = measure(forward, timeline=False)
    return r.saved_bytes, r.peak_bytes


def _estimate(make):
    fwd, m = make()
    fwd().backward()
    m.zero_grad(set_to_none=True)
    r = estimate(make, timeline=False)
    return r.saved_bytes, r.peak_bytes


def test_hardsigmoid_recomputed_by_a_checkpoint():
    # in place: eager's own hardsigmoid_ keeps a clone of x, recomputed just before its backward
    def make(convert=True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 64), nn.Hardsigmoid(inplace=True), nn.Linear(64, 16))
        m = slimgrad.convert_(m) if convert else m
        x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        return _step(m, x, False), m

    eager = _bytes(*make(False))
    slim = _bytes(*make())
    assert slim[0] <= eager[0] and slim[1] <= eager[1], (slim, eager)
    assert _estimate(make) == slim

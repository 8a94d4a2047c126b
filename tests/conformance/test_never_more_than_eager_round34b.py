"""Issue 30 class 7, round 34b: left-overs under checkpoints, each saving and peaking no higher than
eager, with ``slimgrad.memory.estimate`` giving the tracker's bytes.

- Hardsigmoid whose input is recomputed just before its backward (a non-reentrant checkpoint): the
  backward held its stand-in input and dx apart, the bits above eager's peak (NOTE [Hardsigmoid's
  stand-in is dx's buffer] in slimgrad/ops/hardsigmoid.py).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

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


_C = 8


def _abn_models(act):
    from slimgrad.nn import InPlaceABN

    torch.manual_seed(0)

    def block():
        a = nn.LeakyReLU(0.01, inplace=True) if act == "leaky_relu" else nn.ELU(inplace=True)
        return nn.Sequential(nn.BatchNorm2d(_C), a, nn.Conv2d(_C, _C, 3, padding=1, bias=False))

    eager = nn.Sequential(nn.Conv2d(3, _C, 1), block(), block(), nn.Conv2d(_C, 4, 1))
    with torch.no_grad():
        for b in (eager[1], eager[2]):
            b[0].weight[:2] = 0.0  # two channels InPlaceABN cannot rebuild from its output
    slim = copy.deepcopy(eager)
    for b in (slim[1], slim[2]):
        param = 0.01 if act == "leaky_relu" else 1.0
        abn = InPlaceABN(_C, activation=act, activation_param=param)
        abn.load_state_dict(b[0].state_dict())
        b[0], b[1] = abn, nn.Identity()
    return eager, slimgrad.convert_(slim)


@pytest.mark.parametrize("act,reentrant", [("leaky_relu", False), ("elu", False), ("elu", True)])
def test_inplace_abn_first_in_a_checkpointed_region(act, reentrant):
    models = _abn_models(act)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(2, 4, 6, 6)
    out = []
    for m in models:

        def forward(m=m):
            h = m[0](x)
            for b in (m[1], m[2]):
                h = checkpoint(b, h, use_reentrant=reentrant)
            return (m[3](h) * w).sum()

        for _ in range(2):  # steady state
            forward().backward()
        r = measure(forward, module=m, timeline=False)
        x.grad = None
        m.zero_grad(set_to_none=True)
        forward().backward()
        grads = [t.grad.clone() for t in (*m.parameters(), x)]
        out.append(((r.saved_bytes, r.peak_bytes), grads))
    (eager, eager_grads), (slim, slim_grads) = out
    assert slim[0] <= eager[0] and slim[1] <= eager[1], (slim, eager)
    for a, b in zip(eager_grads, slim_grads):
        torch.testing.assert_close(b, a)


def _save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def test_linear_under_autocast_and_a_policy_saving_every_op():
    def make(convert=True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        m = slimgrad.convert_(m) if convert else m
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        ctx = functools.partial(create_selective_checkpoint_contexts, _save_all)

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = checkpoint(m, x, use_reentrant=False, context_fn=ctx)
                return y.float().square().sum()

        return forward, m

    eager = _bytes(*make(False))
    slim = _bytes(*make())
    assert slim[0] <= eager[0] and slim[1] <= eager[1], (slim, eager)
    assert _estimate(make) == slim

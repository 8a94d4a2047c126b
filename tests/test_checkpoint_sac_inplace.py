"""Issue 30 class 7 under selective activation checkpointing: a policy that saves every
non-pointwise op (and recomputes the pointwise ones) runs the converted model wherever it runs
eager's. slimgrad's in-place smooth activations wrote y into x by a ``copy_`` the policy saved, and
Hardsigmoid packed its side bits into an ``aten.empty`` buffer the policy saved: both were written
after the policy stored them, and the recompute raised "Tensor cached during selective activation
checkpoint has been mutated" where eager's single pointwise op ran (NOTE [No write into a buffer a
policy may cache] in slimgrad/ops/_derived.py). Gradients by the error rule against a float64 copy
of the eager model under the same checkpointing."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts as sac

import slimgrad
from slimgrad.testing import assert_within_rule
from tests._threads import one_thread_each_test  # noqa: F401 - autouse fixture


def _save_non_pointwise(ctx, op, *args, **kwargs):
    if torch.Tag.pointwise in op.tags:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


class _Mul1(nn.Module):
    # a pointwise producer (as a residual add): its output is recomputed, not saved
    def forward(self, x):
        return x * 1


# (activation, in place, width, bf16 autocast): 37 * 256 * 8 = 75,776 elements, more than
# Hardsigmoid's 65,536 per chunk; 2 * 37 * 64 = 4,736 elements, one chunk
ROWS = [
    (nn.SiLU, True, 256, False),
    (nn.Hardsigmoid, True, 256, False),
    (nn.Hardsigmoid, False, 64, False),
    (nn.SiLU, True, 64, True),
]


@pytest.mark.parametrize("act,inplace,width,bf16", ROWS)
def test_inplace_activation_after_pointwise_producer_runs_as_eager(act, inplace, width, bf16):
    torch.manual_seed(0)
    n = 8 if width == 256 else 2
    eager = nn.Sequential(nn.Linear(16, width), _Mul1(), act(inplace=inplace), nn.Linear(width, 8))
    slim = slimgrad.convert_(copy.deepcopy(eager))
    ref = copy.deepcopy(eager).double()
    x = torch.randn(n, 37, 16)
    grads = []
    for m in (eager, slim, ref):
        xx = x.to(next(m.parameters()).dtype).requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16 and m is not ref):
            y = checkpoint(
                m, xx, use_reentrant=False, context_fn=functools.partial(sac, _save_non_pointwise)
            )
        y.float().square().sum().backward()
        grads.append([p.grad for p in m.parameters()] + [xx.grad])
    assert_within_rule(grads[1], grads[2], grads[0])

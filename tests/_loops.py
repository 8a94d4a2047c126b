"""Training loops shared by the test files that step a converted model beside eager PyTorch."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn

import slimgrad
from slimgrad.testing import assert_within_rule


# NOTE [Lean, eager and float64, stepped together]: the three copies are made from one model, the
# inputs drawn after the conversion (the order the tests drew them in before they shared this).
# Between steps every parameter of each copy moves by the same amount (0.05 * (its index + 1)), a
# visible write: a converted op's decisions made per parameter version at one step must be made
# again at the next, and a gradient wrong only from the second step on fails.
def assert_steps_within_rule(
    eager: nn.Module,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    *,
    hooks: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    steps: int = 3,
) -> None:
    """Step a converted copy of ``eager``, ``eager`` itself and a float64 copy ``steps`` times on
    ``(model(x) * w).sum()``, each backward under ``hooks()``; every parameter gradient of every
    step is within the error rule (``assert_within_rule``, names ``"step <i> <parameter>"``)."""
    ref = copy.deepcopy(eager).double()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(x_shape)
    w = torch.randn(w_shape)
    for step in range(steps):
        grads = []
        for m, dt in ((lean, torch.float32), (eager, torch.float32), (ref, torch.float64)):
            m.zero_grad(set_to_none=True)
            with hooks():
                (m(x.to(dt)) * w.to(dt)).sum().backward()
            grads.append([p.grad for p in m.parameters()])
        names = [f"step {step} {n}" for n, _ in lean.named_parameters()]
        assert_within_rule(grads[0], grads[2], grads[1], names=names)
        for m in (lean, eager, ref):  # a parameter change: the next step's decisions differ
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.add_(0.05 * (i + 1))


def save_ops(*ops) -> Callable:
    """A selective-checkpoint policy that saves the outputs of ``ops`` and recomputes the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy

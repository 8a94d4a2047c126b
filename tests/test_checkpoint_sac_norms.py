"""Issue 33: converted LayerNorm, RMSNorm and GroupNorm under torch's selective activation
checkpointing (non-reentrant ``checkpoint`` with a ``create_selective_checkpoint_contexts`` policy).
The fallback-channel search runs at the first call of each parameter version; the recompute inside
backward takes the cached answer. Before NOTE [A search the modes never see] (slimgrad/_math/
norms.py) SAC recorded the search's ops in the forward and handed them to the recompute's ops of
the same name: CheckpointError (different metadata), "Autograd not support dtype: Long", or a layer
scale |s| given the search's |gamma|, from every step's first forward."""

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
from slimgrad.testing import assert_within_rule
from tests._loops import save_ops as _save

_A = torch.ops.aten


def _save_all(ctx, op, *args, **kwargs):
    # every op saved but those that write and eager RMSNorm's mean, to which it adds eps in place
    # (a cached output that is mutated is refused, for eager as well)
    if op._schema.is_mutable or op is _A.mean.dim:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


POLICIES = {
    "save_all": _save_all,
    "save_abs": _save(_A.abs.default),
    "save_matmuls": _save(_A.mm.default, _A.addmm.default),
}

D = 16


def _norm(kind: str) -> nn.Module:
    if kind == "layer_norm":
        return nn.LayerNorm(D)
    if kind == "rms_norm":
        return nn.RMSNorm(D)
    return nn.GroupNorm(2, D)  # over (N, D, L): groups of 8 * L values


class _Net(nn.Module):
    # norm -> Linear (over the last dim) inside the checkpoint, then a layer scale |s| the shape
    # of gamma (what a recorded abs(gamma) of the search would be handed to)
    def __init__(self, kind: str, policy: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = _norm(kind)
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.linspace(-2.0, 2.0, D))
        self.policy = POLICIES[policy]
        with torch.no_grad():
            if self.norm.weight is not None:
                self.norm.weight.uniform_(0.5, 1.5)
            if getattr(self.norm, "bias", None) is not None:
                self.norm.bias.uniform_(-0.2, 0.2)

    def _f(self, x):
        y = self.lin(self.norm(x))
        if self.kind == "group_norm":  # (N, D, L): the scale over channels
            return y * self.scale.abs().view(1, -1, 1)
        return y * self.scale.abs()

    def forward(self, x):
        ctx = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self._f, x, use_reentrant=False, context_fn=ctx)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
def test_norms_under_selective_checkpointing_every_step(kind, policy):
    torch.manual_seed(0)
    eager = _Net(kind, policy).train()
    ref = copy.deepcopy(eager).double()
    lean = copy.deepcopy(eager)
    slimgrad.convert_(lean)
    assert type(lean.norm) is not type(eager.norm)  # the norm was converted
    x = torch.randn(2, D, D) if kind == "group_norm" else torch.randn(2, 5, D)
    w = torch.randn_like(x)
    for step in range(3):  # each step a new parameter version: its first forward searches
        grads = []
        for m, dt in ((lean, torch.float32), (eager, torch.float32), (ref, torch.float64)):
            m.zero_grad(set_to_none=True)
            (m(x.to(dt)) * w.to(dt)).sum().backward()
            grads.append([p.grad for p in m.parameters()])
        names = [f"step {step} {n}" for n, _ in lean.named_parameters()]
        assert_within_rule(grads[0], grads[2], grads[1], names=names)
        for m in (lean, eager, ref):  # an optimizer-like step: new versions
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.mul_(1.0 + 0.01 * (i + 1))

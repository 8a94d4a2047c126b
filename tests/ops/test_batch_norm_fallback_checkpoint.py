"""Issue 33: a BatchNorm with channels kept from x (|β| > |γ|/2, a tiny γ: fallback channels) and
without, under torch's selective activation checkpointing and plain non-reentrant checkpointing.
The channel search runs at the first call of each parameter version; the recompute inside backward
takes the cached answer. Under selective checkpointing the search's ops were recorded with the
forward's and handed to the recompute's ops of the same name (NOTE [A channel search no mode sees]
in ops/batch_norm.py): a layer scale's |s| after the block got |γ| (gradients off by 72, silently)
and a full-size abs/mul/lt raised CheckpointError, from the second step on."""

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


def _save_all_but_mutating(ctx, op, *args, **kwargs):
    # every op saved but those that write (BatchNorm's running statistics: a cached output that is
    # mutated is refused, for eager as well)
    if op._schema.is_mutable or "batch_norm" in str(op):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


POLICIES = {
    "plain": None,  # non-reentrant checkpoint without a context_fn
    "save_abs": _save(_A.abs.default),
    "save_pointwise": _save(
        _A.abs.default, _A.mul.Tensor, _A.lt.Scalar, _A.silu.default, _A.index_select.default
    ),
    "save_all_but_mutating": _save_all_but_mutating,
}


class _Net(nn.Module):
    # Conv -> BN -> SiLU -> Conv inside the checkpoint, then a tail: a layer scale |s| (per channel,
    # the shape of γ) or full-size pointwise ops
    def __init__(self, policy: str, tail: str, bad: tuple) -> None:
        super().__init__()
        self.blk = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 1)
        )
        self.scale = nn.Parameter(torch.linspace(-2.0, 2.0, 8))
        self.policy, self.tail = POLICIES[policy], tail
        bn = self.blk[1]
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
            for i, c in enumerate(bad):  # channels kept from x (NOTE [Few values per channel]'s
                if i % 2:  # tests: 72 values per channel here, more than 32)
                    bn.weight[c] = 1e-30
                else:
                    bn.bias[c] = 3.0

    def _f(self, x):
        y = self.blk(x)
        if self.tail == "layer_scale":
            return y * self.scale.abs().view(1, -1, 1, 1)
        return (y * 1.5).abs() + y.lt(0).to(y.dtype) * self.scale.view(1, -1, 1, 1)

    def forward(self, x):
        if self.policy is None:
            return checkpoint(self._f, x, use_reentrant=False)
        ctx = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self._f, x, use_reentrant=False, context_fn=ctx)


@pytest.mark.parametrize("bad", [(), (1,), (1, 5)], ids=["none", "one", "two"])
@pytest.mark.parametrize("tail", ["layer_scale", "pointwise"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_fallback_channels_under_checkpointing_every_step(policy, tail, bad):
    torch.manual_seed(0)
    eager = _Net(policy, tail, bad).train()
    ref = copy.deepcopy(eager).double()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(2, 8, 6, 6)
    w = torch.randn(2, 8, 6, 6)
    for step in range(3):  # from the second step on the norm keeps b (a new weight version)
        grads = []
        for m, dt in ((lean, torch.float32), (eager, torch.float32), (ref, torch.float64)):
            m.zero_grad(set_to_none=True)
            (m(x.to(dt)) * w.to(dt)).sum().backward()
            grads.append([p.grad for p in m.parameters()])
        names = [f"step {step} {n}" for n, _ in lean.named_parameters()]
        assert_within_rule(grads[0], grads[2], grads[1], names=names)
        for m in (lean, eager, ref):  # an optimizer step: the next call searches again
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.mul_(1.0 + 0.01 * (i + 1))


def test_the_search_issues_no_op_a_dispatch_mode_sees():
    # the first call of a parameter version searches, the next takes the cache: both issue the
    # same aten ops under a mode (what selective checkpointing's forward and recompute record)
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    m = slimgrad.convert_(_Net("plain", "pointwise", (1,)).blk.train())
    x = torch.randn(2, 8, 6, 6)
    seen = []
    for _ in range(2):
        with torch.no_grad():
            m[1].weight.mul_(1.0)  # a new version: the first call below searches
        for _ in range(2):
            with _Ops() as mode:
                y = m(x)
            seen.append(mode.ops)
            y.sum().backward()
    assert seen[0] == seen[1] == seen[2] == seen[3]


@pytest.mark.parametrize("bad", [(), (1,)], ids=["none", "one"])
def test_inplace_abn_side_channels_under_selective_checkpointing(bad):
    # In-Place ABN searches its side channels per parameter version through the same cache
    # (NOTE [A channel search no mode sees]); before, its abs(γ) reached the layer scale's abs in
    # the recompute: gradients off by 62 from the first step
    torch.manual_seed(0)
    eager = _Net("save_abs", "layer_scale", bad).train()
    eager.blk[2] = nn.LeakyReLU(0.01)
    ref = copy.deepcopy(eager).double()
    lean = slimgrad.convert_(copy.deepcopy(eager), slimgrad.ConvertConfig(inplace_abn=True))
    assert any(new == "InPlaceABN" for _, _, new in slimgrad.report(lean).converted)
    x = torch.randn(2, 8, 6, 6)
    w = torch.randn(2, 8, 6, 6)
    for step in range(3):
        grads = []
        for m, dt in ((lean, torch.float32), (eager, torch.float32), (ref, torch.float64)):
            m.zero_grad(set_to_none=True)
            (m(x.to(dt)) * w.to(dt)).sum().backward()
            grads.append([p.grad for p in m.parameters()])
        names = [f"step {step} {n}" for n, _ in lean.named_parameters()]
        assert_within_rule(grads[0], grads[2], grads[1], names=names)
        for m in (lean, eager, ref):
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.mul_(1.0 + 0.01 * (i + 1))

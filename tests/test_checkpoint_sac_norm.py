"""torch's selective activation checkpointing around Conv -> BatchNorm -> activation (NOTE [The
same ops under selective checkpointing] in ops/batch_norm.py): the recompute issues no aten op
more often than the forward did, so every step's backward runs and its gradients are within the
error rule of eager's. Before, the second step's backward raised "aten.clone.default encountered
during backward but not found in storage" under any policy."""

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from tests._loops import assert_steps_within_rule

ACTS = {"silu": nn.SiLU, "hardswish": nn.Hardswish, "gelu": nn.GELU}
POLICIES = {
    "recompute": lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE,
    "save_conv": lambda ctx, op, *a, **k: (
        CheckpointPolicy.MUST_SAVE
        if op is torch.ops.aten.convolution.default
        else CheckpointPolicy.PREFER_RECOMPUTE
    ),
}


class _Net(nn.Module):
    def __init__(self, act: str, policy: str) -> None:
        super().__init__()
        self.blk = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), ACTS[act]())
        self.policy = POLICIES[policy]

    def forward(self, x):
        ctx = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self.blk, x, use_reentrant=False, context_fn=ctx)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("act", list(ACTS))
def test_sac_around_conv_bn_act_every_step(act, policy):
    torch.manual_seed(0)
    assert_steps_within_rule(_Net(act, policy), (2, 8, 6, 6), (2, 8, 6, 6))

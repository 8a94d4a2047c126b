"""A BatchNorm -> activation -> conv block split at every place by a non-reentrant
torch.utils.checkpoint, stepped with and without user saved-tensor hooks (NOTE [A lookup across a
checkpoint boundary] in ops/_derived.py): every gradient of every step (the norms' per-version
decisions made at the earlier steps) is within the error rule of eager's, against a float64 eager
reference. Before, a conv inside the checkpoint reading a BatchNorm -> SiLU/GELU/Hardswish output
made outside it had c2.weight's gradient off by 4.57 (SiLU, save_on_cpu) from the second step on."""

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tests._loops import assert_steps_within_rule

ACTS = {"silu": nn.SiLU, "gelu": nn.GELU, "hardswish": nn.Hardswish, "relu": nn.ReLU}


class _Net(nn.Module):
    def __init__(self, act: str, split: str) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.a1 = ACTS[act]()
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.b2 = nn.BatchNorm2d(8)
        self.split = split

    def forward(self, x):
        def ck(fn, t):
            return checkpoint(fn, t, use_reentrant=False)

        s = self.split
        if s == "conv":  # BN and act outside, the conv reading their output inside
            y = ck(self.c2, self.a1(self.b1(self.c1(x))))
        elif s == "act_conv":  # BN outside, act and conv inside
            y = ck(lambda t: self.c2(self.a1(t)), self.b1(self.c1(x)))
        elif s == "bn_act_conv":  # the norm's input conv outside
            y = ck(lambda t: self.c2(self.a1(self.b1(t))), self.c1(x))
        elif s == "bn":  # only the norm inside
            y = self.c2(self.a1(ck(self.b1, self.c1(x))))
        elif s == "act":  # only the activation inside
            y = self.c2(ck(self.a1, self.b1(self.c1(x))))
        elif s == "front":  # conv, BN, act inside; the consumer conv outside
            y = self.c2(ck(lambda t: self.a1(self.b1(self.c1(t))), x))
        else:  # "conv_bn2": the consumer conv and the next norm inside
            y = ck(lambda t: self.b2(self.c2(t)), self.a1(self.b1(self.c1(x))))
        return self.b2(y) if s != "conv_bn2" else y


def _copy_pack(t):
    return t.clone()


HOOKS = {
    "none": contextlib.nullcontext,
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
    "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "copy": lambda: torch.autograd.graph.saved_tensors_hooks(_copy_pack, lambda t: t),
}


@contextlib.contextmanager
def _nested():
    with torch.autograd.graph.save_on_cpu():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            yield


HOOKS["nested"] = _nested


SPLITS = ["conv", "act_conv", "bn_act_conv", "bn", "act", "front", "conv_bn2"]


# every split under every hooks with SiLU; GELU and Hardswish (also lean outputs) at the splits
# that had the conv read across the boundary; ReLU (no derived output) as the control
CASES = (
    [("silu", s, h) for s in SPLITS for h in HOOKS]
    + [(a, s, h) for a in ("gelu", "hardswish") for s in ("conv", "conv_bn2") for h in HOOKS]
    + [("relu", s, "save_on_cpu") for s in SPLITS]
)


@pytest.mark.parametrize("act,split,hooks", CASES)
def test_checkpoint_split_matches_eager_every_step(act, split, hooks):
    torch.manual_seed(0)
    assert_steps_within_rule(_Net(act, split), (2, 3, 8, 8), (2, 8, 8, 8), hooks=HOOKS[hooks])

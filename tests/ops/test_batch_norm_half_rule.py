"""Conv -> BatchNorm -> ReLU under CPU autocast bf16 keeps the error rule on every gradient for
every seed: a mixed-precision BatchNorm (bf16 output, fp32 γ, β) keeps its input as eager does,
not its rounded output (x rebuilt from the bf16 output put dγ and the conv's dbias up to 1.7x past
the bound). bf16/fp16 models (no autocast) keep their input too (dγ from a 16-bit output broke
the rule on the op itself: tests/ops/test_bn_act_adversarial.py) and stay within the rule."""

import copy
import importlib

import pytest
import torch
from torch import nn

import slimgrad

sbn = importlib.import_module("slimgrad.ops.batch_norm")  # the module, not the function

SEEDS = 20


class _Net(nn.Module):
    def __init__(self, skip: bool):
        super().__init__()
        self.skip = skip
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=skip)
        self.conv2 = nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        return torch.cat([y, self.conv2(y)], 1) if self.skip else self.conv2(y)


def _failing_seeds(skip: bool, dtype: torch.dtype | None) -> list[int]:
    bad = []
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        m = _Net(skip)
        with torch.no_grad():
            m.bn.weight.uniform_(0.5, 1.5)
            m.bn.bias.uniform_(-0.2, 0.2)
        x = torch.randn(3, 3, 9, 11)
        if dtype is not None:  # a low-precision model, no autocast
            m, x = m.to(dtype), x.to(dtype)
        s = slimgrad.convert_(copy.deepcopy(m))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is None):
            r = slimgrad.verify(m, s, x, modes=("train",))
        if not r.ok:
            bad.append(seed)
    return bad


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "concat_skip"])
def test_autocast_conv_bn_relu_within_rule_every_seed(skip):
    assert _failing_seeds(skip, None) == []


def test_bf16_model_conv_bn_relu_within_rule_every_seed():
    # fp16 models: 0/40 seeds fail too (checked by hand; left out for the CI budget)
    assert _failing_seeds(True, torch.bfloat16) == []


def test_mixed_precision_keeps_input_half_model_keeps_input():
    # autocast: the BatchNorm keeps x (no _Source.keep_output); a bf16 model keeps x too (dγ from
    # the 16-bit b broke the rule on the op: tests/ops/test_bn_act_adversarial.py)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    w, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    for xd, pd, kept in [(torch.bfloat16, torch.float32, False), (torch.bfloat16,) * 2 + (False,)]:
        holder: list = []
        out = sbn._BatchNormFn.apply(
            x.to(xd), w.to(pd), b.to(pd), None, None, True, 0.1, 1e-5, holder, "never", False
        )
        assert sbn._Source(ctx=holder[0]).keep_output(out) is kept

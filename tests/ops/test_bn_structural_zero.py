"""A scalar bias whose gradient is 0 by structure, through a BatchNorm that keeps its output.

timm HGNetV2 adds a learnable scalar (LearnableAffineBlock: ``scale * x + bias``) after each
activation; where a 1x1 conv and a BatchNorm follow, the BatchNorm removes the constant the bias
adds to every position, so the bias's gradient is 0 in exact arithmetic. In float32 it is rounding
noise: the BatchNorm's dx summed over each channel, the conv's input gradient (a float32 matrix
product) and autograd's float32 sum of that gradient over every element (the broadcast bias's
``sum_to_size``). The error rule compares one draw of that noise against one draw of eager's: a
1-element gradient whose eager value happens to land on the float64 one (eager exactly 0.0 against
float64's -1.8e-15 in timm HGNetV2-B0, 8x3x64x64, seed 0) leaves a bound no other arithmetic can
meet. Measured in that model (seeds 0-5, the 102 lab biases that are 0 by structure): slimgrad's
BatchNorm (dx from its output) broke the 3x-eager bound on 8, a control that computes every
BatchNorm's dx in float64 from x itself and rounds it once (more accurate than eager) on 15;
median errors eager 2.19e-8, slimgrad 1.96e-8, control 2.24e-8. The noise itself is what these
tests pin: slimgrad's median error on such a bias over 24 seeds is no larger than eager's (here
0.44x-0.73x with the C kernel, 0.53x-0.60x on the PyTorch path). Checked to fail: dx through aten's
kernel on the output (mean' = mean(b), invstd' = 1/γ, weight' = γ² σ⁻¹, the 16-bit path) instead of
NOTE [dx from the output]'s coefficients put two of the three rows at 1.07x and 1.18x.
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch
import torch.nn as nn

import slimgrad
from tests._threads import one_thread

SEEDS = range(24)
C = 8  # channels


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _Lab(nn.Module):
    # timm's LearnableAffineBlock: a scalar scale and a scalar bias
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.bias


def _block(c: int, co: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c, c, 3, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        _Lab(),  # [3]: its bias is 0 by structure (1x1 conv, then BatchNorm)
        nn.Conv2d(c, co, 1, bias=False),
        nn.BatchNorm2d(co),
        nn.ReLU(),
        _Lab(),
        nn.Conv2d(co, co, 3, padding=1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(co, 10),
    )


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module]:
    # one conversion for every shape and seed (convert_ costs seconds, a step of this block
    # milliseconds): each seed's parameters are loaded into both, so the numbers are those of a
    # fresh model and conversion per seed
    m = _block(C, C)
    return m, slimgrad.convert_(copy.deepcopy(m))


def _errors(m: nn.Module, s: nn.Module, n: int, hw: int) -> list[tuple[float, float, bool]]:
    rows = []
    m64 = copy.deepcopy(m).double()
    for seed in SEEDS:
        torch.manual_seed(seed)
        fresh = _block(C, C)
        x = torch.randn(n, C, hw, hw)
        for mm in (m, s, m64):  # load_state_dict widens to m64's float64
            mm.load_state_dict(fresh.state_dict())
            mm.zero_grad(set_to_none=True)
        for mm, xx in ((m, x), (m64, x.double()), (s, x)):
            mm.train()
            out = mm(xx)
            nn.functional.cross_entropy(out, torch.arange(n) % 10).backward()
        ref = m64[3].bias.grad.item()
        eager, slim = m[3].bias.grad.item(), s[3].bias.grad.item()
        # whether the converted step differs from eager anywhere (the from-output path ran)
        differs = any(
            not torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), s.parameters())
        )
        rows.append((abs(eager - ref), abs(slim - ref), differs))
    return rows


@pytest.mark.parametrize("n,hw", [(4, 4), (8, 4), (8, 8)])  # 64, 128, 512 values per channel
def test_structural_zero_bias_noise_no_larger_than_eager(models, n, hw):
    rows = _errors(*models, n, hw)
    # the test exercises the BatchNorm that keeps its output (more than 32 values per channel:
    # NOTE [Few values per channel]), not eager's node
    assert any(r[2] for r in rows)
    med_eager = statistics.median(r[0] for r in rows)
    med_slim = statistics.median(r[1] for r in rows)
    assert med_slim <= med_eager, (med_slim, med_eager)

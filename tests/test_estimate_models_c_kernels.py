"""Under fake tensors, dropout, whose CPU C kernel keeps fewer temporaries than its PyTorch path,
allocates what the C kernel allocates, so ``memory.estimate`` models the real CPU step (NOTE
[Fake tensors model the C kernel] in slimgrad/ops/dropout.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.kernels import _backend
from slimgrad.memory import estimate, measure

pytestmark = pytest.mark.skipif(
    not _backend.cpu_kernel_would_run(torch.empty(1), "dropout"),
    reason="needs the CPU C kernels (a C compiler)",
)


def _pair(*acts):
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 128), *acts, nn.Linear(128, 16))
        m = slimgrad.convert_(m).train()
        x = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(1))
        return (lambda: m(x).square().sum()), m

    forward, model = make()
    forward().backward()  # warm-up: one-time tables stay out of the measured step
    for p in model.parameters():
        p.grad = None
    return measure(forward, module=model), estimate(make)


def test_dropout_estimate_is_the_real_cpu_step():
    real, est = _pair(nn.Dropout(0.1))
    # the PyTorch path's mask temporaries put the estimate at 663,552 B
    assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)

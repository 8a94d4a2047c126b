"""The smooth activations' C path (float32 CPU) with a gradient that is not contiguous.

A caller that transposes the activation's output before its next op (a conv feature extractor's
``GELU(conv(x)).transpose(1, 2)`` feeding a Linear, as in HF Wav2Vec2) hands backward a
non-contiguous gradient; the C backward reads g flat, so it declines and the PyTorch path runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.testing import assert_within_rule

ACTS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
    "mish": lambda: nn.Mish(),
}


class _ConvActT(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv, self.act, self.fc = nn.Conv1d(3, 8, 3), act, nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.act(self.conv(x)).transpose(1, 2))


def _grads(model, x):
    x = x.detach().clone().requires_grad_(True)
    model(x).square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(ACTS))
def test_transposed_output_trains_as_eager(name):
    torch.manual_seed(0)
    eager = _ConvActT(ACTS[name]())
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv.act).__module__.startswith("slimgrad."), type(conv.act)
    ref = copy.deepcopy(eager).double()
    x = torch.randn(2, 3, 40)
    assert_within_rule(_grads(conv, x), _grads(ref, x.double()), _grads(eager, x))


@pytest.mark.parametrize("name", sorted(ACTS))
def test_noncontiguous_gradient_bits_as_eager(name):
    # eager's own bits differ between a transposed and a contiguous g (strided vs vectorized
    # loops): the converted op matches eager's for each layout
    act = slimgrad.convert_(nn.Sequential(ACTS[name]()))[0]
    assert type(act).__module__.startswith("slimgrad."), type(act)
    eager = ACTS[name]()
    torch.manual_seed(0)
    x = torch.randn(2, 40, 8) * 4
    g = torch.randn(2, 8, 40).transpose(1, 2)  # not contiguous
    assert not g.is_contiguous()
    for grad in (g, g.contiguous()):
        out = []
        for m in (act, eager):
            xx = x.clone().requires_grad_(True)
            m(xx).backward(grad)
            out.append(xx.grad)
        assert torch.equal(out[0], out[1]), (name, grad.is_contiguous())

"""A gradient penalty (WGAN-GP / R1: ``autograd.grad(..., create_graph=True)``, then backward)
through a converted critic, one row per converted module type, at a few-element size (<= 512
elements at the op) and above it: every gradient within the error rule of eager's float64 result
(NOTE [Second derivatives] in slimgrad/_autograd.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.testing import assert_within_rule


class _LlamaRMSNorm(nn.Module):
    # transformers' LlamaRMSNorm forward (importing transformers would cost this file ~10 s; the
    # conversion of the real class is tests/test_convert_hf_rms_norm.py's)
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def _hf_converted(mod):
    from slimgrad.nn.rms_norm import HFRMSNorm

    out = HFRMSNorm(mod.weight.shape[0], eps=mod.variance_epsilon, variant="llama")
    out.weight = mod.weight
    return out


# name -> (module factory over the feature size d, converted class name)
MODS = {
    "rms_norm": (lambda d: nn.RMSNorm(d), "RMSNorm"),
    "rms_norm_no_affine": (lambda d: nn.RMSNorm(d, elementwise_affine=False), "RMSNorm"),
    "hf_rms_norm": (lambda d: _LlamaRMSNorm(d), "HFRMSNorm"),
    "layer_norm": (lambda d: nn.LayerNorm(d), "LayerNorm"),
    "group_norm": (lambda d: nn.GroupNorm(4, d), "GroupNorm"),
    "batch_norm": (lambda d: nn.BatchNorm1d(d), "BatchNorm1d"),
    "elu": (lambda d: nn.ELU(), "ELU"),
    "gelu": (lambda d: nn.GELU(), "GELU"),
    "gelu_tanh": (lambda d: nn.GELU("tanh"), "GELU"),
    "silu": (lambda d: nn.SiLU(), "SiLU"),
    "mish": (lambda d: nn.Mish(), "Mish"),
    "linear": (lambda d: nn.Linear(d, d), "Linear"),
}

# (rows, features): 512 elements at the op (the few-elements path) and 1,536 (past it)
SIZES = [(32, 16), (48, 32)]


def _critic(name, d):
    torch.manual_seed(0)
    mod = MODS[name][0](d)
    with torch.no_grad():  # weights away from 1 and 0, so that gamma's role is exercised
        for p in mod.parameters():
            if p.dim() == 1 and name != "linear":
                p.uniform_(0.5, 1.5)
    return nn.Sequential(nn.Linear(d, d), mod, nn.Linear(d, 1))


def _penalty_grads(model, x0):
    x = x0.to(next(model.parameters()).dtype).requires_grad_()
    (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    penalty = ((gx.flatten(1).norm(dim=1) - 1) ** 2).mean()
    inputs = [x, *model.parameters()]
    grads = torch.autograd.grad(penalty, inputs, allow_unused=True, materialize_grads=True)
    return list(grads)


# Past the few-elements path these keep y + branch bits + a table, which give f' but not f'':
# differentiating their gradient raises slimgrad's error (NOTE [Second derivatives]); strict, so a
# fix shows here
_REFUSED_PAST_FEW = {"gelu_tanh", "silu", "mish"}
ROWS = [
    pytest.param(
        name,
        shape,
        marks=[pytest.mark.xfail(raises=RuntimeError, strict=True)]
        if name in _REFUSED_PAST_FEW and shape[0] * shape[1] > 512
        else [],
        id=f"{name}-{shape[0]}x{shape[1]}",
    )
    for name in MODS
    for shape in SIZES
]


@pytest.mark.parametrize("name,shape", ROWS)
def test_gradient_penalty_matches_eager(name, shape):
    n, d = shape
    eager = _critic(name, d)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    if name == "hf_rms_norm":
        from slimgrad import _ext

        _ext.load()  # the C++ node where the extension builds (else the Python Function)
        slim[1] = _hf_converted(slim[1])
    x0 = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # a first call resolves the kernel backend: the second takes the straight path (for the
    # Llama RMSNorm with slimgrad's C++ extension, its C++ node)
    slim(x0.float().requires_grad_())
    assert type(slim[1]).__module__.startswith("slimgrad."), type(slim[1])
    assert type(slim[1]).__name__ == MODS[name][1]
    ref64 = _penalty_grads(copy.deepcopy(eager).double(), x0)
    eager32 = _penalty_grads(eager, x0)
    out = _penalty_grads(slim, x0)
    names = ["x"] + [k for k, _ in eager.named_parameters()]
    assert_within_rule(out, ref64, eager32, names=names)

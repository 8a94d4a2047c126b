"""The two rows every source-reading guard suite checks (tests/conformance/test_guard_*.py): a model
whose forward writes a LayerNorm's output keeps that norm eager and trains with eager's gradients;
one whose forward only reads it keeps the norm converted, within rounding of eager's gradients.
Each model has ``ln`` (LayerNorm(6)) and takes a (2, 3, 6) input."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import kept_reason


def step(m: nn.Module, x: torch.Tensor):
    """One step's loss and the gradients of the parameters that got one."""
    m.zero_grad(set_to_none=True)
    loss = m(x).square().sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def _pair(make: Callable[[], nn.Module]):
    torch.manual_seed(0)
    m = make()
    c = slimgrad.convert_(copy.deepcopy(m))
    x = torch.randn(2, 3, 6)
    return c, step(m, x), step(c, x)


def assert_write_keeps_norm_eager(make: Callable[[], nn.Module]) -> None:
    """The norm of the model ``make()`` builds is kept eager; the converted step runs
    (autograd's in-place error otherwise) with eager's loss and gradients."""
    c, (want_loss, want), (got_loss, got) = _pair(make)
    assert kept_reason(c.ln) is not None
    assert type(c.ln) is nn.LayerNorm
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def assert_read_keeps_norm_converted(make: Callable[[], nn.Module]) -> None:
    """The norm of the model ``make()`` builds is converted (not run eagerly per call) and the
    step is eager's within rounding."""
    c, (want_loss, want), (got_loss, got) = _pair(make)
    assert kept_reason(c.ln) is None
    assert type(c.ln) is not nn.LayerNorm
    assert not c.ln.handed_out
    torch.testing.assert_close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)  # (rounding)

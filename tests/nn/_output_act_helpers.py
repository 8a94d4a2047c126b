"""Shared checks for the activation modules (tests/nn/test_<stem>.py)."""

from __future__ import annotations

import inspect

import pytest
import torch


def check_module(slim_cls, torch_module: torch.nn.Module, scale: float = 2.0):
    """from_torch, class relationship, args/defaults, state_dict, forward and grads vs torch."""
    tcls = type(torch_module)
    assert issubclass(slim_cls, tcls)
    # same constructor args and defaults as torch (slimgrad may add keyword-only ones)
    tsig = inspect.signature(tcls.__init__).parameters
    ssig = inspect.signature(slim_cls.__init__).parameters
    for name, p in tsig.items():
        assert name in ssig and ssig[name].default == p.default
    assert repr(slim_cls()) == repr(tcls())
    m = slim_cls.from_torch(torch_module)
    assert isinstance(m, slim_cls) and repr(m) == repr(torch_module)
    assert list(m.state_dict()) == list(torch_module.state_dict())
    assert m.training == torch_module.training
    x0 = torch.randn(5, 7, 3) * scale
    res = []
    for mod in (m, torch_module):
        x = x0.clone().requires_grad_()
        y = mod(x * 1)
        (y * torch.arange(105.0).view(5, 7, 3) / 105).sum().backward()
        res.append((y.detach(), x.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b)
    return m


def check_wrong_type(slim_cls):
    with pytest.raises(TypeError, match=rf"slimgrad.nn.{slim_cls.__name__}.from_torch"):
        slim_cls.from_torch(torch.nn.Identity())

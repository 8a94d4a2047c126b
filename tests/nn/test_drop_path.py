"""slimgrad.nn.DropPath: timm's DropPath converted by instance, the same draws and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.nn.drop_path import DropPath
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


class _Res(nn.Module):
    def __init__(self, p, scale_by_keep=True):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.drop_path = timm.layers.DropPath(p, scale_by_keep=scale_by_keep)

    def forward(self, x):
        return x + self.drop_path(self.lin(x))


@pytest.mark.parametrize("p, scale", [(0.4, True), (0.4, False), (0.0, True)])
def test_converted_draws_and_gradients_are_timms(p, scale):
    torch.manual_seed(0)
    eager = _Res(p, scale)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    assert type(slim.drop_path) is DropPath, slimgrad.report(slim)
    assert repr(slim.drop_path) == repr(eager.drop_path)
    x = torch.randn(9, 5)
    for m in (eager, slim):
        torch.manual_seed(3)
        m.zero_grad()
        m.out = m(x)
        m.out.square().sum().backward()
        m.after = torch.rand(2)
    torch.testing.assert_close(slim.out, eager.out, rtol=0, atol=0)
    torch.testing.assert_close(slim.after, eager.after, rtol=0, atol=0)
    for a, b in zip(slim.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_eval_is_identity_and_from_torch_checks_the_type():
    m = DropPath.from_torch(timm.layers.DropPath(0.5)).eval()
    x = torch.randn(3, 2)
    assert m(x) is x
    with pytest.raises(TypeError, match="slimgrad.nn.DropPath.from_torch"):
        DropPath.from_torch(nn.Dropout(0.5))

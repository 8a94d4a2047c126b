"""Functions and probes shared by the ownership tests (tests/test_ownership*.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimgrad import ownership


@pytest.fixture(autouse=True)
def reuse_on(monkeypatch):
    """Reuse on for every test of a module that imports this fixture.

    These tests assert that reuse happens: a developer's ``SLIMGRAD_NO_REUSE=1`` must not leak in.
    """
    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)


def storage_use_count(t: torch.Tensor) -> int:
    """The use count of ``t``'s StorageImpl, read without making a storage object."""
    return torch._C._storage_Use_Count(torch._C._storage_address(t))


class ExpSaved(torch.autograd.Function):
    """y = exp(x) (returned as a copy); saves exp(x), writes dx = g * exp(x) into it when dead."""

    @staticmethod
    def forward(ctx, x):
        e = x.exp()
        ctx.save_for_backward(e)
        return e.clone()

    @staticmethod
    def backward(ctx, grad_out):
        ownership.check_not_consumed(ctx, "tests._ExpSaved")
        (e,) = ctx.saved_tensors
        buf = ownership.take_saved(ctx, e)
        if buf is not None:
            return buf.mul_(grad_out)
        return grad_out * e


class Double(torch.autograd.Function):
    """y = 2x; backward writes 2g into g when ``ownership.take`` grants it, else returns 2g anew.

    Each backward appends to ``Double.taken`` whether it was granted and to ``Double.uses`` the
    incoming gradient's storage use count after ``take`` (rebind or clear them before a run).
    """

    taken: list[bool] = []
    uses: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        buf = ownership.take(grad_out)
        Double.taken.append(buf is not None)
        Double.uses.append(storage_use_count(grad_out))
        if buf is not None:
            return buf.mul_(2)
        return grad_out * 2


class BasicBlock(nn.Module):
    """torchvision's BasicBlock shape with its two in-place ReLUs as two modules (each can be
    stated): conv, BatchNorm, ReLU, conv, BatchNorm, ``out += x``, ReLU. Converted, the ReLU after
    the first BatchNorm is asked whether it owns its input; the one after the residual is not."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu2(out)

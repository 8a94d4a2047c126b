"""Helpers shared by the tests of slimgrad.step_in_backward (tests/test_step_in_backward*.py):
bit-for-bit comparisons of a model's parameters and an optimizer's state, and ``Boom``, an error
raised in the middle of a backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.testing import assert_close


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    """Every parameter of ``b`` equals ``a``'s, in order, bit for bit (named after ``a``'s)."""
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def assert_same_state(expected: dict, got: dict) -> None:
    """Two optimizers' ``state_dict()["state"]``: the same parameters, the same entries for each,
    tensors bit for bit and every other value equal."""
    assert expected.keys() == got.keys()
    for k in expected:
        assert expected[k].keys() == got[k].keys()
        for name, v in expected[k].items():
            if torch.is_tensor(v):
                assert_close(got[k][name], v, rtol=0, atol=0)
            else:
                assert got[k][name] == v


class Boom(torch.autograd.Function):
    """Identity whose backward raises ``armed("simulated error in backward")`` once when
    ``Boom.armed`` is an exception class (it disarms itself), e.g. ``Boom.armed = RuntimeError``."""

    armed: type[BaseException] | None = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Boom.armed is not None:
            exc, Boom.armed = Boom.armed, None
            raise exc("simulated error in backward")
        return g

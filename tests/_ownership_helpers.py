"""Functions and probes shared by the ownership tests (tests/test_ownership*.py)."""

from __future__ import annotations

import torch

from slimgrad import ownership


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

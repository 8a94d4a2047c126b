"""A wrong gradient for the stand-ins of wrong converted models that verify must catch
(tests/test_verify.py, tests/test_verify_inputs_inference.py, tests/test_verify_layouts.py)."""

from __future__ import annotations

import torch


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A copy of ``x`` in forward; in backward the gradient arriving at it, times ``scale``."""
    return _ScaleGrad.apply(x, scale)

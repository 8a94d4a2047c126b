"""``slimgrad.nn.RMSNorm``: ``torch.nn.RMSNorm`` keeping its output (``ops/rms_norm.py``)."""

from __future__ import annotations

import torch

from slimgrad.ops.rms_norm import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same args, defaults, parameters, state_dict keys), memory-lean.

    Memory: fp32: saves the output (shared with the next layer), rstd (4 B/row), and the input
    columns of channels with weight 0; bf16/fp16: saves the input (2 B/elt) + 4 B/row; eager
    saves the input and x * rstd in fp32 (8 B/elt) + 4 B/row in every dtype.

    Example:
        >>> y = RMSNorm(8)(torch.randn(4, 8, requires_grad=True))
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    @classmethod
    def from_torch(cls, module: torch.nn.RMSNorm) -> RMSNorm:
        """A slimgrad RMSNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.RMSNorm):
            raise TypeError(
                f"slimgrad.nn.RMSNorm.from_torch: expected a torch.nn.RMSNorm, got "
                f"{type(module).__name__}. Pass an nn.RMSNorm instance."
            )
        new = cls(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
        new.weight = module.weight
        new.train(module.training)
        return new

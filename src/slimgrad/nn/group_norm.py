"""``slimgrad.nn.GroupNorm``: ``torch.nn.GroupNorm`` keeping its output (``ops/group_norm.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._script import NoScript
from slimgrad.ops.group_norm import group_norm

__all__ = ["GroupNorm"]


class GroupNorm(NoScript, torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` (same args, defaults, parameters, state_dict keys) saving its output.

    Memory: fp32: saves the output (shared with the next layer), mean and rstd per (sample, group),
    and the input of fallback channels (weight ~ 0); eager saves the input too. Shapes with few
    values per channel (where the backward would not fit in eager's bytes) and bf16/fp16 run
    eager's group_norm (saves the input, as eager: ``ops/group_norm.py``).

    Example:
        >>> y = GroupNorm(2, 6)(torch.randn(3, 6, 5, requires_grad=True))
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if forward_hooked(self):  # NOTE [Forward hooks on an output-saving module]
            return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    @classmethod
    def from_torch(cls, module: torch.nn.GroupNorm) -> GroupNorm:
        """A slimgrad GroupNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.GroupNorm):
            raise TypeError(
                f"slimgrad.nn.GroupNorm.from_torch: expected a torch.nn.GroupNorm, got "
                f"{type(module).__name__}. Pass an nn.GroupNorm instance."
            )
        new = cls(module.num_groups, module.num_channels, module.eps, module.affine, device="meta")
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new

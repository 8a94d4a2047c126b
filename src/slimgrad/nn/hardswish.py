"""``slimgrad.nn.Hardswish``: ``torch.nn.Hardswish`` whose forward keeps less for backward.

Memory: see ``slimgrad.ops.hardswish`` (same args, defaults and state_dict keys as torch.nn).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.hardswish import hardswish

__all__ = ["Hardswish"]


class Hardswish(NoScript, torch.nn.Hardswish):
    """Drop-in ``torch.nn.Hardswish`` (a subclass) using
    :func:`slimgrad.ops.hardswish.hardswish`."""

    def forward(self, input: Tensor) -> Tensor:
        return hardswish(input, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Hardswish:
        """The slimgrad module with the settings of ``module`` (a ``torch.nn.Hardswish``)."""
        if not isinstance(module, torch.nn.Hardswish):
            raise type_error("Hardswish", "torch.nn.Hardswish", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

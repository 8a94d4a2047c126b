"""``slimgrad.nn.Tanh``: ``torch.nn.Tanh`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.tanh`` (same args, defaults and state_dict keys as torch.nn.Tanh).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.tanh import tanh

__all__ = ["Tanh"]


class Tanh(NoScript, torch.nn.Tanh):
    """Drop-in ``torch.nn.Tanh`` (a subclass) using :func:`slimgrad.ops.tanh.tanh`."""

    def forward(self, input: Tensor) -> Tensor:
        return tanh(input, False)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Tanh:
        """The slimgrad module with the same settings as ``module`` (a ``torch.nn.Tanh``)."""
        if not isinstance(module, torch.nn.Tanh):
            raise type_error("Tanh", "torch.nn.Tanh", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

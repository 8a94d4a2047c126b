"""``slimgrad.nn.ReLU``: ``torch.nn.ReLU`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.relu`` (same args, defaults and state_dict keys as torch.nn.ReLU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.relu import relu

__all__ = ["ReLU"]


class ReLU(NoScript, torch.nn.ReLU):
    """Drop-in ``torch.nn.ReLU`` (a subclass) using :func:`slimgrad.ops.relu.relu`."""

    def forward(self, input: Tensor) -> Tensor:
        return relu(input, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> ReLU:
        """The slimgrad module with the same settings as ``module`` (a ``torch.nn.ReLU``)."""
        if not isinstance(module, torch.nn.ReLU):
            raise type_error("ReLU", "torch.nn.ReLU", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

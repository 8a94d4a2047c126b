"""``slimgrad.nn.Sigmoid``: ``torch.nn.Sigmoid`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.sigmoid`` (same args, defaults and state_dict keys as torch.nn.Sigmoid).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.sigmoid import sigmoid

__all__ = ["Sigmoid"]


class Sigmoid(NoScript, torch.nn.Sigmoid):
    """Drop-in ``torch.nn.Sigmoid`` (a subclass) using :func:`slimgrad.ops.sigmoid.sigmoid`."""

    def forward(self, input: Tensor) -> Tensor:
        return sigmoid(input, False)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Sigmoid:
        """The slimgrad module with the same settings as ``module`` (a ``torch.nn.Sigmoid``)."""
        if not isinstance(module, torch.nn.Sigmoid):
            raise type_error("Sigmoid", "torch.nn.Sigmoid", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

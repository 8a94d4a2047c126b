"""``slimgrad.nn.Hardsigmoid``: ``torch.nn.Hardsigmoid`` whose forward keeps less for backward.

Memory: see ``slimgrad.ops.hardsigmoid`` (same args, defaults and state_dict keys as torch.nn).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.hardsigmoid import hardsigmoid

__all__ = ["Hardsigmoid"]


class Hardsigmoid(NoScript, torch.nn.Hardsigmoid):
    """Drop-in ``torch.nn.Hardsigmoid`` (a subclass) using
    :func:`slimgrad.ops.hardsigmoid.hardsigmoid`."""

    def forward(self, input: Tensor) -> Tensor:
        return hardsigmoid(input, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Hardsigmoid:
        """The slimgrad module with the settings of ``module`` (a ``torch.nn.Hardsigmoid``)."""
        if not isinstance(module, torch.nn.Hardsigmoid):
            raise type_error("Hardsigmoid", "torch.nn.Hardsigmoid", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

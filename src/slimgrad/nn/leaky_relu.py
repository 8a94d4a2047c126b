"""``slimgrad.nn.LeakyReLU``: ``torch.nn.LeakyReLU`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.leaky_relu`` (same args, defaults and state_dict keys as
torch.nn.LeakyReLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.leaky_relu import leaky_relu

__all__ = ["LeakyReLU"]


class LeakyReLU(NoScript, torch.nn.LeakyReLU):
    """Drop-in ``torch.nn.LeakyReLU`` (a subclass) using
    :func:`slimgrad.ops.leaky_relu.leaky_relu`."""

    #: False where the output may be the model's output: eager's op (it keeps the input) runs
    #: instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        if not self.keep_y or forward_hooked(
            self
        ):  # NOTE [Forward hooks on an output-saving module]
            return F.leaky_relu(input, self.negative_slope, self.inplace)
        return leaky_relu(input, self.negative_slope, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> LeakyReLU:
        """The slimgrad module with the same settings as ``module`` (a ``torch.nn.LeakyReLU``)."""
        if not isinstance(module, torch.nn.LeakyReLU):
            raise type_error("LeakyReLU", "torch.nn.LeakyReLU", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

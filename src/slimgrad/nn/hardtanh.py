"""``slimgrad.nn.Hardtanh`` and ``slimgrad.nn.ReLU6``: torch's modules, keeping only the output.

Memory: see ``slimgrad.ops.hardtanh`` (same args, defaults and state_dict keys as torch.nn).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.hardtanh import hardtanh

__all__ = ["Hardtanh", "ReLU6"]


def _copy_settings(cls, module):
    new = cls.__new__(cls)
    torch.nn.Module.__init__(new)
    new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
    new.train(module.training)
    return new


class Hardtanh(NoScript, torch.nn.Hardtanh):
    """Drop-in ``torch.nn.Hardtanh`` (a subclass) using :func:`slimgrad.ops.hardtanh.hardtanh`."""

    #: False where the output may be the model's output: eager's op (it keeps the input) runs
    #: instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        if not self.keep_y or forward_hooked(
            self
        ):  # NOTE [Forward hooks on an output-saving module]
            return F.hardtanh(input, self.min_val, self.max_val, self.inplace)
        return hardtanh(input, self.min_val, self.max_val, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Hardtanh:
        """The slimgrad module with the settings of ``module`` (``torch.nn.Hardtanh`` or
        ``ReLU6``)."""
        if not isinstance(module, torch.nn.Hardtanh):
            raise type_error("Hardtanh", "torch.nn.Hardtanh", module)
        if isinstance(module, torch.nn.ReLU6) and cls is Hardtanh:
            return ReLU6.from_torch(module)
        return _copy_settings(cls, module)


class ReLU6(NoScript, torch.nn.ReLU6):
    """Drop-in ``torch.nn.ReLU6`` (a subclass) using :func:`slimgrad.ops.hardtanh.hardtanh` (0,
    6)."""

    #: False where the output may be the model's output: eager's op (it keeps the input) runs
    #: instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        if not self.keep_y or forward_hooked(
            self
        ):  # NOTE [Forward hooks on an output-saving module]
            return F.hardtanh(input, 0.0, 6.0, self.inplace)
        return hardtanh(input, 0.0, 6.0, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> ReLU6:
        """The slimgrad module with the settings of ``module`` (a ``torch.nn.ReLU6``)."""
        if not isinstance(module, torch.nn.ReLU6):
            raise type_error("ReLU6", "torch.nn.ReLU6", module)
        return _copy_settings(cls, module)

"""``slimgrad.nn.ELU``: ``torch.nn.ELU`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.elu`` (same args, defaults and state_dict keys as torch.nn.ELU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.elu import elu

__all__ = ["ELU"]


class ELU(NoScript, torch.nn.ELU):
    """Drop-in ``torch.nn.ELU`` (a subclass) using :func:`slimgrad.ops.elu.elu`."""

    #: False where ``convert_`` found nothing downstream that keeps the output: eager's op (it
    #: keeps x) runs instead (NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        if forward_hooked(self):  # NOTE [Forward hooks on an output-saving module]
            return F.elu(input, self.alpha, self.inplace)
        # NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py
        keep = self.keep_y  # True, False or a KeepYWhen (NOTE [Keep y only where the
        # producer does not keep x] in nn/_output_act.py)
        if keep is not True and (not keep or not keep(input)):
            return F.elu(input, self.alpha, self.inplace)
        return elu(input, self.alpha, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> ELU:
        """The slimgrad module with the same settings as ``module`` (a ``torch.nn.ELU``)."""
        if not isinstance(module, torch.nn.ELU):
            raise type_error("ELU", "torch.nn.ELU", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

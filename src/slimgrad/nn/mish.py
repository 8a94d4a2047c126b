"""``slimgrad.nn.Mish``: ``torch.nn.Mish`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.mish`` (same args, defaults and state_dict keys as torch.nn.Mish).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as _module

from slimgrad._autograd import unwrap_if_dead
from slimgrad._library import straight
from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import hf_name, type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.mish import _MISH_APPLY, _PLAIN, _grad_on, mish

__all__ = ["Mish"]


class Mish(NoScript, torch.nn.Mish):
    """Drop-in ``torch.nn.Mish`` (a subclass) using :func:`slimgrad.ops.mish.mish`."""

    #: False where ``convert_`` found nothing downstream that keeps the output: eager's op (it
    #: keeps x) runs instead (NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        hooks = (
            self._forward_hooks
            or _module._global_forward_hooks
            or self.near_hooks != self.near_free
        )  # forward_hooked if any
        if hooks and forward_hooked(self):  # NOTE [Forward hooks on an output-saving module]
            return F.mish(input, self.inplace)
        # NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py
        keep = self.keep_y  # True, False or a KeepYWhen (NOTE [Keep y only where the
        # producer does not keep x] in nn/_output_act.py)
        if keep is not True and (not keep or not keep(input)):
            return F.mish(input, self.inplace)
        if (  # mish()'s straight path, without its frame (NOTE [One gate per call])
            not self.inplace
            and type(input) in _PLAIN
            and input.requires_grad
            and not input.is_meta
            and _grad_on()
            and straight()
        ):
            return _MISH_APPLY(unwrap_if_dead(input), True)
        return mish(input, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Mish:
        """The slimgrad module with the same settings as ``module`` (``torch.nn.Mish`` or HF
        ``MishActivation``)."""
        if hf_name(module) == "MishActivation":  # HF's ACT2FN["mish"]
            new = cls()
            new.train(module.training)
            return new
        if not isinstance(module, torch.nn.Mish):
            raise type_error("Mish", "torch.nn.Mish or HF MishActivation", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

"""``slimgrad.nn.SiLU``: ``torch.nn.SiLU`` whose forward keeps only what backward needs.

Memory: see ``slimgrad.ops.silu`` (same args, defaults and state_dict keys as torch.nn.SiLU).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.modules import module as _module

from slimgrad._autograd import unwrap_if_dead
from slimgrad._library import straight
from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import hf_name, type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops.silu import _PLAIN, _SILU_APPLY, _grad_on, silu

__all__ = ["SiLU"]


class SiLU(NoScript, torch.nn.SiLU):
    """Drop-in ``torch.nn.SiLU`` (a subclass) using :func:`slimgrad.ops.silu.silu`."""

    #: False where ``convert_`` found nothing downstream that keeps the output: eager's op (it
    #: keeps x) runs instead (NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        hooks = (
            self._forward_hooks
            or _module._global_forward_hooks
            or self.near_hooks != self.near_free
        )  # forward_hooked if any
        # NOTE [Forward hooks on an output-saving module]: eager's op
        if hooks and forward_hooked(self):
            return torch.nn.functional.silu(input, self.inplace)
        # NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py
        keep = self.keep_y  # True, False or a KeepYWhen (NOTE [Keep y only where the
        # producer does not keep x] in nn/_output_act.py)
        if keep is not True and (not keep or not keep(input)):
            return torch.nn.functional.silu(input, self.inplace)
        if (  # silu()'s straight path, without its frame (NOTE [One gate per call])
            not self.inplace
            and type(input) in _PLAIN
            and input.requires_grad
            and not input.is_meta
            and _grad_on()
            and straight()
        ):
            return _SILU_APPLY(unwrap_if_dead(input), True)
        return silu(input, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> SiLU:
        """The slimgrad module with the same settings as ``module`` (``torch.nn.SiLU`` or HF
        ``SiLUActivation``)."""
        if hf_name(module) == "SiLUActivation":  # HF's ACT2FN["silu"]
            new = cls()
            new.train(module.training)
            return new
        if not isinstance(module, torch.nn.SiLU):
            raise type_error("SiLU", "torch.nn.SiLU or HF SiLUActivation", module)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
        new.train(module.training)
        return new

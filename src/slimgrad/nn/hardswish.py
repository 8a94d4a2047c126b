"""``slimgrad.nn.Hardswish``: ``torch.nn.Hardswish`` whose forward keeps less for backward.

Memory: see ``slimgrad.ops.hardswish`` (same args, defaults and state_dict keys as torch.nn).
:class:`HardswishAfterNorm` is the same module for the place right after a BatchNorm, where the
pair keeps the BatchNorm output only (NOTE [Derived saved inputs] in ``slimgrad/ops/_derived.py``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from slimgrad import ownership
from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import type_error
from slimgrad.nn._script import NoScript
from slimgrad.ops import _derived
from slimgrad.ops.hardswish import hardswish

__all__ = ["Hardswish", "HardswishAfterNorm"]


class Hardswish(NoScript, torch.nn.Hardswish):
    """Drop-in ``torch.nn.Hardswish`` (a subclass) using
    :func:`slimgrad.ops.hardswish.hardswish`."""

    #: False where ``convert_`` found nothing downstream that keeps the output: eager's op (it
    #: keeps x) runs instead (NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py)
    keep_y = True

    def forward(self, input: Tensor) -> Tensor:
        if forward_hooked(self):  # NOTE [Forward hooks on an output-saving module]: eager's op
            return torch.nn.functional.hardswish(input, self.inplace)
        # NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py
        keep = self.keep_y  # True, False or a KeepYWhen (NOTE [Keep y only where the
        # producer does not keep x] in nn/_output_act.py)
        if keep is not True and (not keep or not keep(input)):
            return torch.nn.functional.hardswish(input, self.inplace)
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


class HardswishAfterNorm(NoScript, torch.nn.Hardswish):
    """``torch.nn.Hardswish`` (same ``inplace`` argument) that, after a slimgrad BatchNorm, lets the
    block keep only the BatchNorm output; anywhere else exactly torch's Hardswish.

    Right after a slimgrad BatchNorm in training (its pristine output b), the result is a new
    tensor ``hardswish(b)`` that keeps b (kept by the norm already) and eager's own backward kernel
    on it, and a following slimgrad conv keeps b instead of the result (NOTE [Derived saved
    inputs]). With ``inplace=True`` that path needs ``slimgrad.ownership.owns_input`` (nobody
    else can see b); otherwise it is eager's op (in place when asked), and the BatchNorm keeps its
    input, as eager. Not :class:`Hardswish` off the path: that keeps its output, which an in-place
    write after this module (which ``convert_``'s in-place guard does not see once the module is
    slimgrad's) could overwrite; eager's op keeps x, as the other ``*AfterNorm`` modules do.

    Memory: after a BatchNorm, 0 bytes of its own (b is the norm's); elsewhere eager's (x).
    Eager keeps the BatchNorm input and x.
    """

    _slimgrad_owns_input = True  # NOTE [Forward ownership from stated structure]

    def forward(self, input: Tensor) -> Tensor:
        # first use of input: NOTE [Gradient-buffer ownership]
        owned = self.inplace and ownership.owns_input(input, self, writes=False)
        return _derived.activation(input, "hardswish", self.inplace, owned=owned)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> HardswishAfterNorm:
        """A HardswishAfterNorm with ``module``'s ``inplace`` flag and hooks (a plain
        ``torch.nn.Hardswish``)."""
        if type(module) is not torch.nn.Hardswish:
            raise type_error("HardswishAfterNorm", "torch.nn.Hardswish", module)
        new = cls.__new__(cls)
        # own containers (hook dicts are copied); the hook functions themselves are shared
        for k, v in module.__dict__.items():
            new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
        return new

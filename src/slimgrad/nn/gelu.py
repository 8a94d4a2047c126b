"""``slimgrad.nn.GELU``: ``torch.nn.GELU`` keeping its output + 1 bit/elt instead of its input.

Memory: see ``slimgrad.ops.gelu`` (same args, defaults and state_dict keys as torch.nn.GELU). Unlike
torch, ``inplace=True`` is accepted (keyword only): the output overwrites the input.
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
from slimgrad.ops.gelu import _APPROX, _GELU_APPLY, _PLAIN, _check_approximate, _grad_on, gelu

__all__ = ["GELU"]

# HF transformers.activations classes -> approximate
_HF = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "FastGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
}


class GELU(NoScript, torch.nn.GELU):
    """Drop-in ``torch.nn.GELU`` (a subclass) using :func:`slimgrad.ops.gelu.gelu`.

    Args:
        approximate: ``'none'`` (erf) or ``'tanh'``.
        inplace: overwrite the input with the output (torch.nn.GELU has no such flag).

    Raises:
        ValueError: unknown ``approximate``.
    """

    #: False where ``convert_`` found nothing downstream that keeps the output: eager's op (it
    #: keeps x) runs instead (NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py)
    keep_y = True

    def __init__(self, approximate: str = "none", *, inplace: bool = False) -> None:
        _check_approximate(approximate)
        super().__init__(approximate)
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:
        hooks = (
            self._forward_hooks
            or _module._global_forward_hooks
            or self.near_hooks != self.near_free
        )  # forward_hooked if any
        if hooks and forward_hooked(self):  # NOTE [Forward hooks on an output-saving module]
            if self.inplace:  # eager's in-place GELU (it keeps a copy of the input)
                return torch.ops.aten.gelu_(input, approximate=self.approximate)
            return torch.nn.functional.gelu(input, approximate=self.approximate)
        a = self.approximate
        # NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py
        keep = self.keep_y  # True, False or a KeepYWhen (NOTE [Keep y only where the
        # producer does not keep x] in nn/_output_act.py)
        if keep is not True and (not keep or not keep(input)):
            if self.inplace:  # eager's in-place GELU (it keeps a copy of the input)
                return torch.ops.aten.gelu_(input, approximate=a)
            return torch.nn.functional.gelu(input, approximate=a)
        if (  # gelu()'s straight path, without its frame (NOTE [One gate per call])
            not self.inplace
            and type(input) in _PLAIN
            and a in _APPROX
            and input.requires_grad
            and not input.is_meta
            and _grad_on()
            and straight()
        ):
            return _GELU_APPLY(unwrap_if_dead(input), a, True)
        return gelu(input, a, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> GELU:
        """The slimgrad GELU for ``torch.nn.GELU`` or HF's GELU activations.

        HF ``GELUActivation`` maps to ``approximate='none'``; ``NewGELUActivation`` (``gelu_new``),
        ``FastGELUActivation`` (``gelu_fast``) and ``GELUTanh`` to ``'tanh'`` (the same function;
        the output differs from HF's formula by float32 rounding only).
        """
        if isinstance(module, torch.nn.GELU):
            new = cls(module.approximate)
        elif hf_name(module) in _HF:
            new = cls(_HF[hf_name(module)])
        else:
            raise type_error("GELU", "torch.nn.GELU or a HF GELU activation", module)
        new.train(module.training)
        return new

"""convert_ handlers for plain ``torch.nn.Linear``, by class name.

``TABLE`` ({qualified class name: (ConvertConfig field, handler)}) is merged into
``slimgrad.convert._TABLE``.

# NOTE [Which Linears convert]
``nn.Linear`` becomes :class:`slimgrad.nn.Linear` (the same Parameters, hooks carried over by
convert_): outside autocast it runs eager's ``F.linear`` itself, since slimgrad's Function there
computed eager's bits and kept eager's bytes for a few Python frames more per call (NOTE
[Converted Linear outside autocast] in ``slimgrad/nn/linear.py``); under autocast it keeps the
fp32 weight instead of its cast (NOTE [Autocast weight casts] in ``slimgrad/ops/linear.py``), the
saving that makes converting it worthwhile. Subclasses
follow NOTE [Subclasses convert by what they compute] in ``convert.py`` (a subclass with its own
forward, e.g. PEFT's LoRA ``Linear``, stays; its ``base_layer``, a plain Linear that LoRA calls
as a module, converts). Left as they are:

- ``NonDynamicallyQuantizableLinear`` (``nn.MultiheadAttention.out_proj``): its forward is never
  called; MultiheadAttention reads ``out_proj.weight`` itself (``F.multi_head_attention_forward``)
  and quantization flows dispatch on this exact class, so converting it would change nothing that
  is computed and would break those flows.
- a Linear whose weight is not a 2-D floating tensor (quantized, lazily initialised). A
  parametrized Linear (``torch.nn.utils.parametrize``) is an instance of a generated subclass with
  a ``weight`` property: the subclass rule leaves it (and reports why).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from slimgrad.nn.linear import Linear

__all__ = ["TABLE", "linear_from_torch"]


def linear_from_torch(module: nn.Module) -> nn.Module:
    """``slimgrad.nn.Linear`` sharing ``module``'s Parameters, or ``NotImplementedError(reason)``.

    Raises:
        NotImplementedError: the weight is not a 2-D floating tensor (e.g. a quantized or
            lazily initialised Linear).
    """
    w = getattr(module, "weight", None)
    if isinstance(w, nn.parameter.UninitializedParameter):
        raise NotImplementedError(
            "its weight is not initialised yet (LazyLinear); expected a materialised weight, got "
            "an UninitializedParameter"
        )
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise NotImplementedError(
            "its weight is not a 2-D floating tensor; expected a Linear's (out, in) weight, got "
            f"{type(w).__name__}"
        )
    return Linear.from_torch(module)


def _mha_out_proj(module: nn.Module) -> nn.Module:
    raise NotImplementedError(
        "nn.MultiheadAttention's out_proj: MultiheadAttention reads its weight directly (the "
        "module's forward is never called) and quantization dispatches on this class; expected a "
        "Linear whose forward computes with its weight, got NonDynamicallyQuantizableLinear"
    )


TABLE: dict = {
    "torch.nn.modules.linear.Linear": ("selective_saving", linear_from_torch),
    "torch.nn.modules.linear.NonDynamicallyQuantizableLinear": ("selective_saving", _mha_out_proj),
}

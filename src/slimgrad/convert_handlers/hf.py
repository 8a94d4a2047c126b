"""HF transformers glue shared by the HF ``convert_`` passes, and HF's RMSNorm handler.

Nothing here rebinds an HF class or module-level function. The attention pass lives in
``hf_attention.py``, the fused LM-head loss in ``hf_loss.py``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn


def hf_models(model: nn.Module):
    """Yield ``(name, module)`` for the outermost HF ``PreTrainedModel`` instances in ``model``,
    user subclasses included (each pass then decides from the instance's own code whether it may
    touch it); their configs are shared with their submodules."""
    mu = sys.modules.get("transformers.modeling_utils")
    base = getattr(mu, "PreTrainedModel", None)
    if base is None:  # transformers not imported: no HF model can be in there
        return
    seen: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in seen or not isinstance(m, base):
            continue
        seen.update(id(sub) for sub in m.modules())
        yield name, m


def rms_norm_from_hf(module: nn.Module) -> nn.Module:
    """HF ``LlamaRMSNorm`` -> :class:`slimgrad.nn.rms_norm.HFRMSNorm` (HF's function in every
    dtype; memory-lean where that equals ``F.rms_norm``: float32 input and weights)."""
    from slimgrad.nn.rms_norm import HFRMSNorm

    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dtype != torch.float32:
        raise NotImplementedError(
            f"{weight.dtype} weights: HF's cast order differs from F.rms_norm in half precision"
        )
    return HFRMSNorm.from_hf(module)


# {qualified HF class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE = {
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": ("norms", rms_norm_from_hf),
}

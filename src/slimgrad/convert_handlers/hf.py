"""HF transformers glue shared by the HF ``convert_`` passes, and HF's RMSNorm handler.

Nothing here rebinds an HF class or module-level function. The attention pass lives in
``hf_attention.py``, the fused LM-head loss in ``hf_loss.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def hf_models(model: nn.Module):
    # outermost HF PreTrainedModel instances (their config is shared with their submodules)
    seen: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in seen:
            continue
        cfg = getattr(m, "config", None)
        if type(m).__module__.startswith("transformers.") and hasattr(cfg, "_attn_implementation"):
            for sub in m.modules():
                seen.add(id(sub))
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

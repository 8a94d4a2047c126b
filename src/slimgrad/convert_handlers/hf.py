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
    """HF ``LlamaRMSNorm``-style module (``weight``, ``variance_epsilon``) -> slimgrad RMSNorm.

    HF computes in float32 and casts back before scaling by the weight; ``F.rms_norm`` scales in
    the input dtype. In float32 both are the same function; in half precision the rounding
    order differs, so only float32 weights convert (others are reported as skipped).
    """
    from slimgrad.nn.rms_norm import RMSNorm

    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
        raise NotImplementedError("not a LlamaRMSNorm-style module (weight, variance_epsilon)")
    if weight.dtype != torch.float32:
        raise NotImplementedError(
            f"{weight.dtype} weights: HF's cast order differs from F.rms_norm in half precision"
        )
    new = RMSNorm(weight.shape[0], eps=eps, elementwise_affine=True, device="meta")
    new.weight = weight
    new.train(module.training)
    return new

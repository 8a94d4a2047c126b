"""HF attention for ``convert_``: reached through the instance's config, never by rebinding HF code.

The converted instance's own ``config._attn_implementation`` becomes ``"slimgrad"``, a name added
to HF's ``AttentionInterface`` registry (HF's documented extension point; other models keep
theirs). With dropout active it runs ``softmax -> dropout -> @V`` (the causal mask applied inside
the op, the scaling on q as SDPA does) through
:func:`slimgrad.ops.softmax_dropout.softmax_dropout_matmul` (keeps the softmax output + 1 bit/elt
instead of softmax output + float mask + dropped matrix); without dropout it is HF's own SDPA
function, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from slimgrad.convert_handlers.hf import hf_models

ATTN_NAME = "slimgrad"
_registered = False


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    from slimgrad.ops.softmax_dropout import softmax_dropout_matmul

    if dropout == 0.0 or not torch.is_grad_enabled() or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_len > 1 and attention_mask is None and is_causal
    # scale q (B·H·T·d) rather than the scores (B·H·T·T), as SDPA's math path does; exact for a
    # power-of-two scaling such as GPT-2's 1/8
    q = query * scaling if scaling != 1.0 else query
    scores = torch.matmul(q, key.transpose(-1, -2))
    if not is_causal and attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    # the causal mask is applied inside the op (no masked copy of the scores kept by autograd)
    out = softmax_dropout_matmul(scores, value, p=dropout, training=True, causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Add ``"slimgrad"`` to HF's attention registry (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    _registered = True


def use_slimgrad_attention(model: nn.Module) -> bool:
    """Point the instance's config at the slimgrad attention; False when it has no such config."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if getattr(cfg, "_attn_implementation", None) == "eager" and getattr(
        cfg, "reorder_and_upcast_attn", False
    ):
        return False
    register_attention()
    cfg._attn_implementation = ATTN_NAME
    for sub in model.modules():  # sub-configs (e.g. text_config) share the instance's choice
        sub_cfg = getattr(sub, "config", None)
        if sub_cfg is not None and sub_cfg is not cfg and hasattr(sub_cfg, "_attn_implementation"):
            if sub_cfg._attn_implementation in ("sdpa", "eager"):
                sub_cfg._attn_implementation = ATTN_NAME
    return True


def attention_pattern(model: nn.Module, config, allowed, rep) -> None:
    """``convert_`` pattern (technique ``dropout``): HF models use the slimgrad attention."""
    for name, m in hf_models(model):
        kind = type(m).__name__
        if not any("Attention" in type(sub).__name__ for sub in m.modules()):
            continue  # no attention layers (e.g. HF ResNet)
        if not allowed(m, name):
            rep.skipped.append((name, kind, "filter_fn returned False"))
            continue
        impl = m.config._attn_implementation
        if use_slimgrad_attention(m):
            rep.converted.append((name, f"{kind} attention ({impl})", "slimgrad attention"))
        elif impl != ATTN_NAME:
            rep.skipped.append(
                (name, kind, f"attention implementation {impl!r} kept (only sdpa/eager convert)")
            )

"""HF transformers glue for ``convert_``: attention and LM-head losses reached through the instance.

Nothing here rebinds an HF class or module-level function. Two things change on the converted
instance only:

- its attention implementation: the instance's own ``config._attn_implementation`` becomes
  ``"slimgrad"``, a name added to HF's ``AttentionInterface`` registry (HF's documented extension
  point; other models keep theirs). With dropout active it runs ``softmax -> dropout -> @V``
  (the causal mask applied inside the op, the scaling on q as SDPA does)
  through :func:`slimgrad.ops.softmax_dropout.softmax_dropout_matmul` (keeps the softmax output +
  1 bit/elt instead of softmax output + float mask + dropped matrix); without dropout it is HF's
  own SDPA function, unchanged;
- its ``forward``, bound on the instance, for ``*ForCausalLM`` and ``BertForMaskedLM`` when called
  with ``labels``: the loss comes from the hidden states through the chunked fused linear +
  cross-entropy (:mod:`slimgrad.ops.linear_cross_entropy`), so the B x T x V logits and
  log-probabilities are never materialised. The output's ``logits`` is then ``None``; without
  ``labels`` the class's own forward runs.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

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


def _skip_identity_view(t: torch.Tensor) -> torch.Tensor:
    # HF's base models end with ``ln_f(x).view(output_shape)``, an identity view: feed the loss its
    # base (same shape, strides, storage) so the gradient reaching ln_f is not a view of the
    # loss's dh, and ln_f's backward may reuse it (NOTE [Gradient-buffer ownership]).
    base = t._base
    if (
        base is not None
        and base.shape == t.shape
        and base.stride() == t.stride()
        and base.storage_offset() == t.storage_offset()
        and base.dtype == t.dtype
        and base.requires_grad == t.requires_grad
    ):
        return base
    return t


def _causal_lm_forward(self, input_ids=None, labels=None, **kwargs):
    precompute = getattr(self, "_slimgrad_fast_loss", False)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from slimgrad.ops.linear_cross_entropy import causal_lm_loss

    if labels is None or kwargs.get("return_dict") is False:
        return type(self).forward(self, input_ids=input_ids, labels=labels, **kwargs)
    kwargs.pop("logits_to_keep", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    out = self.base_model(input_ids=input_ids, **kwargs)
    hidden = _skip_identity_view(out.last_hidden_state)
    head = self.get_output_embeddings()
    loss = causal_lm_loss(
        hidden,
        head.weight,
        labels,
        getattr(head, "bias", None),
        num_items_in_batch=num_items,
        shift_labels=shift_labels,
        precompute_grads=precompute,
    )
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(out, "past_key_values", None),
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )


def _masked_lm_forward(self, input_ids=None, labels=None, **kwargs):
    from transformers.modeling_outputs import MaskedLMOutput

    from slimgrad.ops.linear_cross_entropy import linear_cross_entropy

    if labels is None or kwargs.get("return_dict") is False:
        return type(self).forward(self, input_ids=input_ids, labels=labels, **kwargs)
    out = self.base_model(input_ids=input_ids, **kwargs)
    hidden = out.last_hidden_state
    dec = self.cls.predictions.decoder
    if is_fake(labels):  # slimgrad.memory.estimate: which positions are labelled is data
        h = self.cls.predictions.transform(hidden.flatten(0, -2))  # all of them: an upper bound
        loss = linear_cross_entropy(h, dec.weight, labels.flatten(), bias=dec.bias)
    else:
        # only labelled positions reach the head: the loss is a mean over them, as eager's
        keep = labels != -100
        h = self.cls.predictions.transform(hidden[keep])
        loss = linear_cross_entropy(h, dec.weight, labels[keep], bias=dec.bias)
    return MaskedLMOutput(
        loss=loss,
        logits=None,
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )


def _bind(model: nn.Module, fn) -> None:
    model.forward = types.MethodType(fn, model)
    model._slimgrad_forward = fn.__name__


def fuse_lm_loss(model: nn.Module, fast: bool = False) -> str | None:
    """Bind the fused-loss forward on an HF LM instance; returns what was done, or None.

    ``fast``: precompute the head's gradients in forward (``ConvertConfig.fast_loss``).
    """
    if getattr(model, "_slimgrad_forward", None):
        return None  # already converted
    model._slimgrad_fast_loss = fast
    cls_name = type(model).__name__
    if cls_name.endswith("ForCausalLM") or cls_name.endswith("LMHeadModel"):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear):
            return None
        _bind(model, _causal_lm_forward)
        return "causal-LM loss fused with the LM head (chunked, no logits kept)"
    if cls_name == "BertForMaskedLM":
        _bind(model, _masked_lm_forward)
        return "masked-LM loss on labelled positions only, fused with the decoder"
    return None


def _hf_models(model: nn.Module):
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


def attention_pattern(model: nn.Module, config, allowed, rep) -> None:
    """``convert_`` pattern (technique ``dropout``): HF models use the slimgrad attention."""
    for name, m in _hf_models(model):
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


def lm_loss_pattern(model: nn.Module, config, allowed, rep) -> None:
    """``convert_`` pattern (technique ``fused_loss``): fused, chunked LM-head losses."""
    for name, m in _hf_models(model):
        if not allowed(m, name):
            continue
        what = fuse_lm_loss(m, fast=config.fast_loss)
        if what is not None:
            rep.converted.append((name, f"{type(m).__name__}.forward", what))


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

"""HF LM-head losses for ``convert_``: the instance's ``forward``, bound on the instance only.

For ``*ForCausalLM`` and ``BertForMaskedLM`` called with ``labels``, the loss comes from the hidden
states through the chunked fused linear + cross-entropy (:mod:`slimgrad.ops.linear_cross_entropy`),
so the B x T x V logits and log-probabilities are never materialised. The output's ``logits`` is
then ``None``; without ``labels`` the class's own forward runs.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from slimgrad.convert_handlers.hf import hf_models


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


def lm_loss_pattern(model: nn.Module, config, allowed, rep) -> None:
    """``convert_`` pattern (technique ``fused_loss``): fused, chunked LM-head losses."""
    for name, m in hf_models(model):
        if not allowed(m, name):
            continue
        what = fuse_lm_loss(m, fast=config.fast_loss)
        if what is not None:
            rep.converted.append((name, f"{type(m).__name__}.forward", what))

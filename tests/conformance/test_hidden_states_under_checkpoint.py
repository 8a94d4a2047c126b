"""Conformance: gradient checkpointing (non-reentrant) with ``output_hidden_states=True`` (NOTE
[Hidden states handed out per call] in slimgrad/nn/_output_act.py).

A LayerNorm whose output may be handed out as a hidden state runs eager's op while the call asks
for hidden states; the recompute inside backward runs outside that call, so it kept y there and
torch raised CheckpointError (converted BERT, RoBERTa, SegFormer, ... where eager trains; found by
a read-only sweep of HF families). Each row: every HF family of the suite that supports gradient
checkpointing, and SegFormer (which always asks its encoder for hidden states), against eager's
loss and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import slimgrad
from tests._threads import one_thread
from tests.conformance._hf_families import FAMILIES, build, inputs


def _grads(m):
    return {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def _close(got, want):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hidden_states_requested_under_checkpointing(name):
    fam = FAMILIES[name]
    with one_thread():
        torch.manual_seed(0)
        eager = build(fam)
        if not eager.supports_gradient_checkpointing:
            pytest.skip("the family has no gradient checkpointing")
        conv = slimgrad.convert_(copy.deepcopy(eager))
        batch = inputs(fam, eager, labels=True)
        losses, grads = [], []
        for m in (eager, conv):
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            torch.manual_seed(1)
            out = m(**copy.deepcopy(batch), output_hidden_states=True)
            out.loss.backward()  # (converted: CheckpointError before, BERT among them)
            losses.append(out.loss.detach())
            grads.append(_grads(m))
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        _close(grads[1], grads[0])


def test_segformer_under_checkpointing():
    cfg = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        drop_path_rate=0.0, decoder_hidden_size=32, num_labels=5,
    )  # fmt: skip
    with one_thread():
        torch.manual_seed(0)
        eager = transformers.SegformerForSemanticSegmentation(cfg).train()
        conv = slimgrad.convert_(copy.deepcopy(eager))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(3, 3, 32, 32, generator=g)
        y = torch.randint(0, 5, (3, 32, 32), generator=g)
        losses, grads = [], []
        for m in (eager, conv):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            loss = m(pixel_values=x, labels=y).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append(_grads(m))
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        _close(grads[1], grads[0])

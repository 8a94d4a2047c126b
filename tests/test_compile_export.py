"""``torch.export`` of converted models: strict and non-strict export the eager ops.

Under torch.compile slimgrad puts some eager ops inside a non-reentrant checkpoint so that the
partitioner recomputes them (the HF RMSNorm, the gated MLP); strict export of such a checkpoint
failed in torch 2.13 (``KeyError: '_checkpoint_context_fn'``). While exporting the ops run as they
are (NOTE [Recompute tags under torch.export] in ``slimgrad/_compile.py``): the exported graph has
no checkpoint and computes what the converted model computes.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import slimgrad

transformers = pytest.importorskip("transformers")


class _NormThenLinear(torch.nn.Module):
    # the norm's output feeds a linear, so convert_ gives it the lean (checkpointed) path
    def __init__(self) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(16)
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(self.norm(x))


def _no_checkpoint(ep) -> None:
    names = {str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("checkpoint" in n for n in names), names


# strict: test_export_strict_of_a_recomputed_attention_core exports Llama's HF RMSNorms on the
# same checkpointed path (hf_rms_norm's, into the q/k/v projections)
@pytest.mark.parametrize("strict", [False])
def test_export_converted_rms_norm_under_grad(strict):
    torch.manual_seed(0)
    model = _NormThenLinear()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    assert type(conv.norm).__name__ == "HFRMSNorm"
    x = torch.randn(2, 5, 16, requires_grad=True)
    ep = torch.export.export(conv, (x,), strict=strict)
    _no_checkpoint(ep)
    y = ep.module()(x)
    assert torch.equal(y, model(x))


def _causal_lm(family):
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()  # eval: no dropout draws to compare


def _leaves(out):
    return torch.utils._pytree.tree_leaves(out)


# strict: test_export_strict_of_a_recomputed_attention_core, the same converted Llama with labels
@pytest.mark.parametrize(("family", "strict"), [("llama", False), ("gpt2", False)])
def test_export_converted_causal_lm_with_labels(family, strict):
    # NOTE [The fused loss under torch.export] in slimgrad/convert_handlers/hf_loss.py: non-strict
    # export failed on the fused forward ('_FusedLMForward' object has no attribute '__code__');
    # strict export traced the fused loss, whose training output has no logits
    model = _causal_lm(family)
    conv = slimgrad.convert_(copy.deepcopy(model))
    ids = torch.randint(0, 97, (2, 11))
    kw = {"input_ids": ids, "labels": ids}
    ep = torch.export.export(conv, (), kw, strict=strict)
    _no_checkpoint(ep)
    got = _leaves(ep.module()(**kw))
    # loss and logits, as the eager model returns; converted Llama computes eager's bits, converted
    # GPT-2's ops round as their own (the error rule, not bits): there the converted model's
    want = _leaves((model if family == "llama" else conv)(**kw))
    assert len(got) == len(want) == 2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_export_non_strict_of_a_block_with_an_instance_forward():
    # GPT-2's block and attention forwards (decision.InstanceForward) as the exported module
    model = _causal_lm("gpt2")
    slimgrad.convert_(model)
    blk = model.transformer.h[0]
    assert "forward" in blk.__dict__ and "forward" in blk.attn.__dict__
    x = torch.randn(2, 7, 32)
    for mod in (blk, blk.attn):
        ep = torch.export.export(mod, (x,), strict=False)
        got, want = ep.module()(x), mod(x)
        if isinstance(want, tuple):  # the attention: (output, weights=None)
            (got, none), (want, _) = got, want
            assert none is None
        assert torch.equal(got, want)


def test_export_strict_of_a_recomputed_attention_core():
    # NOTE [The attention core, recomputed] in slimgrad/attention_core.py: its checkpoint goes
    # through recompute_in_backward, which runs the core itself while exporting; a plain
    # checkpoint failed strict export (KeyError '_checkpoint_context_fn', torch 2.13). The rest
    # is convert_'s (apply_choices converts the whole model first): the HF RMSNorms' checkpointed
    # path and the fused loss with labels, strict (as test_export_converted_causal_lm_with_labels
    # non-strict)
    from slimgrad.plan import apply_choices

    model = _causal_lm("llama")  # SDPA's core (HF's default implementation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = apply_choices(
            copy.deepcopy(model), {"model.layers.0": "lean+recompute:attention-core"}
        )
    assert conv.model.layers[0].self_attn.config._attn_implementation == "slimgrad_core"
    assert type(conv.model.layers[0].input_layernorm).__name__ == "HFRMSNorm"
    assert type(conv.__dict__.get("forward")).__name__ == "_FusedLMForward"
    ids = torch.randint(0, 97, (2, 9))
    kw = {"input_ids": ids, "labels": ids}
    ep = torch.export.export(conv, (), kw, strict=True)
    _no_checkpoint(ep)
    got, want = _leaves(ep.module()(**kw)), _leaves(model(**kw))
    assert len(got) == len(want) == 2  # loss and logits, as the eager model returns
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

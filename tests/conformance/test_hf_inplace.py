"""Conformance: HF forwards that write a converted module's output in place.

NOTE [In-place writes in HF forwards] (``convert_handlers/inplace_guard.py``): a module whose
slimgrad replacement keeps its output (the norms in float32, the smooth activations) must stay as
it is when its HF parent writes that output in place, or the converted backward raises autograd's
"modified by an inplace operation" where eager trains. Found in transformers 5.23:

- Chameleon's VQ-VAE resnet block: ``h = self.norm1(x); h *= torch.sigmoid(h)`` (GroupNorm);
- OLMoE's attention with ``config.clip_qkv``: ``query_states.clamp_(...)`` over ``q_norm``'s output;
- Mixtral's sparse MoE block with ``router_jitter_noise > 0`` in training: ``hidden_states *= ...``
  over ``post_attention_layernorm``'s output.

Where the parent's settings never take the writing branch (``clip_qkv=None``, no jitter) or the
write is to a fresh tensor (DeepSeek-V3's ``expand_kv``), the module still converts. Each row trains
eager and converted on the same batch (same seed) and compares the loss and every gradient by the
error rule against a float64 copy.
"""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
from slimgrad.testing import assert_within_rule, grads_of

transformers = pytest.importorskip("transformers")

_LM = dict(
    vocab_size=61,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
    pad_token_id=0,
)
CASES = {
    # name: (config class, model class, overrides, {module suffix: converts?})
    "olmoe_clip": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(num_experts=2, num_experts_per_tok=1, clip_qkv=0.05),
        {"self_attn.q_norm": False, "self_attn.k_norm": False},
    ),
    "olmoe_noclip": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(num_experts=2, num_experts_per_tok=1, clip_qkv=None),
        {"self_attn.q_norm": True, "self_attn.k_norm": True},
    ),
    "mixtral_jitter": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=2, num_experts_per_tok=1, router_jitter_noise=0.1),
        {"post_attention_layernorm": False, "input_layernorm": True},
    ),
    "mixtral_nojitter": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=2, num_experts_per_tok=1, router_jitter_noise=0.0),
        {"post_attention_layernorm": True},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=2,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=8,
            first_k_dense_replace=1,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        {"self_attn.kv_a_layernorm": True},
    ),
}


def _step(model, batch, f64=False):
    torch.manual_seed(3)
    loss = model(**batch).loss
    return loss.detach(), grads_of(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_forward_writing_in_place(name):
    cfg_cls, model_cls, over, expect = CASES[name]
    cfg = getattr(transformers, cfg_cls)(**_LM, **over, experts_implementation="eager")
    torch.manual_seed(0)
    eager = getattr(transformers, model_cls)(cfg).float().train()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    ref = copy.deepcopy(eager).double()
    kinds = {n: type(m).__module__ for n, m in conv.named_modules()}
    for suffix, converts in expect.items():
        names = [n for n in kinds if n.endswith(suffix)]
        assert names, suffix
        for n in names:
            assert kinds[n].startswith("slimgrad.") == converts, (n, str(slimgrad.report(conv)))
    if not all(expect.values()):
        why = [r for n, _, r in slimgrad.report(conv).skipped if n.endswith(tuple(expect))]
        assert why and all("in-place write" in r for r in why), str(slimgrad.report(conv))
    ids = torch.randint(4, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    le, ge = _step(eager, batch)
    lc, gc = _step(conv, batch)
    lr, gr = _step(ref, batch)
    assert_within_rule(lc, lr, le, atol=1e-6 * max(1.0, float(lr.abs())), names=["loss"])
    names = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert_within_rule(gc, gr, ge, names=names)


def test_chameleon_vqvae_block_norm_then_inplace_swish():
    from transformers.models.chameleon.modeling_chameleon import (
        ChameleonVQVAEEncoderResnetBlock,
    )

    torch.manual_seed(0)
    cfg = transformers.ChameleonConfig().vq_config
    eager = ChameleonVQVAEEncoderResnetBlock(cfg, 32, 32).train()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv.norm1) is torch.nn.GroupNorm and type(conv.norm2) is torch.nn.GroupNorm
    assert type(conv.conv1).__module__.startswith("slimgrad.")  # the rest still converts
    x = torch.randn(2, 32, 5, 5)
    for m in (eager, conv):
        torch.manual_seed(1)
        y = m(x)
        m.grads = torch.autograd.grad(y.square().sum(), list(m.parameters()))
        m.y = y.detach()
    torch.testing.assert_close(conv.y, eager.y, rtol=0, atol=0)
    for a, b in zip(conv.grads, eager.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _steer_(module, args, output):  # activation steering: edits the output in place
    output.mul_(1.5)


def _observe(module, args, output):  # reads only
    module.seen = output.shape


def _nets():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for name, mk in [
        ("LlamaRMSNorm", lambda: LlamaRMSNorm(64)),
        ("RMSNorm", lambda: torch.nn.RMSNorm(64)),
        ("LayerNorm", lambda: torch.nn.LayerNorm(64)),
        ("GELU", torch.nn.GELU),
    ]:
        torch.manual_seed(0)
        yield name, torch.nn.Sequential(torch.nn.Linear(64, 64), mk(), torch.nn.Linear(64, 64))


def _same_grads(eager, conv):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    ge = torch.autograd.grad(eager(x).square().sum(), list(eager.parameters()))
    gc = torch.autograd.grad(conv(x).square().sum(), list(conv.parameters()))
    for a, b in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("hook", [_steer_, _observe], ids=["in_place", "read_only"])
def test_forward_hook_before_convert_writing_the_output(hook):
    # a saver whose forward hook (registered before convert_) writes its output stays as it is
    for name, eager in _nets():
        eager[1].register_forward_hook(hook)
        conv = slimgrad.convert_(copy.deepcopy(eager))
        converted = type(conv[1]).__module__.startswith("slimgrad.")
        assert converted == (hook is _observe), (name, str(slimgrad.report(conv)))
        if hook is _steer_:
            why = [r for n, _, r in slimgrad.report(conv).skipped if n == "1"]
            assert why and "_steer_" in why[0], str(slimgrad.report(conv))
        _same_grads(eager, conv)


def test_forward_hook_after_convert_on_rms_norms():
    # NOTE [Forward hooks on an output-saving module] (nn/_hooks.py): hooks added to a converted
    # norm run on eager's ops (the float32 norms keep their output otherwise)
    for name, eager in _nets():
        if "RMSNorm" not in name:
            continue
        conv = slimgrad.convert_(copy.deepcopy(eager))
        assert type(conv[1]).__module__.startswith("slimgrad."), name
        for m in (eager, conv):
            m[1].register_forward_hook(_steer_)
        _same_grads(eager, conv)

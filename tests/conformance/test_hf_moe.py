"""Conformance rows of the HF MoE families (``convert_handlers/hf_moe.py``): its handler's gate.

Tiny Mixtral, Qwen2-MoE and Qwen3-MoE language models (OLMoE: its report row only, to keep the
suite short) built with ``experts_implementation="eager"`` (the loop the handler converts) and the
router's aux loss in the loss, converted with the default ``ConvertConfig`` (attention, norms,
gated MLPs, the LM loss and the expert banks together), and judged by
``test_hf_families.check_row``: every output, the loss and every gradient within the error rule
against a float64 copy, on unpadded and left/right padded batches, train and eval (eval also under
no_grad), the caller's batch unchanged.
"""

from __future__ import annotations

import pytest

import slimgrad
from slimgrad.convert_handlers.hf_moe import GatedExperts
from tests.conformance import _hf_families as H
from tests.conformance import test_hf_families as HF

pytest.importorskip("transformers")

_MOE = dict(
    H._LLAMA,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
    experts_implementation="eager",
)
FAMILIES = {
    f.name: f
    for f in [
        H.Family(
            "mixtral_moe",
            "MixtralConfig",
            "MixtralForCausalLM",
            "causal",
            dict(_MOE, intermediate_size=24, num_local_experts=4),
        ),
        H.Family(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            "causal",
            dict(_MOE, moe_intermediate_size=24, num_experts=4, shared_expert_intermediate_size=40),
        ),
        H.Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            "causal",
            dict(_MOE, head_dim=8, moe_intermediate_size=24, num_experts=4, norm_topk_prob=True),
        ),
        H.Family(
            "olmoe",
            "OlmoeConfig",
            "OlmoeForCausalLM",
            "causal",
            dict(_MOE, intermediate_size=24, num_experts=4),
        ),
    ]
}
# train and eval, unpadded and padded on each side, with and without labels (a subset of the
# families suite's grid: each row runs three models)
ROWS = [
    ("train", "none", True),
    ("train", "left", True),
    ("eval", "right", True),
    ("train", "none", False),
]


@pytest.fixture
def family(request, monkeypatch):
    # the suite's check_row looks families up in _hf_families.FAMILIES: these rows only, here
    name = request.param
    monkeypatch.setitem(H.FAMILIES, name, FAMILIES[name])
    return name


@pytest.mark.parametrize("family", ["mixtral_moe", "qwen2_moe", "qwen3_moe"], indirect=True)
@pytest.mark.parametrize("mode, pad, labels", ROWS)
def test_moe_family_row(family, mode, pad, labels):
    HF.check_row(family, mode, pad, labels)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_moe_family_report(family):
    # every expert bank of the model converts; whatever is skipped says why
    eager, conv, _ = HF._models(family)
    banks = [n for n, m in eager.named_modules() if type(m).__name__.endswith("Experts")]
    assert banks
    converted = {n for n, m in conv.named_modules() if isinstance(m, GatedExperts)}
    assert converted == set(banks), slimgrad.report(conv)
    assert all(why for _, _, why in slimgrad.report(conv).skipped)

"""HF MoE expert banks (``convert_handlers/hf_moe.py``): eager's bits, less kept, or untouched.

Each test builds a tiny HF sparse-MoE block (router + 3-D expert bank) with
``experts_implementation="eager"``, converts a copy with ``convert_`` (the expert bank only, so the
comparison is of this handler alone) and compares outputs and every gradient with eager's
(``rtol=0, atol=0``: the error rule is implied).
"""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
from slimgrad.convert_handlers import hf_moe
from slimgrad.convert_handlers.hf_moe import GatedExperts
from slimgrad.memory import measure

transformers = pytest.importorskip("transformers")

D, I, E = 12, 7, 5  # noqa: E741 - hidden, expert intermediate (odd), experts
# {family: (config class, modeling module, sparse block class, config fields)}
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "mixtral",
        "MixtralSparseMoeBlock",
        dict(intermediate_size=I, num_local_experts=E),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        dict(moe_intermediate_size=I, num_experts=E, shared_expert_intermediate_size=9),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        dict(moe_intermediate_size=I, num_experts=E, norm_topk_prob=True),
    ),
}


def _config(fam, k=2, **kw):
    cfg_name, _, _, fields = FAMILIES[fam]
    cfg = getattr(transformers, cfg_name)(
        hidden_size=D,
        num_attention_heads=2,
        num_experts_per_tok=k,
        hidden_act="silu",
        experts_implementation="eager",
        **{**fields, **kw},
    )
    cfg._experts_implementation = "eager"
    return cfg


def _block(fam, k=2, dtype=torch.float32, **kw):
    _, mod, cls, _ = FAMILIES[fam]
    modeling = getattr(getattr(transformers.models, mod), f"modeling_{mod}")
    torch.manual_seed(0)
    block = getattr(modeling, cls)(_config(fam, k, **kw))
    for p in block.parameters():  # HF leaves the banks uninitialised (torch.empty)
        torch.nn.init.normal_(p, std=0.3)
    return block.to(dtype)


def _only_experts(model):
    conv = slimgrad.convert_(
        copy.deepcopy(model), filter_fn=lambda m, name: type(m).__name__.endswith("Experts")
    )
    assert sum(isinstance(m, GatedExperts) for m in conv.modules()) >= 1, slimgrad.report(conv)
    return conv


def _step(block, x0, autocast=False, train=True):
    block.train(train)
    x = x0.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = block(x)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    grads = torch.autograd.grad(y, [x, *block.parameters()], gy)
    return y.detach(), grads


def _same(a, b):
    ya, ga = a
    yb, gb = b
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    assert len(ga) == len(gb)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("fam", sorted(FAMILIES))
@pytest.mark.parametrize(
    "dtype, autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "autocast"],
)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_expert_bank_matches_eager_bit_for_bit(fam, dtype, autocast, train):
    eager = _block(fam, dtype=dtype)
    conv = _only_experts(eager)
    x0 = torch.randn(2, 9, D).to(dtype)
    _same(_step(conv, x0, autocast, train), _step(eager, x0, autocast, train))


def test_expert_bank_no_grad_and_inference_mode():
    eager = _block("mixtral")
    conv = _only_experts(eager)
    x = torch.randn(2, 5, D)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            torch.testing.assert_close(conv(x), eager(x), rtol=0, atol=0)


def _bank(block):
    return next(m for m in block.modules() if type(m).__name__.endswith("Experts"))


def test_experts_without_tokens_and_the_sentinel():
    # top-1 over 5 experts, 3 tokens: at least two experts get no token (their slices of the
    # banks' gradients are zero in both); index E (expert-parallel's "not here") is skipped
    eager = _bank(_block("mixtral", k=1))
    holder = _only_experts(torch.nn.ModuleDict({"experts": eager}))
    conv = holder["experts"]
    assert isinstance(conv, GatedExperts)
    idx = torch.tensor([[1], [1], [E]])  # experts 0, 2, 3, 4 get nothing; token 2: sentinel
    w = torch.rand(3, 1)
    x0 = torch.randn(3, D)

    def run(m):
        x, ww = x0.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = m(x, idx, ww)
        return y.detach(), torch.autograd.grad(y.square().sum(), [x, ww, *m.parameters()])

    out_c, out_e = run(conv), run(eager)
    _same(out_c, out_e)
    g_gu = out_c[1][2]
    assert g_gu[[0, 2, 3, 4]].abs().sum() == 0 and g_gu[1].abs().sum() > 0
    assert out_c[0][2].abs().sum() == 0  # the sentinel token's output stays zero


def test_top_k_ties():
    # a zero router: every expert has the same probability, topk breaks the ties; the converted
    # bank follows the same routing (the router is untouched) with eager's bits
    eager = _block("qwen3_moe", k=2)
    with torch.no_grad():
        eager.gate.weight.zero_()
    conv = _only_experts(eager)
    x0 = torch.randn(1, 6, D)
    _same(_step(conv, x0), _step(eager, x0))


def _moe_lm(fam="mixtral"):
    cfg_name = FAMILIES[fam][0]
    model_cls = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[fam]
    cfg = _config(
        fam,
        vocab_size=53,
        num_hidden_layers=2,
        num_key_value_heads=2,
        output_router_logits=True,
        router_aux_loss_coef=0.3,
    )
    assert type(cfg).__name__ == cfg_name
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).train()
    for n, p in model.named_parameters():
        if "experts" in n:
            torch.nn.init.normal_(p, std=0.3)
    return model


@pytest.mark.parametrize("fam", ["mixtral", "qwen2_moe"])
def test_lm_with_router_aux_loss(fam):
    # the whole LM (router logits returned, aux loss in the loss): loss, aux loss and every
    # parameter's gradient are eager's bits with only the banks converted
    eager = _moe_lm(fam)
    conv = _only_experts(eager)
    ids = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (eager, conv):
        out = m(input_ids=ids, labels=ids)
        assert out.aux_loss is not None and out.aux_loss > 0
        grads = torch.autograd.grad(out.loss, list(m.parameters()))
        outs.append(((out.loss.detach(), out.aux_loss.detach()), grads))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    for a, b in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sorted(conv.state_dict()) == sorted(eager.state_dict())


def _saved_bytes(block, x0):
    x = x0.clone().requires_grad_(True)
    return measure(lambda: block(x), grad=torch.ones(x0.shape), timeline=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_memory_contract(dtype):
    # per (token, expert) pair: eager keeps x_e, the fused pre-activation, act(gate) and the
    # product; the converted bank keeps x_e and the pre-activation: 2 I elements less per pair,
    # exactly, and its op keeps x_e + gu = (D + 2 I) elements per pair
    k, tokens = 2, 2 * 9
    eager = _block("mixtral", k=k, dtype=dtype)
    conv = _only_experts(eager)
    x0 = torch.randn(2, 9, D).to(dtype)
    me, mc = _saved_bytes(eager, x0), _saved_bytes(conv, x0)
    s = torch.empty((), dtype=dtype).element_size()
    pairs = tokens * k
    assert me.saved_bytes - mc.saved_bytes == pairs * 2 * I * s
    assert mc.by_node["_GatedMLPFnBackward"] == pairs * (D + 2 * I) * s
    assert mc.peak_bytes < me.peak_bytes


def test_hooks_carried_and_state_shared():
    eager = _block("mixtral")
    seen = []
    bank = _bank(eager)
    bank.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    conv = _only_experts(eager)
    cbank = _bank(conv)
    assert isinstance(cbank, GatedExperts)
    conv(torch.randn(1, 4, D))
    assert seen == [torch.Size([4, D])]
    orig = slimgrad.convert_(torch.nn.ModuleDict({"e": bank}))["e"]
    assert isinstance(orig, GatedExperts) and orig.config is bank.config
    assert orig.gate_up_proj is bank.gate_up_proj and orig.down_proj is bank.down_proj
    assert orig.act_fn is bank.act_fn and orig.num_experts == bank.num_experts


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda b: setattr(b.config, "_experts_implementation", "grouped_mm"), "grouped_mm"),
        (lambda b: b.act_fn.register_forward_hook(lambda *a: None), "act_fn has hooks"),
        (lambda b: setattr(b, "act_fn", transformers.activations.NewGELUActivation()), "NewGELU"),
        (lambda b: setattr(b, "_is_expert_parallel", True), "expert-parallel"),
    ],
    ids=["grouped_mm", "hooked_act", "gelu_new", "expert_parallel"],
)
def test_left_untouched_with_reason(change, reason):
    bank = _bank(_block("mixtral"))
    change(bank)
    holder = slimgrad.convert_(torch.nn.ModuleDict({"e": bank}))
    assert holder["e"] is bank
    skipped = {name: why for name, _, why in slimgrad.report(holder).skipped}
    assert reason in skipped["e"], skipped


def test_call_time_dispatch_and_act_changes():
    # converted under "eager"; then the config switches implementation and act_fn is hooked: the
    # converted bank computes what the original computes then
    eager = _bank(_block("mixtral"))
    conv = slimgrad.convert_(torch.nn.ModuleDict({"e": copy.deepcopy(eager)}))["e"]
    assert isinstance(conv, GatedExperts)
    x = torch.randn(6, D)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [4, 0], [0, 2]])
    w = torch.rand(6, 2)
    for impl in ("batched_mm", "eager"):
        eager.config._experts_implementation = impl
        conv.config._experts_implementation = impl
        torch.testing.assert_close(conv(x, idx, w), eager(x, idx, w), rtol=0, atol=0)
    calls = []
    conv.act_fn.register_forward_hook(lambda *a: calls.append(1))
    torch.testing.assert_close(conv(x, idx, w), eager(x, idx, w), rtol=0, atol=0)
    assert len(calls) == 5  # the original loop ran: one act_fn call per expert hit


def test_lora_on_the_banks():
    # PEFT LoRA targeting the 3-D Parameters parametrizes the bank during its forward; the loop
    # reads each expert's weight view once, as eager does: the adapters' gradients are eager's
    peft = pytest.importorskip("peft")
    base = _moe_lm("mixtral")
    cfg = peft.LoraConfig(
        r=2, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]
    )
    eager = peft.get_peft_model(copy.deepcopy(base), cfg)
    for n, p in eager.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    conv = _only_experts(eager)
    ids = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(4))
    res = []
    for m in (eager, conv):
        loss = m(input_ids=ids, labels=ids).loss
        named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        assert named and all("lora" in n for n, _ in named)
        res.append((loss.detach(), torch.autograd.grad(loss, [p for _, p in named])))
    _same(res[1], res[0])


def test_every_table_class_is_the_template():
    # transformers' own classes (the table's keys) still have the template forward; a few
    # representative families (importing all ~50 modeling files is slow)
    import importlib

    for m, cls in [
        ("mixtral", "MixtralExperts"),
        ("olmoe", "OlmoeExperts"),
        ("jamba", "JambaExperts"),
    ]:
        klass = getattr(importlib.import_module(f"transformers.models.{m}.modeling_{m}"), cls)
        assert hf_moe._parts(klass) is not None, cls
        assert f"transformers.models.{m}.modeling_{m}.{cls}" in hf_moe.TABLE
    gpt_oss = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    assert hf_moe._parts(gpt_oss.GptOssExperts) is None  # biased, transposed banks

"""convert_ of HF gated MLPs (``convert_handlers/hf_mlp.py``): which instances convert, and that
the converted models compute what eager does (the HF families' rows are in tests/conformance)."""

import copy

import pytest
import torch

import slimgrad
from slimgrad.convert_handlers.hf_mlp import gated_mlp_from_hf
from slimgrad.memory import measure
from slimgrad.nn.gated_mlp import GatedMLP
from tests.conformance import _hf_families as H

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"]
ACT = {"gemma": "gelu_tanh", "gemma2": "gelu_tanh"}


def _mlps(model):
    return [m for n, m in model.named_modules() if n.endswith(".mlp")]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_converts_and_verifies(name):
    fam = H.FAMILIES[name]
    eager = H.build(fam)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    mlps = _mlps(conv)
    assert mlps and all(type(m) is GatedMLP for m in mlps), slimgrad.report(conv)
    assert {m.activation for m in mlps} == {ACT.get(name, "silu")}
    assert all(m.fused == (name == "phi3") for m in mlps)
    assert list(conv.state_dict()) == list(eager.state_dict())
    rep = slimgrad.verify(
        eager, conv, H.inputs(fam, eager, labels=True), padded=False, modes=("train",)
    )
    assert rep.ok, str(rep)


@pytest.mark.parametrize("name", ["llama", "gemma", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, "autocast"])
def test_mlp_bits_and_memory(name, dtype):
    # one HF MLP instance, as HF computes it: output and gradients bit for bit; saved bytes as the
    # op's contract (x + g + u) against eager's (x + g + act(g) + u + h)
    eager = H.build(H.FAMILIES[name]).model.layers[0].mlp
    wdt = torch.float32 if dtype == "autocast" else dtype
    eager = eager.to(wdt)
    conv = gated_mlp_from_hf(copy.deepcopy(eager))
    cfg = H.build(H.FAMILIES[name]).config
    d, i = cfg.hidden_size, cfg.intermediate_size
    # 120 tokens: where the op's backward peaks below eager's, so the module runs it (fewer: eager's
    # ops, NOTE [The gated MLP's peak against eager's] in ops/gated_mlp.py)
    x0 = torch.randn(3, 40, d).to(wdt)
    gy = torch.randn(3, 40, d)
    res, saved = [], []
    for m in (conv, eager):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
            y = m(x)
        ps = [x, *m.parameters()]
        res.append([y.detach(), *torch.autograd.grad((y.float() * gy).sum(), ps)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
            saved.append(measure(lambda m=m, x=x: m(x * 1).float().sum()).saved_bytes)
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    n, s_x = 3 * 40, x0.element_size()
    s = 2 if dtype == "autocast" else s_x
    assert saved[0] == n * d * s_x + 2 * n * i * s
    assert saved[0] < saved[1]


def test_moe_dense_and_shared_expert_mlps():
    # Qwen2-MoE: the shared expert and the dense layers are the template; the expert bank is not
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=H.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[0],
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    eager = transformers.Qwen2MoeForCausalLM(cfg).float().train()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    kinds = {n: type(m).__name__ for n, m in conv.named_modules()}
    assert kinds["model.layers.0.mlp"] == "GatedMLP"  # a dense layer
    assert kinds["model.layers.1.mlp.shared_expert"] == "GatedMLP"
    assert kinds["model.layers.1.mlp.experts"] == "Qwen2MoeExperts"
    batch = {"input_ids": torch.randint(4, H.VOCAB, (2, 9))}
    batch["labels"] = batch["input_ids"].clone()
    rep = slimgrad.verify(eager, conv, batch, padded=False)
    assert rep.ok, str(rep)


def test_not_converted_says_why():
    eager = H.build(H.FAMILIES["llama"])
    layers = eager.model.layers
    layers[0].mlp.act_fn = transformers.activations.NewGELUActivation()  # a python formula
    layers[1].mlp.forward = layers[1].mlp.forward  # a patched (instance) forward
    conv = slimgrad.convert_(eager)
    skipped = {n: r for n, _, r in slimgrad.report(conv).skipped}
    assert "NewGELUActivation" in skipped["model.layers.0.mlp"]
    assert "forward" in skipped["model.layers.1.mlp"]
    assert type(conv.model.layers[0].mlp).__name__ == "LlamaMLP"

    class Sum(transformers.models.llama.modeling_llama.LlamaMLP):
        def forward(self, x):  # not the template: a sum
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    with pytest.raises(NotImplementedError, match="not the gated-MLP template"):
        gated_mlp_from_hf(Sum(eager.config))


def test_roles_follow_the_template_not_the_names():
    # the template's shape decides which module gates: names swapped, the function is kept
    cfg = H.build(H.FAMILIES["llama"]).config

    class Swapped(transformers.models.llama.modeling_llama.LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    torch.manual_seed(0)
    eager = Swapped(cfg)
    conv = gated_mlp_from_hf(copy.deepcopy(eager))
    assert conv._roles == ("up_proj", "gate_proj", "down_proj", "act_fn")
    x = torch.randn(2, 5, cfg.hidden_size)
    torch.testing.assert_close(conv(x), eager(x), rtol=0, atol=0)


def test_mlp_hooks_carried():
    eager = H.build(H.FAMILIES["llama"])
    seen = []
    eager.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.append("mlp"))
    eager.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append("down"))
    conv = slimgrad.convert_(eager)
    assert type(conv.model.layers[0].mlp) is GatedMLP
    conv(torch.randint(4, H.VOCAB, (1, 5)))
    assert seen == ["down", "mlp"]


def test_config_off():
    eager = H.build(H.FAMILIES["llama"])
    conv = slimgrad.convert_(eager, slimgrad.ConvertConfig(activations=False))
    assert all(type(m).__name__ == "LlamaMLP" for m in _mlps(conv))

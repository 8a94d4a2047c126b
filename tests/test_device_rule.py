"""The device rule (NOTE [Never more than eager, per device and dtype]): decisions for cpu and cuda,
asserted on CPU (``convert_(..., device="cuda")`` and ``memory.estimate(..., device="cuda")``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad import convert as sconvert
from slimgrad.convert_handlers import device_rule
from slimgrad.memory import estimate

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# where slimgrad's replacement would keep more than eager's kernel: (family, device) -> dtypes
KEEPS_MORE = {("attention", "cuda"): {torch.float32, torch.bfloat16, torch.float16}}


def test_every_technique_has_a_rule():
    used = {t for t, _ in sconvert._TABLE.values()}
    used |= {t for t, _ in sconvert._PATTERNS if t is not None}
    assert used <= set(device_rule.RULES), used - set(device_rule.RULES)
    with pytest.raises(RuntimeError, match="has no device rule"):
        device_rule.check("nope", "cpu", torch.float32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("family", sorted(device_rule.RULES))
def test_decision_table(family, device):
    for dtype in DTYPES:
        why = device_rule.check(family, device, dtype)
        assert (why is not None) == (dtype in KEEPS_MORE.get((family, device), ())), (dtype, why)
    other = device_rule.check(family, "mps", torch.float32)
    assert (other is not None) == (family == "attention")


def test_stands_for_maps_tensor_devices_only():
    lin = nn.Linear(2, 2)
    assert device_rule.tensor_device("cpu") == "cpu"
    with device_rule.stands_for("cuda"):
        assert device_rule.tensor_device(torch.device("cpu")) == "cuda"
        assert device_rule.targets(lin) == (("cuda", torch.float32),)
        assert device_rule.targets(lin, "cpu") == (("cpu", torch.float32),)  # explicit: as given
    assert device_rule.tensor_device("cpu") == "cpu"


# --------------------------------------------------------------------- rule vs estimated bytes
# For each op family and device: where the rule lets slimgrad replace, the estimate of that
# device's kernels shows the converted module keeping no more than eager.


class _BNAct(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, dtype=dtype), nn.BatchNorm2d(4, dtype=dtype)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _mlp(mid):
    return lambda dtype: nn.Sequential(
        nn.Linear(8, 16, dtype=dtype), mid(dtype), nn.Linear(16, 8, dtype=dtype)
    )


_MODULES = {
    "activations": (_mlp(lambda dt: nn.GELU()), (6, 8)),
    "norms": (_mlp(lambda dt: nn.LayerNorm(16, dtype=dt)), (6, 8)),
    "dropout": (_mlp(lambda dt: nn.Dropout(0.3)), (6, 8)),
    "batch_norm": (_BNAct, (2, 3, 9, 9)),
}


def _saved(build, shape, device, dtype, convert):
    def make():  # built under fake tensors, as slimgrad.profile does
        torch.manual_seed(0)
        model = build(dtype).train()
        if convert:
            slimgrad.convert_(model, device=device)
            assert slimgrad.report(model).converted
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        return (lambda: model(x).float().sum()), model

    return estimate(make, device=device).saved_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("family", sorted(_MODULES))
def test_replacement_keeps_no_more_than_eager(family, device):
    build, shape = _MODULES[family]
    for dtype in (torch.float32, torch.bfloat16):
        assert device_rule.check(family, device, dtype) is None
        eager = _saved(build, shape, device, dtype, False)
        slim = _saved(build, shape, device, dtype, True)
        assert 0 < slim <= eager, (dtype, slim, eager)


def test_attention_rule_matches_the_bytes():
    # slimgrad's softmax -> dropout -> @V vs eager's SDPA, per device (modelled kernels)
    import importlib

    sdm = importlib.import_module("slimgrad.ops.softmax_dropout")

    def saved(device, ours):
        def make():
            q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))

            def fwd():
                if ours:
                    s = q @ k.transpose(-2, -1) * 8**-0.5
                    return sdm.softmax_dropout_matmul(s, v, 0.1, True, causal=True).sum()
                f = torch.nn.functional.scaled_dot_product_attention
                return f(q, k, v, dropout_p=0.1, is_causal=True).sum()

            return fwd

        return estimate(make, device=device).saved_bytes

    for device in ("cpu", "cuda"):
        keeps_more = saved(device, True) > saved(device, False)
        assert keeps_more == (device_rule.check("attention", device, torch.float32) is not None)


# --------------------------------------------------------------------------- convert_ decisions
transformers = pytest.importorskip("transformers")


def _gpt2(impl="sdpa"):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)
    cfg._attn_implementation = impl
    return transformers.GPT2LMHeadModel(cfg)


def _attention_rows(model):
    rep = slimgrad.report(model)
    conv = [r for r in rep.converted if "attention" in r[1]]
    skip = [r for r in rep.skipped if "attention" in r[1]]
    return rep, conv, skip


@pytest.mark.parametrize(
    "device,dtype,converts",
    [
        (None, None, True),
        ("cpu", torch.bfloat16, True),
        ("cuda", None, False),
        ("cuda", torch.bfloat16, False),
        ("cuda", torch.float64, True),
        ("mps", None, False),
    ],
)
def test_sdpa_attention_decision(device, dtype, converts):
    model = _gpt2()
    slimgrad.convert_(model, device=device, dtype=dtype)
    rep, conv, skip = _attention_rows(model)
    assert bool(conv) == converts and bool(skip) != converts
    assert (model.config._attn_implementation == "slimgrad") == converts
    if not converts:
        assert "SDPA kept" in skip[0][2]
    kind = torch.device(device).type if device else "cpu"
    assert f"decided for {kind}" in str(rep).splitlines()[0]
    assert any(to == "Dropout" for _, _, to in rep.converted)  # other families: every device


def test_eager_attention_converts_on_cuda():
    cfg = transformers.LlamaConfig(
        hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
        vocab_size=40, attention_dropout=0.1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    slimgrad.convert_(model, device="cuda")
    _, conv, skip = _attention_rows(model)
    assert conv and not skip and model.config._attn_implementation == "slimgrad_eager"


def test_default_decides_for_the_parameters_dtype():
    model = _gpt2().to(torch.bfloat16)
    slimgrad.convert_(model)
    assert slimgrad.report(model).targets == (("cpu", torch.bfloat16),)


def test_converted_on_cpu_keeps_sdpa_on_cuda_at_call_time():
    # converted for cpu, then run where CPU tensors stand for CUDA ones: SDPA's fused node, not
    # slimgrad's attention
    def make():
        torch.manual_seed(0)
        model = _gpt2()
        model.train()
        slimgrad.convert_(model, device="cpu")
        assert model.config._attn_implementation == "slimgrad"
        ids = torch.randint(0, 40, (2, 12))
        return (lambda: model(input_ids=ids, labels=ids).loss), model

    nodes = {d: set(estimate(make, device=d).by_node) for d in ("cpu", "cuda")}
    # GPT-2's attention output as one node on CPU (NOTE [GPT-2's attention node under dispatch
    # modes]): the estimate takes it where the real step does
    ours = {
        "_SoftmaxDropoutMatmulFnBackward",
        "_ScoresSoftmaxDropoutMatmulFnBackward",
        "_GPT2AttentionFnBackward",
    }
    assert ours & nodes["cpu"]
    assert not ours & nodes["cuda"]
    assert "ScaledDotProductEfficientAttentionBackward0" in nodes["cuda"]


def test_bad_device_and_dtype():
    with pytest.raises(ValueError, match="device must name a torch device"):
        slimgrad.convert_(nn.Linear(2, 2), device="gpu0")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        slimgrad.convert_(nn.Linear(2, 2), dtype=torch.int64)

"""convert_ on HF transformers models (tiny random configs) and on small plain-torch models."""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.memory import measure
from slimgrad.targets import resolve
from slimgrad.testing import assert_within_rule
from slimgrad.verify import _call

pytest.importorskip("transformers")

FAMILIES = ["gpt2", "bert", "llama", "vit", "resnet"]


def _pair(name: str):
    t = resolve(name, size="tiny", seq=16)
    torch.manual_seed(0)
    model = t.build()
    return t, model, slimgrad.convert_(copy.deepcopy(model))


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_match_eager_by_the_rule(name):
    t, model, conv = _pair(name)
    assert slimgrad.report(conv).converted, "nothing converted"
    torch.manual_seed(1)
    rep = slimgrad.verify(model, conv, t.inputs(2))
    assert rep.ok, str(rep)
    assert len(rep.grads) == sum(1 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_round_trip_and_idempotence(name):
    _, model, conv = _pair(name)
    a, b = model.state_dict(), conv.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    fresh = copy.deepcopy(conv)
    fresh.load_state_dict(model.state_dict())  # eager checkpoint -> converted model
    model.load_state_dict(conv.state_dict())  # and back
    again = slimgrad.convert_(conv)
    assert slimgrad.report(again).converted == []


# NOTE [Rows under the newest transformers] (tests/conformance/test_hf_families.py): the bytes a
# converted decoder keeps under the newest release, the RMSNorm template, the whole conversion
# under autocast and the fused loss without labels (the rest is in the families suite)
@pytest.mark.parametrize(
    "name", ["gpt2", pytest.param("llama", marks=pytest.mark.hf_release), "bert"]
)
def test_converted_saves_less(name):
    t, model, conv = _pair(name)
    inputs = t.inputs(2)
    figures = []
    for m in (model, conv):
        t.loss(_call(m, inputs)).backward()  # warm-up: one-time caches are not step memory
        m.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        figures.append(measure(lambda m=m: t.loss(_call(m, inputs)), module=m))
    eager, lean = figures
    assert lean.saved_bytes < 0.6 * eager.saved_bytes
    # at this tiny size the peak is the parameter gradients at the end of backward, for both
    assert lean.peak_bytes <= eager.peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "vit"])
def test_a_few_training_steps_match_eager(name):
    t, model, conv = _pair(name)
    losses = []
    for m in (model, conv):
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        curve = []
        for step in range(3):
            torch.manual_seed(100 + step)
            inputs = t.inputs(2)
            loss = t.loss(_call(m, inputs))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


@pytest.mark.hf_release
def test_filter_fn_and_skip_report():
    t = resolve("gpt2", size="tiny", seq=16)
    torch.manual_seed(0)
    model = t.build()
    slimgrad.convert_(model, filter_fn=lambda m, name: not name.startswith("transformer.h.0."))
    rep = slimgrad.report(model)
    assert type(model.transformer.h[0].ln_1) is nn.LayerNorm
    assert type(model.transformer.h[1].ln_1).__module__ == "slimgrad.nn.layer_norm"
    assert any(n == "transformer.h.0.ln_1" and "filter_fn" in r for n, _, r in rep.skipped)

    # bf16 weights: HF's RMSNorm converts too (HF's own cast order, bit for bit)
    llama = resolve("llama", size="tiny", seq=16).build().to(torch.bfloat16)
    slimgrad.convert_(llama)
    assert type(llama.model.norm).__name__ == "HFRMSNorm"
    assert "model.norm" not in {n for n, _, _ in slimgrad.report(llama).skipped}


@pytest.mark.hf_release
def test_fused_loss_keeps_no_logits_and_falls_back_without_labels():
    t, model, conv = _pair("gpt2")
    inputs = t.inputs(2)
    out = conv(**inputs)
    assert out.logits is None and out.loss is not None
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    logits = []
    for m in (model, conv):
        torch.manual_seed(4)  # same dropout masks
        logits.append(m(**no_labels).logits)
    torch.testing.assert_close(logits[1], logits[0])


@pytest.mark.hf_release
def test_autocast_bf16_gradients_within_rule():
    t, model, conv = _pair("gpt2")
    inputs = t.inputs(2)
    ref = copy.deepcopy(model).double()

    def grads(m, autocast):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = t.loss(_call(m, inputs))
        return torch.autograd.grad(loss, list(m.parameters()))

    g_ref = grads(ref, False)
    g_eager = grads(model, True)
    g_conv = grads(conv, True)
    names = [n for n, _ in model.named_parameters()]
    assert_within_rule(list(g_conv), list(g_ref), list(g_eager), names=names)


def _small_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(0.1),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 16),
        nn.LayerNorm(16),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(16, 4),
    )


def test_compile_on_a_converted_model():
    torch.manual_seed(0)
    model = _small_net()
    conv = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(4, 3, 6, 6)
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager")
    outs = []
    for m, params in ((model, model.parameters()), (compiled, conv.parameters())):
        torch.manual_seed(5)
        loss = m(x).square().mean()
        outs.append((loss, torch.autograd.grad(loss, list(params))))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fast_loss_option_matches_eager():
    t = resolve("gpt2", size="tiny", seq=32)
    torch.manual_seed(0)
    model = t.build()
    fast = slimgrad.convert_(copy.deepcopy(model), slimgrad.ConvertConfig(fast_loss=True))
    assert fast._slimgrad_fast_loss is True
    torch.manual_seed(1)
    rep = slimgrad.verify(model, fast, t.inputs(4))  # 4 x 32 tokens >= 64 wide: precomputed path
    assert rep.ok, str(rep)


def test_gpt2_gradient_buffer_reuse_changes_no_bit(monkeypatch):
    # issue 6: the converted GPT-2 (dropout on) with reuse on and off, same seed: every gradient
    # bit for bit, and reuse did happen (ln_f's dy from the fused loss and the blocks' gradient
    # buffers; attention recomputes P in backward, so no saved P is there to be reused)
    from slimgrad import ownership

    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)
    t, _, conv = _pair("gpt2")
    inputs = t.inputs(2)
    grads, counts = [], []
    for reuse in (True, False):
        ownership.reset_reuse_count()
        torch.manual_seed(5)
        with ownership.reuse_disabled() if not reuse else torch.enable_grad():
            t.loss(_call(conv, inputs)).backward()
        grads.append({n: p.grad for n, p in conv.named_parameters()})
        counts.append((ownership.reuse_count("grad"), ownership.reuse_count("saved")))
        conv.zero_grad(set_to_none=True)
    assert counts[1] == (0, 0)
    assert counts[0][0] >= 1, counts
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n

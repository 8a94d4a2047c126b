"""HF RMSNorms of every family (``convert_handlers/hf.py``, ``ops/rms_norm.hf_rms_norm``).

Each template is checked on a representative class: the converted module's forward equals HF's
bit for bit (value and dtype) for float32/bfloat16/float16 inputs, float32/bfloat16 weights, and
under CPU autocast; gradients equal eager's bit for bit where the input is kept (every dtype but
float32), and are within the error rule against a float64 reference where the output is kept
(float32); the memory contract holds exactly.
"""

import copy
import importlib

import pytest
import torch

import slimgrad
from slimgrad.convert_handlers import hf
from slimgrad.memory import measure
from slimgrad.nn.rms_norm import HFRMSNorm
from slimgrad.testing import assert_within_rule

pytest.importorskip("transformers")

# (qualified class, variant): the families of issue 14 and one class per template
CLASSES = [
    ("llama.modeling_llama.LlamaRMSNorm", "llama"),
    ("mistral.modeling_mistral.MistralRMSNorm", "llama"),
    ("qwen2.modeling_qwen2.Qwen2RMSNorm", "llama"),
    ("qwen3.modeling_qwen3.Qwen3RMSNorm", "llama"),
    ("phi3.modeling_phi3.Phi3RMSNorm", "llama"),
    ("olmo2.modeling_olmo2.Olmo2RMSNorm", "scale_then_cast"),
    ("helium.modeling_helium.HeliumRMSNorm", "fp32_scale_then_cast"),
    ("t5.modeling_t5.T5LayerNorm", "t5"),
    ("gemma.modeling_gemma.GemmaRMSNorm", "gemma"),
    ("gemma2.modeling_gemma2.Gemma2RMSNorm", "gemma"),
    ("gemma3.modeling_gemma3.Gemma3RMSNorm", "gemma"),
    ("muse_spark.modeling_muse_spark.MuseSparkTextCenteredRMSNorm", "centered"),
    ("moshi.modeling_moshi.MoshiRMSNorm", "float_scale"),
    ("gemma3n.modeling_gemma3n.Gemma3nRMSNorm", "float_scale_pow"),
    ("llama4.modeling_llama4.Llama4TextRMSNorm", "cast_then_scale"),
    ("llama4.modeling_llama4.Llama4TextL2Norm", "unweighted"),
]
D = 24


def _cls(path):
    mod, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{mod}"), name)


def _make(path, wdtype=torch.float32, zero=False):
    cls = _cls(path)
    try:
        m = cls(D, eps=1e-5)
    except TypeError:
        m = cls(eps=1e-5)
    w = getattr(m, "weight", None)
    if isinstance(w, torch.nn.Parameter):
        with torch.no_grad():
            w.copy_(0.3 + torch.randn(D))
            if zero:  # channels whose scale is 0: the float32 path keeps their input columns
                w[::5] = -1.0 if hf.rms_norm_variant(m)[0] in ("gemma", "centered") else 0.0
    return m.to(wdtype)


def _step(m, x, g, autocast=False):
    x = x.detach().clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = m(x)
    y.backward(g.to(y.dtype))
    w = getattr(m, "weight", None)
    gw = w.grad if isinstance(w, torch.nn.Parameter) else None
    return [y.detach(), x.grad, gw]


def _ref64(variant, m, x, g):
    # float64 math of the float32 path: y = x rsqrt(mean(x^2) + eps) * gamma
    x = x.detach().double().requires_grad_()
    eps = getattr(m, "eps", getattr(m, "variance_epsilon", None))
    w = getattr(m, "weight", None)
    w = w.detach().double().requires_grad_() if isinstance(w, torch.nn.Parameter) else None
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * ((1.0 + w) if variant in ("gemma", "centered") else w)
    y.backward(g.double())
    return [y.detach(), x.grad, w.grad if w is not None else None]


@pytest.mark.parametrize("path,variant", CLASSES)
def test_template_recognised(path, variant):
    assert hf.rms_norm_variant(_make(path)) == (
        variant,
        "variance_epsilon"
        if variant in ("llama", "scale_then_cast", "fp32_scale_then_cast", "t5")
        else "eps",
    )
    assert f"transformers.models.{path}" in hf.TABLE


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path,variant", CLASSES)
def test_forward_bit_for_bit_gradients_eager(path, variant, xdtype, wdtype, autocast):
    eager = _make(path, wdtype, zero=True)
    conv = hf.rms_norm_from_hf(copy.deepcopy(eager))
    assert isinstance(conv, HFRMSNorm) and conv.variant == variant
    x = (3 * torch.randn(3, 5, D) + 0.5).to(xdtype)
    g = torch.randn(3, 5, D)
    e, c = _step(eager, x, g, autocast), _step(conv, x, g, autocast)
    assert c[0].dtype == e[0].dtype
    torch.testing.assert_close(c[0], e[0], rtol=0, atol=0)  # forward: HF's bits
    if xdtype != torch.float32:  # keeps x, recomputes HF's forward: eager's gradient bits
        for a, b in zip(c[1:], e[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif e[0].dtype == torch.float32:
        names = ["y", "dx", "dw"] if e[2] is not None else ["y", "dx"]
        k = len(names)
        assert_within_rule(c[:k], _ref64(variant, eager, x, g)[:k], e[:k], names=names)
    else:  # T5 with half weights: its output is the weight's dtype; the input is kept
        for a, b in zip(c[1:], e[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gemma3n_without_scale_and_eval_no_grad():
    m = _cls("gemma3n.modeling_gemma3n.Gemma3nRMSNorm")(D, eps=1e-6, with_scale=False)
    c = hf.rms_norm_from_hf(copy.deepcopy(m))
    assert "weight" not in dict(c.named_parameters())
    x = torch.randn(4, D).to(torch.bfloat16)
    e, s = _step(m, x, torch.randn(4, D)), _step(c, x, torch.randn(4, D) * 0 + 1)
    torch.testing.assert_close(s[0], e[0], rtol=0, atol=0)
    m2 = _make("llama.modeling_llama.LlamaRMSNorm")
    c2 = hf.rms_norm_from_hf(copy.deepcopy(m2)).eval()
    with torch.no_grad():
        torch.testing.assert_close(c2(x), m2.eval()(x), rtol=0, atol=0)


def test_memory_contract():
    n = 29
    x0 = torch.randn(n, D, requires_grad=True)
    for dt, saved, eager_saved in [
        # float32: y (4 B/elt, shared with the next layer) + rstd; eager: x and x * rstd + rstd
        (torch.float32, 4 * n * D + 4 * n, 8 * n * D + 4 * n),
        # bf16: x (2 B/elt); eager: float32 x (4 B/elt) + the normalized bf16 tensor + rstd
        (torch.bfloat16, 2 * n * D, 6 * n * D + 4 * n),
    ]:
        m = _make("llama.modeling_llama.LlamaRMSNorm", dt)
        c = hf.rms_norm_from_hf(copy.deepcopy(m))
        got = measure(lambda c=c, dt=dt: c((x0 * 1).to(dt)).float().sum())
        want = measure(lambda m=m, dt=dt: m((x0 * 1).to(dt)).float().sum())
        assert (got.saved_bytes, want.saved_bytes) == (saved, eager_saved)


def _gemma64(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def test_double_backward():
    m = _make("gemma.modeling_gemma.GemmaRMSNorm", torch.bfloat16)
    c = hf.rms_norm_from_hf(copy.deepcopy(m))
    x = torch.randn(4, D).to(torch.bfloat16)
    w64 = m.weight.detach().double().requires_grad_()
    res = []
    for fn, dt, w in [(m, torch.bfloat16, m.weight), (c, torch.bfloat16, c.weight)] + [
        (lambda t: _gemma64(t, w64), torch.float64, w64)
    ]:
        xx = x.to(dt).requires_grad_()
        (gx,) = torch.autograd.grad(fn(xx).float().pow(2).sum(), xx, create_graph=True)
        res.append(list(torch.autograd.grad(gx.float().pow(2).sum(), [xx, w])))
    # the input is kept: eager's second derivatives (the same ops; summation order may differ)
    assert_within_rule(res[1], res[2], res[0], names=["ddx", "ddw"])
    # float32 keeps y: x rebuilt and bridged to the node (NOTE [RMSNorm's second derivatives
    # through its own node]), gamma = 1 + w differentiated as Gemma's own ops
    m32 = _make("gemma.modeling_gemma.GemmaRMSNorm")
    with torch.no_grad():
        m32.weight.uniform_(-0.5, 0.5)
    c32 = hf.rms_norm_from_hf(copy.deepcopy(m32))
    w64 = m32.weight.detach().double().requires_grad_()
    x = torch.randn(4, D)
    res = []
    for fn, dt, w in [(m32, torch.float32, m32.weight), (c32, torch.float32, c32.weight)] + [
        (lambda t: _gemma64(t, w64), torch.float64, w64)
    ]:
        xx = x.to(dt).requires_grad_()
        (gx,) = torch.autograd.grad(fn(xx).pow(3).sum(), xx, create_graph=True)
        res.append(list(torch.autograd.grad(gx.pow(2).sum(), [xx, w])))
    assert_within_rule(res[1], res[2], res[0], names=["ddx", "ddw"])


def test_other_code_is_refused_with_the_reason():
    cls = _cls("llama.modeling_llama.LlamaRMSNorm")

    class Scaled(cls):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    with pytest.raises(NotImplementedError, match="not one of the HF RMSNorm templates"):
        hf.rms_norm_variant(Scaled(D))
    patched = cls(D)
    patched.forward = lambda h: h
    with pytest.raises(NotImplementedError, match="patched on the instance"):
        hf.rms_norm_variant(patched)
    model = torch.nn.Sequential(cls(D), patched, cls(D))
    slimgrad.convert_(model)
    # the patched module stays, with the reason; the norm before it too: a forward slimgrad
    # cannot read may write its input, which would overwrite the output slimgrad's norm keeps
    # (NOTE [A forward set on the instance] in convert_handlers/inplace_guard.py); the last norm
    # converts
    assert type(model[0]) is cls and model[1] is patched and isinstance(model[2], HFRMSNorm)
    skipped = {n: why for n, _, why in slimgrad.report(model).skipped}
    assert sorted(skipped) == ["0", "1"]  # convert_ says why
    assert "forward set on the instance" in skipped["0"]


def test_state_dict_attributes_and_hooks_carried():
    m = torch.nn.Sequential(_make("t5.modeling_t5.T5LayerNorm"))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    seen = []
    m[0].register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    w = m[0].weight
    slimgrad.convert_(m)
    assert isinstance(m[0], HFRMSNorm) and m[0].weight is w
    assert m[0].variance_epsilon == 1e-5 and m.state_dict().keys() == sd.keys()
    m(torch.randn(2, D))
    assert seen == [torch.Size([2, D])]


def test_torch_func_runs_hfs_formula_and_jit_trace_refused():
    m = _make("gemma.modeling_gemma.GemmaRMSNorm")
    c = hf.rms_norm_from_hf(copy.deepcopy(m))
    x = torch.randn(3, D)
    got = torch.func.grad(lambda t: c(t).pow(3).sum())(x)
    torch.testing.assert_close(got, torch.func.grad(lambda t: m(t).pow(3).sum())(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="slimgrad.ops.rms_norm.hf_rms_norm: torch.jit.trace"):
        torch.jit.trace(c, (x.requires_grad_(),))

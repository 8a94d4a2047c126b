"""HF ``attn_implementation="eager"`` attention in every dtype, and T5 under CPU autocast.

NOTE [HF eager attention in every dtype] in ``slimgrad/convert_handlers/hf_attention.py`` and NOTE
[HF eager attention, recomputed in backward] in ``slimgrad/ops/softmax_dropout.py``. The family's
own ``eager_attention_forward`` against the converted attention, bit for bit (outputs and every
gradient): float32, float64, bfloat16, float16 and CPU autocast (bf16 and fp16; q and k float32
after RoPE, v float32 or bf16, HF's float32 mask), GQA, a padded row and a row that sees nothing,
dropout on and off, Gemma2's softcap; whole models in bf16, fp16 and autocast; per-call saved
bytes against eager's; the report when the cast order is not known.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch

import slimgrad
from slimgrad.memory import measure

transformers = pytest.importorskip("transformers")

from slimgrad.convert_handlers import hf_attention as H  # noqa: E402

V = 100
_LM = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=V)
_GQA = dict(_LM, num_hidden_layers=2, num_key_value_heads=2, attention_dropout=0.1)
CFG = slimgrad.ConvertConfig(
    activations=False, norms=False, fused_loss=False, selective_saving=False, batch_norm=False
)


def _family(name):
    # (modeling module, config) of a family whose attention calls its eager function
    t = transformers
    cfgs = {
        "llama": ("llama", t.LlamaConfig(**_GQA)),
        "mistral": ("mistral", t.MistralConfig(sliding_window=3, **_GQA)),
        "qwen2": ("qwen2", t.Qwen2Config(**_GQA)),
        "qwen3": ("qwen3", t.Qwen3Config(head_dim=8, **_GQA)),
        "gemma": ("gemma", t.GemmaConfig(head_dim=8, **_GQA)),
        "gemma2": ("gemma2", t.Gemma2Config(head_dim=8, sliding_window=3, **_GQA)),
        "phi3": ("phi3", t.Phi3Config(pad_token_id=0, **_GQA)),
        "bert": (
            "bert",
            t.BertConfig(num_hidden_layers=2, attention_probs_dropout_prob=0.1, **_LM),
        ),
    }
    mod, cfg = cfgs[name]
    cfg._attn_implementation = "eager"
    return t, cfg


@functools.cache
def _attention_module(name):
    # the first module of the family's model that dispatches through ALL_ATTENTION_FUNCTIONS
    modeling, cfg = _family(name)
    cls = {"bert": "BertForMaskedLM"}.get(name, f"{type(cfg).__name__[:-6]}ForCausalLM")
    torch.manual_seed(0)
    model = getattr(modeling, cls)(cfg)
    routed, reason = H._analyse(model)
    assert reason is None and routed, reason
    attn = H._class_named(model, routed[0].split(" ")[0])
    return next(m for m in model.modules() if type(m) is attn)


MODES = {  # (query dtype, key dtype, value dtype, mask dtype, autocast dtype)
    "fp32": (torch.float32,) * 4 + (None,),
    "fp64": (torch.float64,) * 4 + (None,),
    "bf16": (torch.bfloat16,) * 4 + (None,),
    "fp16": (torch.float16,) * 4 + (None,),
    # Llama & co. under autocast: q, k float32 after RoPE, v the projection's bf16, mask float32
    "autocast_bf16": (torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
    "autocast_bf16_v32": (torch.float32,) * 4 + (torch.bfloat16,),
    "autocast_fp16": (torch.float32, torch.float32, torch.float16, torch.float32, torch.float16),
}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "bert"]


def _autocast(dtype):
    return torch.autocast("cpu", dtype) if dtype is not None else contextlib.nullcontext()


def _qkv_mask(module, mode, b=2, q_len=5, k_len=7, d=8):
    qd, kd, vd, md, _ = MODES[mode]
    groups = getattr(module, "num_key_value_groups", 1)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, 2 * groups, q_len, d, generator=g, dtype=torch.float64).to(qd)
    k = torch.randn(b, 2, k_len, d, generator=g, dtype=torch.float64).to(kd)
    v = torch.randn(b, 2, k_len, d, generator=g, dtype=torch.float64).to(vd)
    mask = torch.zeros(b, 1, q_len, k_len, dtype=md)
    mask[0, :, :, :3] = torch.finfo(md).min  # left padding
    mask[1, :, 0, :] = torch.finfo(md).min  # a row that sees nothing
    return q, k, v, mask


class _Count:
    def __init__(self, monkeypatch):
        import slimgrad.ops.softmax_dropout as sdm

        # calls of slimgrad's op, not counting the probe's (which compares it with the original)
        self.n, self.probing = 0, 0
        real, real_probe = sdm.eager_attention, H._probe_run

        def counting(*a, **k):
            self.n += not self.probing
            return real(*a, **k)

        def probe(*a, **k):
            self.probing += 1
            try:
                return real_probe(*a, **k)
            finally:
                self.probing -= 1

        monkeypatch.setattr(sdm, "eager_attention", counting)
        monkeypatch.setattr(H, "_probe_run", probe)


def _kwargs(module, train):
    kw = {"dropout": 0.3 if train else 0.0, "scaling": 0.3}
    if getattr(module, "attn_logit_softcapping", None) is not None:
        kw["softcap"] = 2.0
    return kw


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FAMILIES)
def test_eager_attention_matches_the_family_function(name, mode, monkeypatch):
    module = _attention_module(name)
    original = H._eager_default(type(module))
    q, k, v, mask = _qkv_mask(module, mode)
    count = _Count(monkeypatch)
    for train in (True, False):  # dropout on; off (eval, or attention_dropout = 0) with grad
        module.train(train)
        kw = _kwargs(module, train)
        results = []
        for fn in (H._attention_eager, original):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(5)
            with _autocast(MODES[mode][4]):
                out, weights = fn(module, *leaves, mask, **kw)
            assert (weights is None) == (fn is H._attention_eager)
            g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
            results.append([out, *torch.autograd.grad(out, leaves, g)])
        for o, r in zip(*results):
            assert o.dtype == r.dtype  # float64: the row that sees nothing is NaN in both
            torch.testing.assert_close(o, r, rtol=0, atol=0, equal_nan=mode == "fp64")
    module.train()
    assert count.n == 2  # slimgrad's op ran, with dropout and without


@pytest.mark.parametrize("why", ["no_grad", "float_mask_needs_bool", "weights_wanted", "compile"])
def test_eager_attention_hands_the_rest_to_the_family_function(why, monkeypatch):
    module = _attention_module("llama")
    original = H._eager_default(type(module))
    q, k, v, mask = _qkv_mask(module, "bf16")
    if why == "float_mask_needs_bool":
        mask = mask == 0  # a bool mask: eager adds it as 0/1, slimgrad does not model that
    if why == "weights_wanted":
        monkeypatch.setattr(H, "_capture_wants_attentions", lambda: True)
    if why == "compile":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    count = _Count(monkeypatch)
    outs = []
    for fn in (H._attention_eager, original):
        torch.manual_seed(5)
        with torch.set_grad_enabled(why != "no_grad"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            outs.append(fn(module, *leaves, mask, dropout=0.3, scaling=0.3))
    assert count.n == 0
    assert outs[0][1] is not None  # the family's function ran: it returns its weights
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)


# Per-call saved bytes (slimgrad.memory.measure): B=2, H=4, T=16, d=8, no GQA; q, k, v are the
# caller's (not step tensors, except their autocast casts); S = B*H*T*T scores.
_B, _H, _T, _D = 2, 4, 16, 8
_S, _QKV = _B * _H * _T * _T, _B * _H * _T * _D


def _eager_saved(mode, train):
    qd, kd, vd, _, ac = MODES[mode]
    if ac is not None:  # q, k, v cast for the matmuls; P, noise (float32), the dropped P cast
        casts = sum(_QKV * 2 for t in (qd, kd, vd) if t != ac)
        return casts + (_S * (4 + 4 + 2) if train else _S * (4 + 2))
    size = torch.empty((), dtype=qd).element_size()
    if qd == torch.float32:  # P, noise, dropped P; without dropout P (cast is a no-op)
        return _S * 3 * size if train else _S * size
    # float32 P, then the cast P: noise and dropped P in the half dtype, or the cast P alone
    return _S * 4 + (_S * 2 * size if train else _S * size)


def _ours_saved(mode, train):
    qd, kd, vd, _, ac = MODES[mode]
    casts = sum(_QKV * 2 for t in (qd, kd, vd) if ac is not None and t != ac)
    return casts + (_S // 8 if train else 0)  # the casts eager keeps too; 1 bit per score


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "autocast_bf16", "autocast_bf16_v32"])
def test_eager_attention_saved_bytes_per_call(mode, train):
    module = _attention_module("qwen2")
    groups = module.num_key_value_groups
    module.num_key_value_groups = 1
    original = H._eager_default(type(module))
    qd, kd, vd, md, ac = MODES[mode]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(_B, _H, _T, _D, generator=g).to(dt).requires_grad_() for dt in (qd, kd, vd)
    )
    mask = torch.zeros(_B, 1, _T, _T, dtype=md)
    mask[0, :, :, :3] = torch.finfo(md).min
    kw = {"dropout": 0.3 if train else 0.0, "scaling": 0.3}
    saved, peak = {}, {}
    try:
        module.train(train)
        for fn in (H._attention_eager, original):
            with _autocast(ac):  # the probe runs once, outside the measured call
                fn(module, q, k, v, mask, **kw)
            with _autocast(ac):  # a fresh region: no cast cached from the call above
                m = measure(lambda fn=fn: fn(module, q, k, v, mask, **kw)[0].float().sum())
            saved[fn], peak[fn] = m.saved_bytes, m.peak_bytes
    finally:
        module.num_key_value_groups = groups
        module.train()
    assert saved[original] == _eager_saved(mode, train)
    assert saved[H._attention_eager] == _ours_saved(mode, train)


# Whole models: the converted model's loss and gradients are eager's, bit for bit.


def _model(name, dtype):
    modeling, cfg = _family(name)
    cls = {"bert": "BertForMaskedLM"}.get(name, f"{type(cfg).__name__[:-6]}ForCausalLM")
    torch.manual_seed(0)
    eager = getattr(modeling, cls)(cfg).to(dtype)
    return eager, slimgrad.convert_(copy.deepcopy(eager), CFG)


def _batch(pad):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0 if pad == "left" else 1
    mask[0, -3:] = 0 if pad == "right" else 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _loss_grads(model, batch, autocast, train, **kw):
    model.train(train)
    torch.manual_seed(7)
    with _autocast(autocast):
        out = model(**batch, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(out.loss.float(), params, allow_unused=True)


MODEL_ROWS = [  # (family, weights dtype, autocast dtype, pad, train)
    ("llama", torch.bfloat16, None, "left", True),
    ("llama", torch.float32, torch.bfloat16, "right", True),
    ("mistral", torch.float16, None, "left", True),
    ("qwen2", torch.float32, torch.bfloat16, "left", True),
    ("qwen3", torch.bfloat16, None, "right", False),
    ("gemma", torch.float16, None, "right", True),
    ("gemma2", torch.bfloat16, None, "left", True),
    ("gemma2", torch.float32, torch.bfloat16, "left", True),
    ("phi3", torch.bfloat16, None, "left", True),
    ("bert", torch.bfloat16, None, "right", True),
    ("bert", torch.float32, torch.bfloat16, "left", False),
]


@pytest.mark.parametrize(
    "name,dtype,autocast,pad,train",
    [
        pytest.param(*r, id=f"{r[0]}-{str(r[1])[6:]}-{r[2] and 'autocast'}-{r[3]}-{r[4]}")
        for r in MODEL_ROWS
    ],
)
def test_eager_model_matches_in_half_precision(name, dtype, autocast, pad, train, monkeypatch):
    eager, conv = _model(name, dtype)
    rep = slimgrad.report(conv)
    assert any("attention (eager)" in r[1] for r in rep.converted), rep.skipped
    batch = _batch(pad)
    ref, ref_grads = _loss_grads(eager, batch, autocast, train)
    count = _Count(monkeypatch)
    out, grads = _loss_grads(conv, batch, autocast, train)
    assert count.n == 2  # both layers, with grad (dropout on in train, off in eval)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_output_attentions_runs_the_family_function_in_bf16(monkeypatch):
    eager, conv = _model("llama", torch.bfloat16)
    batch = _batch("left")
    ref, ref_grads = _loss_grads(eager, batch, None, True, output_attentions=True)
    count = _Count(monkeypatch)
    out, grads = _loss_grads(conv, batch, None, True, output_attentions=True)
    assert count.n == 0
    assert len(out.attentions) == len(ref.attentions) == 2
    for a, b in zip((out.loss, *out.attentions), (ref.loss, *ref.attentions)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eager_model_keeps_less_in_bf16_and_autocast():
    # the whole step (2 layers, 8 tokens): eager keeps float32 P, noise and dropped P per layer
    eager, conv = _model("llama", torch.bfloat16)
    batch = _batch("left")
    for m in (eager, conv):
        m.train()
    saved = {}
    for m in (eager, conv):
        torch.manual_seed(7)
        r = measure(lambda m=m: m(**batch).loss.float())
        saved[m is conv] = (r.saved_bytes, r.peak_bytes)
    s = 2 * 4 * 8 * 8  # scores per layer (B x H x T x T)
    # per layer: 8 B/elt (P fp32 4, noise 2, dropped P 2) -> 1/8 B/elt; HF's bf16 mask
    # (B x 1 x T x T, one for both layers) is kept by reference
    assert saved[False][0] - saved[True][0] == 2 * (8 * s - s // 8) - 2 * 8 * 8 * 2
    assert saved[True][1] < saved[False][1]


# The report: no conversion where the cast order around softmax is not HF's known one.


def _softmax_in_bf16(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    w = torch.nn.functional.softmax(query @ key.mT * scaling, dim=-1, dtype=torch.bfloat16)
    return w @ value, w


def _two_softmaxes(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    w = torch.softmax(torch.softmax(query @ key.mT, -1), -1)
    return w @ value, w


def _cast_twice(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    w = torch.softmax(query @ key.mT, -1, dtype=torch.float32).to(query.dtype).to(value.dtype)
    return w @ value, w


def test_eager_variant_is_read_from_the_family_function():
    from transformers.models.bert.modeling_bert import eager_attention_forward as bert
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward as gpt2
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama

    assert H._eager_variant(llama)[0] == (True, "query")
    assert H._eager_variant(bert)[0] == (False, None)
    assert H._eager_variant(gpt2)[0] == (False, "value")
    variant, why = H._eager_variant(_softmax_in_bf16)
    assert variant is None and "runs softmax in torch.bfloat16, not float32" in why
    variant, why = H._eager_variant(_two_softmaxes)
    assert variant is None and "calls softmax 2 times" in why
    variant, why = H._eager_variant(_cast_twice)
    assert variant is None and "casts the probabilities 2 times" in why


def test_report_says_why_when_the_probe_fails(monkeypatch):
    # a dtype where slimgrad's computation is not proven equal keeps the family's function
    monkeypatch.setattr(H, "_probe", lambda *a, **k: False)
    eager, conv = _model("llama", torch.bfloat16)
    rep = slimgrad.report(conv)
    assert not any("attention" in r[1] for r in rep.converted)
    (why,) = [r[2] for r in rep.skipped if "attention" in r[1]]
    assert "not bit for bit equal to modeling_llama.eager_attention_forward in bfloat16" in why
    assert conv.config._attn_implementation == "eager"


# T5 under CPU autocast: a float32 position bias with a bf16/fp16 query (issue 14)


def _t5():
    cfg = transformers.T5Config(
        num_layers=2,
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=64,
        vocab_size=V,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    eager = transformers.T5ForConditionalGeneration(cfg)
    return eager, slimgrad.convert_(copy.deepcopy(eager), CFG)


@pytest.mark.parametrize("pad", ["left", "right"])
@pytest.mark.parametrize("ac", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_t5_autocast_position_bias_converts_exactly(ac, pad, monkeypatch):
    import slimgrad.ops.softmax_dropout as sdm

    eager, conv = _t5()
    batch = _batch(pad)
    batch["labels"] = batch["labels"][:, :5].contiguous()
    ref, ref_grads = _loss_grads(eager, batch, ac, True)
    calls = []
    real = sdm.softmax_dropout_matmul
    monkeypatch.setattr(
        sdm, "softmax_dropout_matmul", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    out, grads = _loss_grads(conv, batch, ac, True)
    assert len(calls) == 6  # encoder self, decoder self and cross, 2 layers each
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_t5_autocast_attention_function_matches_sdpa_and_keeps_less():
    # the call T5 makes under autocast: bf16 q, k, v (the projections), a float32 position bias
    # (the bias embedding) with a bool padding mask; per call: eager's SDPA math path keeps
    # float32 q, k, v copies, P, noise and dropped P (float32, T x T); slimgrad keeps q, k
    # (float32 copies), P (a float mask: P is kept) and 1 bit per score
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attn(torch.nn.Module):
        is_causal = False

    b, h, t, d = 2, 4, 16, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16() for _ in range(3))
    bias = torch.randn(1, h, t, t, generator=g)
    mask = torch.ones(b, 1, t, t, dtype=torch.bool)
    mask[0, :, :, :3] = False
    results, saved = [], {}
    for fn in (H._attention, sdpa_attention_forward):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        with torch.autocast("cpu", torch.bfloat16):
            torch.manual_seed(5)
            out = fn(Attn(), *leaves[:3], mask, dropout=0.3, scaling=1.0, position_bias=leaves[3])[
                0
            ]
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).bfloat16())
        # (copies: the measured step's backward below adds into the same .grad tensors, inside
        # autocast, where slimgrad's backward runs without it: NOTE [Backward without autocast])
        results.append([out, *(x.grad.clone() for x in leaves)])
        with torch.autocast("cpu", torch.bfloat16):
            m = measure(
                lambda fn=fn, x=leaves: (
                    fn(Attn(), *x[:3], mask, dropout=0.3, scaling=1.0, position_bias=x[3])[0]
                    .float()
                    .sum()
                )
            )
        saved[fn] = m.saved_bytes
    for o, r in zip(*results):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    s, qkv = b * h * t * t, b * h * t * d
    assert saved[H._attention] == 2 * qkv * 4 + s * 4 + s // 8
    assert saved[sdpa_attention_forward] == 3 * qkv * 4 + 3 * s * 4


def test_probe_under_disabled_saved_tensor_hooks_still_answers(monkeypatch):
    # the probe runs under saved-tensor hooks of its own (a checkpointed region must not see its
    # saved tensors); where hooks are disabled (vmap, aot_autograd use
    # torch.autograd.graph.disable_saved_tensors_hooks) pushing them raises: the probe then runs
    # without them instead of answering False, which was cached for the process and turned
    # slimgrad's eager attention off for every later call
    _, cfg = _family("llama")
    torch.manual_seed(0)
    m = slimgrad.convert_(transformers.LlamaForCausalLM(cfg).train())
    monkeypatch.setattr(H, "_PROBES", {})  # convert_ may have probed already
    ids = torch.randint(0, V, (2, 9))
    with torch.autograd.graph.disable_saved_tensors_hooks("probe test"):
        m(input_ids=ids, labels=ids).loss.backward()
    assert H._PROBES and all(H._PROBES.values()), H._PROBES

"""convert_'s fused LM-head loss on HF families (tiny random configs, CPU): exact where applied.

Every family: converted vs eager by the error rule (loss and every gradient, float64 reference),
train with labels (padded labels -100, num_items_in_batch), eval / no_grad with labels (logits as
HF returns them), and the report converts or names why not. Dropout probabilities are 0 in these
configs so that the float64 reference draws no masks: the loss is what is under test here.
Attention masks are all ones (unpadded): padding in attention is tested by the attention suite.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch

import slimgrad
from slimgrad.testing import assert_within_rule
from tests._threads import one_thread

transformers = pytest.importorskip("transformers")

V, T, B = 97, 11, 2
_TX = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
_LLAMA = dict(_TX, intermediate_size=48, num_key_value_heads=2, max_position_embeddings=64)
_NO_DROP = dict(attention_dropout=0.0)
_BERT = dict(
    _TX,
    intermediate_size=48,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    max_position_embeddings=64,
)
# name: (config class, model class, config kwargs, causal)
FAMILIES = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=V,
            n_embd=32,
            n_head=4,
            n_layer=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),  # fmt: skip
        True,
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA, **_NO_DROP), True),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LLAMA, **_NO_DROP), True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA, **_NO_DROP), True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_LLAMA, head_dim=8, **_NO_DROP), True),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(_LLAMA, head_dim=8, final_logit_softcapping=0.7, **_NO_DROP),
        True,
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(_LLAMA, logits_scaling=3.0, **_NO_DROP),
        True,
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(_LLAMA, logit_scale=0.4, **_NO_DROP),
        True,
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_LLAMA, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, **_NO_DROP),
        True,
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            _TX,
            ffn_dim=48,
            dropout=0.0,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            pad_token_id=1,
            **_NO_DROP,
        ),  # fmt: skip
        True,
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _LLAMA,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
            **_NO_DROP,
        ),  # fmt: skip
        True,
    ),
    "bert": ("BertConfig", "BertForMaskedLM", _BERT, False),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(_BERT, pad_token_id=1), False),
    "xlm-roberta": (
        "XLMRobertaConfig",
        "XLMRobertaForMaskedLM",
        dict(_BERT, pad_token_id=1),
        False,
    ),
    "electra": (
        "ElectraConfig",
        "ElectraForMaskedLM",
        dict(_BERT, embedding_size=24),
        False,
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(
            vocab_size=V,
            dim=32,
            n_heads=4,
            n_layers=2,
            hidden_dim=48,
            dropout=0.0,
            attention_dropout=0.0,
            max_position_embeddings=64,
        ),  # fmt: skip
        False,
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny shapes: intra-op threads only add spin-wait time on a shared 2-core machine
    with one_thread():
        yield


def _build(name, **over):
    cfg_cls, model_cls, kw, _ = FAMILIES[name]
    cfg = getattr(transformers, cfg_cls)(**dict(kw, **over))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # HF initialises some biases and scales to 0/1: make every term count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def _inputs(name, padded=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    causal = FAMILIES[name][3]
    if causal:
        labels = ids.clone()
        if padded:
            labels[0, :3] = -100
            labels[1, -4:] = -100
    else:
        mask = torch.rand(B, T, generator=g) < (0.4 if padded else 0.9)
        mask[0, 0] = True
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _loss_and_grads(model, inputs, **kw):
    out = model(**inputs, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    return out, [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]


def _config(name):
    # gemma2: the attention pass is off (its softcap attention is another engineer's work in
    # progress); the loss is what this file tests
    return slimgrad.ConvertConfig(dropout=False) if name == "gemma2" else None


@functools.cache
def _models(name):
    # (eager, converted, float64 copy) of a family with its own config, built once per process:
    # the tests reading them only run forwards in train/eval and take autograd.grad (no .grad,
    # no parameter or buffer changes; dropout is 0), each setting the mode it runs in
    eager = _build(name)
    conv = slimgrad.convert_(copy.deepcopy(eager), _config(name))
    return eager, conv, copy.deepcopy(eager).double()


def _fused(model) -> bool:
    rep = slimgrad.report(model)
    return any(a.endswith(".forward") and "loss" in what for _, a, what in rep.converted)


# padded labels (-100) everywhere; the causal LMs also with num_items_in_batch (gradient
# accumulation), and GPT-2 / Gemma2 also unpadded with the plain mean
CASES = [(n, True, FAMILIES[n][3]) for n in FAMILIES] + [("gpt2", False, False),
                                                         ("gemma2", False, False)]  # fmt: skip
# NOTE [Rows under the newest transformers] (tests/conformance/test_hf_families.py): every
# family's padded row reads its release's loss function and forward; the unpadded two repeat them
_RELEASE_CASES = [pytest.param(*c, marks=pytest.mark.hf_release) if c[1] else c for c in CASES]


@pytest.mark.parametrize("name,padded,num_items", _RELEASE_CASES)
def test_train_loss_and_every_gradient_within_rule(name, padded, num_items):
    eager, conv, ref = _models(name)
    for m in (eager, conv, ref):
        m.train()
    assert _fused(conv), str(slimgrad.report(conv))
    inputs = _inputs(name, padded)
    kw = {"num_items_in_batch": torch.tensor(7)} if num_items else {}
    out_e, g_e = _loss_and_grads(eager, inputs, **kw)
    out_r, g_r = _loss_and_grads(ref, inputs, **kw)
    out_c, g_c = _loss_and_grads(conv, inputs, **kw)
    assert out_c.logits is None and out_e.logits is not None  # fused: no logits in training
    # the loss is a sum over tokens, in another order than eager's: atol relative to its size
    atol = 4 * torch.finfo(torch.float32).eps * abs(out_r.loss.item())
    assert_within_rule(out_c.loss, out_r.loss, out_e.loss, atol=atol, names=["loss"])
    names = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert_within_rule(g_c, g_r, g_e, names=names)


@pytest.mark.hf_release
@pytest.mark.parametrize("name", list(FAMILIES))
def test_eval_and_no_grad_with_labels_return_hf_logits(name):
    eager, conv, _ = _models(name)
    inputs = _inputs(name, padded=True)
    for mode in ("eval", "no_grad"):
        outs = []
        for m in (eager, conv):
            if mode == "eval":
                m.eval()
                outs.append(m(**inputs))
            else:
                m.train()
                with torch.no_grad():
                    outs.append(m(**inputs))
        e, c = outs
        assert c.logits is not None, mode
        torch.testing.assert_close(c.logits, e.logits)
        torch.testing.assert_close(c.loss, e.loss)


@pytest.mark.hf_release
def test_mixtral_router_aux_loss_keeps_hf_forward():
    eager = _build("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    skipped = {n: r for n, _, r in slimgrad.report(conv).skipped}
    assert "router aux loss" in skipped[""], str(slimgrad.report(conv))
    assert not _fused(conv)
    inputs = _inputs("mixtral", padded=True)
    kw = {"num_items_in_batch": torch.tensor(7)}
    (e, ge), (c, gc) = _loss_and_grads(eager, inputs, **kw), _loss_and_grads(conv, inputs, **kw)
    r, gr = _loss_and_grads(copy.deepcopy(eager).double(), inputs, **kw)
    assert c.aux_loss is not None and c.logits is not None
    atol = 4 * torch.finfo(torch.float32).eps * abs(r.loss.item())
    assert_within_rule(c.loss, r.loss, e.loss, atol=atol, names=["loss"])
    assert_within_rule(c.aux_loss, r.aux_loss, e.aux_loss, atol=atol, names=["aux_loss"])
    names = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert_within_rule(gc, gr, ge, names=names)
    # off in the config, asked for in the call: this call runs HF's forward, aux loss included
    eager = _build("mixtral", router_aux_loss_coef=0.5)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert _fused(conv)
    e = eager(**inputs, output_router_logits=True)
    c = conv(**inputs, output_router_logits=True)
    assert c.logits is not None
    torch.testing.assert_close(c.loss, e.loss)
    assert conv(**inputs).logits is None  # and the fused loss otherwise


@pytest.mark.hf_release
def test_keep_logits_returns_detached_logits_at_no_extra_saved_bytes():
    from slimgrad.memory import measure

    eager = _build("gemma2")
    figures = []
    for keep in (False, True):
        cfg = slimgrad.ConvertConfig(dropout=False, keep_logits=keep)
        conv = slimgrad.convert_(copy.deepcopy(eager), cfg)
        inputs = _inputs("gemma2", padded=True)
        out = conv(**inputs)
        if keep:
            e = eager(**inputs)
            assert out.logits is not None
            torch.testing.assert_close(out.logits.detach(), e.logits.detach())
            # a loss that uses them fails loudly (no silent missing gradient term)
            with pytest.raises(RuntimeError, match="slimgrad.ConvertConfig.keep_logits"):
                (out.loss + out.logits.float().logsumexp(-1).mean()).backward(retain_graph=True)
            conv.zero_grad(set_to_none=True)
        else:
            assert out.logits is None
        out.loss.backward()  # warm-up: one-time caches are not step memory
        conv.zero_grad(set_to_none=True)
        figures.append(measure(lambda c=conv, i=inputs: c(**i).loss, module=conv))
    assert figures[1].saved_bytes == figures[0].saved_bytes


def test_subclass_overriding_forward_is_skipped_with_reason():
    base = transformers.LlamaForCausalLM

    class Custom(base):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            out.loss = out.logits.float().square().mean()
            return out

    class Plain(base):  # same forward: converts
        pass

    cfg = getattr(transformers, FAMILIES["llama"][0])(**FAMILIES["llama"][2])
    for cls, fused in ((Custom, False), (Plain, True)):
        model = cls(cfg).train()
        slimgrad.convert_(model)
        assert _fused(model) is fused
        if not fused:
            skipped = {n: r for n, _, r in slimgrad.report(model).skipped}
            assert "not a known LM template" in skipped[""]


def test_hooked_or_wrapped_head_runs_hf_forward():
    eager = _build("gpt2")
    conv = slimgrad.convert_(copy.deepcopy(eager))
    inputs = _inputs("gpt2", padded=True)
    seen = []
    for m in (eager, conv):
        m.lm_head.register_forward_hook(lambda mod, a, out: seen.append(out.sum().item()))
    e, c = eager(**inputs), conv(**inputs)
    assert len(seen) == 2 and c.logits is not None  # the hook ran: HF's forward
    torch.testing.assert_close(c.loss, e.loss)


def _roundtrip(kind, model):
    if kind == "deepcopy":
        return copy.deepcopy(model)
    if kind == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(
    "name,kind",
    [
        pytest.param(
            n, k, marks=[pytest.mark.hf_release] if n == "gpt2" and k != "torch.save" else []
        )
        for k in ["torch.save", "deepcopy", "pickle"]
        for n in ["gpt2", "bert"]
    ],
)
def test_converted_model_survives_copies(name, kind):
    conv = slimgrad.convert_(_build(name))
    back = _roundtrip(kind, conv)
    assert back.forward.model is back  # the fused forward belongs to the copy
    inputs = _inputs(name, padded=True)
    a, ga = _loss_and_grads(conv, inputs)
    b, gb = _loss_and_grads(back, inputs)
    assert a.logits is None and b.logits is None  # still fused
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(gb, ga)
    assert back.state_dict().keys() == conv.state_dict().keys()


@pytest.mark.hf_release
@pytest.mark.parametrize("name", ["gpt2", "gemma2", "bert"])
def test_save_pretrained_loads_into_the_plain_class(name, tmp_path):
    eager = _build(name)
    conv = slimgrad.convert_(copy.deepcopy(eager), _config(name))
    conv.save_pretrained(tmp_path)
    plain = type(eager).from_pretrained(tmp_path).eval()
    assert "forward" not in plain.__dict__
    sd, sd_e = plain.state_dict(), eager.state_dict()
    assert sd.keys() == sd_e.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], sd_e[k], rtol=0, atol=0)
    inputs = _inputs(name, padded=True)
    e, p = eager.eval()(**inputs), plain(**inputs)
    torch.testing.assert_close(p.logits, e.logits)
    torch.testing.assert_close(p.loss, e.loss)


_LORA = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("order", ["peft_then_convert", "convert_then_peft"])
def test_peft_lora_before_and_after_convert(name, order):
    peft = pytest.importorskip("peft")

    def lora(model):
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=_LORA[name], lora_dropout=0.0,
                              init_lora_weights=False, fan_in_fan_out=name == "gpt2")  # fmt: skip
        torch.manual_seed(3)
        return peft.get_peft_model(model, cfg)

    eager = lora(_build(name))
    if order == "peft_then_convert":
        conv = slimgrad.convert_(copy.deepcopy(eager))
    else:
        conv = lora(slimgrad.convert_(_build(name)))
    n_lora = sum("lora_A" in n for n, _ in conv.named_parameters())
    assert n_lora == sum("lora_A" in n for n, _ in eager.named_parameters()) > 0
    assert _fused(conv if order == "peft_then_convert" else conv.base_model.model)
    lean = slimgrad.nn.Conv1D if name == "gpt2" else torch.nn.Linear
    bases = [m.base_layer for m in conv.modules() if hasattr(m, "lora_A")]
    assert bases and all(isinstance(b, lean) for b in bases)  # LoRA wraps slimgrad's layers
    inputs = _inputs(name, padded=True)
    (e, ge), (c, gc) = _loss_and_grads(eager, inputs), _loss_and_grads(conv, inputs)
    assert c.logits is None
    names = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert names == [n for n, p in conv.named_parameters() if p.requires_grad]
    torch.testing.assert_close(c.loss, e.loss)
    torch.testing.assert_close(gc, ge, msg=lambda m: f"{names}: {m}")


@pytest.mark.hf_release
@pytest.mark.parametrize("keep_logits", [False, True])
def test_return_dict_false_gives_hf_tuple(keep_logits):
    # a tuple cannot hold logits=None without shifting every later field (``loss, logits =
    # out[:2]``): without keep_logits HF's forward runs; with it the fused loss fills the slot
    eager = _build("llama")
    cfg = slimgrad.ConvertConfig(keep_logits=keep_logits)
    conv = slimgrad.convert_(copy.deepcopy(eager), cfg)
    inputs = _inputs("llama", padded=True)
    kw = dict(return_dict=False, output_hidden_states=True, use_cache=False)
    e, c = eager(**inputs, **kw), conv(**inputs, **kw)
    assert isinstance(c, tuple) and len(c) == len(e)
    torch.testing.assert_close(c[0], e[0])
    torch.testing.assert_close(c[1], e[1])  # the logits, in their slot
    torch.testing.assert_close(c[2], e[2])  # hidden states, in their slot


@pytest.mark.hf_release
def test_trainer_predict_hands_logits_to_compute_metrics(tmp_path):
    pytest.importorskip("accelerate")
    eager = _build("gpt2")
    conv = slimgrad.convert_(copy.deepcopy(eager))
    x = _inputs("gpt2", padded=True)
    data = [{k: v[i] for k, v in x.items()} for i in range(B)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=B, report_to=[], use_cpu=True
    )
    seen = []

    def metrics(p):
        seen.append(p.predictions)
        return {}

    preds = []
    for m in (eager, conv):
        trainer = transformers.Trainer(model=m, args=args, compute_metrics=metrics)
        preds.append(trainer.predict(data))
    assert len(seen) == 2 and seen[1] is not None
    torch.testing.assert_close(torch.as_tensor(seen[1]), torch.as_tensor(seen[0]))
    assert preds[1].metrics["test_loss"] == pytest.approx(preds[0].metrics["test_loss"], rel=1e-6)


def test_unknown_lm_forward_is_reported_and_left_alone():
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=32, n_head=4, n_layer=1)
    torch.manual_seed(0)
    eager = transformers.BloomForCausalLM(cfg).train()
    conv = slimgrad.convert_(copy.deepcopy(eager), slimgrad.ConvertConfig(dropout=False))
    skipped = {(n, a): r for n, a, r in slimgrad.report(conv).skipped}
    assert "HF's forward kept" in skipped[("", "BloomForCausalLM.forward")]
    assert "forward" not in conv.__dict__
    inputs = _inputs("gpt2", padded=True)
    torch.testing.assert_close(conv(**inputs).loss, eager(**inputs).loss)


PADDED = ["gpt2", "llama", "gemma2", "opt", "mixtral", "bert", "distilbert"]


@pytest.mark.parametrize("name", PADDED)
def test_left_padded_attention_mask_matches_eager(name):
    # float32 against eager (HF's eager attention gives NaN gradients in float64 for fully masked
    # query rows of Llama-style models, so there is no float64 reference for the rule here)
    eager, conv, _ = _models(name)
    for m in (eager, conv):
        m.train()
    inputs = _inputs(name, padded=True)
    inputs["attention_mask"][0, :3] = 0
    inputs["labels"][0, :3] = -100
    (e, ge), (c, gc) = _loss_and_grads(eager, inputs), _loss_and_grads(conv, inputs)
    assert c.logits is None
    torch.testing.assert_close(c.loss, e.loss)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name,autocast",
    [
        pytest.param(n, a, id=f"{'autocast_bf16' if a else 'plain'}-{n}", marks=marks)
        for a in (False, True)
        for n in ("llama", "bert")
        # the loss dtype HF's loss functions return: one causal and one masked LM
        for marks in [[pytest.mark.hf_release] if (n == "llama") == a else []]
    ],
)
def test_float64_model_gives_eager_loss_dtype_and_bits(name, autocast):
    # CPU autocast leaves float64 tensors alone (eager's F.linear runs in float64): the fused loss
    # must not cast a float64 head to bf16; HF's causal loss computes float32 from logits.float()
    # (a float32 loss), so a float64 causal head keeps HF's forward; a float64 MLM head fuses
    eager = _build(name).double()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    inputs = _inputs(name, padded=True)
    outs = []
    for m in (eager, conv):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out, grads = _loss_and_grads(m, copy.deepcopy(inputs))
        outs.append((out.loss, grads))
    (le, ge), (lc, gc) = outs
    assert lc.dtype == le.dtype
    if FAMILIES[name][3]:  # HF's forward ran: its bits
        torch.testing.assert_close(lc, le, rtol=0, atol=0)
        for a, b in zip(gc, ge, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:  # float64 throughout, like eager (a bf16 head would be ~1e-3 off)
        torch.testing.assert_close(lc, le, rtol=1e-12, atol=1e-12)
        for a, b in zip(gc, ge, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.hf_release
def test_call_shapes_bind_once_as_signature_bind_binds(monkeypatch):
    # the fused forward binds the forward's signature once per call shape (positional count,
    # keyword names) and maps each call's arguments as Signature.bind + apply_defaults does;
    # a shape bind refuses falls back to HF's forward (which raises its own error)
    import inspect

    from slimgrad.convert_handlers import hf_loss

    eager = _build("gpt2")
    conv = slimgrad.convert_(copy.deepcopy(eager))
    spec, _ = hf_loss._cached(type(conv).forward, "forward")
    sig = spec.signature
    inputs = _inputs("gpt2", padded=True)
    ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
    names = list(sig.parameters)[1:]
    upto_labels = [ids] + [None] * (names.index("labels") - 1) + [labels]
    upto_labels[names.index("attention_mask")] = mask
    shapes = [
        ((ids,), dict(labels=labels)),
        ((), dict(labels=labels, input_ids=ids, attention_mask=mask, num_items_in_batch=7)),
        (tuple(upto_labels), {}),
        (tuple(upto_labels), dict(use_cache=False, shift_labels=labels, ignore_index=3)),
        ((ids, None), dict(labels=labels, logits_to_keep=0)),
        ((ids,), dict(input_ids=ids, labels=labels)),  # twice: bind refuses
        (tuple(upto_labels) + (None,) * 3, {}),  # too many positional arguments
    ]
    for args, kw in shapes:
        plan = hf_loss._binding(spec, len(args) + 1, tuple(kw))
        try:
            ba = sig.bind(conv, *args, **kw)
        except TypeError:
            assert plan is None
            continue
        ba.apply_defaults()
        got = hf_loss._bound(plan, (conv, *args), kw, spec)
        assert list(got) == list(ba.arguments)
        for k, v in got.items():
            want = ba.arguments[k]
            if isinstance(want, dict):
                assert list(v.items()) == list(want.items())
                assert all(v[x] is want[x] for x in want)
            else:
                assert v is want
    # the same results as eager for positional labels, and bind runs once per new shape
    seen = []
    bind = inspect.Signature.bind
    monkeypatch.setattr(
        inspect.Signature, "bind", lambda s, *a, **k: seen.append(1) or bind(s, *a, **k)
    )
    out = [conv(*upto_labels[:-1], labels=labels, use_cache=False) for _ in range(3)]
    assert len(seen) <= 1 and out[0].logits is None
    torch.testing.assert_close(out[2].loss, eager(*upto_labels, use_cache=False).loss)
    monkeypatch.setattr(inspect.Signature, "bind", bind)
    with pytest.raises(TypeError):
        conv(ids, input_ids=ids, labels=labels)  # HF's own error

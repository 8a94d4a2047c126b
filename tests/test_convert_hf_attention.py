"""HF attention under ``convert_``: exact by capability, or kept with the reason in the report.

NOTE [HF attention: exact or untouched] in ``slimgrad/convert_handlers/hf_attention.py``. Every
family: train (dropout on, attention dropout included) and eval, unpadded and padded (left and
right, real zeros in ``attention_mask``), outputs and every gradient of the converted model against
the original with the same seed (same dropout masks); ``generate()`` on a left-padded batch for the
decoder LMs. Only the attention pass and the bit-exact passes run here (``activations`` and
``norms`` round differently in the last bit and are held to the error rule in their own suites;
the fused loss is another pass's: ``fused_loss=False``).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools

import pytest
import torch

import slimgrad
from slimgrad.memory import measure

transformers = pytest.importorskip("transformers")

CFG = slimgrad.ConvertConfig(fused_loss=False, activations=False, norms=False)
V = 100  # vocab
# CPU tensors only: seed the CPU generator alone (torch.manual_seed also seeds the accelerators',
# a lazy call that formats the caller's stack on a machine without one)
_seed = torch.default_generator.manual_seed
_LM = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=V)
_GQA = dict(_LM, num_hidden_layers=2, num_key_value_heads=2, attention_dropout=0.1)


class _Factories:
    # t.XConfig(**kw) in the table below is a factory, called when a pair is built: collecting
    # this file constructs no config and imports no model file of transformers'
    def __getattr__(self, cls):
        return lambda *a, **kw: lambda: getattr(transformers, cls)(*a, **kw)


def _eager(make):
    def eager():
        cfg = make()
        cfg._attn_implementation = "eager"
        return cfg

    return eager


@functools.cache
def _configs():
    t = _Factories()
    return {
        # name: (config factory, model class name, input kind, attention modules or the skip
        # reason)
        "gpt2": (
            t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32),
            "GPT2LMHeadModel",
            "lm",
            2,
        ),
        "gpt_neox": (
            t.GPTNeoXConfig(num_hidden_layers=2, attention_dropout=0.1, hidden_dropout=0.1, **_LM),
            "GPTNeoXForCausalLM",
            "lm",
            2,
        ),
        "llama": (t.LlamaConfig(**_GQA), "LlamaForCausalLM", "lm", 2),
        "mistral": (t.MistralConfig(sliding_window=3, **_GQA), "MistralForCausalLM", "lm", 2),
        "mistral_full": (
            t.MistralConfig(sliding_window=None, **_GQA),
            "MistralForCausalLM",
            "lm",
            2,
        ),
        "qwen2": (t.Qwen2Config(**_GQA), "Qwen2ForCausalLM", "lm", 2),
        "qwen3": (t.Qwen3Config(head_dim=8, **_GQA), "Qwen3ForCausalLM", "lm", 2),
        "gemma": (t.GemmaConfig(head_dim=8, **_GQA), "GemmaForCausalLM", "lm", 2),
        # Gemma2 defaults to eager (softcap): the family's eager function, probed, with softcap
        "gemma2": (
            t.Gemma2Config(head_dim=8, sliding_window=3, **_GQA),
            "Gemma2ForCausalLM",
            "lm",
            2,
        ),
        "llama_eager": (_eager(t.LlamaConfig(**_GQA)), "LlamaForCausalLM", "lm", 2),
        "gpt2_eager": (
            _eager(t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32)),
            "GPT2LMHeadModel",
            "lm",
            "using_eager = self.config._attn_implementation == 'eager'",
        ),
        "phi3": (t.Phi3Config(pad_token_id=0, **_GQA), "Phi3ForCausalLM", "lm", 2),
        "opt": (
            t.OPTConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                ffn_dim=64,
                vocab_size=V,
                word_embed_proj_dim=32,
                attention_dropout=0.1,
                max_position_embeddings=32,
            ),
            "OPTForCausalLM",
            "lm",
            2,
        ),
        "bloom": (
            t.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=V, attention_dropout=0.1),
            "BloomForCausalLM",
            "lm",
            "BloomAttention computes attention in its own code",
        ),
        "falcon": (
            t.FalconConfig(num_hidden_layers=2, attention_dropout=0.1, **_LM),
            "FalconForCausalLM",
            "lm",
            "FalconAttention computes attention in its own code",
        ),
        "mixtral": (
            t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_GQA),
            "MixtralForCausalLM",
            "lm",
            2,
        ),
        "bert": (t.BertConfig(num_hidden_layers=2, **_LM), "BertForMaskedLM", "enc", 2),
        "roberta": (t.RobertaConfig(num_hidden_layers=2, **_LM), "RobertaForMaskedLM", "enc", 2),
        "distilbert": (
            t.DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=64, vocab_size=V),
            "DistilBertForMaskedLM",
            "enc",
            2,
        ),
        "deberta_v2": (
            t.DebertaV2Config(num_hidden_layers=2, **_LM),
            "DebertaV2ForMaskedLM",
            "enc",
            "DisentangledSelfAttention computes attention in its own code",
        ),
        "bert_eager": (
            _eager(t.BertConfig(num_hidden_layers=2, **_LM)),
            "BertForMaskedLM",
            "enc",
            2,
        ),
        "electra": (
            t.ElectraConfig(num_hidden_layers=2, embedding_size=32, **_LM),
            "ElectraForMaskedLM",
            "enc",
            2,
        ),
        "t5": (
            t.T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=V),
            "T5ForConditionalGeneration",
            "s2s",
            6,  # encoder self, decoder self and cross: position_bias through the mask
        ),
        "t5_eager": (
            _eager(
                t.T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=V)
            ),
            "T5ForConditionalGeneration",
            "s2s",
            "T5Attention passes position_bias to eager_attention_forward",
        ),
        "bart": (
            t.BartConfig(
                encoder_layers=2,
                decoder_layers=2,
                d_model=32,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                vocab_size=V,
                attention_dropout=0.1,
                max_position_embeddings=32,
            ),
            "BartForConditionalGeneration",
            "s2s",
            6,
        ),
        "whisper": (
            t.WhisperConfig(
                encoder_layers=2,
                decoder_layers=2,
                d_model=32,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                vocab_size=V,
                num_mel_bins=8,
                max_source_positions=8,
                max_target_positions=32,
                attention_dropout=0.1,
                pad_token_id=1,
                bos_token_id=2,
                eos_token_id=2,
                decoder_start_token_id=3,
                begin_suppress_tokens=None,
                suppress_tokens=None,
            ),
            "WhisperForConditionalGeneration",
            "speech",
            6,
        ),
        "vit": (
            t.ViTConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                image_size=8,
                patch_size=4,
                attention_probs_dropout_prob=0.1,
                hidden_dropout_prob=0.1,
            ),
            "ViTForImageClassification",
            "image",
            2,
        ),
        "clip": (
            t.CLIPConfig(
                text_config=dict(num_hidden_layers=2, attention_dropout=0.1, **_LM),
                vision_config=dict(
                    num_hidden_layers=2,
                    hidden_size=32,
                    num_attention_heads=4,
                    intermediate_size=64,
                    image_size=8,
                    patch_size=4,
                    attention_dropout=0.1,
                ),
            ),
            "CLIPModel",
            "clip",
            4,
        ),
    }


FAMILIES = list(_configs())
EAGER_ORIGIN = {"gemma2", "llama_eager", "bert_eager"}  # attn_implementation="eager"
DECODER_LMS = [n for n in FAMILIES if _configs()[n][2] == "lm"]


def _cases():
    # converted families: train unpadded/left/right, eval left (unpadded eval is SDPA's own call
    # on its own mask); eval right too for the eager origins, whose eval runs slimgrad's op (in
    # every converted family, each right-padded row ran exactly its left-padded twin's branch arcs
    # of src/slimgrad under coverage.py); images have no mask; families kept as they are: left,
    # train + eval
    for name, (_, _, kind, expect) in _configs().items():
        if kind == "image":
            combos = [("none", True), ("none", False)]
        elif isinstance(expect, int):
            combos = [("none", True), ("left", True), ("right", True), ("left", False)]
            if name in EAGER_ORIGIN:  # (right, eval) runs the same arcs as (left, eval) elsewhere
                combos.append(("right", False))
        else:
            combos = [("left", True), ("left", False)]
        for pad, train in combos:
            # NOTE [Rows under the newest transformers] (tests/conformance/test_hf_families.py):
            # each family's padded training row (images: unpadded) runs its attention and mask
            release = train and pad == ("none" if kind == "image" else "left")
            marks = [pytest.mark.hf_release] if release else []
            tag = f"{name}-{pad}-{'train' if train else 'eval'}"
            yield pytest.param(name, pad, train, id=tag, marks=marks)


@functools.cache
def _pair(name):
    make, cls, kind, expect = _configs()[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(make())
    conv = slimgrad.convert_(copy.deepcopy(model), CFG)
    # the eager origin probes its family's function once, at the first training call
    conv.train()
    conv(**_inputs(kind, "left"))
    return model, conv, kind, expect


def _inputs(kind, pad, seq=8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    if pad == "left":
        mask[0, :3] = 0
    elif pad == "right":
        mask[0, -3:] = 0
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    if kind == "speech":
        return {
            "input_features": torch.randn(2, 8, 16, generator=g),
            "decoder_input_ids": ids,
            "decoder_attention_mask": mask,
        }
    out = {"input_ids": ids, "attention_mask": mask}
    if kind == "s2s":
        out["decoder_input_ids"] = ids[:, :5]
    if kind == "clip":
        out["pixel_values"] = torch.randn(2, 3, 8, 8, generator=g)
    return out


class _Counter:
    def __init__(self, monkeypatch):
        import slimgrad.ops.softmax_dropout as sdm

        # calls of slimgrad's attention ops (either entry, or the scores op's Function applied
        # directly by NOTE [HF attention's straight path]; one calling another counts once)
        self.n, self.depth = 0, 0
        names = ("softmax_dropout_matmul", "scores_softmax_dropout_matmul", "eager_attention")
        for name in (*names, "_SSDM_APPLY"):
            monkeypatch.setattr(sdm, name, self._counting(getattr(sdm, name)))
        import slimgrad.ops.gpt2_attention as oga

        # GPT-2's attention output node runs the scores op inside (NOTE [One node for GPT-2's
        # attention output])
        real = oga._GPT2_ATTENTION_APPLY
        monkeypatch.setattr(oga, "_GPT2_ATTENTION_APPLY", self._counting(real))

    def _counting(self, real):
        def counting(*args, **kwargs):
            self.n += self.depth == 0
            self.depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self.depth -= 1

        return counting


def _run(model, inputs, train, seed=7):
    model.train(train)
    model.zero_grad(set_to_none=True)
    _seed(seed)
    out = model(**inputs)
    flat = [t for v in out.values() for t in (v if isinstance(v, tuple) else (v,))]
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
    # weights differ per element, so every output element's gradient path counts
    loss = sum((t * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum() for t in tensors)
    loss.backward()
    return tensors, {n: p.grad for n, p in model.named_parameters()}


def _attention_line(model):
    rep = slimgrad.report(model)
    conv = [r for r in rep.converted if "attention" in r[1]]
    skip = [r for r in rep.skipped if "attention" in r[1]]
    return conv, skip


@pytest.mark.parametrize("name, pad, train", list(_cases()))
def test_family_matches_original(name, pad, train, monkeypatch):
    model, conv, kind, expect = _pair(name)
    converted, skipped = _attention_line(conv)
    if isinstance(expect, int):
        assert len(converted) == 1 and not skipped, (converted, skipped)
    else:
        assert not converted and len(skipped) == 1 and expect in skipped[0][2], skipped
    inputs = _inputs(kind, pad)
    ref_out, ref_grads = _run(model, inputs, train)
    count = _Counter(monkeypatch)
    out, grads = _run(conv, inputs, train)
    # what is claimed runs slimgrad's op in training, once per attention module; in eval (no
    # dropout) only the eager origin does (eager keeps P there, SDPA's flash kernel does not)
    runs = isinstance(expect, int) and (train or name in EAGER_ORIGIN)
    assert count.n == (expect if runs else 0)
    assert len(out) == len(ref_out)
    for o, r in zip(out, ref_out):
        torch.testing.assert_close(o, r)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        if ref_grads[k] is None:
            assert grads[k] is None, k
        else:
            torch.testing.assert_close(grads[k], ref_grads[k], msg=k)


@pytest.mark.parametrize("name", DECODER_LMS)
def test_generate_left_padded(name):
    model, conv, kind, _ = _pair(name)
    inputs = _inputs(kind, "left", seq=6)
    tokens = []
    for m in (model, conv):
        m.eval()
        tokens.append(
            m.generate(
                **inputs, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None
            )
        )
    assert torch.equal(tokens[1], tokens[0])


def test_padding_is_honoured_in_training(monkeypatch):
    # the padded row changes when its mask does; the unpadded row (same dropout masks) does not
    _, conv, kind, _ = _pair("gpt2")
    padded = _inputs(kind, "left")
    full = dict(padded, attention_mask=torch.ones_like(padded["attention_mask"]))
    count = _Counter(monkeypatch)
    a, _ = _run(conv, padded, True)
    b, _ = _run(conv, full, True)
    assert count.n == 4
    torch.testing.assert_close(a[0][1], b[0][1])
    assert not torch.allclose(a[0][0, 3:], b[0][0, 3:])


@pytest.mark.hf_release
def test_sliding_window_is_applied():
    # same weights, window 3 vs none on 8 tokens: the outputs differ (each equals its original)
    with_window, no_window = _pair("mistral")[1], _pair("mistral_full")[1]
    no_window.load_state_dict(with_window.state_dict())
    inputs = _inputs("lm", "none")
    a, _ = _run(with_window, inputs, True)
    b, _ = _run(no_window, inputs, True)
    torch.testing.assert_close(a[0][:, :3], b[0][:, :3])  # inside the window: the same
    assert not torch.allclose(a[0][:, 3:], b[0][:, 3:])


@pytest.mark.hf_release
def test_padded_batch_keeps_the_same_saving():
    # the mask is applied inside the op, which recomputes P in backward: a padded batch saves
    # what an unpadded one saves + HF's bool mask (B x 1 x T x T, one storage for every layer)
    model, conv, kind, _ = _pair("gpt2")
    saved = {}
    for m in (model, conv):
        m.train()
        for pad in ("none", "left"):
            inputs = _inputs(kind, pad, seq=16)
            torch.manual_seed(2)
            saved[m is conv, pad] = measure(lambda m=m, i=inputs: m(**i).logits.sum()).saved_bytes
    batch = inputs["input_ids"].shape[0]
    assert saved[True, "left"] == saved[True, "none"] + batch * 16 * 16
    assert saved[True, "left"] < saved[False, "left"]


@pytest.mark.hf_release
def test_config_is_copied_not_shared(monkeypatch):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32)
    torch.manual_seed(0)
    a, b = transformers.GPT2LMHeadModel(cfg), transformers.GPT2LMHeadModel(cfg)
    slimgrad.convert_(a, CFG)
    assert cfg._attn_implementation == "sdpa" and b.config is cfg
    assert all(m.config is cfg for m in b.modules() if hasattr(m, "config"))
    assert a.config is not cfg and a.config._attn_implementation == "slimgrad"
    assert all(m.config is a.config for m in a.modules() if hasattr(m, "config"))
    count = _Counter(monkeypatch)
    _run(b, _inputs("lm", "left"), True)
    assert count.n == 0  # the other model still runs SDPA
    # T5's stacks hold their own deep copies of the config: every one is switched in the copy
    t5 = _pair("t5")[1]
    impls = {m.config._attn_implementation for m in t5.modules() if hasattr(m, "config")}
    assert impls == {"slimgrad"}


@pytest.mark.hf_release
def test_gpt2_eager_and_overridden_forward_are_kept():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32)
    cfg._attn_implementation = "eager"
    model = slimgrad.convert_(transformers.GPT2LMHeadModel(cfg), CFG)
    (skip,) = _attention_line(model)[1]
    assert "using_eager = self.config._attn_implementation == 'eager'" in skip[2]
    assert model.config._attn_implementation == "eager"

    class Custom(transformers.GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32)
    model = slimgrad.convert_(Custom(cfg), CFG)
    (skip,) = _attention_line(model)[1]
    assert "Custom overrides the forward of GPT2LMHeadModel" in skip[2]
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.hf_release
def test_an_hf_subclass_of_a_torch_module_without_a_forward_keeps_the_attention_converted():
    # HF classes such as EfficientNetDepthwiseConv2d (AlignModel's vision tower) subclass torch's
    # Conv2d and inherit its forward: that is torch's code, not a user's override of HF's
    # forward, and the text tower's attention is converted as without it
    from transformers.models.efficientnet import modeling_efficientnet as E

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    model.conv = E.EfficientNetDepthwiseConv2d(4, kernel_size=3, stride=1, bias=False)
    model = slimgrad.convert_(model, CFG)
    converted, skipped = _attention_line(model)
    assert len(converted) == 1 and not skipped, skipped

    class UserConv(E.EfficientNetDepthwiseConv2d):
        def forward(self, x):
            return super().forward(x)

    model = transformers.GPT2LMHeadModel(cfg)
    model.conv = UserConv(4, kernel_size=3, stride=1, bias=False)
    model = slimgrad.convert_(model, CFG)
    (skip,) = _attention_line(model)[1]
    assert "UserConv overrides the forward of EfficientNetDepthwiseConv2d" in skip[2]


def test_modeling_file_is_walked_once_and_an_edited_model_is_read_again(monkeypatch):
    # the readings of the modeling file's classes and functions are kept by parsed node: a second
    # convert_ of the same classes walks none of them again; what the instance decides (its class
    # here: a subclass overriding forward, set between the two calls) is read at each call
    from slimgrad.convert_handlers import hf_attention as H

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32)
    _seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    first = slimgrad.convert_(copy.deepcopy(model), CFG)
    assert len(_attention_line(first)[0]) == 1
    classes, funcs, _ = H._file_tree(type(model).__module__)
    scopes = {id(n) for n in [*classes.values(), *funcs]}
    scopes |= {id(n) for c in classes.values() for n in c.body if isinstance(n, ast.FunctionDef)}
    walked = []
    real = ast.walk

    def walk(node):
        if id(node) in scopes:
            walked.append(node)
        return real(node)

    monkeypatch.setattr(ast, "walk", walk)
    again = slimgrad.convert_(copy.deepcopy(model), CFG)
    assert len(_attention_line(again)[0]) == 1
    assert not walked, [getattr(n, "name", n) for n in walked]

    class Edited(type(model.transformer.h[0].attn)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    edited = copy.deepcopy(model)
    edited.transformer.h[0].attn.__class__ = Edited
    (skip,) = _attention_line(slimgrad.convert_(edited, CFG))[1]
    assert "Edited overrides the forward of GPT2Attention" in skip[2], skip


def test_attn_implementation_reads_rule():
    from slimgrad.convert_handlers import hf_attention as H

    def flagged(src):
        tree = ast.parse(src)
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        return H._impl_reads(tree, parents, "sdpa", "slimgrad")

    assert not flagged(
        "f = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, g)"
    )
    assert not flagged("f = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]")
    assert not flagged('e = self.config._attn_implementation == "eager"')  # False both ways
    assert not flagged("self._attn_implementation = config._attn_implementation")
    assert not flagged('self.config._attn_implementation = "eager"')
    assert flagged('if self.config._attn_implementation == "sdpa": pass')
    assert flagged('if config._attn_implementation in ("eager", "sdpa"): pass')
    assert flagged("impl = self.config._attn_implementation")
    assert flagged('x = getattr(config, "_attn_implementation")')


# _attention itself against HF's sdpa_attention_forward: every mask form it can receive


class _Attn(torch.nn.Module):
    def __init__(self, groups=1, causal=True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, causal


def _qkv(b=2, h=4, q=5, k=5, d=8, groups=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    q_ = torch.randn(b, h, q, d, generator=g, dtype=torch.float64).to(dtype)
    k_ = torch.randn(b, h // groups, k, d, generator=g, dtype=torch.float64).to(dtype)
    v_ = torch.randn(b, h // groups, k, d, generator=g, dtype=torch.float64).to(dtype)
    return q_, k_, v_


def _pad_mask(b, q, k, causal, float_dtype=None):
    keep = torch.ones(b, 1, q, k, dtype=torch.bool)
    if causal:
        keep &= torch.ones(q, k, dtype=torch.bool).tril(k - q)
    keep[0, :, :, :2] = False  # left padding: the first query rows see nothing
    if float_dtype is None:
        return keep
    return torch.zeros(keep.shape, dtype=float_dtype).masked_fill(
        ~keep, torch.finfo(float_dtype).min
    )


def _autocast(mode):
    # "autocast_bf16" / "autocast_fp16": the region SDPA runs in; anything else: none
    if mode.startswith("autocast"):
        return torch.autocast("cpu", torch.bfloat16 if mode.endswith("bf16") else torch.float16)
    return contextlib.nullcontext()


def _both(module, q, k, v, mask, extra=(), mode="plain", **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from slimgrad.convert_handlers.hf_attention import _attention

    results = []
    for fn in (_attention, sdpa_attention_forward):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in (q, k, v)]
        more = {n: t.detach().clone().requires_grad_() for n, t in extra}
        _seed(5)
        with _autocast(mode):
            out, weights = fn(module, *leaves, mask, **kw, **more)
        assert weights is None
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
        results.append([out, *(t.grad for t in leaves), *(t.grad for t in more.values())])
    return results


CASES = {
    "causal_no_mask": dict(mask=None),
    "causal_bool": dict(mask="bool"),
    "causal_float": dict(mask="float"),
    "bidirectional_bool": dict(mask="bool", causal=False),
    "cross_q3_k7": dict(mask="bool", causal=False, q=3, k=7),
    "causal_crop_k7": dict(mask=None, q=4, k=7),
    "gqa_bool": dict(mask="bool", groups=2),
    "gqa_no_mask": dict(mask=None, groups=2),
    "decode_q1_cache": dict(mask=None, q=1, k=6),
    "position_bias": dict(mask="bool", causal=False, bias=True),
    "position_bias_causal": dict(mask=None, bias=True),
}


# (input dtype, autocast): SDPA's CPU math path upcasts half inputs to float32 (q, k, v; the
# output is cast back), and under autocast it first casts every floating non-float64 argument
DTYPES = {
    "fp32": (torch.float32, "plain"),
    "fp64": (torch.float64, "plain"),
    "bf16": (torch.bfloat16, "plain"),
    "fp16": (torch.float16, "plain"),
    "fp32_autocast_bf16": (torch.float32, "autocast_bf16"),
    "fp32_autocast_fp16": (torch.float32, "autocast_fp16"),
    "bf16_autocast_fp16": (torch.bfloat16, "autocast_fp16"),
    "fp64_autocast_bf16": (torch.float64, "autocast_bf16"),
}


# NOTE [Rows under the newest transformers]: every mask form in fp32, every dtype on a bool mask
_RELEASE_SDPA = [(c, "fp32") for c in CASES] + [("causal_bool", d) for d in DTYPES if d != "fp32"]


@pytest.mark.parametrize(
    "case,dtype",
    [
        pytest.param(c, d, marks=[pytest.mark.hf_release] if (c, d) in _RELEASE_SDPA else [])
        for d in DTYPES
        for c in CASES
    ],
)
def test_attention_function_matches_sdpa(case, dtype, monkeypatch):
    c = CASES[case]
    dt, mode = DTYPES[dtype]
    q_len, k_len, groups = c.get("q", 5), c.get("k", 5), c.get("groups", 1)
    causal = c.get("causal", True)
    q, k, v = _qkv(q=q_len, k=k_len, groups=groups, dtype=dt)
    mask = c["mask"]
    if mask is not None:
        mask = _pad_mask(2, q_len, k_len, causal, dt if mask == "float" else None)
    extra = [("position_bias", torch.randn(1, 4, q_len, k_len).to(dt))] if c.get("bias") else []
    count = _Counter(monkeypatch)
    ours, ref = _both(
        _Attn(groups, causal), q, k, v, mask, extra, mode=mode, dropout=0.3, scaling=0.3
    )
    assert count.n == 1
    for o, r in zip(ours, ref):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)  # SDPA's math path, bit for bit


@pytest.mark.parametrize(
    "dtype", ["bf16", "fp32_autocast_bf16", pytest.param("fp32", marks=pytest.mark.hf_release)]
)
def test_attention_function_keeps_less_than_sdpa(dtype):
    # what one call keeps: q and k (S's operands, float32 copies for half inputs, as SDPA's math
    # path keeps them), value and 1 bit per score; SDPA's math path also keeps P, its dropout
    # noise and the dropped P (float32, T x T each) and a float32 copy of value
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from slimgrad.convert_handlers.hf_attention import _attention

    dt, mode = DTYPES[dtype]
    b, h, t, d = 2, 4, 16, 8
    q, k, v = _qkv(b=b, h=h, q=t, k=t, d=d, dtype=dt)
    saved = {}
    for fn in (_attention, sdpa_attention_forward):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with _autocast(mode):
            m = measure(lambda fn=fn, x=leaves: fn(_Attn(), *x, None, dropout=0.3)[0].float().sum())
        saved[fn] = m.saved_bytes
    qkv, scores = b * h * t * d, b * h * t * t
    # the caller's value is not a step tensor; under autocast both keep the cast one (bf16 here,
    # float32 in SDPA's math path), in bf16 SDPA keeps its float32 copy
    ours_v = qkv * 2 if mode != "plain" else 0
    sdpa_v = qkv * 4 if dt is torch.bfloat16 or mode != "plain" else 0
    assert saved[_attention] == 2 * qkv * 4 + ours_v + scores // 8
    assert saved[sdpa_attention_forward] == 2 * qkv * 4 + sdpa_v + 3 * scores * 4


@pytest.mark.hf_release
@pytest.mark.parametrize(
    "why",
    [
        "no_dropout",
        "no_grad",
        "float_mask_dtype",
        "output_attentions",
        "softcap",
        "gqa_decode_packed",
    ],
)
def test_attention_function_hands_the_rest_to_sdpa(why, monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from slimgrad.convert_handlers.hf_attention import _attention

    groups, q_len = (2, 1) if why == "gqa_decode_packed" else (1, 5)
    q, k, v = _qkv(q=q_len, groups=groups, dtype=torch.bfloat16)
    # a float mask of another dtype than the query's: SDPA's own error
    mask = _pad_mask(2, q_len, 5, True, torch.float32 if why == "float_mask_dtype" else None)
    kw = {"dropout": 0.0 if why == "no_dropout" else 0.3, "scaling": 0.3}
    kw.update({"output_attentions": True} if why == "output_attentions" else {})
    kw.update({"softcap": 30.0} if why == "softcap" else {})
    count = _Counter(monkeypatch)
    outs = []
    for fn in (_attention, sdpa_attention_forward):
        torch.manual_seed(5)
        with torch.set_grad_enabled(why != "no_grad"):
            try:
                outs.append(fn(_Attn(groups), q, k, v, mask, **kw)[0])
            except (ValueError, RuntimeError) as e:  # softcap, mask dtype: SDPA's own error
                outs.append(str(e))
    assert count.n == 0
    if isinstance(outs[1], str):
        assert outs[0] == outs[1] and ("softcap" in outs[1] or "mask" in outs[1])
    else:
        assert torch.equal(outs[0], outs[1])


@pytest.mark.hf_release
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_output_attentions_runs_the_original(name, monkeypatch):
    # SDPA returns no weights and warns, eager returns its weights: either way the converted
    # model hands that call to the original, which returns what it returns
    model, conv, kind, _ = _pair(name)
    inputs = dict(_inputs(kind, "left"), output_attentions=True)
    count = _Counter(monkeypatch)
    out, grads = _run(conv, inputs, True)
    ref, ref_grads = _run(model, inputs, True)
    assert count.n == 0
    assert len(out) == len(ref) == (3 if name == "gemma2" else 1)  # logits (+ eager's weights)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], msg=k)


@pytest.mark.hf_release
def test_save_pretrained_loads_into_the_plain_class(tmp_path):
    _, conv, _, _ = _pair("bert")
    conv.save_pretrained(tmp_path)
    plain = transformers.BertForMaskedLM.from_pretrained(tmp_path)
    assert plain.config._attn_implementation == "sdpa"
    assert conv.config._attn_implementation == "slimgrad"


@pytest.mark.hf_release
def test_eager_probe_refuses_a_different_eager_function():
    # the eager origin runs slimgrad's computation only where a probe proved it bit for bit equal
    # to the family's function; one that orders its math differently keeps running itself
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from slimgrad.convert_handlers import hf_attention as H

    def scaled_first(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return eager_attention_forward(
            module, query * scaling, key, value, attention_mask, 1.0, dropout, **kwargs
        )

    module = _Attn(groups=2)
    assert H._probe(eager_attention_forward, module, torch.float32, False)
    assert not H._probe(scaled_first, module, torch.float32, False)
    assert module.training  # restored


def test_host_calls_per_call():
    # issue 32: GPT-2's training call (dropout, no mask tensor, no num_key_value_groups attribute)
    # takes NOTE [HF attention's straight path] and the scores op's backward reuses the forward's
    # dropout kernels: 62 calls of and from slimgrad's code per fwd + bwd, counted, not timed
    # (NOTE [Attention matmuls as bmm]: q, k^T and v folded to 3-D once before the op, whose
    # seven products are then one bmm call each, and the op's backward in one frame; 101 when
    # each product reshaped its operands; NOTE [Causal masks built once]: 4 calls fewer; the
    # second-derivative check inline in the backward, no first_order frame: 1 fewer; the dropout
    # C pass inline in the straight backward, its scale, bits pointer and thread count read once
    # for both uses: 62 -> 56; the dropout kernel choice and draw in one frame: 56 -> 55; the
    # straight path and the straight backward each in their caller's frame, k^T as ``mT``, a
    # copied value not unwrapped, saved through ctx's fields: 55 -> 49)
    from slimgrad.convert_handlers.hf_attention import _attention
    from tests._host_calls import slimgrad_calls

    class GPT2LikeAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.is_causal = True

    module = GPT2LikeAttention()
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, h=4, q=16, k=16, d=16))

    def step():
        out, _ = _attention(module, q * 1, k * 1, v * 1, None, dropout=0.1, scaling=0.25)
        (out * 1).sum().backward()

    step()
    assert slimgrad_calls(step) <= 49


def test_straight_path_second_derivative_raises_clear_error():
    # the scores op's backward checks create_graph itself (no first_order frame): a second
    # derivative through HF's straight path is the clear slimgrad error, never a silent None
    from slimgrad.convert_handlers.hf_attention import _attention

    q, k, v = (t.requires_grad_() for t in _qkv(b=1, h=2, q=4, k=4, d=4))
    out, _ = _attention(_Attn(1, True), q * 1, k * 1, v * 1, None, dropout=0.2, scaling=0.5)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.ops.scores_softmax_dropout_matmul"):
        gq.sum().backward()

"""Conformance: which modules' outputs may be the model's output (NOTE [Modules whose output is the
model's output] in slimgrad/convert_handlers/inplace_guard.py), loop by loop.

A converted norm or activation that keeps its output for backward runs eager's op where that
output may be what the model returns (the caller may write it in place or through ``.data``).
These rows pin the reading of loops over module containers: one pass per child, in order, with
``if``/``continue``/``break`` followed where they lead (a branch on a number/None setting of the
module or on a local literal is taken as it stands at ``convert_`` time), so that a layer whose
output can never be returned keeps its saving, and every layer whose output can (LayerDrop skips,
a ``break``) runs eager's op. Each row's decisions are checked, then a caller's ``.data`` edit of
the returned tensor, whose gradients must stay eager's (the error rule against a float64 copy).
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from torch import nn

import slimgrad
from tests._threads import one_thread
from tests.conformance.test_round3_adversarial import _assert_rule, _grads, _loss, _r


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _off(m) -> list[str]:
    return [n for n, x in m.named_modules() if getattr(x, "keep_y", True) is False]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + self.fc(x))


def _untraceable(x):
    # a data-dependent branch: torch.fx fails on every forward that calls it, so the guard reads
    # the forward's source (the reading under test)
    return x * 0.5 if bool(x.sum() > 1e9) else x


class _Stack(nn.Module):
    def __init__(self, drop=0.0, n=None, proj=None):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(3)])
        self.drop = drop  # a LayerDrop probability
        self.n = n  # how many layers run
        self.proj = proj  # an optional child


class _LayerDrop(_Stack):
    # BART/OPT's LayerDrop: ``continue`` skips the layer, leaving the previous pass's value
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers:
            if self.training and self.drop > 0.0:
                if bool(torch.rand([], device=x.device) < self.drop):
                    continue
            x = layer(x)
        return x


class _ToDrop(_Stack):
    # BART's encoder: a local flag set under a branch the settings decide
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers:
            to_drop = False
            if self.training and self.drop > 0.0:
                if bool(torch.rand([], device=x.device) < self.drop):
                    to_drop = True
            if not to_drop:
                x = layer(x)
        return x


class _Optional(_Stack):
    # OPT's ``if self.final_layer_norm is not None``: a child's presence, read at convert_ time
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers:
            x = layer(x)
            if bool(x.sum() > 1e9):
                x = x * 0.5
        if self.proj is not None:
            x = self.proj(x)
        return x


class _Sliced(_Stack):
    # Llama's ``self.layers[: self.config.num_hidden_layers]``: the slice's bounds are settings
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers[: self.n]:
            x = layer(x)
        if bool(x.sum() > 1e9):
            x = x * 0.5
        return x


class _Breaks(_Stack):
    # a ``break`` after any layer: any layer's output may be returned
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers:
            x = layer(x)
            if bool(x.sum() > 1e9):
                break
        return x


class _Skipped(_Stack):
    # a data-dependent skip: any layer's output, or the loop's input
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers:
            h = layer(x)
            if bool(h.mean() > 1e9):
                continue
            x = h
        return x


class _NotSelf(_Stack):
    # a forward whose first parameter is not named ``self``
    def forward(mod, x):  # noqa: N805 - the pattern under test
        x = _untraceable(x)
        h = x
        for layer in mod.layers:
            h = layer(h)
        if bool(h.sum() > 1e9):
            h = h * 0.5
        return h


class _Lambda(_Stack):
    # a helper whose source does not parse as one function (a lambda): any child's output
    run = lambda self, x: self.layers[2](self.layers[1](self.layers[0](x)))  # noqa: E731

    def forward(self, x):
        x = _untraceable(x)
        h = self.run(x)
        if bool(h.sum() > 1e9):
            h = h * 0.5
        return h


def _check(layer):
    if getattr(layer, "broken", False):
        raise RuntimeError("skip this layer")


class _TrySkip(_Stack):
    # a flag reset inside ``try``: the handler may start before the reset, so after the ``try``
    # the flag may be True (the layer skipped) and any layer's output may be returned
    def forward(self, x):
        x = _untraceable(x)
        for layer in self.layers:
            skip = True
            try:
                _check(layer)
                skip = False
            except RuntimeError:
                pass
            if not skip:
                x = layer(x)
        return x


LAST = ["layers.2.norm"]
ALL = ["layers.0.norm", "layers.1.norm", "layers.2.norm"]
CASES = {
    # name: (build, the modules that run eager's op)
    "layerdrop_off": (lambda: _LayerDrop(), LAST),
    "layerdrop_on": (lambda: _LayerDrop(drop=0.5), ALL),
    "to_drop_off": (lambda: _ToDrop(), LAST),
    "to_drop_on": (lambda: _ToDrop(drop=0.5), ALL),
    "optional_child_none": (lambda: _Optional(), LAST),
    "optional_child_set": (lambda: _Optional(proj=nn.LayerNorm(8)), ["proj"]),
    "sliced": (lambda: _Sliced(n=2), ["layers.1.norm"]),
    "sliced_negative": (lambda: _Sliced(n=-2), ["layers.0.norm"]),
    "breaks": (lambda: _Breaks(), ALL),
    "skipped": (lambda: _Skipped(), ALL),
    "first_parameter_not_self": (lambda: _NotSelf(), LAST),
    "lambda_helper": (lambda: _Lambda(), ALL),
    "try_skipped": (lambda: _TrySkip(), ALL),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loop_decides_which_layers_run_eager_s_op(case):
    build, off = CASES[case]
    m = slimgrad.convert_(build())
    assert _off(m) == off, slimgrad.report(m)


@pytest.mark.parametrize("case", list(CASES))
def test_caller_edits_the_returned_tensor_through_data(case):
    # train mode: LayerDrop draws the same skips on each side (the same seed)
    build, _ = CASES[case]

    def step(m, dt):
        m.train()
        x = _r(4, 8, dt=dt, rg=True)
        y = m(x * 1.5)
        loss = _loss(y)
        y.data.clamp_(-0.2, 0.2)
        return _grads(m, loss, [x])

    _assert_rule(build, step)


# -- HF encoder/decoder families: LayerDrop loops ---------------------------------------------


def _bart(layerdrop=0.0):
    import transformers as T

    cfg = T.BartConfig(
        d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=99,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop,
    )  # fmt: skip
    return T.BartModel(cfg)


def _opt(layerdrop=0.0, pre_norm=True):
    import transformers as T

    cfg = T.OPTConfig(
        hidden_size=16, num_hidden_layers=3, num_attention_heads=2, ffn_dim=32, vocab_size=99,
        word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, layerdrop=layerdrop,
        do_layer_norm_before=pre_norm,
    )  # fmt: skip
    return T.OPTModel(cfg)


HF_CASES = {
    # name: (build, the modules that run eager's op): the last layer's (or the final) norm, every
    # layer's (and the embedding norm: every layer may be skipped) with LayerDrop on
    "BartModel": (
        _bart,
        ["encoder.layers.1.final_layer_norm", "decoder.layers.1.final_layer_norm"],
    ),
    "BartModel-layerdrop": (
        lambda: _bart(0.5),
        [
            f"{s}.{n}"
            for s in ("encoder", "decoder")
            for n in (
                "layers.0.final_layer_norm",
                "layers.1.final_layer_norm",
                "layernorm_embedding",
            )
        ],
    ),  # fmt: skip
    "OPTModel": (_opt, ["decoder.final_layer_norm"]),
    "OPTModel-post-norm": (lambda: _opt(pre_norm=False), ["decoder.layers.2.final_layer_norm"]),
    "OPTModel-post-norm-layerdrop": (
        lambda: _opt(0.5, pre_norm=False),
        [f"decoder.layers.{i}.final_layer_norm" for i in range(3)],
    ),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_layerdrop_loop_decides_which_norms_run_eager_s_op(name):
    build, off = HF_CASES[name]
    m = slimgrad.convert_(build())
    assert sorted(_off(m)) == sorted(off), slimgrad.report(m)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_caller_edits_last_hidden_state_through_data(name):
    # train mode: LayerDrop skips layers (the same draws on each side); the caller clamps the
    # returned hidden states through .data after the loss
    build, _ = HF_CASES[name]
    ids = torch.arange(3, 21).view(2, 9)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0

    def step(m, dt):
        m.train()
        kw = {"decoder_input_ids": ids[:, :5]} if "Bart" in name else {}
        out = m(input_ids=ids, attention_mask=mask, **kw)
        hs = [out.last_hidden_state] + [getattr(out, "encoder_last_hidden_state", None)]
        hs = [h for h in hs if h is not None]
        loss = sum(_loss(h) for h in hs)
        for h in hs:
            h.data.clamp_(-0.2, 0.2)
        return _grads(m, loss)

    _assert_rule(build, step)


# -- hidden states returned on request (output_hidden_states=True) -----------------------------


def _hf(name):
    import transformers as T

    kw = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=99)
    kw.update(hidden_size=16)
    if name == "BertModel":
        return T.BertModel(T.BertConfig(**kw))
    if name == "GPT2Model":
        return T.GPT2Model(T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=99))
    if name == "LlamaModel":
        return T.LlamaModel(T.LlamaConfig(num_key_value_heads=2, **kw))
    if name == "T5EncoderModel":
        cfg = T.T5Config(d_model=16, d_ff=32, num_layers=2, num_heads=2, vocab_size=99)
        return T.T5EncoderModel(cfg)
    if name == "ViTModel":
        return T.ViTModel(T.ViTConfig(image_size=8, patch_size=4, **kw))
    if name == "RobertaModel":
        return T.RobertaModel(T.RobertaConfig(**kw))
    if name == "OPTModel":
        return _opt()
    if name == "OPTModel-post-norm":
        return _opt(pre_norm=False)
    return _bart()


HS_EDITS = {
    "mul_": lambda h: h.mul_(0.5),
    "data_clamp_": lambda h: h.data.clamp_(-0.2, 0.2),
}


@pytest.mark.parametrize("edit", list(HS_EDITS))
@pytest.mark.parametrize(
    "name", ["BertModel", "GPT2Model", "LlamaModel", "T5EncoderModel", "ViTModel", "OPTModel",
             "BartModel"],
)  # fmt: skip
def test_caller_edits_the_last_returned_hidden_state(name, edit):
    # hidden_states[-1] is the last layer's output (or the final norm's): the caller's write in
    # place into it after the loss leaves the gradients eager's
    ids = torch.arange(3, 21).view(2, 9)
    pix = _r(2, 3, 8, 8)

    def step(m, dt):
        m.train()
        if name == "ViTModel":
            out = m(pixel_values=pix.to(dt), output_hidden_states=True)
        elif name == "BartModel":
            out = m(input_ids=ids, decoder_input_ids=ids[:, :5], output_hidden_states=True)
        else:
            out = m(input_ids=ids, output_hidden_states=True)
        last = out.last_hidden_state
        loss = _loss(last)
        hs = out.decoder_hidden_states if name == "BartModel" else out.hidden_states
        HS_EDITS[edit](hs[-1])
        try:
            return _grads(m, loss)
        except RuntimeError as e:  # ViT: the final norm (eager's op) keeps hidden_states[-1]
            assert "modified by an inplace operation" in str(e)
            return [torch.ones((), dtype=dt)]  # each side must raise alike

    _assert_rule(lambda: _hf(name), step)


def _bert_frozen_middle():
    m = _hf("BertModel")
    for p in m.encoder.layer[1].parameters():
        p.requires_grad_(False)
    return m


def test_caller_edits_a_middle_hidden_state_nobody_else_keeps():
    # NOTE [Hidden states handed out per call]: BERT, layer 1 frozen (its q/k/v keep only their
    # weights): hidden_states[1] is layer 0's output LayerNorm's y, which eager keeps nowhere.
    # Before, the converted norm kept it: mul_ raised autograd's in-place error where eager trains
    ids = torch.arange(3, 21).view(2, 9)

    def step(m, dt):
        out = m(input_ids=ids, output_hidden_states=True)
        loss = _loss(out.last_hidden_state)
        out.hidden_states[1].mul_(0.5)
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters() if p.requires_grad]

    _assert_rule(_bert_frozen_middle, step)


def _layers(m):
    if hasattr(m, "encoder") and hasattr(m.encoder, "layer"):
        return m.encoder.layer  # BERT, RoBERTa, ViT
    if hasattr(m, "h"):
        return m.h  # GPT-2
    if hasattr(m, "layers"):
        return m.layers  # ViT
    return m.decoder.layers  # OPT


def _frozen(name, k):
    def build():
        m = _hf(name)
        for p in _layers(m)[k].parameters():
            p.requires_grad_(False)
        return m

    return build


HS_CALL_EDITS = {
    "mul_": lambda h: h.mul_(0.5),
    "setitem": lambda h: h.__setitem__((0, 1), 0.0),
    "data_clamp_": lambda h: h.data.clamp_(-0.2, 0.2),
    "retain_grad_then_add_": lambda h: (h.retain_grad(), h.add_(1.0)),
}


# (name, k, edit, mode): one row per distinct code path of the 40 (coverage arcs of src/slimgrad and
# this file; a row left out ran a kept row's arcs), every pair of values kept
FROZEN_ROWS = [
    ("BertModel", 0, "mul_", "eval"),
    ("BertModel", 0, "setitem", "train"),
    ("BertModel", 0, "setitem", "eval"),
    ("BertModel", 0, "data_clamp_", "eval"),
    ("BertModel", 0, "retain_grad_then_add_", "eval"),
    ("BertModel", 1, "mul_", "train"),
    ("BertModel", 1, "mul_", "eval"),
    ("BertModel", 1, "data_clamp_", "train"),
    ("BertModel", 1, "data_clamp_", "eval"),
    ("BertModel", 1, "retain_grad_then_add_", "train"),
    ("RobertaModel", 1, "mul_", "train"),
    ("RobertaModel", 1, "mul_", "eval"),
    ("RobertaModel", 1, "setitem", "train"),
    ("RobertaModel", 1, "setitem", "eval"),
    ("RobertaModel", 1, "data_clamp_", "train"),
    ("RobertaModel", 1, "data_clamp_", "eval"),
    ("RobertaModel", 1, "retain_grad_then_add_", "train"),
    ("RobertaModel", 1, "retain_grad_then_add_", "eval"),
    ("OPTModel-post-norm", 1, "setitem", "eval"),
    ("OPTModel-post-norm", 2, "mul_", "train"),
    ("OPTModel-post-norm", 2, "mul_", "eval"),
    ("OPTModel-post-norm", 2, "setitem", "eval"),
    ("OPTModel-post-norm", 2, "data_clamp_", "eval"),
    ("OPTModel-post-norm", 2, "retain_grad_then_add_", "eval"),
]


@pytest.mark.parametrize("name,k,edit,mode", FROZEN_ROWS)
def test_caller_edits_the_hidden_state_a_frozen_layer_reads(name, k, edit, mode):
    # post-norm: hidden_states[k], what frozen layer k reads (its Linears keep only their
    # weights), is layer k-1's output norm's y (the embedding norm's for k=0 in eval, where
    # dropout returns its input), which eager keeps nowhere: the caller's edit after the loss
    # leaves the gradients eager's (before: autograd's in-place error, or .data 0.35 off)
    ids = torch.arange(3, 21).view(2, 9)

    def step(m, dt):
        m.train(mode == "train")
        out = m(input_ids=ids, output_hidden_states=True)
        loss = _loss(out.last_hidden_state)
        HS_CALL_EDITS[edit](out.hidden_states[k])
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters() if p.requires_grad]

    _assert_rule(_frozen(name, k), step)


@pytest.mark.parametrize("edit", ["mul_", "setitem", "retain_grad_then_add_"])
@pytest.mark.parametrize("name", ["ViTModel", "GPT2Model"])
def test_pre_norm_middle_hidden_state_edit_is_never_a_wrong_gradient(name, edit):
    # pre-norm: hidden_states[1] is a residual sum that layer 1's first norm reads; eager keeps it
    # there (its in-place edit raises autograd's error in eager). The converted model keeps the
    # norm's y instead: it either raises alike or trains with the gradients of the unedited call
    import copy

    ids = torch.arange(3, 21).view(2, 9)
    pix = _r(2, 3, 8, 8)
    torch.manual_seed(0)
    eager = _frozen(name, 1)()
    ours = slimgrad.convert_(copy.deepcopy(eager))

    def step(m, edited):
        torch.manual_seed(1)
        m.train()
        kw = {"pixel_values": pix} if name == "ViTModel" else {"input_ids": ids}
        out = m(**kw, output_hidden_states=True)
        loss = _loss(out.last_hidden_state)
        if edited:
            HS_CALL_EDITS[edit](out.hidden_states[1])
        loss.backward()
        grads = [loss.detach()] + [p.grad for p in m.parameters() if p.requires_grad]
        m.zero_grad(set_to_none=True)  # (unbinds .grad: the list keeps these tensors)
        return grads

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(eager, True)
    eager.zero_grad(set_to_none=True)
    ref = step(eager, False)
    try:
        got = step(ours, True)
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_hidden_states_requested_only_where_asked_keep_eager_s_bytes():
    # the decision is per call: a call that asks for hidden states runs eager's op on the norms
    # whose y a layer returns (saved bytes equal to eager's at most); a call that does not keeps
    # their savings (the next call, on the same converted model)
    import copy

    from slimgrad.memory import measure

    ids = torch.arange(3, 21).view(2, 9)
    torch.manual_seed(0)
    eager = _hf("BertModel").eval()
    ours = slimgrad.convert_(copy.deepcopy(eager))

    def run(m, hs):
        return lambda: _loss(m(input_ids=ids, output_hidden_states=hs).last_hidden_state)

    saved = {
        (side, hs): measure(run(m, hs), timeline=False).saved_bytes
        for side, m in (("eager", eager), ("ours", ours))
        for hs in (True, False, True)
    }
    assert saved["ours", True] <= saved["eager", True], saved
    assert saved["ours", False] < saved["ours", True], saved
    marked = sorted(n for n, x in ours.named_modules() if getattr(x, "handed_out", False))
    assert "encoder.layer.0.output.LayerNorm" in marked, marked
    assert "encoder.layer.1.output.LayerNorm" not in marked, marked  # the model's output: eager


# -- InPlaceABN and the reversible chain at the model's output ----------------------------------


def _assert_rule_with(build, convert, step):
    # as _assert_rule, with the converted side built by ``convert(eager copy)``
    import copy

    from slimgrad.testing import rule_ok

    torch.manual_seed(0)
    eager = build()
    ours = convert(copy.deepcopy(eager))
    ref = copy.deepcopy(eager).double()
    outs = []
    for m, dt in ((eager, torch.float32), (ours, torch.float32), (ref, torch.float64)):
        torch.manual_seed(1)
        outs.append(step(m, dt))
    bad = []
    for i, (a, b, c) in enumerate(zip(*outs, strict=True)):
        ok, err, bound = rule_ok(b, c, a)
        if not ok:
            bad.append((i, err, bound))
    assert not bad, bad
    return ours


def _abn_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LeakyReLU(0.01))


def _abn(m):
    return slimgrad.convert_(m, slimgrad.ConvertConfig(inplace_abn=True))


def _coupling():
    from slimgrad.nn import AdditiveCoupling

    return AdditiveCoupling(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4), split_dim=-1
    )


def _chain_net():
    return nn.Sequential(nn.Linear(8, 8), _coupling(), _coupling())


def _reversible(exact):
    def convert(m):
        from slimgrad.nn import ReversibleSequential

        chain = ReversibleSequential(*list(m)[1:], exact=exact)
        return slimgrad.convert_(nn.Sequential(m[0], chain))

    return convert


KEPT_OUTPUT = {
    "InPlaceABN": (_abn_net, _abn, (2, 3, 7, 7)),
    "ReversibleSequential": (_chain_net, _reversible(False), (3, 8)),
    "ReversibleSequential-exact": (_chain_net, _reversible(True), (3, 8)),
}
OUT_EDITS = {
    "add_": lambda y: y.add_(1.0),
    "setitem": lambda y: y.__setitem__((0,), 0.0),
    "data_clamp_": lambda y: y.data.clamp_(-0.2, 0.2),
}


@pytest.mark.parametrize("edit", list(OUT_EDITS))
@pytest.mark.parametrize("kind", list(KEPT_OUTPUT))
def test_caller_edits_a_kept_output_at_the_model_s_output(kind, edit):
    # NOTE [A kept output at the model's output]: the module hands out a copy of what it keeps;
    # before, add_/setitem raised autograd's in-place error and .data changed every gradient
    # (InPlaceABN 8.6, the float chain 1.6 off)
    build, convert, shape = KEPT_OUTPUT[kind]

    def step(m, dt):
        m.train()
        x = _r(*shape, dt=dt, rg=True)
        y = m(x * 1.5)
        loss = _loss(y)
        OUT_EDITS[edit](y)
        return _grads(m, loss, [x])

    ours = _assert_rule_with(build, convert, step)
    copies = [x for x in ours.modules() if getattr(x, "at_output", False)]
    assert len(copies) == (0 if kind.endswith("exact") else 1), slimgrad.report(ours)


def test_a_kept_output_inside_the_model_is_not_copied():
    # a consumer after it: its output is not the model's output, nothing is copied
    from slimgrad.nn import ReversibleSequential

    abn = _abn(nn.Sequential(*_abn_net(), nn.Conv2d(8, 2, 1)))
    chain = ReversibleSequential(_coupling(), _coupling())
    rev = slimgrad.convert_(nn.Sequential(nn.Linear(8, 8), chain, nn.Linear(8, 2)))
    for m in (abn, rev):
        assert not [x for x in m.modules() if getattr(x, "at_output", False)], m


def test_inplace_abn_at_the_output_never_keeps_more_than_eager():
    import copy

    from slimgrad.memory import measure

    torch.manual_seed(0)
    eager = _abn_net()
    ours = _abn(copy.deepcopy(eager))
    x = _r(2, 3, 9, 9, rg=True)
    me = measure(lambda: _loss(eager(x * 1.5)), timeline=False)
    ms = measure(lambda: _loss(ours(x * 1.5)), timeline=False)
    assert ms.saved_bytes <= me.saved_bytes and ms.peak_bytes <= me.peak_bytes, (me, ms)


class _ParamFlag(_Stack):
    # ``skip`` is a parameter (unknown) that a branch may set to a literal: still unknown after
    def forward(self, x, skip=False):
        x = _untraceable(x)
        for layer in self.layers:
            if bool(x.sum() > 1e9):
                skip = True
            if not skip:
                x = layer(x)
        return x


def test_a_parameter_set_to_a_literal_on_one_path_stays_unknown():
    m = slimgrad.convert_(_ParamFlag())
    assert _off(m) == ALL, slimgrad.report(m)


# -- traceable forwards whose trace depends on the call: random draws and the mode -------------
# torch.fx runs forward once; a branch on a Python value (``self.training``, ``random.random()``,
# ``torch.rand([]).item()``) is fixed at trace time, so the trace may name the wrong last layer.


class _PyDrop(_Stack):
    # a plain-torch LayerDrop that torch.fx traces: Python's random module
    def forward(self, x):
        for layer in self.layers:
            if self.training and random.random() < self.drop:
                continue
            x = layer(x)
        return x


class _ItemDrop(_Stack):
    # the draw is torch's, read back as a number
    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]).item() < self.drop:
                continue
            x = layer(x)
        return x


class _OwnRng(_Stack):
    # a generator the module holds
    def __init__(self, drop):
        super().__init__(drop)
        self.rng = random.Random(0)

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.rng.random() < self.drop:
                continue
            x = layer(x)
        return x


class _RandomLayer(_Stack):
    # no branch at all: a random index
    def forward(self, x):
        return self.layers[random.randrange(len(self.layers))](x)


class _EvalExit(_Stack):
    # the mode alone decides the last layer: layers.1 in eval, layers.2 in train
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not self.training and i == 1:
                break
        return x


CALL_CASES = {
    "python_random": lambda: _PyDrop(drop=0.5),
    "torch_rand_item": lambda: _ItemDrop(drop=0.5),
    "own_generator": lambda: _OwnRng(drop=0.5),
    "random_index": lambda: _RandomLayer(),
    "mode_dependent_exit": lambda: _EvalExit(),
}


# (case, seed, train): one row per distinct code path of the 40 (coverage arcs of src/slimgrad and
# this file), each seed and every pair of (case, train) kept
CALL_ROWS = [
    ("python_random", 0, True),
    ("python_random", 1, False),
    ("torch_rand_item", 0, True),
    ("torch_rand_item", 3, True),
    ("torch_rand_item", 3, False),
    ("own_generator", 0, True),
    ("own_generator", 2, False),
    ("own_generator", 3, True),
    ("random_index", 0, True),
    ("random_index", 3, False),
    ("mode_dependent_exit", 0, True),
    ("mode_dependent_exit", 0, False),
]


@pytest.mark.parametrize("case,seed,train", CALL_ROWS)
def test_a_trace_that_depends_on_the_call_is_not_trusted(case, seed, train):
    # whatever fell at convert_ time (the seed, the mode), every layer whose output some call
    # returns runs eager's op (the forward's source read: every branch followed)
    random.seed(seed)
    torch.manual_seed(seed)
    m = CALL_CASES[case]().train(train)
    m = slimgrad.convert_(m)
    assert set(_off(m)) >= {"layers.1.norm", "layers.2.norm"}, slimgrad.report(m)
    assert m.training is train


# (case, seed): one row per distinct code path of the 20 (coverage arcs), each case and seed kept
EDIT_ROWS = [
    ("python_random", 0),
    ("python_random", 1),
    ("torch_rand_item", 3),
    ("own_generator", 3),
    ("random_index", 0),
    ("mode_dependent_exit", 2),
]


@pytest.mark.parametrize("case,seed", EDIT_ROWS)
def test_caller_edits_the_output_of_a_layer_the_trace_did_not_return(case, seed):
    def step(m, dt):
        m.train()
        random.seed(100 + seed)  # the same draws on each side
        x = _r(4, 8, dt=dt, rg=True)
        loss = torch.zeros((), dtype=dt)
        for _ in range(3):
            y = m(x * 1.5)
            loss = loss + _loss(y)
            y.data.clamp_(-0.2, 0.2)
        return _grads(m, loss, [x])

    random.seed(seed)  # what the trace at convert_ time draws
    _assert_rule(CALL_CASES[case], step)


# -- items of a returned tuple literal ----------------------------------------------------------


class _Pair(nn.Module):
    # returns a tuple literal: each item holds what its expression holds
    def __init__(self, swap=False, star=False):
        super().__init__()
        self.a, self.b = nn.LayerNorm(8), nn.LayerNorm(8)
        self.swap, self.star = int(swap), int(star)  # number settings: read at convert_ time

    def forward(self, x):
        x = _untraceable(x)
        a = self.a(x)
        b = self.b(x * 2.0)
        if self.star > 0:
            return (*[a, b],)  # not a literal of known items: either item may hold either
        if bool(x.sum() > 1e9):
            return (a, b)
        if self.swap > 0:
            return (b, a)
        return (a, b)


class _TakesFirst(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.pair = _Pair(**kw)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = _untraceable(x)
        first, second = self.pair(x)
        return self.fc(second) + 1.0, first


PAIR_CASES = {
    # name: (build, the norms that run eager's op)
    "first_item": (lambda: _TakesFirst(), ["pair.a"]),
    "swapped_on_one_path": (lambda: _TakesFirst(swap=True), ["pair.a", "pair.b"]),
    "starred": (lambda: _TakesFirst(star=True), ["pair.a", "pair.b"]),
}


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_tuple_items_are_told_apart(case):
    build, off = PAIR_CASES[case]
    m = slimgrad.convert_(build())
    assert _off(m) == off, slimgrad.report(m)


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_caller_edits_every_returned_item_through_data(case):
    build, _ = PAIR_CASES[case]

    def step(m, dt):
        x = _r(4, 8, dt=dt, rg=True)
        outs = m(x * 1.5)
        loss = sum(_loss(o) for o in outs)
        for o in outs:
            o.data.clamp_(-0.2, 0.2)
        return _grads(m, loss, [x])

    _assert_rule(build, step)


def test_a_hook_on_the_child_keeps_every_item():
    # a forward hook may return other items: either item may hold either
    m = _TakesFirst()
    m.pair.register_forward_hook(lambda mod, args, out: (out[1], out[0]))
    m = slimgrad.convert_(m)
    assert _off(m) == ["pair.a", "pair.b"], slimgrad.report(m)


def _deberta():
    import transformers as T

    cfg = T.DebertaV2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=99,
    )  # fmt: skip
    return T.DebertaV2Model(cfg)


def test_deberta_v2_attention_norms_keep_their_saving():
    # DebertaV2Model returns encoder_outputs[1][-1] and, per call, every hidden state
    # (return_dict=False: encoder_outputs[1:]): the embedding norm and each layer's output norm
    # run eager's op; each attention's output norm, item 0 of a (output, attention) tuple the
    # layer unpacks, is returned by no call
    m = slimgrad.convert_(_deberta())
    assert sorted(_off(m)) == [
        "embeddings.LayerNorm", "encoder.layer.0.output.LayerNorm",
        "encoder.layer.1.output.LayerNorm",
    ], slimgrad.report(m)  # fmt: skip


@pytest.mark.parametrize("return_dict", [True, False])
def test_deberta_v2_caller_edits_every_hidden_state(return_dict):
    ids = torch.arange(3, 21).view(2, 9)

    def step(m, dt):
        m.train()
        out = m(input_ids=ids, output_hidden_states=True, return_dict=return_dict)
        hs = out.hidden_states if return_dict else out[1]
        loss = _loss(hs[-1])
        for h in hs:
            h.data.clamp_(-0.2, 0.2)
        return _grads(m, loss)

    _assert_rule(_deberta, step)


def _swap_items(fn):
    @functools.wraps(fn)
    def swapped(*a, **k):
        x, y = fn(*a, **k)
        return y, x

    return swapped


class _DecoratedChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    @_swap_items
    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: torch.fx cannot trace it, the source is read
            x = x + 1
        return (x * 2, self.ln(x))


class _WritesFirstItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = _DecoratedChild()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 1e9:
            x = x + 1
        a, b = self.child(x)  # a is the LayerNorm's output: the decorator swaps the items
        a.mul_(2)
        return self.fc(a) + b


def test_a_decorated_forward_s_tuple_items_are_not_told_apart():
    # the source read is the undecorated function's, whose items the decorator reorders: before,
    # the norm kept y and backward raised autograd's in-place error where eager trains
    torch.manual_seed(0)
    m = _WritesFirstItem()
    x = torch.randn(4, 8, requires_grad=True)
    conv = slimgrad.convert_(copy.deepcopy(m))
    m(x).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    conv(x).sum().backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(conv.parameters(), want, strict=True))

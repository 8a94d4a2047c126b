"""Conformance: issue 30's round-3 classes, tried as an adversarial user on patterns the other
suites do not run.

Each row runs an eager model and ``slimgrad.convert_`` of a deep copy of it (and, for the error
rule, a float64 copy) on the same step: outputs, the loss and every gradient (parameters, inputs,
running statistics) by the error rule (``slimgrad.testing.rule_ok``), deterministic things bit for
bit. The patterns: in-place writes on what the converted model returns, hooks, double backward,
activation checkpointing, ``retain_graph``, gradient accumulation, tied and shared modules,
``requires_grad`` toggles and train/eval switches between steps, ``no_grad``/``inference_mode``
mixes, autocast bfloat16, channels_last and strided inputs, unbatched and empty inputs, padding
modes, ``torch.func``, optimizer loops with and without ``slimgrad.step_in_backward``, ``verify``
on sparse and complex gradients, copies of converted models and the report's coverage. A strict
xfail is a finding (its reason names the class of issue 30 and the measured numbers); the passing
rows guard classes found right.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.nn import _output_act
from slimgrad.testing import rule_ok
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _r(*shape, dt=torch.float32, seed=0, rg=False):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt).requires_grad_(rg)


def _w(o):
    # a fixed, non-uniform loss weight (a plain sum would hide sign and position errors)
    return torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)


def _loss(o):
    return (o * _w(o)).sum()


def _mlp():
    return nn.Sequential(
        nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 3)
    )


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8), nn.SiLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip


def _img(dt=torch.float32, seed=0, rg=False):
    return _r(2, 3, 7, 7, dt=dt, seed=seed, rg=rg)


def _vec(dt=torch.float32, seed=0, rg=False):
    return _r(4, 6, dt=dt, seed=seed, rg=rg)


def _grads(m, loss, extra=()):
    loss.backward()
    return [loss.detach()] + [p.grad for p in m.parameters()] + [e.grad for e in extra]


def _flat(out):
    if isinstance(out, torch.Tensor) or out is None:
        return [out]
    return [t for o in out for t in _flat(o)]


def _three(build, step, *, converted=None):
    """Run ``step(model, dtype)`` on eager, converted and float64 copies of ``build()``."""
    torch.manual_seed(0)
    eager = build()
    ours = slimgrad.convert_(copy.deepcopy(eager))
    if converted is not None:
        assert converted(ours), slimgrad.report(ours)
    ref = copy.deepcopy(eager).double()
    outs = []
    for m, dt in ((eager, torch.float32), (ours, torch.float32), (ref, torch.float64)):
        torch.manual_seed(1)
        outs.append(_flat(step(m, dt)))
    return outs


def _assert_rule(build, step, *, converted=None):
    e, s, r = _three(build, step, converted=converted)
    assert len(e) == len(s) == len(r)
    bad = []
    for i, (a, b, c) in enumerate(zip(e, s, r)):
        if a is None or b is None:
            assert (a is None) == (b is None), i
            continue
        assert (a.shape, a.dtype) == (b.shape, b.dtype), i
        if a.layout != torch.strided:
            a, b, c = a.to_dense(), b.to_dense(), c.to_dense()
        if not a.is_floating_point():
            assert torch.equal(a, b), i
            continue
        ok, err, bound = rule_ok(b, c, a)
        if not ok:
            bad.append((i, err, bound))
    assert not bad, bad


def _any_converted(m):
    return any(type(x).__module__.startswith("slimgrad.") for x in m.modules())


# -- crashes where eager runs: in-place writes on what the converted model returns -----------

# A norm whose output is the model's output: the caller writes it in place (a post-processing
# clamp, ``out += residual`` in the training loop, masking by assignment). Eager keeps the norm's
# input; the converted LayerNorm/RMSNorm/GroupNorm keep their output, so backward fails autograd's
# version check ("modified by an inplace operation"). The in-place guard
# (convert_handlers/inplace_guard.py) sees writers inside the model only.
NORM_AT_OUTPUT = {
    "LayerNorm": (lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8)), (2, 3, 6)),
    "RMSNorm": (lambda: nn.Sequential(nn.Linear(6, 8), nn.RMSNorm(8)), (2, 3, 6)),
    "GroupNorm": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8)), (2, 3, 7, 7)),
}
CALLER_WRITES = {
    "add_": lambda y: y.add_(1.0),
    "relu_": lambda y: y.relu_(),
    "setitem": lambda y: (y.__setitem__((0,), 0.0), y)[1],
    "view_clamp_": lambda y: (y.view(-1)[:5].clamp_(-0.1, 0.1), y)[1],
}


@pytest.mark.parametrize("write", list(CALLER_WRITES))
@pytest.mark.parametrize("norm", list(NORM_AT_OUTPUT))
def test_caller_writes_a_norm_output_in_place(norm, write):
    build, shape = NORM_AT_OUTPUT[norm]

    def step(m, dt):
        x = _r(*shape, dt=dt, rg=True)
        y = CALLER_WRITES[write](m(x * 1.5))
        return [y.detach()] + _grads(m, _loss(y), [x])

    _assert_rule(build, step)


@pytest.mark.parametrize("norm", list(NORM_AT_OUTPUT))
def test_caller_edits_a_norm_output_through_data(norm):
    build, shape = NORM_AT_OUTPUT[norm]

    def step(m, dt):
        x = _r(*shape, dt=dt, rg=True)
        y = m(x * 1.5)
        y.data.clamp_(-0.2, 0.2)
        return _grads(m, _loss(y), [x])

    _assert_rule(build, step, converted=_any_converted)


class _DataEdit(nn.Module):
    # an older-style forward that edits an activation through .data inside the model
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(self.fc(x))
        h.data.mul_(2.0)
        return self.fc2(self.act(h))


class _AtenEdit(nn.Module):
    # a forward that calls ATen ops directly (torch.ops.aten.*: OpOverload targets in the fx trace)
    def __init__(self, view):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)
        self.view = view

    def forward(self, x):
        h = self.norm(self.fc(x))
        if self.view:
            torch.ops.aten.mul_.Scalar(torch.ops.aten.view.default(h, [-1]), 2.0)
        else:
            torch.ops.aten.add_.Tensor(h, torch.ones(()))
        return self.fc2(h)


@pytest.mark.parametrize("view", [False, True], ids=["add_", "view_then_mul_"])
def test_aten_overload_write_inside_the_model_keeps_the_norm_eager(view):
    # the in-place guard reads an OpOverload's schema (a write to its first argument; a view):
    # before, the LayerNorm was converted and backward raised "modified by an inplace operation"
    _assert_rule(lambda: _AtenEdit(view), lambda m, dt: _grads(m, _loss(m(_vec(dt)))))


def test_data_edit_inside_the_model_keeps_the_norm_eager():
    # the in-place guard follows .data as an alias: the LayerNorm stays eager (before: converted,
    # every gradient wrong by up to 15.2, silently)
    _assert_rule(_DataEdit, lambda m, dt: _grads(m, _loss(m(_vec(dt)))))


def _hf_base(name):
    import transformers as T

    kw = dict(num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=99)
    if name == "BertModel":
        return T.BertModel(T.BertConfig(hidden_size=32, **kw))
    if name == "GPT2Model":
        return T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=99))
    if name == "T5EncoderModel":  # HF's T5LayerNorm (an RMSNorm variant) as its final norm
        cfg = T.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=4, vocab_size=99)
        return T.T5EncoderModel(cfg)
    return T.LlamaModel(T.LlamaConfig(hidden_size=32, num_key_value_heads=4, **kw))


HF_EDITS = {
    # mean pooling that zeroes the padding in place: a common sentence-embedding pattern
    "mask_padding_in_place": lambda h, mask: (h.__setitem__(mask == 0, 0.0), h)[1],
    "clamp_through_data": lambda h, mask: (h.data.clamp_(-0.1, 0.1), h)[1],
}


HF_BASE = ["BertModel", "LlamaModel", "GPT2Model", "T5EncoderModel"]


@pytest.mark.parametrize("edit", list(HF_EDITS))
@pytest.mark.parametrize("name", HF_BASE)
def test_caller_edits_an_hf_last_hidden_state(name, edit):
    ids = torch.arange(3, 21).view(2, 9)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0

    def step(m, dt):
        h = m(input_ids=ids, attention_mask=mask).last_hidden_state
        h = HF_EDITS[edit](h, mask)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).to(h.dtype)
        return _grads(m, _loss(pooled))

    _assert_rule(lambda: _hf_base(name), step, converted=_any_converted)


def _final_norm(m):
    # the norm whose output is last_hidden_state (NOTE [Modules whose output is the model's
    # output] in slimgrad/convert_handlers/inplace_guard.py)
    base = m.base_model
    for attr in ("norm", "ln_f", "final_layer_norm"):
        if isinstance(getattr(base, attr, None), nn.Module):
            return getattr(base, attr)
    if hasattr(base, "encoder") and hasattr(base.encoder, "final_layer_norm"):
        return base.encoder.final_layer_norm
    return base.encoder.layer[-1].output.LayerNorm


@pytest.mark.parametrize("name", HF_BASE)
def test_hf_base_model_runs_eager_norm_at_its_output_only(name):
    # the base model's output norm runs eager's op; every other converted norm keeps y (lean)
    m = slimgrad.convert_(_hf_base(name))
    norms = [x for x in m.modules() if type(x).__name__ in ("LayerNorm", "HFRMSNorm", "RMSNorm")]
    assert all(type(x).__module__.startswith("slimgrad.") for x in norms), slimgrad.report(m)
    off = [x for x in norms if x.keep_y is False]
    assert off == [_final_norm(m)], [type(x).__name__ for x in off]


def _albert():
    import transformers as T

    kw = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=99)
    return T.AlbertModel(T.AlbertConfig(hidden_size=16, embedding_size=8, **kw))


def test_albert_s_shared_layer_norm_at_its_output_runs_eager_s_op():
    # ALBERT calls its shared layer as ``self.albert_layer_groups[group_idx](...)``: a call of a
    # ModuleList's item may return any item's output. Before, that norm kept y: a caller's .data
    # edit of last_hidden_state changed the gradients (1.44 max abs difference in float64)
    m = slimgrad.convert_(_albert())
    off = [n for n, x in m.named_modules() if getattr(x, "keep_y", True) is False]
    assert off == ["encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm"], off
    ids = torch.randint(0, 99, (2, 5), generator=torch.Generator().manual_seed(0))

    def step(m, dt):
        h = m(input_ids=ids).last_hidden_state
        loss = _loss(h)
        h.data.clamp_(-0.2, 0.2)
        return _grads(m, loss)

    _assert_rule(_albert, step, converted=_any_converted)


def _lm(name):
    import transformers as T

    if name == "GPT2LMHeadModel":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=99))
    if name == "BertForMaskedLM":
        kw = dict(num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=99)
        return T.BertForMaskedLM(T.BertConfig(hidden_size=32, **kw))
    cfg = T.LlamaConfig(
        hidden_size=32, num_key_value_heads=4, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, vocab_size=99,
    )  # fmt: skip
    return T.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM"])
def test_a_head_after_the_final_norm_keeps_its_saving(name):
    # the final norm feeds the LM head (or the fused loss): not the model's output, keeps y
    m = slimgrad.convert_(_lm(name))
    norms = [x for x in m.modules() if hasattr(x, "keep_y") and "Norm" in type(x).__name__]
    assert norms and all(x.keep_y for x in norms), slimgrad.report(m)


# The same for every converted module that keeps its output where eager keeps its input, at the
# output of a custom module: one torch.fx traces, and one it cannot (data-dependent control flow:
# its forward's source is read). Unknown (a forward neither traced nor read) is taken as "may
# return any child's output": eager's op there (a few bytes, never a wrong gradient).
def _hf_rms(n):
    import transformers as T

    return T.models.llama.modeling_llama.LlamaRMSNorm(n)


KEEPS_Y_KINDS = {
    "LayerNorm": lambda: nn.LayerNorm(8),
    "RMSNorm": lambda: nn.RMSNorm(8),
    "LlamaRMSNorm": lambda: _hf_rms(8),
    "GroupNorm": lambda: nn.GroupNorm(2, 8),
    "LeakyReLU": lambda: nn.LeakyReLU(0.2),
    "Hardtanh": lambda: nn.Hardtanh(-0.5, 0.5),
    "ReLU6": lambda: nn.ReLU6(),
    "GELU": lambda: nn.GELU(),
    "SiLU": lambda: nn.SiLU(),
}


class _Last(nn.Module):
    # a forward torch.fx traces: returns its last module's output (a view of it)
    def __init__(self, last):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.last = last

    def forward(self, x):
        return self.last(self.fc(x)).view(x.shape[0], -1)


class _LastBranch(_Last):
    # data-dependent control flow: torch.fx fails, the forward's source is read
    def forward(self, x):
        h = self.fc(x)
        if bool(h.sum() > 0):
            h = h * 2.0
        out = self.last(h)
        return out


class _Outer(nn.Module):
    # the module at the output sits two levels down, behind a Sequential and a Dropout
    def __init__(self, last):
        super().__init__()
        self.body = nn.Sequential(_Last(last), nn.Dropout(0.0))

    def forward(self, x):
        return self.body(x)


OUTPUT_SITES = {
    "Sequential": lambda last: nn.Sequential(nn.Linear(6, 8), last, nn.Dropout(0.3)),
    "traced": _Last,
    "source": _LastBranch,
    "nested": _Outer,
}
EDITS = {
    "add_": lambda y: y.add_(1.0),
    "setitem": lambda y: (y.__setitem__((0,), 0.0), y)[1],
    "data_clamp_": lambda y: (y.data.clamp_(-0.2, 0.2), y)[1],
}


class _NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + self.fc(x))


class _Collects(nn.Module):
    # returns every layer's output, gathered in a loop (a post-LN encoder's hidden states); the
    # ``if`` makes torch.fx fail, so the forward's source is read
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_NormBlock() for _ in range(3)])

    def forward(self, x, double=False):
        if double:
            x = x * 2.0
        hs = ()
        for layer in self.layers:
            x = layer(x)
            hs = hs + (x,)
        return hs


class _Appends(_Collects):
    def forward(self, x, double=False):
        if double:
            x = x * 2.0
        hs = []
        for layer in self.layers:
            x = layer(x)
            hs.append(x)
        return hs


class _AugCollects(_Collects):
    def forward(self, x, double=False):
        if double:
            x = x * 2.0
        hs = ()
        for layer in self.layers:
            x = layer(x)
            hs += (x,)
        return hs


@pytest.mark.parametrize("cls", [_Collects, _Appends, _AugCollects])
def test_every_layer_output_gathered_in_a_loop_runs_eager_s_norm(cls):
    # each layer's norm output is in what the model returns, not only the last layer's: all run
    # eager's op, so a caller's .data edit of an early hidden state leaves the gradients eager's
    # (the loop's "last child only" reading left layers 0 and 1 keeping y: wrong gradients)
    m = cls()
    slimgrad.convert_(m)
    assert [x.norm.keep_y for x in m.layers] == [False] * 3, slimgrad.report(m)

    def step(m, dt):
        x = _r(4, 8, dt=dt, rg=True)
        hs = m(x * 1.5)
        loss = sum(_loss(h) for h in hs)
        hs[0].data.clamp_(-0.2, 0.2)
        return _grads(m, loss, [x])

    _assert_rule(cls, step, converted=_any_converted)


class _LastOnly(_Collects):
    def forward(self, x, double=False):
        if double:
            x = x * 2.0
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_loop_s_last_layer_alone_runs_eager_s_norm():
    # the loop leaves only the last layer's output: the other layers keep y (lean)
    m = _LastOnly()
    slimgrad.convert_(m)
    assert [x.norm.keep_y for x in m.layers] == [True, True, False], slimgrad.report(m)


# (kind, site, edit): of the 108 (every kind x site x edit), the rows that together run every
# coverage arc (branch arcs of src/slimgrad and this file) any of them runs, with every (kind,
# site) and every (site, edit) pair kept
Y_KEEPING_ROWS = [
    ("LayerNorm", "Sequential", "data_clamp_"),
    ("LayerNorm", "traced", "add_"),
    ("LayerNorm", "source", "add_"),
    ("LayerNorm", "nested", "setitem"),
    ("RMSNorm", "Sequential", "data_clamp_"),
    ("RMSNorm", "traced", "data_clamp_"),
    ("RMSNorm", "source", "setitem"),
    ("RMSNorm", "nested", "setitem"),
    ("LlamaRMSNorm", "Sequential", "add_"),
    ("LlamaRMSNorm", "traced", "data_clamp_"),
    ("LlamaRMSNorm", "source", "add_"),
    ("LlamaRMSNorm", "nested", "add_"),
    ("GroupNorm", "Sequential", "add_"),
    ("GroupNorm", "traced", "data_clamp_"),
    ("GroupNorm", "source", "data_clamp_"),
    ("GroupNorm", "nested", "data_clamp_"),
    ("LeakyReLU", "Sequential", "add_"),
    ("LeakyReLU", "traced", "add_"),
    ("LeakyReLU", "source", "data_clamp_"),
    ("LeakyReLU", "nested", "data_clamp_"),
    ("Hardtanh", "Sequential", "add_"),
    ("Hardtanh", "traced", "data_clamp_"),
    ("Hardtanh", "source", "setitem"),
    ("Hardtanh", "nested", "add_"),
    ("ReLU6", "Sequential", "setitem"),
    ("ReLU6", "traced", "add_"),
    ("ReLU6", "source", "add_"),
    ("ReLU6", "nested", "add_"),
    ("GELU", "Sequential", "add_"),
    ("GELU", "traced", "setitem"),
    ("GELU", "source", "setitem"),
    ("GELU", "nested", "data_clamp_"),
    ("SiLU", "Sequential", "add_"),
    ("SiLU", "traced", "data_clamp_"),
    ("SiLU", "source", "add_"),
    ("SiLU", "nested", "add_"),
]


@pytest.mark.parametrize("kind,site,edit", Y_KEEPING_ROWS)
def test_caller_edits_the_output_of_a_y_keeping_module(kind, site, edit):
    def build():
        return OUTPUT_SITES[site](KEEPS_Y_KINDS[kind]())

    def converted(m):
        return any(
            type(x).__module__.startswith("slimgrad.") and getattr(x, "keep_y", True) is False
            for x in m.modules()
        )

    def step(m, dt):
        m.eval() if site == "Sequential" else m.train()  # eval: Dropout returns its input
        x = _r(4, 6, dt=dt, rg=True)
        y = EDITS[edit](m(x * 1.5))
        return [y.detach()] + _grads(m, _loss(y), [x])

    _assert_rule(build, step, converted=converted)


@pytest.mark.parametrize("edit", list(EDITS))
def test_caller_edits_a_timm_layer_norm_2d_output(edit):
    # timm's LayerNorm2d as slimgrad converts it (a slimgrad.nn.LayerNorm subclass) at the output;
    # the eager side runs eager's op too (keep_y False): the rows compare it with the float64 copy
    from slimgrad.convert_handlers.timm import LayerNorm2d

    def build():
        eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LayerNorm2d(8))
        eager[1].keep_y = False
        return eager

    def step(m, dt):
        x = _r(2, 3, 5, 4, dt=dt, rg=True)
        y = EDITS[edit](m(x * 1.5))
        return [y.detach()] + _grads(m, _loss(y), [x])

    lone = slimgrad.convert_(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LayerNorm2d(8)))
    assert lone[1].keep_y is False  # convert_ decided it (the class default is True)
    _assert_rule(build, step, converted=lambda m: type(m[0]).__module__.startswith("slimgrad."))


@pytest.mark.parametrize("kind", list(KEEPS_Y_KINDS))
def test_a_consumer_after_the_module_keeps_the_lean_path(kind):
    # not the model's output: a Linear with grad keeps y anyway, so the module keeps y (lean)
    m = slimgrad.convert_(nn.Sequential(nn.Linear(6, 8), KEEPS_Y_KINDS[kind](), nn.Linear(8, 3)))
    # (a smooth activation before a Linear: kept where y is viewed as a matrix, NOTE [A Linear
    # keeps y itself only where y is viewed as a matrix] in slimgrad/nn/_output_act.py)
    flat = m[1].keep_y is _output_act._FLAT
    assert (m[1].keep_y is True or flat) and type(m[1]).__module__.startswith("slimgrad."), m[1]


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm", "GroupNorm", "LeakyReLU", "ReLU6"])
def test_at_the_output_its_bytes_are_eager_s(kind):
    # eager's op at the output: the same saved and peak bytes as eager, the same bits
    from slimgrad.memory import measure

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), KEEPS_Y_KINDS[kind]())
    ours = slimgrad.convert_(copy.deepcopy(eager))
    assert ours[1].keep_y is False
    assert "its output may be the model's output" in str(slimgrad.report(ours))
    x = _r(5, 6, rg=True)
    me = measure(lambda: _loss(eager(x)), timeline=False)
    ms = measure(lambda: _loss(ours(x)), timeline=False)
    assert (ms.saved_bytes, ms.peak_bytes) == (me.saved_bytes, me.peak_bytes)
    assert torch.equal(ours(x), eager(x))


# Activations at the model's output keep x there (NOTE [Keep y only where its consumer keeps
# it]): the caller's writes work; BatchNorm keeps its input once its output is edited.
ACT_AT_OUTPUT = {
    "GELU": lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU()),
    "SiLU": lambda: nn.Sequential(nn.Linear(6, 8), nn.SiLU()),
    "Mish": lambda: nn.Sequential(nn.Linear(6, 8), nn.Mish()),
    "ELU": lambda: nn.Sequential(nn.Linear(6, 8), nn.ELU()),
    "Hardswish": lambda: nn.Sequential(nn.Linear(6, 8), nn.Hardswish()),
    "Dropout": lambda: nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3)),
    "Linear": lambda: nn.Sequential(nn.Linear(6, 8)),
    "BatchNorm1d": lambda: nn.Sequential(nn.Conv1d(3, 8, 3), nn.BatchNorm1d(8)),
    "ConvTranspose2d-BN": lambda: nn.Sequential(nn.ConvTranspose2d(3, 8, 3), nn.BatchNorm2d(8)),
}


# ... and the monotone activations that keep y where eager keeps x: the same class as the norms
ACT_KEEPS_Y_AT_OUTPUT = {
    "LeakyReLU": lambda: nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2)),
    "Hardtanh": lambda: nn.Sequential(nn.Linear(6, 8), nn.Hardtanh(-0.5, 0.5)),
    "ReLU6": lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU6()),
}


@pytest.mark.parametrize("write", ["add_", "setitem"])
@pytest.mark.parametrize("name", list(ACT_KEEPS_Y_AT_OUTPUT))
def test_caller_writes_a_kept_activation_output_in_place(name, write):
    def step(m, dt):
        x = _r(2, 3, 6, dt=dt, rg=True)
        y = CALLER_WRITES[write](m(x * 1.5))
        return [y.detach()] + _grads(m, _loss(y), [x])

    _assert_rule(ACT_KEEPS_Y_AT_OUTPUT[name], step, converted=_any_converted)


@pytest.mark.parametrize("write", ["add_", "setitem"])
@pytest.mark.parametrize("name", list(ACT_AT_OUTPUT))
def test_caller_writes_other_outputs_in_place(name, write):
    shape = (2, 3, 9) if "BatchNorm1d" in name else (2, 3, 6, 6) if "Conv" in name else (2, 3, 6)

    def step(m, dt):
        x = _r(*shape, dt=dt, rg=True)
        y = CALLER_WRITES[write](m(x * 1.5))
        return [y.detach()] + _grads(m, _loss(y), [x])

    _assert_rule(ACT_AT_OUTPUT[name], step, converted=_any_converted)


# -- patterns of a training step ---------------------------------------------------------------


def _hooked(build, hook):
    def b():
        m = build()
        for c in m:
            c.register_forward_hook(hook)
        return m

    return b


def _gradient_penalty(m, dt):
    x = _img(dt, rg=True)
    (g,) = torch.autograd.grad(_loss(m(x)), x, create_graph=True)
    return _grads(m, (g.square().sum() - 1).square())


def _accumulate(m, dt):
    for i in range(3):
        _loss(m(_img(dt, seed=i))).backward()
    return [p.grad for p in m.parameters()] + list(m.buffers())


def _toggles(m, dt):
    for i in range(3):
        m[1].requires_grad_(i != 1)
        m[0].weight.requires_grad_(i != 2)
        m.train(i != 1)
        _loss(m(_img(dt, seed=i))).backward()
    m.requires_grad_(True)
    return [p.grad for p in m.parameters()] + list(m.buffers())


def _no_grad_mix(m, dt):
    with torch.no_grad():
        a = m(_img(dt, seed=1))
    with torch.inference_mode():
        b = m(_img(dt, seed=2)).clone()
    return [a, b] + _grads(m, _loss(m(_img(dt)))) + list(m.buffers())


def _autocast(m, dt):
    with torch.autocast("cpu", torch.bfloat16, enabled=dt == torch.float32):
        o = m(_img(dt))
    return _grads(m, _loss(o.to(dt)))


def _retain_twice(m, dt):
    loss = _loss(m(_img(dt)))
    loss.backward(retain_graph=True)
    return _grads(m, loss)


def _tied_conv():
    a, b = nn.Conv2d(3, 3, 3), nn.Conv2d(3, 3, 3)
    b.weight = a.weight
    return nn.Sequential(a, nn.BatchNorm2d(3), nn.ReLU(), b)


def _shared_bn():
    bn = nn.BatchNorm2d(3)
    return nn.Sequential(nn.Conv2d(3, 3, 3), bn, nn.ReLU(), nn.Conv2d(3, 3, 1), bn, nn.SiLU())


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, i):
        return self.head(self.ln(self.emb(i)))


def _tied_lm_step(m, dt):
    i = torch.arange(12).remainder(10).view(3, 4)
    return _grads(m, F.cross_entropy(m(i).flatten(0, 1), i.flip(0).flatten()))


PATTERNS = {
    "forward_hook_writes_output": (
        _hooked(_mlp, lambda mod, i, o: o.mul_(1.5)),
        lambda m, dt: _grads(m, _loss(m(_vec(dt)))),
    ),
    "forward_hook_returns_new": (_hooked(_cnn, lambda mod, i, o: o * 2), None),
    "forward_hook_retain_grad": (
        _hooked(_cnn, lambda mod, i, o: o.retain_grad() if o.requires_grad else None),
        None,
    ),
    "gradient_penalty_eval": (lambda: _cnn().eval(), _gradient_penalty),
    "checkpoint_non_reentrant": (
        _cnn,
        lambda m, dt: _grads(m, _loss(checkpoint(m, _img(dt), use_reentrant=False))),
    ),
    "checkpoint_reentrant": (
        _cnn,
        lambda m, dt: _grads(m, _loss(checkpoint(m, _img(dt, rg=True), use_reentrant=True))),
    ),
    "retain_graph_twice": (_cnn, _retain_twice),
    "grad_accumulation": (_cnn, _accumulate),
    "shared_bn_twice": (
        _shared_bn,
        lambda m, dt: _grads(m, _loss(m(_img(dt)))) + list(m.buffers()),
    ),
    "tied_conv_weights": (_tied_conv, None),
    "tied_embedding_head": (_TiedLM, _tied_lm_step),
    "requires_grad_and_mode_toggles": (_cnn, _toggles),
    "no_grad_inference_mode_mix": (_cnn, _no_grad_mix),
    "autocast_bf16": (_cnn, _autocast),
    "channels_last_model_and_input": (
        lambda: _cnn().to(memory_format=torch.channels_last),
        lambda m, dt: _grads(m, _loss(m(_img(dt).to(memory_format=torch.channels_last)))),
    ),
    "strided_input": (_cnn, lambda m, dt: _grads(m, _loss(m(_r(2, 3, 7, 14, dt=dt)[..., ::2])))),
    "expanded_input": (_mlp, lambda m, dt: _grads(m, _loss(m(_r(1, 6, dt=dt).expand(4, 6))))),
    "unbatched_1d_linear": (_mlp, lambda m, dt: _grads(m, _loss(m(_r(6, dt=dt))))),
    "unbatched_conv1d": (
        lambda: nn.Sequential(nn.Conv1d(3, 8, 3), nn.ReLU(), nn.Conv1d(8, 4, 3), nn.SiLU()),
        lambda m, dt: _grads(m, _loss(m(_r(3, 9, dt=dt)))),
    ),
    "conv_reflect_dilated": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=2, padding_mode="reflect", dilation=2),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        ),
        None,
    ),
    "conv_same_circular": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 4, padding="same", padding_mode="circular"),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        ),
        None,
    ),
    "conv3d_bn3d_relu6": (
        lambda: nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU6()),
        lambda m, dt: _grads(m, _loss(m(_r(2, 3, 4, 5, 3, dt=dt)))),
    ),
    "bn_untracked_and_eval_unaffine": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8, track_running_stats=False),
            nn.ReLU(),
            nn.BatchNorm2d(8, affine=False).eval(),
            nn.ELU(alpha=-0.5),
        ),
        None,
    ),
    "transformer_encoder_norm_first": (
        lambda: nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, batch_first=True, norm_first=True
        ),
        lambda m, dt: _grads(m, _loss(m(_r(2, 5, 8, dt=dt)))),
    ),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_training_step_patterns(name):
    build, step = PATTERNS[name]
    _assert_rule(build, step or (lambda m, dt: _grads(m, _loss(m(_img(dt))))), converted=None)


def _norm_mlp():
    return nn.Sequential(
        nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.RMSNorm(8), nn.SiLU(),
        nn.Linear(8, 3),
    )  # fmt: skip


LATE_HOOKS = {
    "forward_writes_output": lambda c: c.register_forward_hook(lambda m, i, o: o.mul_(1.5)),
    "forward_edits_output_data": lambda c: c.register_forward_hook(
        lambda m, i, o: o.data.mul_(1.5)
    ),
    "forward_pre_new_input": lambda c: c.register_forward_pre_hook(lambda m, i: (i[0] * 1.1,)),
    "backward_pre_scales": lambda c: c.register_full_backward_pre_hook(
        lambda m, go: tuple(g * 2 if g is not None else None for g in go)
    ),
    "backward_scales_grad_input": lambda c: c.register_full_backward_hook(
        lambda m, gi, go: tuple(g * 3 if g is not None else None for g in gi)
    ),
}


@pytest.mark.parametrize("hook", list(LATE_HOOKS))
def test_hooks_registered_after_convert_on_norms_and_activations(hook):
    def step(m, dt):
        handles = [LATE_HOOKS[hook](m[i]) for i in (1, 2, 4, 5)]
        try:
            x = _vec(dt, rg=True)
            return _grads(m, _loss(m(x)), [x])
        finally:
            for h in handles:
                h.remove()

    _assert_rule(_norm_mlp, step, converted=_any_converted)


def test_empty_batch():
    def step(m, dt):
        y = m(_r(0, 6, dt=dt))
        assert y.shape == (0, 3)
        return _grads(m, _loss(y) + sum(p.sum() * 0 for p in m.parameters()))

    _assert_rule(_mlp, step)


def test_torch_func_grad_and_vmap_per_sample():
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    eager = _mlp()
    ours = slimgrad.convert_(copy.deepcopy(eager))
    x = _vec()
    got = []
    for m in (eager, ours):
        params = {k: v.detach() for k, v in m.named_parameters()}
        g = grad(lambda p, xx, m=m: _loss(functional_call(m, p, (xx,))))(params, x)
        per = vmap(
            grad(lambda p, xx, m=m: _loss(functional_call(m, p, (xx.unsqueeze(0),)))),
            in_dims=(None, 0),
        )(params, x)
        got.append((g, per))
    for k in got[0][0]:
        torch.testing.assert_close(got[1][0][k], got[0][0][k])
        torch.testing.assert_close(got[1][1][k], got[0][1][k])


# -- optimizer loops: the plain loop and step_in_backward ----------------------------------------

OPTIMIZERS = {
    "SGD-nesterov-wd": (
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "RMSprop-centered": (torch.optim.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1)),
    "NAdam-decoupled": (
        torch.optim.NAdam,
        dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    ),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["Adafactor"] = (torch.optim.Adafactor, dict(lr=1e-2))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_in_backward_is_the_plain_loop_bit_for_bit(name):
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(0)
    base = slimgrad.convert_(_mlp())
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    opt = cls(plain.parameters(), **kw)
    handle = slimgrad.step_in_backward(ours, cls, **kw)
    try:
        for i in range(3):
            for m, o in ((plain, opt), (ours, handle)):
                _loss(m(_vec(seed=i))).backward()
                o.step()
                o.zero_grad()
    finally:
        handle.remove()
    for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)
        assert b.grad is None


def test_step_in_backward_with_a_scheduler_and_clip_value():
    torch.manual_seed(0)
    base = slimgrad.convert_(_cnn())
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(plain.parameters(), **kw)
    handle = slimgrad.step_in_backward(ours, torch.optim.SGD, clip_grad_value=0.05, **kw)
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10) for o in (opt, handle)
    ]
    try:
        for i in range(3):
            _loss(plain(_img(seed=i))).backward()
            torch.nn.utils.clip_grad_value_(plain.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            _loss(ours(_img(seed=i))).backward()
            handle.step()
            handle.zero_grad()
            for s in scheds:
                s.step()
    finally:
        handle.remove()
    for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.buffers(), ours.buffers(), strict=True):
        assert torch.equal(a, b)


def test_grad_scaler_cpu_loop_within_rule():
    def step(m, dt):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for i in range(3):
            with torch.autocast("cpu", torch.bfloat16, enabled=dt == torch.float32):
                loss = _loss(m(_img(dt, seed=i)).to(dt))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return list(m.parameters())

    _assert_rule(_cnn, step)


# -- verify on sparse and complex gradients; it leaves both models as they were ------------------


class _SparseEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 8, sparse=True)
        self.n = nn.LayerNorm(8)
        self.l = nn.Linear(8, 3)

    def forward(self, i):
        return self.l(self.n(self.e(i)))


class _ComplexParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.n = nn.LayerNorm(8)
        self.w = nn.Parameter(torch.randn(8, dtype=torch.cfloat))

    def forward(self, x):
        return (torch.fft.fft(self.n(self.l(x))) * self.w).abs()


@pytest.mark.parametrize(
    "build,inp",
    [(_SparseEmb, lambda: torch.arange(6).view(2, 3)), (_ComplexParam, lambda: _r(2, 8))],
    ids=["sparse_embedding", "complex_parameter"],
)
def test_verify_sparse_and_complex_gradients(build, inp):
    torch.manual_seed(0)
    m = build()
    s = slimgrad.convert_(copy.deepcopy(m))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    res = slimgrad.verify(m, s, inp())
    assert res.ok, str(res)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    copy.deepcopy(m)


@pytest.mark.parametrize(
    "build,inp",
    [
        (_mlp, lambda: _vec()),
        (lambda: nn.Sequential(nn.Embedding(5, 6), nn.LayerNorm(6), nn.Linear(6, 3)), None),
    ],
    ids=["float_input", "integer_input"],
)
def test_verify_a_frozen_model(build, inp):
    # every parameter frozen (a feature extractor): the first run (the inputs as given) has
    # nothing to differentiate; verify compares the outputs and the loss (it raised autograd's
    # "`inputs` argument to `grad()` cannot be empty")
    torch.manual_seed(0)
    m = build().requires_grad_(False)
    s = slimgrad.convert_(copy.deepcopy(m))
    x = inp() if inp is not None else torch.arange(6).remainder(5).view(2, 3)
    res = slimgrad.verify(m, s, x)
    assert res.ok, str(res)
    assert res.runs[0].outputs and not res.runs[0].grads


# -- copies of a converted model ------------------------------------------------------------------

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": lambda m: (
        lambda b: (torch.save(m, b), b.seek(0), torch.load(b, weights_only=False))[2]
    )(io.BytesIO()),
}


@pytest.mark.parametrize("how", list(COPIES))
def test_copies_of_a_converted_model_train_as_the_original(how):
    torch.manual_seed(0)
    eager = _cnn()
    ours = slimgrad.convert_(copy.deepcopy(eager))
    dup = COPIES[how](ours)
    x = _img()
    for m in (eager, dup):
        torch.manual_seed(1)
        _loss(m(x)).backward()
    for a, b in zip(eager.parameters(), dup.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)
    assert _any_converted(dup)


@pytest.mark.parametrize("how", list(COPIES))
def test_report_of_a_copied_converted_model(how):
    ours = slimgrad.convert_(_cnn())
    want = str(slimgrad.report(ours))
    assert str(slimgrad.report(COPIES[how](ours))) == want


# -- coverage: every module type with parameters left alone is named -----------------------------


def test_report_names_every_left_alone_type_with_parameters():
    model = nn.Sequential(
        nn.Embedding(5, 4), nn.PReLU(), nn.Bilinear(3, 3, 3), nn.SyncBatchNorm(3),
        nn.InstanceNorm2d(3, affine=True), nn.EmbeddingBag(4, 4), nn.LSTM(4, 4), nn.GRU(4, 4),
        nn.MultiheadAttention(8, 2), nn.Conv2d(3, 3, 1),
    )  # fmt: skip
    slimgrad.convert_(model)
    rep = slimgrad.report(model)
    named = {n for n, _, _ in rep.left_alone} | {n for n, _, _ in rep.converted}
    with_params = {
        n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))
    }
    assert with_params <= named, with_params - named
    assert all(r for _, _, r in rep.left_alone)


# -- findings whose fix lies in ops/ (other files): strict xfails -------------------------------


class _ActThenTranspose(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.act = act
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.act(self.conv(x)).transpose(1, 2))


@pytest.mark.parametrize(
    "act",
    [nn.GELU, lambda: nn.GELU(approximate="tanh"), nn.SiLU, nn.Mish],
    ids=["GELU", "GELU-tanh", "SiLU", "Mish"],
)
def test_transposed_gradient_into_smooth_activation(act):
    def step(m, dt):
        x = _r(2, 3, 40, dt=dt, rg=True)
        return _grads(m, _loss(m(x)), [x])

    _assert_rule(lambda: _ActThenTranspose(act()), step, converted=_any_converted)


@pytest.mark.parametrize(
    "act", [nn.ELU, nn.Hardswish, lambda: nn.LeakyReLU(0.1)], ids=["ELU", "Hardswish", "LeakyReLU"]
)
def test_transposed_gradient_into_other_activations(act):
    def step(m, dt):
        x = _r(2, 3, 40, dt=dt, rg=True)
        return _grads(m, _loss(m(x)), [x])

    _assert_rule(lambda: _ActThenTranspose(act()), step, converted=_any_converted)


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "phi3_fused"])
def test_gated_mlp_peak_never_above_eager_at_small_token_counts(kind):
    # issue 30 class 7 (never more than eager): Linear -> LlamaMLP -> Linear over tokens 1..600;
    # the lean backward held g and u through its weight-gradient matmuls (18 tokens at (32, 64):
    # 49,544 vs 42,376 B); the op now runs eager's ops where it cannot win, decided from the
    # shapes (NOTE [The gated MLP's peak against eager's] in ops/gated_mlp.py), and keeps its
    # savings with many tokens
    # (biases: the general backward; Phi-3: one gate_up projection)
    from transformers import LlamaConfig, Phi3Config
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    from slimgrad.memory import measure

    for hidden, inter in ((16, 48), (32, 64), (64, 128), (128, 344)):
        kw = dict(
            hidden_size=hidden,
            intermediate_size=inter,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
        torch.manual_seed(0)
        if kind == "phi3_fused":
            mlp = Phi3MLP(Phi3Config(**kw))
        else:
            mlp = LlamaMLP(LlamaConfig(**kw, mlp_bias=kind == "llama_bias"))
        eager = nn.Sequential(nn.Linear(hidden, hidden), mlp, nn.Linear(hidden, hidden))
        ours = slimgrad.convert_(copy.deepcopy(eager))
        assert type(ours[1]).__module__.startswith("slimgrad."), slimgrad.report(ours)
        for tokens in (1, 5, 18, 33, 64, 100, 128, 300, 600):
            x, w = _r(tokens, hidden), _r(tokens, hidden, seed=1)
            peaks = []
            for m in (eager, ours):
                (m(x) * w).sum().backward()  # warm-up: caches made on first use count there
                m.zero_grad(set_to_none=True)
                step = lambda m=m, x=x, w=w: (m(x) * w).sum()  # noqa: E731
                peaks.append(measure(step, timeline=False).peak_bytes)
                m.zero_grad(set_to_none=True)
            assert peaks[1] <= peaks[0], (hidden, inter, tokens, peaks)
        # the savings stay where the lean backward wins (600 tokens: 0.80x to 0.92x measured)
        assert peaks[1] <= 0.95 * peaks[0], (hidden, inter, tokens, peaks)

"""Conformance: hooks registered after ``convert_`` on the modules around an output-saving module,
and global pre-hooks (NOTE [Hooks registered after convert_ on the modules around] in
slimgrad/nn/_hooks.py; issue 30, class 1: a converted module's output accepts what the original's
output accepts, hooks included).

Before, only the module's own forward hooks and the global forward hooks were checked per call: a
parent's forward hook (the parent's output is the norm's or activation's), a consumer's forward
pre-hook or forward hook, or a global forward pre-hook that edits that output in place, registered
after ``convert_``, made the converted backward raise autograd's in-place error where eager trains.
Each writing row registers the same hook on the eager model and on the converted one and asserts
the converted gradients equal eager's bit for bit (the module runs eager's op for those calls). A
hook that only reads, or returns a new tensor instead of editing, keeps the savings: those rows
assert slimgrad's tracker's saved bytes equal the hook-free converted run's, below eager's.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.modules import module as _module

import slimgrad
from slimgrad.convert_handlers.inplace_guard import hook_may_write
from slimgrad.memory import measure
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


_W = 256  # (wide enough that every module below keeps its output: the rows test that path)
_SAVERS = {
    "LayerNorm": lambda: nn.LayerNorm(_W),
    "RMSNorm": lambda: nn.RMSNorm(_W),
    "GroupNorm": lambda: nn.GroupNorm(2, _W),
    "GELU": nn.GELU,
    "GELU(tanh)": lambda: nn.GELU(approximate="tanh"),
    "SiLU": nn.SiLU,
    "Mish": nn.Mish,
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "ELU": nn.ELU,
    "Hardtanh": nn.Hardtanh,
    "ReLU6": nn.ReLU6,
    "Hardswish": nn.Hardswish,
}


def _build(make):
    # the saver ends a block (its output is the block's); an Identity, then a Linear, take it
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(_W, _W), make()), nn.Identity(), nn.Linear(_W, 2))


def _grads(m, x):
    m.zero_grad(set_to_none=True)
    m(x).square().sum().backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


def _scale(t):
    t.mul_(1.5)  # a helper of the user's: the hook's write happens here


# each: (model) -> the handle of a hook that edits the saver's output in place and returns None
def _none(f):
    return lambda *a, **k: (f(*a, **k), None)[1]


_WRITERS = {
    "parent forward hook": lambda m: m[0].register_forward_hook(
        _none(lambda mod, i, o: o.mul_(1.5))
    ),
    "parent forward hook, with_kwargs": lambda m: m[0].register_forward_hook(
        _none(lambda mod, a, kw, o: o.add_(1.0)), with_kwargs=True
    ),
    "parent forward hook, always_call": lambda m: m[0].register_forward_hook(
        _none(lambda mod, i, o: o.mul_(1.5)), always_call=True
    ),
    "parent forward hook, through a helper": lambda m: m[0].register_forward_hook(
        lambda mod, i, o: _scale(o)
    ),
    "parent forward hook, through .data": lambda m: m[0].register_forward_hook(_data_write),
    "parent forward hook, setitem": lambda m: m[0].register_forward_hook(_zero_first_column),
    "consumer pre-hook": lambda m: m[2].register_forward_pre_hook(
        _none(lambda mod, a: a[0].mul_(1.5))
    ),
    "consumer pre-hook, with_kwargs": lambda m: m[2].register_forward_pre_hook(
        _none(lambda mod, a, kw: a[0].add_(1.0)), with_kwargs=True
    ),
    "consumer pre-hook, *args": lambda m: m[2].register_forward_pre_hook(_star_pre),
    "pass-through consumer pre-hook": lambda m: m[1].register_forward_pre_hook(_star_pre),
    # (the Identity keeps nothing: eager trains; a Linear there keeps its input: eager raises)
    "consumer forward hook writing its input": lambda m: m[1].register_forward_hook(
        _none(lambda mod, a, o: a[0].mul_(1.5))
    ),
    "global pre-hook": lambda m: _module.register_module_forward_pre_hook(_global_pre),
    "global forward hook": lambda m: _module.register_module_forward_hook(_global_fwd),
}


def _data_write(mod, args, out):
    out.data.mul_(1.5)


def _zero_first_column(mod, args, out):
    out[:, 0] = 0.0


def _star_pre(*a):
    a[1][0].mul_(1.5)


def _global_pre(mod, args):
    # the consumer's input is the saver's output
    if isinstance(mod, nn.Linear) and mod.out_features == 2:
        args[0].mul_(1.5)


def _global_fwd(mod, args, out):
    if isinstance(mod, nn.Sequential) and len(mod) == 2 and isinstance(mod[0], nn.Linear):
        out.mul_(1.5)


@pytest.mark.parametrize("hook", list(_WRITERS))
@pytest.mark.parametrize("saver", list(_SAVERS))
def test_writing_hook_after_convert_trains_as_eager(saver, hook):
    eager = _build(_SAVERS[saver])
    ours = slimgrad.convert_(copy.deepcopy(eager))
    assert type(ours[0][1]).__module__.startswith("slimgrad."), slimgrad.report(ours)
    x = torch.randn(64, _W)
    handles = [_WRITERS[hook](eager)]
    want = _grads(eager, x)
    handles[0].remove()
    handles = [_WRITERS[hook](ours)]
    try:
        got = _grads(ours, x)
    finally:
        for h in handles:
            h.remove()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, saver, hook)
    # the hook gone, the module keeps its output again: the same gradients as before any hook
    again = _grads(ours, x)
    ref = _grads(eager, x)
    for k in ref:
        torch.testing.assert_close(again[k], ref[k])


def _saved(m, x):
    return measure(lambda: m(x).square().sum(), timeline=False).saved_bytes


# each: (model) -> a handle; the hook reads, or returns a new tensor
_READERS = {
    "parent collects its output": lambda m, seen: m[0].register_forward_hook(
        lambda mod, i, o: seen.append(o)
    ),
    "parent returns a new tensor": lambda m, seen: m[0].register_forward_hook(
        lambda mod, i, o: o * 1.5
    ),
    "consumer pre-hook reads": lambda m, seen: m[1].register_forward_pre_hook(
        lambda mod, a: seen.append(a[0].shape)
    ),
    "consumer pre-hook returns new args": lambda m, seen: m[1].register_forward_pre_hook(
        lambda mod, a: (a[0] * 1.5,)
    ),
    "consumer forward hook reads": lambda m, seen: m[1].register_forward_hook(
        lambda mod, a, o: seen.append(o.detach())
    ),
    "global pre-hook reads": lambda m, seen: _module.register_module_forward_pre_hook(
        lambda mod, a: seen.append(type(mod).__name__)
    ),
}

_WIDE = {
    "LayerNorm": lambda: nn.LayerNorm(48),
    "RMSNorm": lambda: nn.RMSNorm(48),
    "GELU": nn.GELU,
    "SiLU": nn.SiLU,
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "Hardtanh": nn.Hardtanh,
}


@pytest.mark.parametrize("hook", list(_READERS))
@pytest.mark.parametrize("saver", list(_WIDE))
def test_reading_hook_after_convert_keeps_the_savings(saver, hook):
    # (an 8x48 input: the tracker's bytes are exact whatever the shape; the saving must show)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Sequential(nn.Linear(48, 48), _WIDE[saver]()), nn.Linear(48, 2))
    ours = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(8, 48)
    bare, eager_bare = _saved(ours, x), _saved(eager, x)
    seen: list = []
    h = _READERS[hook](eager, seen)
    eager_hooked = _saved(eager, x)
    want = _grads(eager, x)
    h.remove()
    h = _READERS[hook](ours, seen)
    try:
        hooked = _saved(ours, x)
        got = _grads(ours, x)
        # read as harmless: the module ran its own op, and its check is back to a C comparison
        assert ours[0][1].near_hooks == ours[0][1].near_free
    finally:
        h.remove()
    assert hooked <= eager_hooked and bare <= eager_bare
    if "returns" not in hook:  # a hook that returns a new tensor: the next Linear keeps that one
        assert hooked == bare, (hooked, bare)  # (not the module's output, as without the hook)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_a_writing_hook_costs_the_savings_only_while_it_is_there():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Sequential(nn.Linear(48, 48), nn.LayerNorm(48)), nn.Linear(48, 2))
    ours = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(8, 48)
    bare, full = _saved(ours, x), _saved(eager, x)
    h = ours[0].register_forward_hook(lambda mod, i, o: o.mul_(1.5))
    assert _saved(ours, x) == full  # eager's op: eager's bytes exactly
    h.remove()
    assert _saved(ours, x) == bare < full


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_watch_their_own_neighbours(how):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)), nn.Linear(6, 2))
    ours = slimgrad.convert_(copy.deepcopy(eager))
    seen: list = []
    h = ours[1].register_forward_pre_hook(_Collect(seen))  # a read-only hook seen before the copy
    ours(torch.randn(2, 6))
    h.remove()
    c = copy.deepcopy(ours) if how == "deepcopy" else pickle.loads(pickle.dumps(ours))
    assert c[0][1].near_hooks[0] is _module._global_forward_pre_hooks
    assert any(d is c[1]._forward_pre_hooks for d in c[0][1].near_hooks)
    x = torch.randn(3, 6)
    eager[1].register_forward_pre_hook(_write_pre)
    c[1].register_forward_pre_hook(_write_pre)
    want, got = _grads(eager, x), _grads(c, x)
    for k in want:
        assert torch.equal(got[k], want[k]), k


class _Collect:
    def __init__(self, seen):
        self.seen = seen

    def __call__(self, mod, args):
        self.seen.append(args[0].shape)


def _write_pre(mod, args):
    args[0].mul_(1.5)


def _first(o):
    return o[0] if isinstance(o, tuple) else o


_BERT_HOOKS = {
    # BertOutput's and BertLayer's output is the layer's last LayerNorm's
    "BertOutput forward hook": lambda m: m.encoder.layer[0].output.register_forward_hook(
        lambda mod, i, o: (_first(o).mul_(1.5), None)[1]
    ),
    "BertLayer forward hook": lambda m: m.encoder.layer[0].register_forward_hook(
        lambda mod, i, o: (_first(o).mul_(1.5), None)[1]
    ),
    # the next layer's query projection is given that output
    "next query pre-hook": lambda m: m.encoder.layer[
        1
    ].attention.self.query.register_forward_pre_hook(lambda mod, a: (a[0].mul_(1.5), None)[1]),
}


@pytest.mark.parametrize("hook", list(_BERT_HOOKS))
def test_bert_post_norm_layer_hook_after_convert(hook):
    transformers = pytest.importorskip("transformers")
    from tests.conformance.test_round3_adversarial import _assert_rule, _grads, _loss

    cfg = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    ids = torch.arange(3, 21).view(2, 9)

    def build():
        return transformers.BertModel(cfg).eval()

    def step(m, dt):
        h = _BERT_HOOKS[hook](m)  # registered after convert_ (``_three`` converts first)
        try:
            return _grads(m, _loss(m(input_ids=ids).last_hidden_state))
        finally:
            h.remove()

    _assert_rule(build, step)
    # the hook gone, the converted model keeps its savings
    torch.manual_seed(0)
    eager = build()
    ours = slimgrad.convert_(copy.deepcopy(eager))

    def saved(m):
        return measure(lambda: _loss(m(input_ids=ids).last_hidden_state)).saved_bytes

    bare = saved(ours)
    _BERT_HOOKS[hook](ours).remove()
    assert saved(ours) == bare < saved(eager)


@pytest.mark.parametrize(
    ("hook", "writes"),
    [
        (lambda m, i, o: o.mul_(2), True),
        (lambda m, i, o: _scale(o), True),  # a function of the user's given the output
        (lambda m, i, o: o.data.mul_(2), True),
        (lambda m, i, o: setattr(o, "data", o * 2), True),
        (lambda m, i, o: (o.detach().zero_(), None)[1], True),
        (lambda m, i, o: torch.nn.functional.relu(o, inplace=True), True),
        (lambda m, i, o: None, False),
        (lambda m, i, o: o * 2, False),
        (lambda m, i, o: print(o.shape), False),
        (lambda m, i, o: [].append(o), False),
        (_Collect([]), True),  # a callable object: its source is not read
    ],
    ids=[
        "mul_", "helper", ".data.mul_", "setattr data", "detach().zero_", "F.relu inplace",
        "None", "new tensor", "print shape", "append", "callable object",
    ],
)  # fmt: skip
def test_hook_may_write_reads_the_hook(hook, writes):
    assert hook_may_write(hook) is writes


def test_transformers_output_capturing_hook_counts_as_reading():
    oc = pytest.importorskip("transformers.utils.output_capturing")
    install = getattr(oc, "install_output_capuring_hook", None)  # (transformers' spelling)
    if install is None:
        pytest.skip("this transformers installs no output-capturing hook")
    m = nn.Linear(2, 2)
    install(m, "hidden_states", 0)
    (hook,) = m._forward_hooks.values()
    assert hook_may_write(hook) is False

"""Forward hooks registered after ``convert_`` on modules that keep their output (NOTE [Forward
hooks on an output-saving module] in ``slimgrad/nn/_hooks.py``): a hook that edits the output in
place (activation steering) trains as in eager, bit for bit; one that writes nothing it is given
keeps the savings; slimgrad's observers do not count."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules import module as _module

import slimgrad
import slimgrad.memory
from slimgrad.nn._hooks import forward_hooked


def _steer(m, args, out):
    out.mul_(1.5)  # edits the output in place, returns None


def _read(m, args, out):
    out.sum()  # only reads


# (name, builder of the module under test, 1-d (Linear) or channels (Conv1d) around it)
CASES = [
    ("LayerNorm", lambda: nn.LayerNorm(64), "linear"),
    ("GroupNorm", lambda: nn.GroupNorm(4, 64), "conv"),
    ("RMSNorm", lambda: nn.RMSNorm(64), "linear"),
    ("GELU", nn.GELU, "linear"),
    ("GELU-tanh", lambda: nn.GELU("tanh"), "linear"),
    ("Mish", nn.Mish, "linear"),
    ("Mish-inplace", lambda: nn.Mish(inplace=True), "linear"),
    ("ELU", nn.ELU, "linear"),
    ("ELU-neg", lambda: nn.ELU(alpha=-0.5), "linear"),
    ("LeakyReLU", nn.LeakyReLU, "linear"),
    ("Hardtanh", nn.Hardtanh, "linear"),
    ("Hardtanh-inplace", lambda: nn.Hardtanh(inplace=True), "linear"),
    ("ReLU6", nn.ReLU6, "linear"),
    ("SiLU", nn.SiLU, "linear"),
    ("SiLU-inplace", lambda: nn.SiLU(inplace=True), "linear"),
    ("Hardswish", nn.Hardswish, "linear"),
]


def _model(make, around):
    torch.manual_seed(0)
    if around == "linear":
        return nn.Sequential(nn.Linear(64, 64), make(), nn.Linear(64, 64))
    return nn.Sequential(nn.Conv1d(64, 64, 1), make(), nn.Conv1d(64, 64, 1))


def _input(around):
    torch.manual_seed(1)
    shape = (32, 64) if around == "linear" else (4, 64, 9)  # above DENSE_MAX elements
    return torch.randn(shape, requires_grad=True)


def _step(model, x):
    y = model(x)
    params = list(model.parameters())
    return (y, *torch.autograd.grad(y.square().sum(), [x, *params]))


def _pair(make, around):
    eager = _model(make, around)
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    assert type(conv[1]).__module__.startswith("slimgrad."), type(conv[1])
    return eager, conv


@pytest.mark.parametrize("name,make,around", CASES)
def test_inplace_hook_after_convert_is_eager(name, make, around):
    eager, conv = _pair(make, around)
    eager[1].register_forward_hook(_steer)
    conv[1].register_forward_hook(_steer)
    x = _input(around)
    ref = _step(eager, x.detach().requires_grad_())
    got = _step(conv, x.detach().requires_grad_())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name,make,around", CASES[:5])
def test_global_inplace_hook_is_eager(name, make, around):
    eager, conv = _pair(make, around)
    kinds = (type(eager[1]), type(conv[1]))

    def steer(m, args, out):
        if isinstance(m, kinds):
            out.mul_(1.5)

    handle = _module.register_module_forward_hook(steer)
    try:
        x = _input(around)
        ref = _step(eager, x.detach().requires_grad_())
        got = _step(conv, x.detach().requires_grad_())
    finally:
        handle.remove()
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _saved(model, x):
    return slimgrad.memory.measure(lambda: model(x).square().sum(), timeline=False).saved_bytes


@pytest.mark.parametrize("name,make,around", [CASES[0], CASES[3], CASES[9]])
def test_read_only_hook_keeps_the_savings_and_a_writer_runs_eager(name, make, around):
    # the policy: a hook whose source writes nothing it is given changes nothing (the savings,
    # the bits, the hook's calls); one that may write runs eager's op, values and memory, and
    # removing it brings slimgrad's saving back
    eager, conv = _pair(make, around)
    x = _input(around)
    # the bytes at inputs near the biases: no hard elements on any CPU (erf-GELU's hard window
    # follows this CPU's erf, NOTE [A window from eager's own forward error]; past 1/16 hard the
    # op keeps x, eager's bytes, and the saving this row compares would not show)
    xs = x.detach() * 0.1
    lean = _saved(conv, xs)
    plain = _step(conv, x.detach().requires_grad_())
    calls = []
    handle = conv[1].register_forward_hook(lambda m, a, out: calls.append(float(out.sum())))
    assert not forward_hooked(conv[1])
    assert _saved(conv, xs) == lean and len(calls) == 1
    for a, b in zip(_step(conv, x.detach().requires_grad_()), plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    handle.remove()
    handle = conv[1].register_forward_hook(_steer)
    assert forward_hooked(conv[1])
    hooked = _saved(conv, xs)
    eager[1].register_forward_hook(_steer)
    ref = _step(eager, x.detach().requires_grad_())
    got = _step(conv, x.detach().requires_grad_())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    handle.remove()
    assert not forward_hooked(conv[1])
    assert lean < hooked, (lean, hooked)
    assert _saved(conv, xs) == lean


def test_memory_measure_observers_are_not_foreign():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64))
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    x = _input("linear")

    def saved(model, module):
        run = lambda: model(x).square().sum()  # noqa: E731
        return slimgrad.memory.measure(run, module=module, timeline=False).saved_bytes

    # slimgrad.memory's attribution hooks sit on every module while it measures
    with_hooks = saved(conv, conv)
    assert with_hooks == saved(conv, None)
    assert with_hooks < saved(eager, eager), (with_hooks, saved(eager, eager))
    assert not any(forward_hooked(m) for m in conv.modules())


class _Opaque:
    # a callable object: its source is not read, so it may write
    def __call__(self, m, args, out):
        return None


def test_forward_hooked_counts_hooks_that_may_write():
    m = slimgrad.nn.LayerNorm(4)
    assert not forward_hooked(m)
    for hook, kw, counted in (
        (lambda mod, a, o: None, {}, False),  # reads nothing, writes nothing
        (_read, {"always_call": True}, False),
        (_steer, {}, True),
        (lambda mod, a, o: o.add_(1), {}, True),
        (_Opaque(), {}, True),
        (lambda mod, a, kw, o: o.relu_(), {"with_kwargs": True}, True),
    ):
        h = m.register_forward_hook(hook, **kw)
        assert forward_hooked(m) is counted, hook
        h.remove()
        assert not forward_hooked(m)
    h = m.register_forward_pre_hook(lambda mod, a: None)  # sees no output: not counted
    assert not forward_hooked(m)
    h.remove()
    h = _module.register_module_forward_hook(lambda mod, a, o: None)  # a global reader
    try:
        assert not forward_hooked(m)
    finally:
        h.remove()
    h = _module.register_module_forward_hook(_steer)  # a global writer
    try:
        assert forward_hooked(m)
    finally:
        h.remove()


def _read_only_hook_under_checkpoint(model, x, hook=True):
    # a reading hook registered between a non-reentrant checkpoint's forward and its backward
    # (the recompute runs with it): CheckpointError before (the recompute took eager's op)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    hooks = [m.register_forward_hook(_read) for m in model] if hook else []
    params = list(model.parameters())
    got = torch.autograd.grad(out.square().sum(), [x, *params])
    for h in hooks:
        h.remove()
    return got


@pytest.mark.parametrize("name,make,around", CASES)
def test_a_reading_hook_on_one_side_of_a_checkpoint(name, make, around):
    _, conv = _pair(make, around)
    x = _input(around)
    ref = _read_only_hook_under_checkpoint(conv, x.detach().requires_grad_(), hook=False)
    got = _read_only_hook_under_checkpoint(conv, x.detach().requires_grad_())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "act", [nn.ReLU, nn.SiLU, nn.GELU, nn.Hardswish, nn.LeakyReLU, nn.ELU], ids=lambda a: a.__name__
)
def test_bn_act_derived_path_inplace_hook_is_exact(act):
    # NOTE [Derived saved inputs]: the next conv keeps the BatchNorm output b and rebuilds act(b)
    # only while act's output is at its forward version; a hook that scales it in place makes the
    # conv keep the edited tensor itself. Reference: the same model with the edit out of place
    # (eager ReLU keeps its output and raises on the in-place edit).
    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            act(),
            nn.Conv2d(8, 8, 1, bias=False),
            nn.BatchNorm2d(8),
        )

    conv, ref_conv = build(), build()
    slimgrad.convert_(conv)
    slimgrad.convert_(ref_conv)
    assert type(conv[2]).__name__.endswith("AfterNorm"), type(conv[2])
    conv[2].register_forward_hook(_steer)
    ref_conv[2].register_forward_hook(lambda m, a, out: out * 1.5)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 9, 9)
    got = _step(conv, x.clone().requires_grad_())
    ref = _step(ref_conv, x.clone().requires_grad_())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU], ids=lambda a: a.__name__)
def test_inplace_hook_on_batch_norm_is_eager(act):
    # slimgrad's BatchNorm keeps its output only once an activation read it unedited
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), act(), nn.Conv2d(8, 8, 1)
    )
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    assert type(conv[2]).__name__.endswith("AfterNorm"), type(conv[2])
    eager[1].register_forward_hook(_steer)
    conv[1].register_forward_hook(_steer)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 9, 9)
    ref = _step(eager, x.clone().requires_grad_())
    got = _step(conv, x.clone().requires_grad_())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inplace_gelu_hooked_runs_eager_inplace_op():
    # slimgrad.nn.GELU(inplace=True) (torch has no such flag): eager's in-place aten op while hooked
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    act = slimgrad.nn.GELU(inplace=True)
    act.register_forward_hook(_steer)
    x = _input("linear")
    y = act(lin(x))
    got = (y, *torch.autograd.grad(y.square().sum(), [x, lin.weight]))
    ref_y = nn.functional.gelu(lin(x)).mul_(1.5)
    ref = (ref_y, *torch.autograd.grad(ref_y.square().sum(), [x, lin.weight]))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _scale(t):
    t.mul_(2)


def _w_data(m, a, o):
    o.data.mul_(2)


def _w_detach(m, a, o):
    o.detach().mul_(2)


def _w_item(m, a, o):
    o[..., 0] = 0


def _w_init(m, a, o):
    torch.nn.init.zeros_(o)


def _w_out(m, a, o):
    with torch.no_grad():
        torch.mul(o, 2, out=o)


def _w_view(m, a, o):
    o.view(-1).add_(1)


def _w_helper(m, a, o):
    _scale(o)


def _w_getattr(m, a, o):
    getattr(o, "mul_")(2)  # noqa: B009


def _w_numpy(m, a, o):
    o.detach().numpy()[...] = 0


def _w_comprehension(m, a, o):
    [t.mul_(2) for t in (o,)]  # noqa: B018


def _w_generator(m, a, o):
    any(t.add_(1) is None for t in [o])


def _w_exec(m, a, o):
    exec("o.mul_(2)")


def _w_default(m, a, o, f=lambda t: t.mul_(2)):
    f(o)


@pytest.mark.parametrize(
    "hook",
    [
        _w_data,
        _w_detach,
        _w_item,
        _w_init,
        _w_out,
        _w_view,
        _w_helper,
        _w_getattr,
        _w_numpy,
        _w_comprehension,
        _w_generator,
        _w_exec,
        _w_default,
    ],  # fmt: skip
    ids=lambda h: h.__name__,
)
@pytest.mark.parametrize("name,make,around", [CASES[0], CASES[3], CASES[13]])
def test_a_hook_that_writes_by_any_route_runs_eager(hook, name, make, around):
    # the writes the source reading must see (a comprehension's and exec's were read as none: the
    # kept output edited, autograd's version error in backward where eager trains)
    eager, conv = _pair(make, around)
    eager[1].register_forward_hook(hook)
    conv[1].register_forward_hook(hook)
    assert forward_hooked(conv[1])
    x = _input(around)
    ref = _step(eager, x.detach().requires_grad_())
    got = _step(conv, x.detach().requires_grad_())
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

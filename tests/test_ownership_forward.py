"""``slimgrad.ownership.owns_input`` (NOTE [Gradient-buffer ownership], forward terms F1-F7) and
term 7 (torch-owned storage) of the backward rule."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch import nn

from slimgrad import ownership
from slimgrad.ops import _derived
from slimgrad.ops.leaky_relu import leaky_relu


def _stated(m):
    """``m`` with its structure stated, as ``convert_`` does (NOTE [Forward ownership from stated
    structure])."""
    ownership.state_inputs_(m)
    return m


class Probe(nn.Module):
    _slimgrad_owns_input = True

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(ownership.owns_input(x, self))
        return x


class Fresh(nn.Module):
    _slimgrad_fresh_output = True  # states a new output it keeps no reference to

    def forward(self, x):
        return x * 2


def _seq_fresh(p, x):
    return _stated(nn.Sequential(Fresh(), p))(x)


class Parent(nn.Module):
    def __init__(self, p, how):
        super().__init__()
        self.p, self.f, self.how = p, Fresh(), how

    def forward(self, x):
        out = x * 2
        if self.how == "rebind":
            out = self.p(out)
        elif self.how == "other_name":
            y = self.p(out)
            return y + out
        elif self.how == "side_effect":
            self.p(out)
        elif self.how == "alias":
            alias = out
            out = self.p(out)
            return out + alias
        elif self.how == "nested":
            return self.p(self.f(x))
        elif self.how == "nested_local":
            return self.p(self.f(out))
        elif self.how == "nested_local_read_later":
            return self.p(self.f(out)) + out
        elif self.how == "kwargs":
            out = self.p(x=out)
        elif self.how == "ternary":
            out = self.p(out if x.numel() > 0 else x)
        return out


class CellParent(Parent):
    def forward(self, x):
        out = x * 2

        def later():  # makes ``out`` a cell variable of the whole function
            return out

        out = self.p(out)
        return out + later()


class CellReadsInput(Parent):
    def forward(self, x):
        out = x * 2
        first = out

        def later():  # the closure reads p's input after p ran
            return first

        out = self.p(out)
        return out + later()


def _parent(how):
    return lambda p, x: _stated(Parent(p, how))(x)


def _hook_keeps(p, x):
    kept = []
    m = _stated(nn.Sequential(Fresh(), p))
    m[0].register_forward_hook(lambda mod, i, o: kept.append(o))
    return m(x)


def _hook_weakref(p, x):
    kept = []
    m = _stated(nn.Sequential(Fresh(), p))
    m[0].register_forward_hook(lambda mod, i, o: kept.append(weakref.ref(o)))
    return m(x)


def _hook_detach(p, x):
    kept = []
    m = _stated(nn.Sequential(Fresh(), p))
    m[0].register_forward_hook(lambda mod, i, o: kept.append(o.detach()))
    return m(x)


def _hook_saved(p, x):
    kept = []
    m = _stated(nn.Sequential(Fresh(), p))
    m[0].register_forward_hook(lambda mod, i, o: kept.append(o.sin()))  # sin saves o
    return m(x.requires_grad_())


def _hook_on_module(p, x):
    p.register_forward_hook(lambda mod, i, o: None)
    return _stated(nn.Sequential(Fresh(), p))(x)


def _global_hook(p, x):
    h = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, a: None)
    try:
        return _stated(nn.Sequential(Fresh(), p))(x)
    finally:
        h.remove()


def _forward_attr(p, x):
    p.forward = p.forward
    return _stated(nn.Sequential(Fresh(), p))(x)


def _view_input(p, x):
    return _stated(nn.Sequential(Fresh(), nn.Unflatten(0, (1, 3)), p))(x)


def _numpy_input(p, x):
    return _stated(nn.Sequential(nn.Identity(), p))(torch.from_numpy(np.ones(3, dtype=np.float32)))


def _no_grad(p, x):
    with torch.no_grad():
        return _seq_fresh(p, x)


def _inference(p, x):
    with torch.inference_mode():
        return _seq_fresh(p, x)


def _disabled(p, x):
    with ownership.reuse_disabled():
        return _seq_fresh(p, x)


def _registry_weakref(p, x):
    # a slimgrad registry's weak reference is accounted for; one more (a user's) is not
    class Reg(nn.Module):
        _slimgrad_fresh_output = True

        def forward(self, x):
            y = x * 2
            _derived.register_recipe(y, lambda: None, ())
            return y

    return _stated(nn.Sequential(Reg(), p))(x)


def _registry_plus_user_weakref(p, x):
    refs = []

    class Reg(nn.Module):
        _slimgrad_fresh_output = True

        def forward(self, x):
            y = x * 2
            _derived.register_recipe(y, lambda: None, ())
            refs.append(weakref.ref(y))
            return y

    return _stated(nn.Sequential(Reg(), p))(x)


CASES = {
    "sequential_fresh": (_seq_fresh, True),
    "sequential_first_child": (lambda p, x: _stated(nn.Sequential(p))(x * 2), False),
    "parent_rebind": (_parent("rebind"), True),
    "parent_other_name": (_parent("other_name"), False),
    "parent_side_effect": (_parent("side_effect"), False),
    "parent_alias": (_parent("alias"), False),
    "parent_nested_call": (_parent("nested"), True),
    "parent_nested_identity_of_local": (_parent("nested_local"), True),
    "parent_kwargs": (_parent("kwargs"), False),
    "parent_ternary_jump": (_parent("ternary"), False),
    # the closure reads ``out`` when it is already p's output: p's input is read by p only
    "parent_cell_variable_rebound": (lambda p, x: _stated(CellParent(p, ""))(x), True),
    "parent_closure_reads_the_input": (lambda p, x: _stated(CellReadsInput(p, ""))(x), False),
    "hook_keeps_producer_output": (_hook_keeps, False),
    "hook_keeps_weakref": (_hook_weakref, False),
    "hook_keeps_detached_alias": (_hook_detach, False),
    "hook_output_saved_by_autograd": (_hook_saved, False),
    "hook_on_the_module": (_hook_on_module, False),
    "global_pre_hook": (_global_hook, False),
    "instance_forward_attribute": (_forward_attr, False),
    "view_input": (_view_input, False),
    "numpy_memory": (_numpy_input, False),
    "no_grad": (_no_grad, True),
    "inference_mode": (_inference, True),
    "reuse_disabled": (_disabled, False),
    "slimgrad_registry_weakref": (_registry_weakref, True),
    "registry_and_user_weakref": (_registry_plus_user_weakref, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_owns_input(case):
    fn, expected = CASES[case]
    p = Probe()
    ownership.reset_reuse_count()
    fn(p, torch.randn(3))
    assert p.seen == [expected]
    assert ownership.reuse_count("forward") == int(expected)
    assert ownership.reuse_count() == 0  # forward grants are not backward reuses


@pytest.mark.parametrize("how, owned", [("nested_local", True), ("nested_local_read_later", False)])
def test_a_child_that_returns_its_input_passes_the_question_on(how, owned):
    # self.p(self.f(out)) with f an Identity: p's input is ``out`` itself, so p may own it only
    # when the parent reads ``out`` nowhere else
    p = Probe()

    class Ident(Parent):
        def __init__(self, p):
            super().__init__(p, how)
            self.f = nn.Identity()

    _stated(Ident(p))(torch.randn(3))
    assert p.seen == [owned]


def test_not_through_module_call():
    p = Probe()
    p.forward(torch.randn(3) * 2)
    assert p.seen == [False]


def test_compile_refuses():
    torch._dynamo.reset()
    seen = []

    class P(nn.Module):
        _slimgrad_owns_input = True

        def forward(self, x):
            seen.append(ownership.owns_input(x, self))
            return x + 1

    m = torch.compile(_stated(nn.Sequential(Fresh(), P())), backend="eager")
    m(torch.randn(3))
    assert seen and not any(seen)


# Term 7: a gradient whose memory belongs to NumPy and is kept elsewhere is never overwritten.


class _NumpyGrad(torch.autograd.Function):
    # hands backward a gradient that wraps a NumPy array it also keeps
    keep: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        arr = np.full(tuple(g.shape), 3.0, dtype=np.float32)
        _NumpyGrad.keep.append(arr)
        return torch.from_numpy(arr)


@pytest.mark.parametrize("share", ["from_numpy", "frombuffer", "share_memory"])
def test_backward_never_overwrites_memory_torch_does_not_own(share):
    x = torch.randn(16, requires_grad=True)
    if share == "from_numpy":
        _NumpyGrad.keep.clear()
        y = _NumpyGrad.apply(leaky_relu(x, 0.1))
        y.sum().backward()
        assert np.all(_NumpyGrad.keep[0] == 3.0)  # leaky_relu's backward did not write into it
        want = torch.where(x > 0, 3.0, 0.3)
        torch.testing.assert_close(x.grad, want)
        return
    buf = bytearray(16 * 4)
    g = torch.frombuffer(buf, dtype=torch.float32) if share == "frombuffer" else torch.ones(16)
    if share == "share_memory":
        g.share_memory_()
    g.fill_(2.0)
    assert not ownership._torch_owned(g)
    assert ownership._torch_owned(torch.ones(16))


# NOTE [Forward ownership from stated structure]: what the statement and the call-time facts see


class Keeper(nn.Module):
    _slimgrad_fresh_output = True  # claims a fresh output, but the test replaces it (type check)

    def __init__(self):
        super().__init__()
        self.kept = []

    def forward(self, x):
        out = x * 2
        self.kept.append(out)
        return out


class Other(Keeper):
    pass


def test_direct_calls_outside_the_stated_parent_are_refused():
    # the user calls the producer and the consumer themselves and keeps the producer's output
    p = Probe()
    m = _stated(nn.Sequential(Fresh(), p))
    y = m[0](torch.randn(3))
    m[1](y)
    assert p.seen == [False]
    m(torch.randn(3))  # through the parent: granted
    assert p.seen == [False, True]


class Unstated(nn.Module):
    # a new output it keeps no reference to, but no statement says so: only the statement (made
    # for another type) can refuse it, nothing about the tensor does
    def forward(self, x):
        return x * 2


def test_a_child_replaced_after_the_statement_is_refused():
    p = Probe()
    m = _stated(nn.Sequential(Fresh(), p))
    m[0] = Unstated()  # not the type the statement was made for
    m(torch.randn(3))
    assert p.seen == [False]
    m[0] = Fresh()  # the stated type again (another instance): the statement holds
    m(torch.randn(3))
    assert p.seen == [False, True]
    p.seen.clear()
    m[0] = Other()  # not the stated producer's type: its output may be kept (it is)
    m(torch.randn(3))
    assert p.seen == [False]
    ownership.state_inputs_(m)  # stated again: Other states a fresh output
    m(torch.randn(3))
    assert p.seen == [False, True]


class Residual(nn.Module):
    # torchvision's Bottleneck tail: out = bn(conv(x)); out += identity; out = relu(out)
    def __init__(self, p, read_after):
        super().__init__()
        self.f, self.p, self.read_after = Fresh(), p, read_after

    def forward(self, x):
        out = self.f(x)
        out += x
        if self.read_after:
            return self.p(out), out
        return self.p(out)


@pytest.mark.parametrize("read_after", [False, True])
def test_in_place_add_on_a_fresh_value_passes_it_on(read_after):
    p = Probe()
    _stated(Residual(p, read_after))(torch.randn(3))
    assert p.seen == [not read_after]


class ModeDependent(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.f, self.p = Fresh(), p

    def forward(self, x):
        out = self.f(x)
        if self.training:  # the producer's output is returned too, in training only
            return self.p(out), out
        return self.p(out)


@pytest.mark.parametrize("train", [True, False])
def test_a_forward_that_differs_by_mode_is_not_stated(train):
    p = Probe()
    m = _stated(ModeDependent(p)).train(train)
    m(torch.randn(3))
    assert p.seen == [False]


class Blind(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.f, self.p = Fresh(), p

    def forward(self, x):
        return self.p(self.f(x))


@pytest.mark.parametrize("cls, traces", [(Blind, 1), (ModeDependent, 2)])
def test_a_forward_that_reads_no_mode_flag_is_traced_once(cls, traces, monkeypatch):
    # NOTE [One trace serves both modes]: the eval trace of a forward that reads no flag is the
    # train trace; a forward that reads one is traced in both modes (and not stated: above)
    seen, real = [], ownership._fx_statement
    monkeypatch.setattr(ownership, "_fx_statement", lambda *a: seen.append(a[2]) or real(*a))
    p = Probe()
    m = cls(p)
    assert ownership.state_inputs_(m) == (1 if cls is Blind else 0)
    assert seen == [True, False][:traces]
    for mode in (True, False):
        m.train(mode)(torch.randn(3))
    assert p.seen == [cls is Blind] * 2


def test_a_consumer_shared_by_two_parents_is_not_stated():
    p = Probe()
    a, b = nn.Sequential(Fresh(), p), nn.Sequential(Fresh(), p)
    assert ownership.state_inputs_(nn.ModuleList([a, b])) == 0
    a(torch.randn(3))
    assert p.seen == [False]


class Counting(nn.Module):
    # updates its own state in forward as timm's BatchNormAct2d does (num_batches_tracked, then
    # float() of it for momentum=None), and keeps a Python attribute
    def __init__(self, p):
        super().__init__()
        self.f, self.p = Fresh(), p
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.scale = torch.ones(())

    def forward(self, x):
        self.calls.add_(1)
        self.scale.mul_(2)
        self.last_rate = 1.0 / float(self.calls)
        return self.p(self.f(x))


def test_stating_a_forward_leaves_the_parent_as_it_was():
    p = Probe()
    m = Counting(p).eval()
    version = m.calls._version
    ownership.state_inputs_(m)
    assert int(m.calls) == 0 and m.calls._version == version and float(m.scale) == 1.0
    assert "last_rate" not in m.__dict__ and not m.training
    m.train()(torch.randn(3))  # stated all the same: the same grant
    assert p.seen == [True] and int(m.calls) == 1


class DeclaredNormAct(nn.Module):
    # a forward fx cannot trace (a branch on the input's shape) whose class states it
    def __init__(self, p, drop):
        super().__init__()
        self.drop, self.act = drop, p

    def forward(self, x):
        if x.ndim != 1:
            raise ValueError("1-D only")
        return self.act(self.drop(x * 2))

    _slimgrad_forward_statement = (forward, {"act": ("drop",)})


class OwnForward(DeclaredNormAct):
    def forward(self, x):
        y = x * 2
        self.act(self.drop(y))
        return y


@pytest.mark.parametrize(
    "cls, drop, granted",
    [
        (DeclaredNormAct, nn.Identity, True),
        (DeclaredNormAct, lambda: nn.Dropout(0.5), True),
        (DeclaredNormAct, Fresh, False),  # not a pass-through child: the statement does not hold
        (OwnForward, nn.Identity, False),  # the statement is for the parent's forward only
    ],
)
def test_a_class_statement_holds_for_its_own_forward_and_children(cls, drop, granted):
    p = Probe()
    m = _stated(cls(p, drop()))
    m(torch.randn(3))
    assert p.seen == [granted]


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    # keeps nothing, but does not say so: a foreign mode is refused for what it could do
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _CountStorages(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outs.append(out)  # a mode can keep any op's output
        return out


def test_a_foreign_dispatch_mode_refuses_and_the_tracker_does_not():
    from slimgrad.memory import measure

    p = Probe()
    m = _stated(nn.Sequential(Fresh(), p))
    with _CountStorages() as mode:
        m(torch.randn(3))
    assert p.seen == [False] and mode.outs
    with _CountOps() as counting:
        m(torch.randn(3))
    assert p.seen == [False, False] and counting.n
    p.seen.clear()
    m(torch.randn(3))
    assert p.seen == [True]  # unwatched: granted
    measure(lambda: m(torch.randn(3)).sum(), backward=False)
    measure(lambda: m(torch.randn(3)).sum(), backward=False, module=m)
    assert p.seen == [True, True, True]  # attribution hooks keep no tensor: the same grant


def test_an_observer_hook_that_states_it_keeps_nothing_is_allowed():
    p = Probe()
    m = _stated(nn.Sequential(Fresh(), p))

    def watch(mod, args, out):
        return None

    watch._slimgrad_keeps_no_tensor = True
    m[0].register_forward_hook(watch)
    m(torch.randn(3))
    m[0].register_forward_hook(lambda mod, args, out: None)  # a user's hook: could keep it
    m(torch.randn(3))
    assert p.seen == [True, False]


class Tapped(nn.Module):
    # p's input is read again only when a tap child is set (None at convert_ time)
    def __init__(self, p):
        super().__init__()
        self.f, self.p, self.tap = Fresh(), p, None

    def forward(self, x):
        out = self.f(x)
        y = self.p(out)
        if self.tap is not None:
            return y + self.tap(out)
        return y


def test_a_flag_changed_after_the_statement_makes_it_stale():
    # S3: the forward branches on a plain attribute; reassigning it after convert_ adds a second
    # reader of p's input, so the statement made before is stale and refused
    p = Probe()
    m = _stated(Parent(p, "rebind"))
    m(torch.randn(3))
    m.how = "other_name"  # now ``y = p(out); return y + out``
    m(torch.randn(3))
    assert p.seen == [True, False]
    assert ownership.state_inputs_(m) == 0  # stated again: out has two readers, not stated
    m(torch.randn(3))
    m.how = "rebind"
    m(torch.randn(3))  # not stated since the last state_inputs_: still refused
    assert ownership.state_inputs_(m) == 1
    m(torch.randn(3))
    assert p.seen == [True, False, False, False, True]


def test_a_child_added_after_the_statement_makes_it_stale():
    p = Probe()
    m = _stated(Tapped(p))
    m(torch.randn(3))
    m.tap = nn.Identity()  # a child where there was None: the forward now reads p's input again
    m(torch.randn(3))
    assert p.seen == [True, False]
    m.tap = None  # now a None child slot (it was a plain attribute): refused until stated again
    m(torch.randn(3))
    assert ownership.state_inputs_(m) == 1
    m(torch.randn(3))
    assert p.seen == [True, False, False, True]


def test_a_stale_statement_keeps_the_bits_of_a_writer():
    # the same change under a module that writes over its input (InPlaceABN): after the tap is
    # added the stated step computes what the never-stated one computes, bit for bit
    from slimgrad.nn import InPlaceABN

    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(5))

    def run(stated):
        ownership.reset_reuse_count()
        m = Tapped(InPlaceABN(3))
        if stated:
            ownership.state_inputs_(m)
        m(x)
        granted = ownership.reuse_count("forward")
        m.tap = nn.Identity()
        return m(x), granted, ownership.reuse_count("forward")

    ref, n0, _ = run(False)
    got, n1, n2 = run(True)
    assert (n0, n1, n2) == (0, 1, 1)  # granted before the change, refused after it
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


class ConfigParent(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p, self.cfg = p, {"read_again": False}

    def forward(self, x):
        out = x * 2
        y = self.p(out)
        return y + out if self.cfg["read_again"] else y


def test_a_forward_that_reads_a_mutable_attribute_is_not_stated():
    p = Probe()
    m = ConfigParent(p)
    assert ownership.state_inputs_(m) == 0  # cfg's contents can change without an assignment
    m(torch.randn(3))
    m.cfg["read_again"] = True
    m(torch.randn(3))
    assert p.seen == [False, False]


class ReadsWeight(nn.Module):
    # the forward reads a Parameter and a missing attribute: markers in the statement's snapshot
    def __init__(self, p):
        super().__init__()
        self.p, self.w = p, nn.Parameter(torch.ones(()))

    def forward(self, x):
        out = x * self.w
        if getattr(self, "extra", None) is not None:
            out = out * 2
        return self.p(out)


def test_a_copied_model_keeps_its_statement():
    import copy
    import pickle

    p = Probe()
    m = _stated(ReadsWeight(p))
    m(torch.randn(3))
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        c.p.seen.clear()
        c(torch.randn(3))
        assert c.p.seen == [True]
    m.extra = 1.0  # was missing when stated: the forward's path may change
    m(torch.randn(3))
    assert p.seen == [True, False]

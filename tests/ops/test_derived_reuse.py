"""Gradient-buffer reuse in the BatchNorm -> activation pair (NOTE [Derived saved inputs],
NOTE [Gradient-buffer ownership]).

The derived activation's backward writes act'(b) * dy over its incoming gradient, and the
BatchNorm-from-output backward (C kernel, float32 CPU) writes dx over its own, when
``slimgrad.ownership.take`` grants them. For every activation spec: a plain chain and a gradient
used twice (both reuse), a hook that keeps the gradient, a sibling still pending on it and a user
``gradient=`` (the activation must not reuse; the BatchNorm still may, its incoming gradient is
the activation's fresh result), each against ``reuse_disabled()`` bit for bit, kept tensors
included; channels_last; the torch backend (no BatchNorm reuse there)."""

from __future__ import annotations

import pytest
import torch

from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.ops import _derived
from slimgrad.ops.batch_norm import batch_norm

SHAPE = (4, 6, 5, 7)
SPECS = {
    "relu": ("relu", False, 0.0),
    "silu": ("silu", False, 0.0),
    "gelu": ("gelu", False, 0.0),
    "gelu_tanh": ("gelu_tanh", False, 0.0),
    "hardswish": ("hardswish", False, 0.0),
    "hardswish_": ("hardswish", True, 0.0),
    "leaky_relu": ("leaky_relu", False, 0.1),
    "leaky_relu_": ("leaky_relu", True, 0.1),
    "elu": ("elu", False, 1.3),
    "elu_": ("elu", True, 1.3),
}
SAFE = ["plain_chain", "used_twice"]
UNSAFE = ["hook_keeps", "sibling_pending", "user_gradient"]


@pytest.fixture(autouse=True)
def _reuse_on(monkeypatch):
    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)


def _case(spec, case, channels_last=False):
    act, inplace, param = SPECS[spec]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, generator=gen).requires_grad_()
    w = (torch.rand(SHAPE[1], generator=gen) + 0.5).requires_grad_()
    bias = ((torch.rand(SHAPE[1], generator=gen) - 0.5) * 0.4).requires_grad_()
    wl = torch.randn(SHAPE, generator=gen)
    # created before y's nodes, so its backward runs after the activation's: still pending then
    x2 = torch.randn(SHAPE, generator=gen).requires_grad_()
    r = x2 * 1.25
    h = x * 1.5
    if channels_last:
        h = h.contiguous(memory_format=torch.channels_last)
    b = batch_norm(h, None, None, w, bias, True, 0.1, 1e-5)
    y = _derived.activation(b, act, inplace=inplace, owned=inplace, param=param)
    assert _derived.lookup(y) is not None  # the derived path ran
    out = {}
    if case == "plain_chain":
        (y * wl).sum().backward()
    elif case == "used_twice":
        ((y * wl).sum() + y.sin().sum()).backward()
    elif case == "hook_keeps":
        kept = []
        y.register_hook(kept.append)
        (y * wl).sum().backward()
        out["kept"] = kept[0]
    elif case == "sibling_pending":
        ((y + r) * wl).sum().backward()
        out["x2.grad"] = x2.grad
    elif case == "user_gradient":
        G = torch.randn(SHAPE, generator=gen)
        y.backward(gradient=G)
        out["G"] = G
    out.update({"x.grad": x.grad, "w.grad": w.grad, "b.grad": bias.grad})
    return out


def _run(spec, case, disabled, **kw):
    ownership.reset_reuse_count()
    if disabled:
        with ownership.reuse_disabled():
            out = _case(spec, case, **kw)
    else:
        out = _case(spec, case, **kw)
    return out, ownership.reuse_count("grad")


def _assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("case", SAFE + UNSAFE)
@pytest.mark.parametrize("spec", list(SPECS))
def test_reuse_is_bitwise_identical(spec, case, backend):
    if backend == "auto":
        from slimgrad.kernels import _cpu

        if _cpu.compiler() is None:
            pytest.skip("no C compiler: the BatchNorm takes the PyTorch path")
    with _backend.set_backend(backend):
        ref, n_off = _run(spec, case, True)
        got, n_on = _run(spec, case, False)
    assert n_off == 0
    _assert_bitwise(got, ref)
    act_reuses = 1 if case in SAFE else 0
    bn_reuses = 1 if backend == "auto" else 0  # the C kernel writes dx over its gradient
    assert n_on == act_reuses + bn_reuses, (spec, case, n_on)


@pytest.mark.parametrize("spec", ["relu", "silu", "hardswish"])
def test_channels_last_is_bitwise_identical(spec):
    ref, _ = _run(spec, "plain_chain", True, channels_last=True)
    got, _ = _run(spec, "plain_chain", False, channels_last=True)
    _assert_bitwise(got, ref)


def test_reuse_writes_into_the_incoming_gradient():
    # the activation's dx and the BatchNorm's dx are the very buffer that arrived as dy
    from slimgrad.kernels import _cpu

    if _cpu.compiler() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(SHAPE, generator=gen).requires_grad_()
    w = (torch.rand(SHAPE[1], generator=gen) + 0.5).requires_grad_()
    bias = torch.zeros(SHAPE[1]).requires_grad_()
    h = x * 1.5
    b = batch_norm(h, None, None, w, bias, True, 0.1, 1e-5)
    y = _derived.activation(b, "relu")
    ptr = {}
    y.register_hook(lambda t: ptr.__setitem__("dy", t.data_ptr()))  # keeps an int only
    b.register_hook(lambda t: ptr.__setitem__("db", t.data_ptr()))
    h.register_hook(lambda t: ptr.__setitem__("dh", t.data_ptr()))
    ownership.reset_reuse_count()
    (y * 2).sum().backward()
    assert ownership.reuse_count("grad") == 2
    assert ptr["dy"] == ptr["db"] == ptr["dh"]


def test_retain_graph_twice():
    # only incoming gradients are reused, never b: a second backward gives the same bits
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE, generator=gen).requires_grad_()
    w = (torch.rand(SHAPE[1], generator=gen) + 0.5).requires_grad_()
    b = batch_norm(x * 1.5, None, None, w, None, True, 0.1, 1e-5)
    loss = (_derived.activation(b, "silu") * 3).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    loss.backward()
    assert torch.equal(x.grad, first[0]) and torch.equal(w.grad, first[1])

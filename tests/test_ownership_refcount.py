"""Reference counts decide ownership only where every holder adds one (issue 31; NOTE [Reference
counts and the interpreter] in slimgrad/ownership.py).

Run with each Python the shown list claims (3.11 in .venv, 3.12 and 3.13 in venvs of their own;
all passed with this file, test_ownership_grants.py and test_ownership.py): the first tests show,
on the running interpreter, that every kind of holder the backward terms rely on adds exactly one
to a gradient's count and is refused (a second use on the backward's own evaluation stack, which
CPython 3.14's borrowed stack references would hide; a local alias; a list; a closure cell); the
last ones that an interpreter not shown to hold (3.14, a free-threaded build) fails closed: no
reuse, the same bits, and ``slimgrad env`` / ``report`` say why.
"""

from __future__ import annotations

import sys

import pytest
import torch

from slimgrad import _compat, ownership
from tests._ownership_helpers import Double, reuse_on  # noqa: F401 (reuse_on: autouse fixture)

N = 257


class _OnTheStack(Double):
    # grad_out is on this frame's evaluation stack (the tuple being built) while take runs
    @staticmethod
    def backward(ctx, grad_out):
        pair = (grad_out, ownership.take(grad_out))
        Double.taken.append(pair[1] is not None)
        return grad_out * 2


class _Alias(Double):
    @staticmethod
    def backward(ctx, grad_out):
        g = grad_out
        buf = ownership.take(grad_out)
        Double.taken.append(buf is not None)
        return g * 2


class _InAList(Double):
    @staticmethod
    def backward(ctx, grad_out):
        keep = [grad_out]
        buf = ownership.take(grad_out)
        Double.taken.append(buf is not None)
        return keep[0] * 2


def _closure(t):
    return lambda: t * 2


class _InACell(Double):
    # a closure's cell (as a hook's closure would keep it)
    @staticmethod
    def backward(ctx, grad_out):
        later = _closure(grad_out)
        buf = ownership.take(grad_out)
        Double.taken.append(buf is not None)
        return later()


def _taken(fn) -> list[bool]:
    Double.taken = []
    x = torch.linspace(-1, 1, N, requires_grad=True)
    (fn.apply(x * 1.5) * 3).sum().backward()
    return Double.taken


def test_this_interpreter_is_one_shown_to_hold():
    # the matrix runs this file with each Python it claims; an interpreter outside the list
    # skips (it is the fail-closed case below)
    if sys.version_info[:2] not in ownership._REFCOUNT_SHOWN:
        pytest.skip(f"Python {sys.version_info[:2]} is not in the shown list: fails closed")
    assert ownership.refcount_problem() is None
    assert ownership.calibrated()


@pytest.mark.parametrize("fn", [_OnTheStack, _Alias, _InAList, _InACell], ids=lambda f: f.__name__)
def test_every_holder_adds_one_and_is_refused(fn):
    if ownership.refcount_problem() is not None:
        pytest.skip(ownership.refcount_problem())
    assert _taken(Double) == [True]  # the same chain without the holder is granted
    assert _taken(fn) == [False]


def test_calibration_measures_a_stack_holder():
    # the running interpreter's stack holder adds one (the calibration's own check): the
    # baselines exist only because it did
    if ownership.refcount_problem() is not None:
        pytest.skip(ownership.refcount_problem())
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad_out):
            seen.append(sys.getrefcount(grad_out))
            seen.append((grad_out, sys.getrefcount(grad_out))[1])
            return grad_out * 2

    x = torch.ones(3, requires_grad=True)
    (Probe.apply(x * 1) * 3).sum().backward()
    assert seen[1] == seen[0] + 1


def _fresh_calibration(monkeypatch):
    # the calibration and the storage probes as a new process would make them
    monkeypatch.setattr(ownership, "_BY_MODE", {})
    monkeypatch.setattr(ownership, "_MODE", None)
    monkeypatch.setattr(ownership, "_FACTS", None)
    monkeypatch.setattr(ownership, "_PLAIN_FACTS", None)
    monkeypatch.setattr(ownership, "_STORAGE_SIG", None)
    monkeypatch.setattr(ownership, "_GRAD_REFCOUNT", None)
    monkeypatch.setattr(ownership, "_SAVED_SIGS", None)
    monkeypatch.setattr(ownership, "_VIEW_SIG", None)


def test_an_interpreter_not_shown_fails_closed(monkeypatch):
    ref = None
    x = torch.linspace(-1, 1, N, requires_grad=True)
    with ownership.reuse_disabled():
        (Double.apply(x * 1.5) * 3).sum().backward()
    ref, x.grad = x.grad, None
    _fresh_calibration(monkeypatch)
    monkeypatch.setattr(ownership, "_REFCOUNT_SHOWN", ())  # as on CPython 3.14
    problem = ownership.refcount_problem()
    assert problem is not None and "Python" in problem
    ownership.reset_reuse_count()
    Double.taken = []
    (Double.apply(x * 1.5) * 3).sum().backward()
    assert Double.taken == [False] and ownership.reuse_count() == 0
    assert not ownership.calibrated()
    assert torch.equal(x.grad, ref)
    # a storage object's count is not read either (the forward path's only count)
    assert ownership.storage_facts_available() and ownership._STORAGE_SIG[1] is None
    feature = _compat._ownership()
    assert not feature.on and problem in feature.detail
    assert any(problem in f.detail for f in _compat.features_off())


def test_a_free_threaded_build_fails_closed(monkeypatch):
    import sysconfig

    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda k: 1 if k == "Py_GIL_DISABLED" else real(k)
    )
    assert "free-threaded" in ownership.refcount_problem()


def test_reversible_rounds_in_place_only_where_counts_hold(monkeypatch):
    # slimgrad.ops.reversible rounds F's output in place when its count says nobody else holds
    # it; on an interpreter whose counts are not shown it rounds out of place (_grid_units): the
    # same bits, one temporary more per rounding
    import copy

    from slimgrad.nn.reversible import ReversibleSequential
    from slimgrad.ops import reversible
    from tests.nn._reversible_helpers import additive_blocks

    if ownership.refcount_problem() is not None:
        pytest.skip(ownership.refcount_problem())
    monkeypatch.setenv("SLIMGRAD_BACKEND", "torch")
    monkeypatch.setattr(reversible, "_stream_lib", lambda *a, **k: None)  # the rounding branch
    calls = []
    real = reversible._grid_units
    monkeypatch.setattr(reversible, "_grid_units", lambda *a: calls.append(1) or real(*a))
    blocks = additive_blocks(2, 4, seed=3, scale=0.5)
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))

    def step(counts_ok):
        monkeypatch.setattr(ownership, "_REFCOUNTS_OK", counts_ok)
        calls.clear()
        rev = ReversibleSequential(*copy.deepcopy(blocks), exact=True)
        xi = x.clone().requires_grad_()
        rev(xi).square().sum().backward()
        return [xi.grad] + [p.grad for p in rev.parameters()], len(calls)

    shown, n_shown = step(None)
    closed, n_closed = step(False)
    assert n_closed - n_shown == 4  # 2 blocks x 2 halves rounded out of place instead
    for a, b in zip(shown, closed, strict=True):
        assert torch.equal(a, b)

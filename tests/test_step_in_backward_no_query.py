"""slimgrad.step_in_backward without torch's private ``_will_engine_execute_node`` (issue 30).

The handle asks torch whether a backward runs a parameter's ``AccumulateGrad`` (a tensor hook
fires under ``torch.autograd.grad`` too, which the plain loop's ``.grad`` never sees). The query
is private: probed once at import; where it is missing or answers wrong the checks wait for a
pre-hook of the node (public API), the fused loss's head comes back whole, and ``slimgrad env``
and ``handle.features_off`` say so (NOTE [A graph task that accumulates nothing] in
``slimgrad/step_in_backward.py``). Here the query is taken away and representative loops of the
other files run again: the same bits as the plain loop.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import slimgrad
from slimgrad import _compat
from tests import test_step_in_backward_chunked as chunked
from tests import test_step_in_backward_probe_and_hooks as probe
from tests import test_step_in_backward_raised as raised
from tests._bitwise import assert_same_parameters, assert_same_state

_mod = sys.modules["slimgrad.step_in_backward"]
_NAME = "step_in_backward accumulation query"


def _reprobe(monkeypatch) -> None:
    monkeypatch.setattr(_mod, "_WILL_EXECUTE", False)  # restored by monkeypatch
    on, why = _mod._probe_will_execute()
    monkeypatch.setattr(_mod, "_WILL_EXECUTE", on)
    monkeypatch.setattr(_mod, "_WILL_EXECUTE_WHY", why)


@pytest.fixture
def no_query(monkeypatch):
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    _reprobe(monkeypatch)
    assert not _mod._WILL_EXECUTE


def test_the_query_is_on_here():
    assert _mod._WILL_EXECUTE, _mod._WILL_EXECUTE_WHY


@pytest.mark.parametrize("how", ["missing", "wrong", "raises"])
def test_env_and_the_handle_name_the_query_that_is_off(monkeypatch, how):
    if how == "missing":
        monkeypatch.delattr(torch._C, "_will_engine_execute_node")
        why = "torch._C._will_engine_execute_node is missing"
    elif how == "wrong":
        monkeypatch.setattr(torch._C, "_will_engine_execute_node", lambda node: True)
        why = r"torch._C._will_engine_execute_node answered \[True, True\], expected"
    else:

        def broken(node):
            raise TypeError("changed signature")

        monkeypatch.setattr(torch._C, "_will_engine_execute_node", broken)
        why = r"torch._C._will_engine_execute_node failed \(TypeError\)"
    _reprobe(monkeypatch)
    (feat,) = [f for f in _compat.features() if f.name == _NAME]
    assert not feat.on
    assert re.match(why, feat.detail)
    assert "pre-hook of its AccumulateGrad node" in feat.detail
    assert "updates whole, not by row blocks" in feat.detail
    assert (_NAME, feat.detail) in [(f.name, f.detail) for f in _compat.features_off()]
    handle = slimgrad.step_in_backward(torch.nn.Linear(2, 2), torch.optim.SGD, lr=0.1)
    assert dict(handle.features_off)[_NAME] == feat.detail
    monkeypatch.undo()
    handle = slimgrad.step_in_backward(torch.nn.Linear(2, 2), torch.optim.SGD, lr=0.1)
    assert _NAME not in dict(handle.features_off)


# the loops of the other files that meet the query, under its absence: refusals before a gradient
# is added (a pre-hook, and the guard on a raised backward's gradients), and torch.autograd.grad
# that must count for nothing


@pytest.mark.parametrize("accumulate", [1, 2])
def test_refused_before_the_gradient_is_added(no_query, accumulate):
    raised.test_a_backward_after_one_that_raised_once_it_updated_is_refused_unchanged(
        accumulate, False
    )


@pytest.mark.parametrize("raised_first", [False, True], ids=["clean", "after-raised"])
def test_autograd_grad_mid_cycle_is_no_micro_batch(no_query, raised_first):
    probe.test_autograd_grad_mid_cycle_is_no_micro_batch(2, raised_first)


@pytest.mark.parametrize("recover", ["step", "skip"])
def test_the_loop_with_a_probe_after_a_raised_backward(no_query, recover):
    probe.test_the_loop_with_a_probe_after_a_raised_backward_is_the_plain_loop(64, "all", recover)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_retained_graph_probed_then_backward(no_query, accumulate):
    """``torch.autograd.grad(..., retain_graph=True)`` then ``backward()`` of the same graph in
    every micro-batch: a leaf's ``AccumulateGrad`` node is shared by the two, and the pre-hook the
    probe left on it is replaced (one per parameter), not run a second time."""
    a, opt, b, handle = raised._pair(False, accumulate=accumulate)
    for m, o in ((a, opt), (b, handle)):
        for i in range(3 * accumulate):
            loss = m(raised._x(i))
            torch.autograd.grad(loss, list(m.parameters()), retain_graph=True)
            loss.backward()
            if (i + 1) % accumulate == 0:
                o.step()
                o.zero_grad()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert len(handle._deferred) <= len(list(b.parameters()))
    handle.remove()
    assert not handle._deferred


def test_the_fused_loss_head_comes_back_whole(no_query, monkeypatch, rows97):
    a, b = chunked._LM(bias=True), chunked._LM(bias=True)
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(a.parameters(), **kw)
    handle = slimgrad.step_in_backward(b, torch.optim.AdamW, **kw)
    taken = chunked._spy_rows(monkeypatch, handle)
    chunked._run(a, opt, steps=3)
    chunked._run(b, handle, steps=3)
    chunked._same(a, b)
    assert taken == [False] * 3


rows97 = chunked.rows97

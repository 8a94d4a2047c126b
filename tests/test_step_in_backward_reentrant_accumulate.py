"""slimgrad.step_in_backward (issue 30): a reentrant checkpoint backward is one step's backward,
with ``accumulate=N`` too, and gives the plain loop's bits.

``torch.utils.checkpoint(..., use_reentrant=True)`` runs a nested backward inside the outer one.
The handle used to refuse it under ``accumulate=N``, and where the nested backward ran the handle's
first hook (checkpointed layers last in the model) the refusal came after that backward had
updated parameters (mlp30's report: the first Linear moved in all 20 elements). Now a nested
backward that ends inside a node of the enclosing one hands the step to the enclosing backward
(NOTE [A reentrant backward is not a second backward] in ``slimgrad/step_in_backward.py``): no
refusal, the plain loop's parameters, optimizer state and ``.grad`` in every placement of the
checkpointed segments, first and updating micro-batches, accumulate 1/2/3, SGD and AdamW. A
parameter reached both inside and outside a segment is refused with ``accumulate=N`` (NOTE [A
parameter in and around a reentrant checkpoint]), changing nothing.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from tests._bitwise import assert_same_parameters, assert_same_state
from tests._gc_frozen import older_objects_frozen  # noqa: F401  (autouse)

_mod = sys.modules["slimgrad.step_in_backward"]


def _ck(f, x):
    return checkpoint(f, x, use_reentrant=True)


# the model: six Linear layers L0..L5, each followed by Tanh (m[2k] Linear, m[2k+1] Tanh); each
# placement says which spans go through a reentrant checkpoint
_PLACEMENTS = {
    "first": lambda m, x: m[4:](m[2:4](_ck(m[:2], x))),
    "middle": lambda m, x: m[6:](_ck(m[2:6], m[:2](x))),
    "last": lambda m, x: _ck(m[8:], m[:8](x)),
    "two_adjacent_last": lambda m, x: _ck(m[8:], _ck(m[4:8], m[:4](x))),
    "every_layer": lambda m, x: _ck(m[8:], _ck(m[4:8], _ck(m[:4], x))),
    "nested": lambda m, x: m[10:](_ck(lambda h: _ck(m[4:8], m[2:4](h)), m[:2](x))),
    "first_and_last": lambda m, x: _ck(m[8:], m[4:8](_ck(m[:4], x))),
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i, o in [(4, 5), (5, 5), (5, 6), (6, 5), (5, 5), (5, 3)]:
        layers += [nn.Linear(i, o), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(k: int) -> torch.Tensor:
    # the input requires grad: a reentrant checkpoint over the first layers needs one that does
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(k)).requires_grad_()


_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
}


# the inner checkpoint of "nested" runs first under the outer one's no_grad forward (torch warns)
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["alone", "bucketed"])
@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("accumulate", [1, 2, 3])
@pytest.mark.parametrize("where", sorted(_PLACEMENTS))
def test_reentrant_checkpoint_in_accumulation_is_the_plain_loop(
    where, accumulate, opt_name, bucket_bytes
):
    """Two whole cycles, then a half cycle stepped early: after each backward and each step the
    handle's parameters, optimizer state and ``.grad`` are the plain loop's, bit for bit (a cycle's
    first and its updating micro-batch both run the checkpointed backward)."""
    cls, kw = _OPTIMIZERS[opt_name]
    forward = _PLACEMENTS[where]
    ref = _model()
    m = copy.deepcopy(ref)
    opt = cls(ref.parameters(), **kw)
    handle = slimgrad.step_in_backward(
        m, cls, accumulate=accumulate, bucket_bytes=bucket_bytes, **kw
    )
    k = 0
    for cycle in range(3):
        n = accumulate if cycle < 2 else max(1, accumulate - 1)
        for _ in range(n):
            forward(ref, _batch(k)).square().mean().backward()
            forward(m, _batch(k)).square().mean().backward()
            k += 1
            if k % accumulate:  # the cycle goes on: both hold the summed gradients
                for p, q in zip(ref.parameters(), m.parameters(), strict=True):
                    torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        opt.step()
        opt.zero_grad()
        handle.step()
        handle.zero_grad()
        assert_same_parameters(ref, m)
        assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
        assert all(p.grad is None for p in m.parameters())


def test_a_step_that_ends_inside_a_nested_backward_then_a_new_step():
    """The outer backward reaches no handle parameter after the nested one ends (the checkpointed
    layers hold every parameter): the step ends with the enclosing backward, and the next
    backward is a new step, not a continuation (accumulate=2, two cycles)."""
    ref = _model()
    m = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    handle = slimgrad.step_in_backward(m, torch.optim.AdamW, lr=1e-2, accumulate=2)
    for k in range(4):
        _ck(ref, _batch(k)).square().mean().backward()
        _ck(m, _batch(k)).square().mean().backward()
        if k % 2:
            opt.step()
            opt.zero_grad()
            handle.step()
            handle.zero_grad()
            assert_same_parameters(ref, m)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


_REENTRANT = (
    r"^slimgrad\.step_in_backward: a reentrant backward \(torch\.utils\.checkpoint with "
    r"use_reentrant=True\) inside an accumulate=N backward; .* Pass use_reentrant=False to "
    r"checkpoint\.$"
)


@pytest.mark.parametrize("then", ["zero_grad", "step"])
def test_a_parameter_reached_inside_and_outside_the_checkpoint_is_refused_unchanged(then):
    """A weight used inside the checkpointed segment and again outside it gets two gradients in
    one backward (NOTE [A parameter in and around a reentrant checkpoint]): refused at the first
    micro-batch where it is seen, before the second gradient is added, with the use_reentrant
    message; ``.grad``, parameters and AdamW state as before it, and the cycle count too: the
    handle's step()/zero_grad() and the next cycle are the plain loop's, bit for bit."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    ref = copy.deepcopy(lin)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def shared(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mod(_ck(lambda h: torch.tanh(mod(h)), x)).square().mean()

    def plain(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mod(torch.tanh(mod(x))).square().mean()

    handle = slimgrad.step_in_backward(lin, torch.optim.AdamW, lr=1e-2, accumulate=2)
    for k in range(2):  # one whole cycle first: AdamW's state exists
        plain(ref, _batch(k)).backward()
        plain(lin, _batch(k)).backward()
    opt.step()
    handle.step()
    opt.zero_grad()
    handle.zero_grad()
    params = [p.detach().clone() for p in lin.parameters()]
    state = copy.deepcopy(handle.state_dict()["state"])
    with pytest.raises(NotImplementedError, match=_REENTRANT):
        shared(lin, _batch(5)).backward()
    assert [p.grad for p in lin.parameters()] == [None, None]
    for p, q in zip(params, lin.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert_same_state(state, handle.state_dict()["state"])
    # the plain loop after its own failed backward: .grad None here too, step() applies nothing
    getattr(handle, then)()
    getattr(opt, then)()
    for k in range(2, 4):
        plain(ref, _batch(k)).backward()
        plain(lin, _batch(k)).backward()
    opt.step()
    handle.step()
    assert_same_parameters(ref, lin)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


def test_without_the_node_query_a_nested_backward_in_accumulation_is_refused(monkeypatch):
    """Without torch's private ``_current_autograd_node`` the handle cannot tell a nested backward
    from a new one; ``accumulate=N`` then refuses it in the GUIDE form, as before (here where the
    outer backward reaches the handle first: refused before the update of this micro-batch)."""
    monkeypatch.setattr(_mod, "_HAS_NODE_QUERY", False)
    monkeypatch.setattr(_mod, "_enclosing_node", lambda: None)
    m = _model()
    handle = slimgrad.step_in_backward(m, torch.optim.SGD, lr=0.1, accumulate=2)
    with pytest.raises(NotImplementedError, match=r"use_reentrant=False"):
        _PLACEMENTS["first"](m, _batch(0)).square().mean().backward()
    del handle


@pytest.mark.parametrize("accumulate", [1, 2])
def test_retain_graph_seen_only_after_a_nested_backward_is_refused(accumulate):
    """``retain_graph=True`` on a backward whose first handle hook runs in a reentrant
    checkpoint's nested backward (which keeps no graph of its own): the enclosing backward's
    ``retain_graph`` is seen when the step resumes there, after the nested backward's updates,
    and refused in the slimgrad form (loud, not a second step over the kept graph)."""
    m = _model()
    handle = slimgrad.step_in_backward(
        m, torch.optim.SGD, lr=0.1, accumulate=accumulate, check_loop=False
    )
    for k in range(accumulate - 1):
        _PLACEMENTS["last"](m, _batch(k)).square().mean().backward()
    loss = _PLACEMENTS["last"](m, _batch(9)).square().mean()
    with pytest.raises(NotImplementedError, match=r"^slimgrad\.step_in_backward: backward\(retain"):
        loss.backward(retain_graph=True)
    del handle


# --- accumulate=1: a parameter in and around a reentrant checkpoint (sib28) -------------------
def _in_around(mod: nn.Module, x: torch.Tensor, where: str, reentrant: bool = True):
    ck = lambda f, h: checkpoint(f, h, use_reentrant=reentrant)  # noqa: E731
    if where == "outside_reached_first":  # the outside use after the segment: its gradient first
        return mod(ck(lambda h: torch.tanh(mod(h)), x)).square().mean()
    return ck(lambda h: torch.tanh(mod(h)), mod(x)).square().mean()  # the nested one first


_IN_AROUND_ONE = (
    r"^slimgrad\.step_in_backward: parameter '(weight|bias)' \((4, 4|4,)\) gets a gradient both "
    r"inside a reentrant checkpoint \(torch\.utils\.checkpoint\(\.\.\., use_reentrant=True\): .*; "
    r"expected every use of a parameter on one side of the checkpoint, or use_reentrant=False, "
    r"got '(weight|bias)' .* used in and around the checkpointed function\. Pass "
    r"use_reentrant=False to checkpoint"
)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("where", ["outside_reached_first", "inside_reached_first"])
def test_accumulate_one_in_and_around_a_checkpoint_is_refused_by_name_unchanged(where):
    """accumulate=1: the two gradients come in two graph tasks of one step. It was the generic
    'second gradient' advice; now a GUIDE-form error naming the parameter and the reentrant
    checkpoint, and where nothing was updated yet (the waiting bucket) nothing changed: then the
    advised ``use_reentrant=False`` is the plain loop bit for bit (NOTE [A parameter in and around
    a reentrant checkpoint])."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    ref = copy.deepcopy(lin)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    handle = slimgrad.step_in_backward(lin, torch.optim.AdamW, lr=1e-2)
    for a, o in ((ref, opt), (lin, handle)):  # one step first: AdamW's state exists
        _in_around(a, _batch(0), where, reentrant=False).backward()
        o.step()
        o.zero_grad()
    params = [p.detach().clone() for p in lin.parameters()]
    state = copy.deepcopy(handle.state_dict())
    for _ in range(2):
        with pytest.raises(NotImplementedError, match=_IN_AROUND_ONE):
            _in_around(lin, _batch(1), where).backward()
        assert [p.grad for p in lin.parameters()] == [None, None]
        for p, q in zip(params, lin.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
        assert_same_state(state["state"], handle.state_dict()["state"])
        assert handle._since_zero == {} and handle._raised == 0
    for k in range(1, 4):
        for a, o in ((ref, opt), (lin, handle)):
            _in_around(a, _batch(k), where, reentrant=False).backward()
            o.step()
            o.zero_grad()
    assert_same_parameters(ref, lin)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("where", ["outside_reached_first", "inside_reached_first"])
def test_accumulate_one_in_and_around_after_an_update_is_refused_and_recovers(where):
    """bucket_bytes=0: the weight (or the other parameter) updated at its first gradient, before
    the second came: the same error, after the fact (NOTE [Every refusal changes nothing]'s
    list); the backward is then one that raised (NOTE [A backward that raised]): step() applies
    what it left, and the loop goes on as a plain optimizer from the handle's state."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    handle = slimgrad.step_in_backward(lin, torch.optim.AdamW, lr=1e-2, bucket_bytes=0)
    x = _batch(1)
    if where == "inside_reached_first":
        # (an input without grad: the outside use then keeps no weight for its input's gradient,
        # which would meet autograd's version check after the update in the nested backward,
        # before the second gradient: NOTE [Why the update is exact])
        x = x.detach()
    with pytest.raises(NotImplementedError, match=_IN_AROUND_ONE):
        _in_around(lin, x, where).backward()
    handle.step()
    handle.zero_grad()
    assert all(p.grad is None for p in lin.parameters())
    ref = copy.deepcopy(lin)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(handle.state_dict()))
    for k in range(2, 5):
        for a, o in ((ref, opt), (lin, handle)):
            _in_around(a, _batch(k), where, reentrant=False).backward()
            o.step()
            o.zero_grad()
    assert_same_parameters(ref, lin)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])

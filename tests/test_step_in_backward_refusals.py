"""slimgrad.step_in_backward (issue 30): every refusal leaves everything as it was.

Each test snapshots the parameters, ``optimizer.state_dict()``, every ``.grad`` and the LR
scheduler's state, makes the refused call, and compares bit for bit (NOTE [Every refusal changes
nothing] in ``slimgrad/step_in_backward.py``). The handle then goes on as a working optimizer.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import slimgrad

step_in_backward = slimgrad.step_in_backward
_mod = sys.modules["slimgrad.step_in_backward"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + i))


def _loss(m: nn.Module, i: int) -> torch.Tensor:
    return m(_x(i)).square().mean()


def _snap(m: nn.Module, opt, sched=None) -> dict:
    return {
        "params": [p.detach().clone() for p in m.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in m.parameters()],
        "state": copy.deepcopy(opt.state_dict()),
        "sched": None if sched is None else copy.deepcopy(sched.state_dict()),
    }


def _same_tree(a, b) -> None:
    if torch.is_tensor(a):
        assert_close(b, a, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_tree(x, y)
    else:
        assert a == b


def _untouched(before: dict, m: nn.Module, opt, sched=None) -> None:
    _same_tree(before, _snap(m, opt, sched))


def _steps(m, opt, start: int, n: int, sched=None) -> None:
    for i in range(start, start + n):
        _loss(m, i).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _same(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0)


# ------------------------------------------------------------------------------- GradScaler
def test_grad_scaler_is_refused_before_the_first_update():
    """A scaled loss needs every gradient checked for inf before the first update (one inf skips
    every parameter's step), which a per-parameter update in backward cannot do: refused at the
    first hook of the first backward, nothing changed, then the loop without the scaler is the
    plain loop bit for bit."""
    ref, m = _net(), _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    handle = step_in_backward(m, torch.optim.AdamW, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(handle, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")  # enabled, init_scale 65536
    before = _snap(m, handle, sched)
    with pytest.raises(
        NotImplementedError,
        match=r"^slimgrad\.step_in_backward: a live enabled torch\.amp\.GradScaler; .*"
        r"expected no enabled GradScaler .*, got 1 enabled GradScaler\. ",
    ):
        scaler.scale(_loss(m, 0)).backward()
    _untouched(before, m, handle, sched)
    with pytest.raises(NotImplementedError):  # and again: nothing remembered as checked
        scaler.scale(_loss(m, 0)).backward()
    _untouched(before, m, handle, sched)
    del scaler
    _steps(ref, opt, 0, 3, ref_sched)
    _steps(m, handle, 0, 3, sched)
    _same(ref, m)


def test_a_disabled_grad_scaler_is_the_plain_loop():
    ref, m = _net(), _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for a, o in ((ref, opt), (m, handle)):
        for i in range(3):
            scaler.scale(_loss(a, i)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    _same(ref, m)


def test_grad_scaler_made_after_the_first_backward_is_refused_before_any_change():
    """The scan for scalers runs at the handle's first backward and again wherever a scaler
    class's reference count changed (NOTE [GradScaler]): a scaler made later refuses the next
    backward at its first hook, before any update (before: seen only at ``scaler.step(handle)``,
    after that backward's updates). ``scaler.step(handle)`` still refuses and leaves the handle as
    it was (no grad_scale/found_inf left on it)."""
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1)
    _steps(m, handle, 0, 1)
    scaler = torch.amp.GradScaler("cpu")
    before = _snap(m, handle)
    with pytest.raises(NotImplementedError, match=r"a live enabled torch\.amp\.GradScaler"):
        scaler.scale(_loss(m, 1)).backward()
    _untouched(before, m, handle)
    with pytest.raises(NotImplementedError, match=r"GradScaler cannot drive step_in_backward"):
        scaler.step(handle)
    _untouched(before, m, handle)
    assert "grad_scale" not in handle.__dict__ and "found_inf" not in handle.__dict__


@pytest.mark.parametrize("first_enabled", [False, True])
def test_a_rebound_grad_scaler_is_refused_before_any_change(first_enabled):
    """``scaler = GradScaler()`` over a scaler the last scan saw leaves the class's reference count
    as it was (one instance made, one freed): the freed one's weak reference makes the next backward
    scan again (NOTE [GradScaler]); before, the next backward updated the parameters with scaled
    gradients and only ``scaler.step`` refused."""
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=first_enabled)
    if first_enabled:
        with pytest.raises(NotImplementedError, match=r"a live enabled torch\.amp\.GradScaler"):
            _loss(m, 0).backward()
        scaler = torch.amp.GradScaler("cpu", enabled=False)
    _steps(m, handle, 0, 1)
    scaler = torch.amp.GradScaler("cpu")
    before = _snap(m, handle)
    with pytest.raises(NotImplementedError, match=r"a live enabled torch\.amp\.GradScaler"):
        scaler.scale(_loss(m, 1)).backward()
    _untouched(before, m, handle)


def test_the_scaler_scan_runs_again_only_when_a_scaler_class_changes(monkeypatch):
    # NOTE [GradScaler]: the heap walk runs at the first backward, then only where the scaler
    # classes' reference counts moved
    import importlib

    sib = importlib.import_module("slimgrad.step_in_backward")  # the package exports a function

    calls = []
    real = sib._live_grad_scalers
    monkeypatch.setattr(sib, "_live_grad_scalers", lambda: calls.append(1) or real())
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1)
    _steps(m, handle, 0, 3)
    assert len(calls) == 1
    off = torch.amp.GradScaler("cpu", enabled=False)  # a new instance: scanned again, passes
    _steps(m, handle, 3, 5)
    assert len(calls) == 2
    del off
    handle.step()  # a plain step() works again


# ------------------------------------------------------------------------------- in backward
def test_a_second_backward_in_one_step_is_refused_before_any_change():
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1)
    _steps(m, handle, 0, 1)
    _loss(m, 1).backward()
    before = _snap(m, handle)
    with pytest.raises(
        RuntimeError,
        match=r"^slimgrad\.step_in_backward: a second backward in one step: .*; expected "
        r"step\(\) and zero_grad\(\) between two backward calls, got a second backward after 4 ",
    ):
        _loss(m, 2).backward()
    _untouched(before, m, handle)
    # two losses over disjoint parameters are refused as well (their sum, backward'ed once, is
    # the supported form): the first parameter reached is the second layer's
    handle.step()
    handle.zero_grad()
    m[2](torch.randn(2, 7)).sum().backward()
    before = _snap(m, handle)
    with pytest.raises(RuntimeError, match=r"a second backward in one step"):
        m[0](_x(3)).sum().backward()
    _untouched(before, m, handle)
    handle.step()
    handle.zero_grad()
    _steps(m, handle, 4, 1)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("saves_params", [False, True])
def test_retain_graph_is_refused_in_the_guide_form_before_any_change(saves_params):
    """``loss.backward(retain_graph=True); loss.backward()``: the first call is refused (its
    graph would outlive parameters updated in place), nothing changed; the kept graph is intact,
    so the second call, without retain_graph, is an ordinary step equal to the plain loop's."""
    ref, m = _net(), _net()
    if not saves_params:  # a graph that keeps no parameter (first layer only, input no grad)
        ref, m = ref[0], m[0]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, momentum=0.9)
    for a, o in ((ref, opt), (m, handle)):
        _steps(a, o, 0, 1)
    loss = _loss(m, 1)
    before = _snap(m, handle)
    with pytest.raises(
        NotImplementedError,
        match=r"^slimgrad\.step_in_backward: backward\(retain_graph=True\) \(or "
        r"create_graph=True\) .*; expected retain_graph=False, got a backward that keeps its "
        r"graph \(retain_graph=True or create_graph=True\)\. ",
    ):
        loss.backward(retain_graph=True)
    _untouched(before, m, handle)
    loss.backward()
    handle.step()
    handle.zero_grad()
    _loss(ref, 1).backward()
    opt.step()
    _same(ref, m)
    with pytest.raises(NotImplementedError, match=r"retain_graph=True"):
        _loss(m, 2).backward(create_graph=True)


def test_retain_graph_in_a_micro_batch_that_does_not_update_is_the_plain_loop():
    # accumulate=2: the first backward only accumulates, so its kept graph stays valid; the
    # second backward over it is the plain loop's loss.backward(retain_graph=True); loss.backward()
    ref, m = _net(), _net()
    opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    handle = step_in_backward(m, torch.optim.Adam, lr=0.1, accumulate=2)
    for a, o in ((ref, opt), (m, handle)):
        for i in range(3):
            loss = _loss(a, i)
            loss.backward(retain_graph=True)
            loss.backward()
            o.step()
            o.zero_grad()
    _same(ref, m)


def test_frozen_then_unfrozen_is_refused_before_any_change():
    m = _net()
    m[0].bias.requires_grad_(False)
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1)
    _steps(m, handle, 0, 1)
    m[0].bias.requires_grad_(True)
    before = _snap(m, handle)
    with pytest.raises(RuntimeError, match=r"frozen when the handle was made now requires grad"):
        _loss(m, 1).backward()
    _untouched(before, m, handle)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_several_processes_are_refused_before_any_change(monkeypatch, accumulate):
    """With accumulate=2 the refusal comes in the second micro-batch, where every gradient of
    the first is held: a tensor hook refuses before AccumulateGrad adds to it."""
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, accumulate=accumulate)
    if accumulate == 2:
        _loss(m, 0).backward()
        assert all(p.grad is not None for p in m.parameters())
    before = _snap(m, handle)
    monkeypatch.setattr(_mod, "_world_size", lambda: 2)
    with pytest.raises(NotImplementedError, match=r"backward under a process group"):
        _loss(m, 1).backward()
    _untouched(before, m, handle)
    monkeypatch.undo()
    _loss(m, 1).backward()  # the cycle goes on
    handle.step()
    assert all(p.grad is None for p in m.parameters())


def test_step_inside_backward_is_refused_before_any_change():
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1)
    out = m(_x(0))
    out.register_hook(lambda g: handle.step())  # runs before any parameter's gradient
    before = _snap(m, handle)
    with pytest.raises(RuntimeError, match=r"step\(\) inside backward"):
        out.square().mean().backward()
    _untouched(before, m, handle)
    _steps(m, handle, 1, 1)


# ------------------------------------------------------------------------------- at step()
def test_zero_grad_in_the_middle_of_an_accumulation_cycle_changes_nothing():
    # (a step() there is the plain step(): NOTE [A step that ends a cycle early])
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, accumulate=2)
    _loss(m, 0).backward()
    before = _snap(m, handle)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) in the middle of an accumulation"):
        handle.zero_grad()
    _untouched(before, m, handle)


def test_handle_refusals_change_nothing():
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, momentum=0.9)
    _steps(m, handle, 0, 1)
    before = _snap(m, handle)
    with pytest.raises(NotImplementedError, match=r"step\(\) got a closure"):
        handle.step(lambda: _loss(m, 0))
    with pytest.raises(NotImplementedError, match=r"GradScaler cannot drive"):
        handle.step(grad_scaler=None)
    with pytest.raises(NotImplementedError, match=r"step hooks do not run"):
        handle.register_step_pre_hook(lambda *a: None)
    with pytest.raises(NotImplementedError, match=r"step hooks do not run"):
        handle.register_step_post_hook(lambda *a: None)
    with pytest.raises(TypeError, match=r"cannot be pickled or copied"):
        copy.deepcopy(handle)
    _untouched(before, m, handle)
    _steps(m, handle, 1, 1)


def test_removed_handle_refusals_change_nothing():
    m = _net()
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, momentum=0.9)
    _steps(m, handle, 0, 1)
    handle.remove()
    before = _snap(m, handle)
    for call in (handle.step, handle.zero_grad):
        with pytest.raises(RuntimeError, match=r"on a removed handle"):
            call()
    with pytest.raises(RuntimeError, match=r"add_param_group\(\) on a removed handle"):
        handle.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    _untouched(before, m, handle)
    assert len(handle.param_groups) == 1


# ------------------------------------------------------------------------------- at creation
def test_creation_refusals_change_nothing(monkeypatch):
    m = _net()
    before = [p.clone() for p in m.parameters()]
    bad = [
        (NotImplementedError, dict(cls=torch.optim.LBFGS)),
        (TypeError, dict(cls=torch.optim.SGD(m.parameters(), lr=0.1))),
        (TypeError, dict(cls=_mod.StepInBackward)),
        (TypeError, dict(accumulate=2.0)),
        (ValueError, dict(accumulate=0)),
        (ValueError, dict(bucket_bytes=-1)),
        (ValueError, dict(clip_grad_norm_per_param=-1.0)),
        (ValueError, dict(clip_grad_value=float("nan"))),
    ]
    for exc, kw in bad:
        cls = kw.pop("cls", torch.optim.SGD)
        with pytest.raises(exc, match=r"^slimgrad\.step_in_backward: "):
            step_in_backward(m, cls, lr=0.1, **kw)
    monkeypatch.setattr(_mod, "_world_size", lambda: 2)
    with pytest.raises(NotImplementedError, match=r"got world size 2"):
        step_in_backward(m, torch.optim.SGD, lr=0.1)
    monkeypatch.undo()
    for p, q in zip(before, m.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0)
        assert not hasattr(q, _mod._OWNER) and q.grad is None
        assert not q._post_accumulate_grad_hooks
    _loss(m, 0).backward()  # no hook left behind: a plain backward fills every .grad
    assert all(p.grad is not None for p in m.parameters())
    with pytest.raises(RuntimeError, match=r"parameters already hold gradients"):
        step_in_backward(m, torch.optim.SGD, lr=0.1)
    assert all(not q._post_accumulate_grad_hooks for q in m.parameters())


def test_a_held_parameter_in_a_later_group_attaches_nothing():
    """The ownership check covers every group before any hook is attached: a refused handle
    leaves no hook on the earlier groups (it would update them in every later backward)."""
    m = _net()
    other = step_in_backward(m[2], torch.optim.SGD, lr=0.1)
    groups = [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 0.01}]
    with pytest.raises(RuntimeError, match=r"already updated in backward by another"):
        step_in_backward(groups, torch.optim.SGD, lr=0.1)
    w0 = m[0].weight.clone()
    _loss(m, 0).backward()  # m[2] steps by `other`; m[0] has no hook: its gradient stays
    assert torch.equal(m[0].weight, w0) and m[0].weight.grad is not None
    m[0].zero_grad()
    # add_param_group with a held parameter: refused before the group is added
    handle = step_in_backward(m[0], torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r"already updated in backward by another"):
        handle.add_param_group({"params": [m[2].weight]})
    assert len(handle.param_groups) == 1 and len(handle.optimizer.param_groups) == 1
    other.step()
    handle.step()


# ------------------------------------------------------------------------------- clipping
def test_global_clip_grad_norm_after_backward_sees_no_gradient():
    """What the docstring states: ``clip_grad_norm_(model.parameters(), c)`` after backward finds
    every ``.grad`` freed (norm 0, nothing clipped; it cannot be detected without patching
    torch). ``clip_grad_norm_per_param`` is the supported clip, equal to the plain loop's
    per-parameter clip."""
    ref, m = _net(), _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    handle = step_in_backward(m, torch.optim.SGD, lr=0.1, clip_grad_norm_per_param=0.05)
    for i in range(3):
        _loss(ref, i).backward()
        for p in ref.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.05)
        opt.step()
        opt.zero_grad()
        _loss(m, i).backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        assert norm.item() == 0.0
        handle.step()
        handle.zero_grad()
    _same(ref, m)


def test_param_groups_given_as_generators_keep_their_parameters():
    # a group's "params" may be a generator (module.parameters()): it is read once
    ref, m = _net(), _net()
    groups = [{"params": ref[0].parameters()}, {"params": ref[2].parameters()}]
    opt = torch.optim.SGD(groups, lr=0.1)
    handle = step_in_backward(
        [{"params": m[0].parameters()}, {"params": m[2].parameters()}], torch.optim.SGD, lr=0.1
    )
    assert [len(g["params"]) for g in handle.param_groups] == [2, 2]
    _steps(ref, opt, 0, 2)
    _steps(m, handle, 0, 2)
    _same(ref, m)


def test_a_model_with_a_handle_attached_saves_and_loads(tmp_path):
    # NOTE [A handle's marks pickle as none]: torch.save(model) raised "cannot pickle
    # 'weakref.ReferenceType'" while a handle was attached (its marks on the parameters)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = slimgrad.step_in_backward(model, torch.optim.SGD, lr=0.1)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for a, b in zip(model.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b)
    copied = copy.deepcopy(model)
    # the loaded and copied models are updated by no handle: plain steps on them
    for m in (loaded, copied):
        plain = torch.optim.SGD(m.parameters(), lr=0.1)
        before = [p.detach().clone() for p in m.parameters()]
        m(x).sum().backward()
        assert all(p.grad is not None for p in m.parameters())
        plain.step()
        assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), before, strict=True))
    # the handle still updates its own model
    before = [p.detach().clone() for p in model.parameters()]
    model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))

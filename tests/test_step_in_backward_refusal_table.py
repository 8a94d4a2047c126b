"""slimgrad.step_in_backward (issue 30 item 5, sib28): every refusal, one table row each.

Each row is a loop prefix (legal calls, run on the handle and on the plain optimizer alike), one
refused call on the handle, and the legal calls that finish the step. The refused call must leave
the parameters, every ``.grad``, the optimizer state, the LR scheduler and the handle's own
bookkeeping as they were (NOTE [Every refusal changes nothing] in
``slimgrad/step_in_backward.py``), and the loop that goes on must be the plain loop's that never
made that call, bit for bit. The refusals that come after a change they cannot undo are the NOTE's
list; each has its own test (test_step_in_backward_raised.py, _loops.py, _refusals.py).
A test here walks the module's raise sites, so a new one gets a row or a place in that list.
"""

from __future__ import annotations

import copy
import pickle
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from tests._bitwise import Boom as _Boom
from tests._bitwise import assert_same_parameters, assert_same_state
from tests._gc_frozen import older_objects_frozen  # noqa: F401  (autouse)

_mod = sys.modules["slimgrad.step_in_backward"]
step_in_backward = slimgrad.step_in_backward
_KW = dict(lr=0.1, momentum=0.9, weight_decay=0.01)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0 = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_Boom.apply(torch.tanh(self.l0(x)))).square().mean()

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        # l0 inside a reentrant checkpoint and outside it (NOTE [A parameter in and around a
        # reentrant checkpoint])
        h = torch.tanh(self.l0(x))
        h = checkpoint(lambda t: torch.tanh(self.l0(t)), h, use_reentrant=True)
        return self.head(h).square().mean()

    def nested(self, x: torch.Tensor) -> torch.Tensor:
        # the head in a reentrant checkpoint: backward reaches it first, in the nested backward
        h = torch.tanh(self.l0(x))
        return checkpoint(lambda t: self.head(t).square().mean(), h, use_reentrant=True)

    def nested_first(self, x: torch.Tensor) -> torch.Tensor:
        # l0 in a reentrant checkpoint, reached last: the outer backward reaches the head first
        h = checkpoint(lambda t: torch.tanh(self.l0(t)), x.requires_grad_(), use_reentrant=True)
        return self.head(h).square().mean()


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(200 + i))


@dataclass
class _Ctx:
    m: _Net
    o: Any  # the handle or the plain optimizer
    sched: Any
    mp: pytest.MonkeyPatch
    i: int = 0
    keep: list = field(default_factory=list)

    def back(self, **kw) -> None:
        self.m(_x(self.i)).backward(**kw)
        self.i += 1

    def step(self) -> None:
        self.o.step()
        self.o.zero_grad()
        self.sched.step()


def _nothing(c: _Ctx) -> None:
    pass


def _backs(n: int) -> Callable[[_Ctx], None]:
    def run(c: _Ctx) -> None:
        for _ in range(n):
            c.back()

    return run


def _then_step(prefix) -> Callable[[_Ctx], None]:
    def run(c: _Ctx) -> None:
        prefix(c)
        c.step()

    return run


def _scaled(c: _Ctx) -> None:
    scaler = torch.amp.GradScaler("cpu")
    try:
        scaler.scale(c.m(_x(90))).backward()
    finally:
        del scaler


def _scaler_step(c: _Ctx) -> None:
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # (its scale made, as the loop's scale(loss) makes it)
    try:
        scaler.step(c.o)
    finally:
        del scaler


def _world_two(c: _Ctx) -> None:
    c.mp.setattr(_mod, "_world_size", lambda: 2)
    try:
        c.m(_x(91)).backward()
    finally:
        c.mp.undo()


def _inside_backward(what: str) -> Callable[[_Ctx], None]:
    def run(c: _Ctx) -> None:
        out = c.m.head(torch.tanh(c.m.l0(_x(92))))
        out.register_hook(lambda g: getattr(c.o, what)())  # before any parameter's gradient
        out.square().mean().backward()

    return run


def _unfrozen(c: _Ctx) -> None:
    c.m.l0.bias.requires_grad_(True)
    try:
        c.m(_x(93)).backward()
    finally:
        c.m.l0.bias.requires_grad_(False)


def _no_node_query(forward: str) -> Callable[[_Ctx], None]:
    def run(c: _Ctx) -> None:
        c.mp.setattr(_mod, "_HAS_NODE_QUERY", False)
        c.mp.setattr(_mod, "_enclosing_node", lambda: None)
        try:
            getattr(c.m, forward)(_x(94)).backward()
        finally:
            c.mp.undo()

    return run


def _raised_after_update(c: _Ctx) -> None:
    # (prefix) the error after the head updated alone (bucket_bytes=16: its bias waits), at the
    # cycle's last micro-batch
    _Boom.armed = RuntimeError
    try:
        c.m(_x(c.i)).backward()
    except RuntimeError as e:
        assert "simulated" in str(e)
    c.i += 1


def _fake_ddp(module: nn.Module) -> nn.Module:
    # a DistributedDataParallel instance wrapping ``module``, without a process group: what the
    # handle reads of it is public (the instance alive, its parameters() and modules())
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel
    )
    nn.Module.__init__(ddp)
    ddp.module = module
    return ddp


def _wrapped_after(c: _Ctx) -> None:
    # NOTE [Parameters a DDP or FSDP reduces]: a DDP made after the handle, its module's backward
    ddp = _fake_ddp(c.m)
    try:
        c.m(_x(96)).backward()
    finally:
        del ddp


def _step_wrapped(c: _Ctx) -> None:
    ddp = _fake_ddp(c.m)  # (one that replaced the parameters, as fully_shard, runs no hook)
    try:
        c.o.step()
    finally:
        del ddp


def _written_back(c: _Ctx) -> None:
    # NOTE [Parameters a DDP or FSDP reduces]: a reducer the scan did not see writes .grad back
    # after the handle's update freed it (the handle only; the plain loop's finish skips it)
    if isinstance(c.o, _mod.StepInBackward):
        for p in c.m.parameters():
            p.grad = torch.full_like(p, 0.5)


def _drop_written(c: _Ctx) -> None:
    if isinstance(c.o, _mod.StepInBackward):
        for p in c.m.parameters():
            p.grad = None


def _raised_in_clipped_update(c: _Ctx) -> None:
    # (prefix) the head's weight (alone: bucket_bytes=16) clipped in place (clip_grad_value=1e9
    # changes no bit, so the plain loop needs no clip), then its update raises in an optimizer
    # step pre-hook; the plain loop's backward raises right after the same AccumulateGrad
    armed = [True]

    def once(*args) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("simulated error in an update")

    if isinstance(c.o, _mod.StepInBackward):
        hook = c.o.optimizer.register_step_pre_hook(once)
    else:
        hook = c.m.head.weight.register_post_accumulate_grad_hook(once)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            c.m(_x(c.i)).backward()
    finally:
        hook.remove()
    c.i += 1


def _held_elsewhere(c: _Ctx) -> None:
    other = step_in_backward([c.keep[0]], torch.optim.SGD, lr=0.1)
    c.keep.append(other)
    c.o.add_param_group({"params": [c.keep[0]]})


def _dtensor_group(c: _Ctx) -> None:
    c.mp.setattr(_mod, "_is_dtensor", lambda p: True)
    try:
        c.o.add_param_group({"params": [c.keep[0]]})
    finally:
        c.mp.undo()


@dataclass
class _Row:
    accumulate: int
    prefix: Callable[[_Ctx], None]
    call: Callable[[_Ctx], None]
    exc: type
    match: str
    finish: Callable[[_Ctx], None]
    handle_kw: dict = field(default_factory=dict)
    frozen: bool = False


# finish: the legal calls the plain loop makes from the same point (the refused call skipped)
_ROWS = {
    "second backward in one step": _Row(
        1,
        _backs(1),
        _backs(1),
        RuntimeError,
        r"a second backward in one step",
        _then_step(_nothing),
    ),
    "no zero_grad after step": _Row(
        1,
        lambda c: (c.back(), c.o.step()),
        _backs(1),
        RuntimeError,
        r"the gradients of the last step were not zeroed",
        lambda c: (c.o.zero_grad(), c.sched.step()),
    ),
    "no zero_grad after step, accumulate=2": _Row(
        2,
        lambda c: (c.back(), c.back(), c.o.step()),
        _backs(1),
        RuntimeError,
        r"not zeroed",
        lambda c: (c.o.zero_grad(), c.sched.step()),
    ),
    "retain_graph": _Row(
        1,
        _nothing,
        lambda c: c.back(retain_graph=True),
        NotImplementedError,
        r"backward\(retain_graph=True\)",
        _then_step(_backs(1)),
    ),
    "create_graph": _Row(
        1,
        _nothing,
        lambda c: c.back(create_graph=True),
        NotImplementedError,
        r"backward\(retain_graph=True\) \(or create_graph=True\)",
        _then_step(_backs(1)),
    ),
    "retain_graph in the updating micro-batch": _Row(
        2,
        _backs(1),
        lambda c: c.back(retain_graph=True),
        NotImplementedError,
        r"retain_graph=False",
        _then_step(_backs(1)),
    ),
    "enabled GradScaler": _Row(
        1,
        _nothing,
        _scaled,
        NotImplementedError,
        r"a live enabled torch\.amp\.GradScaler",
        _then_step(_backs(1)),
    ),
    "enabled GradScaler, micro-batch 2 of 3": _Row(
        3,
        _backs(1),
        _scaled,
        NotImplementedError,
        r"a live enabled torch\.amp\.GradScaler",
        _then_step(_backs(2)),
    ),
    "several processes": _Row(
        1,
        _nothing,
        _world_two,
        NotImplementedError,
        r"backward under a process group",
        _then_step(_backs(1)),
    ),
    "several processes, micro-batch 2": _Row(
        2,
        _backs(1),
        _world_two,
        NotImplementedError,
        r"backward under a process group",
        _then_step(_backs(1)),
    ),
    "frozen parameter unfrozen": _Row(
        1,
        _nothing,
        _unfrozen,
        RuntimeError,
        r"frozen when the handle was made now requires grad",
        _then_step(_backs(1)),
        frozen=True,
    ),
    "a parameter in and around a reentrant checkpoint, accumulate=1": _Row(
        1,
        _nothing,
        lambda c: c.m.shared(_x(95)).backward(),
        NotImplementedError,
        r"parameter 'l0\.(weight|bias)' \(5,?\s?5?\) gets a gradient both inside a reentrant "
        r"checkpoint \(torch\.utils\.checkpoint\(\.\.\., use_reentrant=True\)",
        _then_step(_backs(1)),
    ),
    "a parameter in and around a reentrant checkpoint, micro-batch 1": _Row(
        2,
        _nothing,
        lambda c: c.m.shared(_x(95)).backward(),
        NotImplementedError,
        r"a reentrant backward \(torch\.utils\.checkpoint with use_reentrant=True\)",
        _then_step(_backs(2)),
    ),
    "nested backward without the node query": _Row(
        2,
        _nothing,
        _no_node_query("nested_first"),
        NotImplementedError,
        r"use_reentrant=False",
        _then_step(_backs(2)),
    ),
    "nested backward without the node query, first hook nested": _Row(
        2,
        _nothing,
        _no_node_query("nested"),
        NotImplementedError,
        r"use_reentrant=False",
        _then_step(_backs(2)),
    ),
    "a backward after one that raised once it updated": _Row(
        1,
        _raised_after_update,
        _backs(1),
        RuntimeError,
        r"a backward after one that raised once it had updated some parameters",
        lambda c: (c.step(), _backs(1)(c), c.step()),
        handle_kw=dict(bucket_bytes=16),
    ),
    "a backward after one that raised once it updated, accumulate=2": _Row(
        2,
        lambda c: (c.back(), _raised_after_update(c)),
        _backs(1),
        RuntimeError,
        r"a backward after one that raised once it had updated some parameters",
        lambda c: (c.step(), _backs(2)(c), c.step()),
        handle_kw=dict(bucket_bytes=16),
    ),
    "a backward after an update that raised on clipped gradients": _Row(
        1,
        _raised_in_clipped_update,
        _backs(1),
        RuntimeError,
        r"a backward after one that raised in an update whose gradients the handle had clipped",
        lambda c: (c.step(), _backs(1)(c), c.step()),
        handle_kw=dict(bucket_bytes=16, clip_grad_value=1e9),
    ),
    "a backward after an update that raised on clipped gradients, accumulate=2": _Row(
        2,
        lambda c: (c.back(), _raised_in_clipped_update(c)),
        _backs(1),
        RuntimeError,
        r"whose gradients the handle had clipped in place",
        lambda c: (c.step(), _backs(2)(c), c.step()),
        handle_kw=dict(bucket_bytes=16, clip_grad_norm_per_param=1e9),
    ),
    "a DDP made after the handle": _Row(
        1,
        _nothing,
        _wrapped_after,
        NotImplementedError,
        r"parameters that a DistributedDataParallel/FSDP wrapper reduces \(any world size\).*"
        r"got 4 of its parameters inside a DistributedDataParallel",
        _then_step(_backs(1)),
    ),
    "a DDP made after the handle, micro-batch 2": _Row(
        2,
        _backs(1),
        _wrapped_after,
        NotImplementedError,
        r"parameters that a DistributedDataParallel/FSDP wrapper reduces",
        _then_step(_backs(1)),
    ),
    "step() with a DDP made after the handle": _Row(
        1,
        _backs(1),
        _step_wrapped,
        NotImplementedError,
        r"parameters that a DistributedDataParallel/FSDP wrapper reduces",
        _then_step(_nothing),
    ),
    "step() with a .grad written after the update": _Row(
        1,
        lambda c: (c.back(), _written_back(c)),
        lambda c: c.o.step(),
        NotImplementedError,
        r"something wrote \.grad after the update: a DDP/FSDP reducer\?.*got 4 updated",
        lambda c: (_drop_written(c), c.step()),
    ),
    "zero_grad() with a .grad written after the update, check_loop=False": _Row(
        1,
        lambda c: (c.back(), _written_back(c)),
        lambda c: c.o.zero_grad(),
        NotImplementedError,
        r"something wrote \.grad after the update",
        lambda c: (_drop_written(c), c.step()),
        handle_kw=dict(check_loop=False),
    ),
    "a backward after a .grad was written after the update, accumulate=2": _Row(
        2,
        lambda c: (c.back(), c.back(), _written_back(c)),
        _backs(1),
        NotImplementedError,
        r"something wrote \.grad after the update",
        lambda c: (_drop_written(c), c.step()),
    ),
    "step() inside backward": _Row(
        1,
        _nothing,
        _inside_backward("step"),
        RuntimeError,
        r"step\(\) inside backward",
        _then_step(_backs(1)),
    ),
    "zero_grad() inside backward": _Row(
        1,
        _nothing,
        _inside_backward("zero_grad"),
        RuntimeError,
        r"zero_grad\(\) inside backward",
        _then_step(_backs(1)),
    ),
    "zero_grad() mid-cycle": _Row(
        2,
        _backs(1),
        lambda c: c.o.zero_grad(),
        RuntimeError,
        r"zero_grad\(\) in the middle of an accumulation cycle",
        _then_step(_backs(1)),
    ),
    "a second step()": _Row(
        1,
        lambda c: (c.back(), c.o.step()),
        lambda c: c.o.step(),
        RuntimeError,
        r"a second step\(\) with no backward",
        lambda c: (c.o.zero_grad(), c.sched.step()),
    ),
    "step(closure)": _Row(
        1,
        _backs(1),
        lambda c: c.o.step(lambda: c.m(_x(0))),
        NotImplementedError,
        r"step\(\) got a closure",
        _then_step(_nothing),
    ),
    "GradScaler.step(handle)": _Row(
        1,
        _backs(1),
        _scaler_step,
        NotImplementedError,
        r"GradScaler cannot drive step_in_backward",
        _then_step(_nothing),
    ),
    "register_step_pre_hook": _Row(
        1,
        _backs(1),
        lambda c: c.o.register_step_pre_hook(lambda *a: None),
        NotImplementedError,
        r"step hooks do not run",
        _then_step(_nothing),
    ),
    "register_step_post_hook": _Row(
        1,
        _backs(1),
        lambda c: c.o.register_step_post_hook(lambda *a: None),
        NotImplementedError,
        r"step hooks do not run",
        _then_step(_nothing),
    ),
    "deepcopy": _Row(
        1,
        _backs(1),
        lambda c: copy.deepcopy(c.o),
        TypeError,
        r"cannot be pickled or copied",
        _then_step(_nothing),
    ),
    "pickle": _Row(
        1,
        _backs(1),
        lambda c: pickle.dumps(c.o),
        TypeError,
        r"cannot be pickled or copied",
        _then_step(_nothing),
    ),
    "add_param_group held by another handle": _Row(
        1,
        _backs(1),
        _held_elsewhere,
        RuntimeError,
        r"already updated in backward by another step_in_backward handle",
        _then_step(_nothing),
    ),
    "add_param_group of DTensors": _Row(
        1,
        _backs(1),
        _dtensor_group,
        NotImplementedError,
        r"DTensor parameters",
        _then_step(_nothing),
    ),
}


def _book(h) -> dict:
    # the handle's own bookkeeping that a refused call must leave as it was
    return {
        "micro": h._micro,
        "loop": h._loop,
        "raised": getattr(h, "_raised", 0),
        "partial": h._raised_partial,
        "clipped": sorted(map(id, h._clipped)),
        "freed": sorted(map(id, getattr(h, "_freed", {}))),
        "task": h._task,
        "held": list(map(id, getattr(h, "_held", []))),
        "late": list(map(id, getattr(h, "_late", []))),
        "pending": list(map(id, h._pending)),
        "since_zero": {id(p): v for p, v in h._since_zero.items()},
        "held_zero": {id(p): v for p, v in h._held_zero.items()},
        "hooks": sorted(map(id, h._hooks)),
        "pre_hooks": sorted(map(id, h._pre_hooks)),
        "guards": len(getattr(h, "_held_hooks", [])),
        "groups": [
            {k: (list(map(id, v)) if k == "params" else v) for k, v in g.items()}
            for g in h.param_groups
        ],
        "removed": h._removed,
        "watch": h._watch,
    }


def _snap(c: _Ctx) -> dict:
    return {
        "params": [p.detach().clone() for p in c.m.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in c.m.parameters()],
        "state": copy.deepcopy(c.o.state_dict()),
        "sched": copy.deepcopy(c.sched.state_dict()),
        "book": _book(c.o),
        "model_dict": sorted(c.m.__dict__),
    }


def _same(a: dict, b: dict) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    for x, y in zip(a["grads"], b["grads"], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert a["state"]["param_groups"] == b["state"]["param_groups"]
    assert_same_state(a["state"]["state"], b["state"]["state"])
    assert a["sched"] == b["sched"]
    assert a["book"] == b["book"]
    assert a["model_dict"] == b["model_dict"]


def _make(row: _Row, plain: bool, mp) -> _Ctx:
    m = _Net()
    if row.frozen:
        m.l0.bias.requires_grad_(False)
    if plain:
        o = torch.optim.SGD(m.parameters(), **_KW)
    else:
        o = step_in_backward(m, torch.optim.SGD, accumulate=row.accumulate, **_KW, **row.handle_kw)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    c = _Ctx(m, o, sched, mp)
    c.keep.append(nn.Parameter(torch.ones(3)))  # a parameter of no model, for add_param_group
    for _ in range(row.accumulate):  # one whole step first: momentum buffers exist
        c.back()
    c.step()
    return c


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("name", list(_ROWS))
def test_a_refused_call_changes_nothing_and_the_loop_goes_on(name, monkeypatch):
    row = _ROWS[name]
    plain = _make(row, True, monkeypatch)
    c = _make(row, False, monkeypatch)
    for ctx in (plain, c):
        row.prefix(ctx)
    before = _snap(c)
    for _ in range(2):  # and again: nothing remembered
        with pytest.raises(row.exc, match=r"^slimgrad\.step_in_backward: .*" + row.match) as err:
            row.call(c)
        # the error's frames hold what the call made (a scaler, a wrapper the handle counts as
        # alive) in a cycle through the error: cleared, the loop's own objects alone are left
        traceback.clear_frames(err.tb)
        del err
        _same(before, _snap(c))
    for ctx in (plain, c):
        row.finish(ctx)
        ctx.back()  # one more whole step
        for _ in range(row.accumulate - 1):
            ctx.back()
        ctx.step()
    assert_same_parameters(plain.m, c.m)
    assert_same_state(plain.o.state_dict()["state"], c.o.state_dict()["state"])
    assert all(p.grad is None for p in c.m.parameters())


_CREATION = [
    (
        TypeError,
        dict(cls=torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)),
        "optimizer_class must be an optimizer class",
    ),
    (TypeError, dict(cls="StepInBackward"), "optimizer_class is slimgrad's own handle class"),
    (NotImplementedError, dict(cls=torch.optim.LBFGS), "needs a closure"),
    (TypeError, dict(accumulate=2.0), "accumulate must be an int"),
    (TypeError, dict(accumulate=True), "accumulate must be an int"),
    (ValueError, dict(accumulate=0), "accumulate must be at least 1"),
    (ValueError, dict(bucket_bytes=-1), "bucket_bytes must be a non-negative int"),
    (TypeError, dict(check_loop=1), "check_loop must be a bool"),
    (TypeError, dict(module="model"), "module must be a torch.nn.Module"),
    (ValueError, dict(module="other"), "module= names another module"),
    (
        ValueError,
        dict(clip_grad_norm_per_param=-1.0),
        "clip_grad_norm_per_param must be a non-negative number",
    ),
    (ValueError, dict(clip_grad_value=float("nan")), "clip_grad_value must be a non-negative"),
    (NotImplementedError, dict(ddp=True), "-wrapped module"),
    (
        NotImplementedError,
        dict(ddp_around=True),
        "parameters that a DistributedDataParallel/FSDP wrapper reduces",
    ),
    (NotImplementedError, dict(dtensor=True), "DTensor parameters"),
    (NotImplementedError, dict(world=2), "a process group of several processes"),
    (RuntimeError, dict(grads=True), "parameters already hold gradients"),
    (RuntimeError, dict(held=True), "already updated in backward by another"),
    (ValueError, dict(params_module=True), "module= must hold every parameter"),
]


@pytest.mark.parametrize("exc, kw, match", _CREATION, ids=[m for _, _, m in _CREATION])
def test_a_refused_handle_attaches_nothing(exc, kw, match, monkeypatch):
    """Every refusal of ``step_in_backward()`` itself: no hook, no mark, no watch left on the
    model, parameters and ``.grad`` as they were; a plain step afterwards is a plain step."""
    m = _Net()
    kw = dict(kw)
    cls = kw.pop("cls", torch.optim.SGD)
    if cls == "StepInBackward":
        cls = _mod.StepInBackward
    given: Any = m
    extra: dict = {}
    if kw.pop("ddp", False):
        monkeypatch.setattr(_mod, "_dist_classes", lambda: (nn.Linear,))
    ddp = _fake_ddp(m) if kw.pop("ddp_around", False) else None
    if kw.pop("dtensor", False):
        monkeypatch.setattr(_mod, "_is_dtensor", lambda p: True)
    if kw.pop("world", None):
        monkeypatch.setattr(_mod, "_world_size", lambda: 2)
    if kw.pop("grads", False):
        m.head.bias.grad = torch.zeros_like(m.head.bias)
    if kw.pop("held", False):
        other = step_in_backward(m.head, torch.optim.SGD, lr=0.1)
        given = list(m.parameters())
        extra["module"] = m
    if kw.pop("params_module", False):
        given = list(m.parameters())
        extra["module"] = m.l0
    if kw.get("module") == "other":
        kw["module"] = nn.Linear(1, 1)
    params = [p.detach().clone() for p in m.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
    held = (
        {id(p) for p in m.head.parameters()}
        if "module" in extra and match.startswith("already")
        else set()
    )
    with pytest.raises(exc, match=r"^slimgrad\.step_in_backward: .*" + re.escape(match)):
        step_in_backward(given, cls, lr=0.1, **kw, **extra)
    monkeypatch.undo()
    for p, q, g in zip(params, m.parameters(), grads, strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
        assert (g is None) == (q.grad is None)
        if id(q) not in held:
            assert not hasattr(q, _mod._OWNER) and not q._post_accumulate_grad_hooks
            assert not q._backward_hooks
    if not held:
        assert "zero_grad" not in m.__dict__ and "__getstate__" not in m.__dict__
    else:
        other.remove()
    del ddp


# ------------------------------------------------------------------------------- the sweep
# raise sites not in the table: the refusals that come after a change they cannot undo (NOTE
# [Every refusal changes nothing]'s list) and those whose call itself changes the handle; each
# is tested in the file named, by a test that contains the words given
_ELSEWHERE = {
    "() on a removed handle": ("test_step_in_backward_refusals.py", "on a removed handle"),
    "after a backward that updated the parameters and before step()": (
        "test_step_in_backward_raised.py",
        "after a backward that updated",
    ),
    "a weight updated row by row in the fused loss's backward got another gradient": (
        "test_step_in_backward_chunked.py",
        "a weight updated row by",
    ),
}


def _messages() -> list[str]:
    # the first sentence part of every _err(...) message in the module, placeholders dropped
    src = Path(_mod.__file__).read_text()
    out = []
    for lit in re.findall(r"_err\(\s*\w+,\s*((?:f?\"[^\"]*\"\s*)+)", src):
        out.append(re.sub(r"\{[^}]*\}", "", "".join(re.findall(r"f?\"([^\"]*)\"", lit))))
    return out


def _literal(pattern: str) -> str:
    # the longest literal run of a row's pattern
    runs = re.split(r"\\.|[.*+?()\[\]|^$]", pattern)
    return max(runs, key=len)


def test_every_raise_site_is_a_row_or_named():
    """Every GUIDE-form message the module raises is triggered by a row above (a literal run of
    a row's pattern is in it), a creation row, or named in _ELSEWHERE with the file whose test
    triggers it."""
    messages = _messages()
    assert len(messages) >= 35  # the sweep is not silently empty
    literals = [_literal(r.match) for r in _ROWS.values()]
    literals += [m for _, _, m in _CREATION] + list(_ELSEWHERE)
    missing = [t for t in messages if not any(x in t or t.strip() in x for x in literals)]
    assert not missing, f"raise sites without a row or a named test: {missing}"
    here = Path(__file__).parent
    for where, words in _ELSEWHERE.values():
        assert words in (here / where).read_text(), (where, words)

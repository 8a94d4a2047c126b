"""An output kept past forward inside a closure, a partial, an iterator, a generator or a frame
escapes like one kept in an attribute (NOTE [An output kept on the module escapes]): written after
forward through ``.data``, eager's gradient still holds. A Proxy held only by a reference cycle is
garbage, not kept: the saving stays."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = self.ln(self.fc(x))
        self.keep(h)
        return self.out(torch.tanh(x + h))


class Lambda(_Base):
    def keep(self, h):
        self.cb = lambda: h

    def get(self):
        return self.cb()


class Partial(_Base):
    def keep(self, h):
        self.cb = functools.partial(lambda t: t, h)

    def get(self):
        return self.cb()


class Iterator(_Base):
    def keep(self, h):
        self.it = iter([h])

    def get(self):
        return next(self.it)


class Generator(_Base):
    def keep(self, h):
        self.gen = (t for t in [h])

    def get(self):
        return next(self.gen)


class Frame(_Base):
    def keep(self, h):
        self.fr = sys._getframe()

    def get(self):
        return self.fr.f_locals["h"]


class _Untraceable(_Base):
    # a data-dependent branch: torch.fx cannot trace it, convert_ reads the source
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.sum() > -1e9:
            self.cb = lambda: h
        return self.out(torch.tanh(x + h))

    def get(self):
        return self.cb()


class _UntraceableComprehension(_Base):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.sum() > -1e9:
            self.kept = [t for t in (h,)]
        return self.out(torch.tanh(x + h))

    def get(self):
        return self.kept[0]


@pytest.mark.parametrize(
    "cls",
    [Lambda, Partial, Iterator, Generator, Frame, _Untraceable, _UntraceableComprehension],
    ids=lambda c: c.__name__.strip("_"),
)
def test_an_output_kept_in_a_closure_written_after_forward_keeps_eagers_gradient(cls):
    eager = cls()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(4, 6)
    grads = []
    for m in (eager, conv):
        y = m(x)
        m.get().data.add_(1.0)  # no version bump: a kept-output backward would be wrong
        y.square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class _Cycle(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 64)
        self.ln = nn.LayerNorm(64)
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        h = self.ln(self.fc(x))

        def pick(n):  # recursive: pick -> its cell -> pick, a cycle holding h past the call
            return pick(n - 1) if n else h

        return self.out(pick(2))


def test_an_output_held_only_by_a_reference_cycle_keeps_the_saving():
    m, x = _Cycle(), torch.randn(32, 64)
    eager = measure(lambda: m(x).sum(), timeline=False).saved_bytes
    slimgrad.convert_(m)
    lean = measure(lambda: m(x).sum(), timeline=False).saved_bytes
    # the LayerNorm keeps its output (shared with the next Linear) instead of its input:
    # 32 x 64 float32 = 8,192 B fewer (eager 16,640 B)
    assert lean == eager - 32 * 64 * 4


class _ReadsItsParameter(nn.Module):
    # the forward reads a parameter by attribute: torch.fx's tracer caches the parameter's Proxy
    # in a closure's dict, a cycle that outlives every trace of it
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


def test_a_parameters_proxy_left_by_the_tracer_runs_no_collection(monkeypatch):
    # a parameter's Proxy holds no activation: convert_ decides without a garbage collection
    # (before: one per trace, 2,340 of them, 12.6 s of a 57 s test file)
    import gc

    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    m = slimgrad.convert_(_ReadsItsParameter())
    assert type(m.fc).__module__.startswith("slimgrad.")
    assert calls == []


class _Unpacks(nn.Module):
    # a tuple unpacked from a Proxy: torch.fx's Proxy.__iter__ keeps its own frame, and through it
    # this forward's, in a reference cycle that outlives the trace
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 24)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(self.ln(q * k + v))


def test_a_cycle_left_by_the_tracer_is_freed_without_a_full_collection(monkeypatch):
    # the trace's own cycles are young: a young-generation pass frees them (before: a full
    # collection per such trace, whose cost grows with the heap: 0.38 s each in a test worker)
    import gc

    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    eager = _Unpacks()
    # no automatic collection during convert_: the trace's cycle is there when the guard looks
    # (one trace serves both modes here, and a collection of its own may have freed it first)
    was = gc.isenabled()
    gc.disable()
    try:
        conv = slimgrad.convert_(copy.deepcopy(eager))
    finally:
        if was:
            gc.enable()
    assert type(conv.ln).__module__.startswith("slimgrad.")
    assert calls and all(a == (1,) for a in calls), calls
    x = torch.randn(4, 8)
    for a, b in zip(
        torch.autograd.grad(conv(x).square().sum(), list(conv.parameters())),
        torch.autograd.grad(eager(x).square().sum(), list(eager.parameters())),
        strict=True,
    ):
        torch.testing.assert_close(a, b)

"""Conformance: more routes by which a source-read forward writes an output-saving module's output
(NOTE [A function the forward calls by name] and NOTE [Calls the source reading spells out] in
slimgrad/convert_handlers/inplace_guard.py), found by a read-only review of the readings: a
generator that yields its argument, a ``functools.wraps`` wrapper that writes (over a Python or a
torch function), a global partial, callable object or class method, local containers and objects
that hold the output (builtins' results too), a child or method held in a local name, ``super()``
in a forward another class aliases, a local name for the module, and a ``match`` statement; and
two forwards whose reading raised inside ``convert_`` (a wrapper over a C function, a
``__wrapped__`` loop). Each writing route keeps the norm eager with eager's gradients (the
generator's regressed with the function reading; the others failed before); the two crashes
convert.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from tests._threads import one_thread
from tests.conformance._guard_rows import (
    assert_read_keeps_norm_converted,
    assert_write_keeps_norm_eager,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _edit(t):
    t.mul_(2.0)


def _gen(t):
    yield t


def _writes_around(fn):
    @functools.wraps(fn)
    def wrapper(t):
        t.mul_(2.0)
        return fn(t)

    return wrapper


@_writes_around
def _looks(t):
    return t * 2.0


_relu_writer = _writes_around(torch.relu)
_PARTIAL = functools.partial(_edit)


class _Editor:
    def __call__(self, t):
        t.mul_(2.0)


_EDITOR = _Editor()


class _Tools:
    @classmethod
    def edit(cls, t):
        t.mul_(2.0)


class _Box:
    pass


@functools.wraps(math.fsum)  # claims to wrap a C function; its own code reads
def _scaled(t):
    return t * 2.0


def _cycle(t):
    return t * 2.0


_cycle.__wrapped__ = _cycle  # a __wrapped__ loop (inspect.unwrap raises)


class _Net(nn.Module):
    # each subclass's forward has a data-dependent branch: torch.fx cannot trace it
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)

    def scale(self, h):
        h.mul_(2.0)


class _Generator(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        for t in _gen(h):
            t.mul_(2.0)
        return self.o(h)


class _WrapsWriter(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(_looks(h))


class _WrapsTorch(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(_relu_writer(h))


class _GlobalPartial(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _PARTIAL(h)
        return self.o(h)


class _GlobalCallable(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _EDITOR(h)
        return self.o(h)


class _ClassMethod(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _Tools.edit(h)
        return self.o(h)


class _LocalDict(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        d = {}
        d["h"] = h
        d["h"].mul_(2.0)
        return self.o(h)


class _LocalList(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        hs = []
        hs.append(h)
        hs[0].mul_(2.0)
        return self.o(h)


class _LocalObject(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        b = _Box()
        b.h = h
        b.h.mul_(2.0)
        return self.o(h)


class _SuperParent(_Net):
    def scale(self, h):
        return h  # reads; its parent's writes

    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        super().scale(h)  # _Net.scale, whichever class the forward is found on
        return self.o(h)


class _SuperAliased(_SuperParent):
    forward = _SuperParent.forward


class _ModuleAlias(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        a = self
        a.scale(h)
        return self.o(h)


class _Match(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        match x.dim():
            case 3:
                h.mul_(2.0)
            case _:
                pass
        return self.o(h)


class _WrapsC(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(_scaled(h))


class _WrapperLoop(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(_cycle(h))


class _ChildInLocal(_Net):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        act = self.act
        act(h)
        return self.o(h)


class _MethodInLocal(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        fn = self.scale
        fn(h)
        return self.o(h)


class _BuiltinContainers(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        for t in dict(a=h).values():
            t.mul_(2.0)
        return self.o(h)


class _Sorted(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        sorted([h], key=id)[0].mul_(2.0)
        return self.o(h)


class _InlineSoftmax(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(nn.Softmax(dim=-1)(h) + nn.GELU()(h))


class _TypeOfTuple(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        hs = type((h,))(t * 2.0 for t in (h,))
        return self.o(hs[0])


class _SizeKept(_Net):
    # a number read from the output and kept on the module holds no tensor
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        self.rows = h.size(0)
        return self.o(h)


class _InlineInPlace(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(nn.ReLU(inplace=True)(h))


_WRITERS = [
    _Generator, _WrapsWriter, _WrapsTorch, _GlobalPartial, _GlobalCallable, _ClassMethod,
    _LocalDict, _LocalList, _LocalObject, _SuperAliased, _ModuleAlias, _Match, _InlineInPlace,
    _ChildInLocal, _MethodInLocal, _BuiltinContainers, _Sorted,
]  # fmt: skip


@pytest.mark.parametrize("net", _WRITERS, ids=lambda c: c.__name__.strip("_"))
def test_a_write_keeps_the_norm_eager(net):
    assert_write_keeps_norm_eager(net)


@pytest.mark.parametrize(
    "net",
    [_WrapsC, _WrapperLoop, _InlineSoftmax, _TypeOfTuple, _SizeKept],
    ids=["wraps a C function", "loop", "inline torch modules", "type(x)(...)", "size kept"],
)
def test_a_read_keeps_the_norm_converted(net):
    # (the first two raised inside convert_; the others were kept eager by this round's readings
    # before their rules: HF Funnel's and SwitchTransformers' norms among them)
    assert_read_keeps_norm_converted(net)

"""Conformance: what a convert_ trace's forward can reach from the module tree and change is put
back exactly, or the trace is refused (NOTE [A trace leaves the model as it was]
in slimgrad/convert_handlers/inplace_guard.py).

Before the fix each row's trace left its change behind: a tensor held by a plain object or a
tuple written in place (``self.box.t.add_(1)``; the version check saw it only after the write), a
parameter written through a list, a NumPy array written, a NumPy ``RandomState`` drawn from (also
held by an object), an ``itertools.count`` or an iterator advanced, an ``array.array`` or a
``bytearray`` appended to, an object's ``__slots__`` set or a tensor in them written, a closure
cell rebound (``nonlocal``), a mutable default argument or a ``functools.partial``'s argument
appended to. Each row converts a module whose forward does that once per call, compares the state
with what it was, then the first real step (output and gradients) with an unconverted twin's.
"""

from __future__ import annotations

import array
import functools
import itertools
import types

import numpy as np
import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import untouched
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _Box:
    pass


class _Slots:
    __slots__ = ("t", "n")


def _acc(acc=[]):  # noqa: B006 (the mutable default is the row)
    acc.append(1)


def _counter():
    n = 0

    def bump():
        nonlocal n
        n += 1
        return n

    return bump


# kind: (what the module holds, what forward does with it, a reading of its state)
_KINDS = {
    "tensor_on_object": (
        lambda: types.SimpleNamespace(t=torch.zeros(6)),
        lambda h: h.t.add_(1),
        lambda h: (h.t.tolist(), h.t._version),
    ),
    "tensor_in_tuple": (
        lambda: (torch.zeros(6), 1),
        lambda h: h[0].mul_(2).add_(1),
        lambda h: (h[0].tolist(), h[0]._version),
    ),
    "numpy_array": (lambda: np.zeros(3), lambda h: h.__setitem__(0, h[0] + 1), np.ndarray.tolist),
    "numpy_array_in_tuple": (
        lambda: (np.zeros(3),),
        lambda h: h[0].__iadd__(1),
        lambda h: h[0].tolist(),
    ),
    "numpy_randomstate": (
        lambda: np.random.RandomState(0),
        lambda h: h.rand(),
        lambda h: (h.get_state()[1].tolist(), h.get_state()[2]),
    ),
    "numpy_randomstate_on_object": (
        lambda: types.SimpleNamespace(rs=np.random.RandomState(1)),
        lambda h: h.rs.rand(),
        lambda h: (h.rs.get_state()[1].tolist(), h.rs.get_state()[2]),
    ),
    "itertools_count": (itertools.count, next, repr),
    "iterator": (lambda: iter([1, 2, 3]), next, lambda h: list(h.__reduce__()[1:])),
    "array_array": (lambda: array.array("d", [1.0]), lambda h: h.append(2.0), array.array.tolist),
    "bytearray": (lambda: bytearray(b"ab"), lambda h: h.append(99), bytes),
    "slots": (_Slots, lambda h: setattr(h, "n", 1), lambda h: hasattr(h, "n")),
    "tensor_in_slots": (
        lambda: _slots_with(torch.zeros(6)),
        lambda h: h.t.sub_(1),
        lambda h: (h.t.tolist(), h.t._version),
    ),
    "closure_cell": (_counter, lambda h: h(), lambda h: h.__closure__[0].cell_contents),
    "mutable_default": (
        lambda: types.FunctionType(_acc.__code__, _acc.__globals__, "_acc", ([],)),
        lambda h: h(),
        lambda h: list(h.__defaults__[0]),
    ),
    "partial_argument": (
        lambda: functools.partial(list.append, [], 1),
        lambda h: h(),
        lambda h: list(h.args[0]),
    ),
}


def _slots_with(t):
    s = _Slots()
    s.t = t
    return s


class _Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.kind = kind
        self.held = _KINDS[kind][0]()

    def forward(self, x):
        h = nn.functional.gelu(self.ln(self.fc(x)))
        with torch.no_grad():
            _KINDS[self.kind][1](self.held)
        return h


def _step(m, x):
    y = m(x)
    y.square().sum().backward()
    return y.detach(), [p.grad for p in m.parameters()]


@pytest.mark.parametrize("kind", list(_KINDS))
def test_convert_leaves_what_forward_reaches(kind):
    read = _KINDS[kind][2]
    torch.manual_seed(0)
    m = _Net(kind)
    torch.manual_seed(0)
    ref = _Net(kind)
    held, before = m.held, read(m.held)
    slimgrad.convert_(m)
    assert m.held is held
    assert read(m.held) == before
    x = torch.randn(2, 3, 6)
    (y, g), (yr, gr) = _step(m, x), _step(ref, x)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(g, gr)
    assert read(m.held) == read(ref.held)


def test_a_generator_is_not_run():
    # a generator can be neither copied nor put back: a trace that uses it gets a stand-in that
    # raises, and is refused
    m = nn.Linear(2, 2)
    m.gen = (i for i in range(3))
    with pytest.raises(RuntimeError, match="got one that uses generator"):
        with untouched(m):
            next(m.gen)
    assert next(m.gen) == 0

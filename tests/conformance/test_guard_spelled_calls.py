"""Conformance: writes a source-read forward reaches through calls that do not name them (NOTE
[Calls the source reading spells out] in slimgrad/convert_handlers/inplace_guard.py): a child's
method, a child's forward called directly, a name bound to an in-place function, ``getattr(self,
"name")(...)``, ``super().name(...)``, exec/eval/locals/vars, functions defined in the
forward (``def`` and lambda, called there or handed to another call), methods of objects the
forward makes, and callables an expression computes.

Before, each left the LayerNorm before it converted, and backward raised autograd's in-place error
where eager trains. Each writing route now keeps the norm eager with eager's gradients; the same
routes that only read keep it converted.
"""

from __future__ import annotations

import functools

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


class _Editor(nn.Module):
    def edit(self, h):
        h.mul_(2.0)
        return h

    def look(self, h):
        return h * 2.0

    def forward(self, h):
        return h.add_(1.0)


class _Net(nn.Module):
    # each subclass's forward has a data-dependent branch, so torch.fx cannot trace it and its
    # source is read
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)
        self.editor = _Editor()

    def scale(self, h):
        h.mul_(2.0)

    def double(self, h):
        return h * 2.0


class _ChildMethod(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        self.editor.edit(h)
        return self.o(h)


class _ChildForward(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        self.editor.forward(h)
        return self.o(h)


class _BoundFunction(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        f = torch.Tensor.mul_
        f(h, 2.0)
        return self.o(h)


class _Getattr(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        getattr(self, "scale")(h)  # noqa: B009 (the spelling under test)
        return self.o(h)


class _GetattrTensor(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        getattr(h, "mul_")(2.0)  # noqa: B009
        return self.o(h)


class _NestedDef(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)

        def inner():
            h.mul_(2.0)

        inner()
        return self.o(h)


class _NestedDefArgument(_Net):
    def forward(self, x):
        def inner(t, s=2.0):
            t.mul_(s)

        h = self.ln(self.fc(x))  # made after the def: read where inner is called
        if x.shape[-1] != 6:
            return self.o(h)
        inner(h)
        return self.o(h)


class _LambdaLocal(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        g = lambda t: t.add_(1.0)  # noqa: E731
        g(h)
        return self.o(h)


class _Handed(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)

        def inner(t):
            t.mul_(2.0)
            return t

        list(map(inner, [h]))
        return self.o(h)


class _LateBinding(_Net):
    def forward(self, x):
        t = x.clone()

        def inner():
            t.mul_(2.0)  # t is h by the time inner runs

        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        t = h
        inner()
        return self.o(h)


class _ReturnedByLocal(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)

        def same(t):
            return t

        same(h).mul_(2.0)
        return self.o(h)


class _Super(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        super().scale(h)
        return self.o(h)


class _SuperOfSubclass(_Net):
    # super() from the class that defines the forward, not from the instance's class
    def scale(self, h):
        return h * 2.0  # reads; its parent's writes

    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        super().scale(h)
        return self.o(h)


class _BoundByGetattr(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        f = getattr(torch.Tensor, "mul_")  # noqa: B009
        f(h, 2.0)
        return self.o(h)


class _Exec(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        exec("h.mul_(2.0)")
        return self.o(h)


class _Locals(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        locals()["h"].mul_(2.0)
        return self.o(h)


class _ReadsSuper(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(super().double(h))


class _Tool:
    # a plain Python object the forward makes
    def __init__(self, s=2.0):
        self.s = s

    def edit(self, h):
        h.mul_(self.s)

    def look(self, h):
        return h * self.s

    @staticmethod
    def sedit(h):
        h.add_(1.0)


class _LocalObject(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        t = _Tool()
        t.edit(h)
        return self.o(h)


class _InlineObject(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _Tool(0.5).edit(h)
        return self.o(h)


class _ObjectStatic(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _Tool().sedit(h)
        return self.o(h)


class _BoundMethod(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        m = _Tool().edit
        m(h)
        return self.o(h)


class _ComputedCallable(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        functools.partial(_Tool().edit)(h)
        return self.o(h)


class _ReadsObject(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(_Tool().look(h))


class _ReadsChildMethod(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(self.editor.look(h))


class _ReadsGetattr(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(getattr(self, "double")(h))  # noqa: B009


class _ReadsLocal(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)

        def inner(t):
            return t * 2.0

        g = lambda t: t + 1.0  # noqa: E731
        return self.o(g(inner(h)))


_WRITERS = [
    _ChildMethod, _ChildForward, _BoundFunction, _Getattr, _GetattrTensor, _NestedDef,
    _NestedDefArgument, _LambdaLocal, _Handed, _LateBinding, _ReturnedByLocal, _Super,
    _SuperOfSubclass, _BoundByGetattr, _Exec, _Locals, _LocalObject, _InlineObject,
    _ObjectStatic, _BoundMethod, _ComputedCallable,
]  # fmt: skip
_READERS = [_ReadsChildMethod, _ReadsGetattr, _ReadsLocal, _ReadsSuper, _ReadsObject]


@pytest.mark.parametrize("net", _WRITERS, ids=lambda c: c.__name__.strip("_"))
def test_a_spelled_out_write_keeps_the_norm_eager(net):
    assert_write_keeps_norm_eager(net)


@pytest.mark.parametrize("net", _READERS, ids=lambda c: c.__name__.strip("_"))
def test_a_spelled_out_read_keeps_the_norm_converted(net):
    assert_read_keeps_norm_converted(net)

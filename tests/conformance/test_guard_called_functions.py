"""Conformance: a forward read from its source that hands an output-saving module's output to a
plain Python function it reaches by name (NOTE [A function the forward calls by name] in
slimgrad/convert_handlers/inplace_guard.py).

Before, such a call was judged by the function's name alone: ``edit(h)`` with ``def edit(h):
h.mul_(2)`` over a LayerNorm's output left the norm converted and backward raised autograd's
in-place error where eager trains; a function returning its argument hid a later write through
the result. Each writing route now keeps the norm eager with eager's gradients; a function that
only reads keeps the norm converted.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import kept_reason
from tests._threads import one_thread
from tests.conformance._guard_rows import (
    assert_read_keeps_norm_converted,
    assert_write_keeps_norm_eager,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def edit(h):
    h.mul_(2.0)
    return h


def edit_second(scale, h):
    h.mul_(scale)


def outer(h):
    return edit(h)  # the write is one call further


def same(h):
    return h


def same_view(h):
    return h.view(-1, h.shape[-1])


def deep(h, n):
    return h if n == 0 else deep(h, n - 1)


def zero_row(h):
    h[0].zero_()


def relu_kw(h):
    return F.relu(h, inplace=True)


def relu_op(h):
    return torch.relu_(h)


def spread_writer(*hs):
    for t in hs:
        t.add_(1.0)


def reads(h):
    return h * 2.0 + h.mean()


def reads_twice(h):
    return reads(h) + same(h).sum()


EDIT = lambda h: h.add_(1.0)  # noqa: E731
helpers = types.ModuleType("helpers")
helpers.edit = edit


class Tools:
    @staticmethod
    def edit(h):
        h.sub_(1.0)


_namespace: dict = {}
exec("def unread(h):\n    return h * 2.0\n", _namespace)  # no source to read
unread = _namespace["unread"]


class _Net(nn.Module):
    # each subclass's forward is one that torch.fx cannot trace (a data-dependent branch), so
    # its source is read
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)


class _Edit(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        edit(h)
        return self.o(h)


class _Keyword(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        edit(h=h)
        return self.o(h)


class _Spread(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        edit(**{"h": h})
        return self.o(h)


class _Second(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        edit_second(0.5, h)
        return self.o(h)


class _Outer(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        outer(h)
        return self.o(h)


class _ModulePath(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        helpers.edit(h)
        return self.o(h)


class _StaticMethod(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        Tools.edit(h)
        return self.o(h)


class _Lambda(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        EDIT(h)
        return self.o(h)


class _Returned(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        g = same(h)
        g.mul_(3.0)
        return self.o(h)


class _ReturnedView(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        same_view(h).mul_(3.0)
        return self.o(h)


class _Recursive(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        deep(h, 3).mul_(3.0)
        return self.o(h)


class _Item(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        zero_row(h)
        return self.o(h)


class _InplaceTrue(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        relu_kw(h)
        return self.o(h)


class _TorchRelu(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        relu_op(h)
        return self.o(h)


class _StarArgs(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        spread_writer(*(h,))
        return self.o(h)


class _Reads(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        h = reads(h)
        return self.o(h)


class _ReadsTwice(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        h = reads_twice(h)
        return self.o(h)


class _Unreadable(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true
            return self.o(h)
        h = unread(h)
        return self.o(h)


_NETS = {
    "edit": _Edit,
    "keyword": _Keyword,
    "spread": _Spread,
    "second": _Second,
    "outer": _Outer,
    "module path": _ModulePath,
    "static method": _StaticMethod,
    "lambda": _Lambda,
    "returned": _Returned,
    "returned view": _ReturnedView,
    "recursive": _Recursive,
    "item": _Item,
    "inplace=True": _InplaceTrue,
    "torch.relu_": _TorchRelu,
    "*args": _StarArgs,
    "reads": _Reads,
    "reads twice": _ReadsTwice,
    "unreadable": _Unreadable,
}

_WRITERS = [
    "edit", "keyword", "spread", "second", "outer", "module path", "static method", "lambda",
    "returned", "returned view", "recursive", "item", "inplace=True", "torch.relu_", "*args",
]  # fmt: skip


@pytest.mark.parametrize("body", _WRITERS)
def test_a_function_that_writes_keeps_the_norm_eager(body):
    assert_write_keeps_norm_eager(_NETS[body])


@pytest.mark.parametrize("body", ["reads", "reads twice"])
def test_a_function_that_reads_keeps_the_norm_converted(body):
    assert_read_keeps_norm_converted(_NETS[body])


def test_a_function_without_source_may_write():
    torch.manual_seed(0)
    c = slimgrad.convert_(_NETS["unreadable"]())
    assert kept_reason(c.ln) is not None

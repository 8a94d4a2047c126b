"""Conformance: the source-reading routes issue 30's last note left unfollowed (NOTE [Calls the
source reading spells out] in slimgrad/convert_handlers/inplace_guard.py): a function handed to
another call as an argument (``apply(edit, h)``, ``map(edit, [h])``, ``sorted(..., key=...)``), a
function a default argument holds, a callable a call returns and a name keeps (``g = make();
g(h)``), a plain function given the module (``run(self, h)`` reaching a child that writes), a
class defined inside the forward, and a loop over a literal tuple or list of children (``for
layer in (self.act,)``). Each writing route keeps the LayerNorm eager with eager's gradients
(autograd's in-place error where it stayed converted); the reading twins keep it converted."""

from __future__ import annotations

import pytest
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
    return t


def _look(t):
    return t * 2.0


def _apply(fn, t):
    return fn(t)


def _make_editor():
    return _edit


def _make_looker():
    return _look


def _run_act(m, t):
    return m.act(t)


def _run_o(m, t):
    return m.o(t)


class _Net(nn.Module):
    # each subclass's forward has a data-dependent branch: torch.fx cannot trace it
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.act = nn.ReLU(inplace=True)
        self.soft = nn.Softsign()
        self.o = nn.Linear(6, 2)


class _ArgApply(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _apply(_edit, h)
        return self.o(h)


class _ArgMap(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        list(map(_edit, [h]))
        return self.o(h)


class _ArgKey(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        sorted([h], key=_edit)
        return self.o(h)


class _DefaultArg(_Net):
    def forward(self, x, fn=_edit):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        fn(h)
        return self.o(h)


class _KeptFromCall(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        g = _make_editor()
        g(h)
        return self.o(h)


class _ModuleGiven(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        _run_act(self, h)
        return self.o(h)


class _LocalClass(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)

        class Tool:
            def edit(self, t):
                t.mul_(2.0)

        Tool().edit(h)
        return self.o(h)


class _LocalClassCall(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)

        class Tool:
            def __call__(self, t):
                t.mul_(2.0)

        Tool()(h)
        return self.o(h)


class _LiteralTuple(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        for layer in (self.act,):
            layer(h)
        return self.o(h)


class _LiteralList(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        for layer in [self.soft, self.act]:
            layer(h)
        return self.o(h)


WRITERS = [
    _ArgApply,
    _ArgMap,
    _ArgKey,
    _DefaultArg,
    _KeptFromCall,
    _ModuleGiven,
    _LocalClass,
    _LocalClassCall,
    _LiteralTuple,
    _LiteralList,
]


@pytest.mark.parametrize("make", WRITERS, ids=lambda c: c.__name__)
def test_writing_route_keeps_norm_eager(make):
    assert_write_keeps_norm_eager(make)


class _ReadApply(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(_apply(_look, h))


class _ReadKept(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        g = _make_looker()
        return self.o(g(h))


class _ReadModuleGiven(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return _run_o(self, h)


class _ReadLiteralTuple(_Net):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        for layer in (self.soft,):
            h = layer(h)
        return self.o(h)


READERS = [_ReadApply, _ReadKept, _ReadModuleGiven, _ReadLiteralTuple]


@pytest.mark.parametrize("make", READERS, ids=lambda c: c.__name__)
def test_reading_route_keeps_norm_converted(make):
    assert_read_keeps_norm_converted(make)

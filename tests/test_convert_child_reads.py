"""A kept module whose forward reads a child other than by calling it is read again after the swaps
(NOTE [A forward that reads its children] in slimgrad/convert_handlers/inplace_guard.py).

convert_ reads each forward once, before the swaps, and maps that reading through them; a forward
that branches on a child's type (``type(self.act) is nn.GELU``, ``isinstance``, ``__class__``, a
helper or function handed the child, a loop over a container that looks at its items) takes
another path once that child is slimgrad's. The reading of the converted model must then be a
fresh one: the LayerNorm whose output the converted forward returns runs eager's op, and the
caller's in-place write on the output trains as in eager.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import slimgrad
from tests._readings import convert_and_read_afresh, count_traces
from tests._threads import one_thread_each_test  # noqa: F401 (an autouse fixture)


def _torch_gelu(m):
    return type(m) is nn.GELU


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.fc = nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)
        self.acts = nn.ModuleList([nn.GELU()])

    def forward(self, x):
        h = self.norm(x)
        if self.torch_act():
            return self.fc(self.act(h))
        return h  # once the GELU is slimgrad's: the LayerNorm's output is the model's

    def torch_act(self):
        raise NotImplementedError


class _TypeIs(_Base):
    def torch_act(self):
        return type(self.act) is nn.GELU


class _TypeEq(_Base):
    def torch_act(self):
        return type(self.act) == nn.GELU  # noqa: E721


class _ClassAttr(_Base):
    def torch_act(self):
        return self.act.__class__ is nn.GELU


class _ModuleName(_Base):
    def torch_act(self):
        return type(self.act).__module__.startswith("torch.")


class _Function(_Base):
    def torch_act(self):
        return _torch_gelu(self.act)


class _Alias(_Base):
    def torch_act(self):
        act = self.act
        return type(act) is nn.GELU


class _Items(_Base):
    def torch_act(self):
        return all(type(a) is nn.GELU for a in self.acts)


class _GetAttr(_Base):
    def torch_act(self):
        return getattr(self, "act").__class__ is nn.GELU  # noqa: B009 (the spelling tested)


class _Children(_Base):
    def torch_act(self):
        return all(type(c) is not slimgrad.nn.GELU for c in self.children())


class _Property(_Base):
    @property
    def act_kind(self):
        return type(self.act)

    def torch_act(self):
        return self.act_kind is nn.GELU


class _Lambda(_Base):
    torch_act = lambda self: type(self.act) is nn.GELU  # noqa: E731 (source read as one line)


SPELLINGS = {
    "type_is": _TypeIs,
    "type_eq": _TypeEq,
    "class_attr": _ClassAttr,
    "module_name": _ModuleName,
    "function": _Function,
    "alias": _Alias,
    "items": _Items,
    "getattr": _GetAttr,
    "children": _Children,
    "property": _Property,
    "lambda": _Lambda,
}


class _Inline(nn.Module):
    # the read written in forward itself
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.fc = nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        if isinstance(self.act, nn.GELU) and type(self.act) is nn.GELU:
            return self.fc(self.act(h))
        return h


class _Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)
        self.acts = nn.ModuleList([nn.GELU(), nn.GELU()])

    def forward(self, x):
        h = self.norm(x)
        for a in self.acts:
            if type(a) is not nn.GELU:
                return h
            h = self.fc(a(h))
        return h


def _checks_act(fn):
    # the read is in the decorator, not in the source of the forward it wraps
    @functools.wraps(fn)
    def forward(self, x):
        if type(self.act) is not nn.GELU:
            return self.norm(x)
        return fn(self, x)

    return forward


class _Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.fc = nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)

    @_checks_act
    def forward(self, x):
        return self.fc(self.act(self.norm(x)))


MODELS = {
    **SPELLINGS,
    "inline": _Inline,
    "loop_items": _Loop,
    "decorated": _Decorated,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_forward_reading_its_children_is_read_after_the_swaps(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    convert_and_read_afresh(model)
    assert type(model.norm) is slimgrad.nn.LayerNorm
    assert model.norm.keep_y is False  # its output is the model's output now
    # and the caller's in-place write trains, as in eager
    x = torch.randn(3, 8, requires_grad=True)
    out = model(x)
    out.mul_(2.0)
    out.sum().backward()
    assert x.grad is not None


class _Plain(nn.Module):
    # calls its children only: its reading before the swaps stands
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.fc = nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        h = self.norm(x)
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None and len(self.layers) > 1:
            h = self.layers[0](h) + self.fc(self.act(h))
        return h


def test_a_forward_that_only_calls_its_children_is_read_once(monkeypatch):
    model = _Plain()
    seen = count_traces(monkeypatch)
    slimgrad.convert_(model)
    # one trace before the swaps, for both modes (NOTE [One trace serves both modes]), none after
    assert seen == {id(model): 1}

"""One torch.fx trace serves both modes where the forward cannot read a ``training`` flag (NOTE [One
trace serves both modes] in slimgrad/convert_handlers/inplace_guard.py).

A row that may read a flag (its own, a child's, through a property, a stored callable, a user's
function, an object it holds) is traced in both modes, and its reading is the one two traces
make; a row that cannot is traced once, and its reading is still the one two traces make.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slimgrad.convert_handlers import inplace_guard as _guard
from tests._readings import count_traces


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.drop = nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Dropout(0.5)
        self.scale, self.cfg, self.fn = 2.0, None, None


class Blind(_Base):
    # children called, settings read, torch functions, a method and a property of the class
    @property
    def width(self):
        return 4 if self.fc is not None else int(self.scale)

    def helper(self, h):
        return F.relu(h) * self.scale

    def forward(self, x):
        h = self.fc(x)
        if self.width == 4:
            h = self.helper(h)
        return torch.cat([self.act(h), x.transpose(0, 1).transpose(0, 1)], dim=-1)


class OwnFlag(_Base):
    def forward(self, x):
        h = self.fc(x)
        return self.act(h) if self.training else h + 1


class ChildFlag(_Base):
    def forward(self, x):
        h = self.fc(x)
        return self.act(h) if self.drop.training else h + 1


class PropertyFlag(_Base):
    @property
    def busy(self):
        return self.__dict__["train" + "ing"]  # (the name as a string: still read)

    def forward(self, x):
        h = self.fc(x)
        return self.act(h) if self.busy else h + 1


class _Owner:
    def __init__(self, m):
        self.m = m

    @property
    def on(self):
        return self.m.training


class HeldObject(_Base):
    # ``self.cfg``: an object whose property reads the module's flag
    def forward(self, x):
        h = self.fc(x)
        return self.act(h) if self.cfg.on else h + 1


class StoredCallable(_Base):
    # ``self.fn``: a lambda that reads the module's flag
    def forward(self, x):
        return self.fn(self.fc(x))


_REGISTRY: dict = {}


def _user_helper(h):
    return h.relu_() if _REGISTRY["m"].training else h + 1


class UserFunction(_Base):
    # a function of the user's, which reads a flag through a global registry of modules
    def forward(self, x):
        return _user_helper(self.fc(x))


class _Flip:
    def __init__(self, m):
        self.m = m

    def __call__(self, h):
        return h.relu_() if self.m.training else h + 1


class Container(_Base):
    # a callable held in a list on the module
    def forward(self, x):
        return self.fns[0](self.fc(x))


class _FlagTensor(torch.Tensor):
    def on(self):
        return self.owner.training


class SubclassTensor(_Base):
    # a tensor held on the module whose class (a torch.Tensor subclass) runs code that reads the
    # flag (review35: any tensor counted as a setting that runs no code)
    def forward(self, x):
        h = self.fc(x)
        return self.act(h) if self.flag.on() else h + 1


def _build(cls):
    m = cls()
    if cls is SubclassTensor:
        t = torch.ones(1).as_subclass(_FlagTensor)
        t.owner = m
        m.flag = t
    if cls is HeldObject:
        m.cfg = _Owner(m)
    elif cls is StoredCallable:
        m.fn = lambda h: h.relu_() if m.training else h + 1
    elif cls is UserFunction:
        _REGISTRY["m"] = m
    elif cls is Container:
        m.fns = [_Flip(m)]
    return m


READS_FLAG = [
    OwnFlag,
    ChildFlag,
    PropertyFlag,
    HeldObject,
    StoredCallable,
    UserFunction,
    Container,
    SubclassTensor,
]


def _reading(m):
    r = _guard._Read.of(m)
    texts = [None if g is None else _guard._text(g) for g in (r.train, r.eval)]
    return (r.same, r.drew, r.kept, *texts)


def _two_traces(m, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(_guard, "_mode_blind", lambda m: False)
        return _reading(m)


@pytest.mark.parametrize("cls", READS_FLAG, ids=lambda c: c.__name__)
def test_a_forward_that_may_read_a_flag_is_traced_in_both_modes(cls, monkeypatch):
    m = _build(cls)
    assert not _guard._mode_blind(m)
    seen = count_traces(monkeypatch)
    got = _reading(m)
    assert seen[id(m)] == 2
    assert got == _two_traces(m, monkeypatch)
    # each of these forwards branches on the flag: the two traces differ (a single trace taken
    # for both modes would be read where it does not hold)
    assert got[0] is False and got[3] != got[4]


def test_a_forward_that_cannot_read_a_flag_is_traced_once(monkeypatch):
    m = Blind()
    assert _guard._mode_blind(m)
    seen = count_traces(monkeypatch)
    got = _reading(m)
    assert seen == collections.Counter({id(m): 1})
    assert got == _two_traces(m, monkeypatch)
    assert got[0] is True and got[3] is not None


def test_a_subclass_that_reads_the_flag_is_not_its_parents_reading():
    # the same children and settings, another forward: read by its own source
    class Sub(Blind):
        def helper(self, h):
            return F.dropout(h, 0.5, self.training)

    assert _guard._mode_blind(Blind()) and not _guard._mode_blind(Sub())

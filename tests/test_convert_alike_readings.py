"""Modules that read alike share the guard's reading (NOTE [Modules that read alike share a
reading] in slimgrad/convert_handlers/inplace_guard.py): a block repeated with the same facts is
traced once per convert_, and a block of the same class whose facts differ in anything its forward
can read (a setting, a child's setting, a plain tensor's values, aliasing) gets its own reading."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import inplace_guard as _guard
from tests._readings import count_traces, read_afresh

_FALSE = torch.tensor(False)


class _Block(nn.Module):
    # LayerNorm -> Linear; ``h += x`` over the norm's output where the forward's facts say so
    def __init__(self, write=False, p=0.0, flag=None):
        super().__init__()
        self.norm, self.fc, self.act = nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU()
        self.write, self.p = write, p
        self.flag = _FALSE if flag is None else flag  # a plain tensor, not a buffer

    def forward(self, x):
        h = self.norm(x)
        if self.write or self.p > 0 or bool(self.flag):
            h += x  # over the norm's output: the converted LayerNorm keeps it, so it stays torch's
        return self.fc(h)


class _ChildBlock(_Block):
    # reads a child other than by calling it (read again after the swaps, as any such forward)
    def forward(self, x):
        h = self.norm(x)
        if self.act.inplace:
            h += x
        return self.fc(h)


def _kinds(model):
    return [type(b.norm).__module__.split(".")[0] for b in model]


def _step(model):
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()  # a converted norm written over raises here


@pytest.fixture
def shared(monkeypatch):
    # readings are shared only for trees of library classes; the blocks here stand for one
    monkeypatch.setattr(_guard, "_ALIKE_LIBRARIES", _guard._ALIKE_LIBRARIES | {"tests"})


def test_repeated_blocks_are_traced_once(monkeypatch, shared):
    model = nn.Sequential(*(_Block() for _ in range(4)))
    _keep = list(model.modules())  # the originals stay alive: their ids stay unique
    seen = count_traces(monkeypatch)
    slimgrad.convert_(model)
    blocks = {id(b) for b in _keep if type(b) is _Block}
    traced = [k for k in seen if k in blocks]
    # one block, one trace for both modes (NOTE [One trace serves both modes])
    assert len(traced) == 1 and seen[traced[0]] == 1
    assert _kinds(model) == ["slimgrad"] * 4
    read_afresh(model)
    _step(model)


@pytest.mark.parametrize(
    "differs",
    [
        {"write": True},  # a setting
        {"p": 0.5},  # a number
        {"flag": torch.tensor(True)},  # a plain tensor's value (fx reads it as it is)
        "child",  # a child's setting the forward reads
    ],
    ids=["setting", "number", "tensor", "child"],
)
@pytest.mark.parametrize("first", [True, False], ids=["writer_first", "writer_last"])
def test_a_block_with_other_facts_is_read_on_its_own(differs, first, shared):
    if differs == "child":
        plain, writer = _ChildBlock(), _ChildBlock()
        writer.act = nn.ReLU(inplace=True)
    else:
        plain, writer = _Block(), _Block(**differs)
    model = nn.Sequential(writer, plain) if first else nn.Sequential(plain, writer)
    slimgrad.convert_(model)
    expected = ["torch", "slimgrad"] if first else ["slimgrad", "torch"]
    assert _kinds(model) == expected
    read_afresh(model)
    _step(model)


def test_the_facts_name_aliasing_and_shapes():
    keep: list = []

    def key(m):
        return _guard._alike_key(m, keep)

    a, b = _Block(), _Block()
    assert key(a) == key(b)
    b.fc = nn.Linear(8, 8, bias=False)  # a parameter less
    assert key(a) != key(b)
    c = _Block()
    c.fc = c.norm  # one child under two names, where ``a`` has two
    assert key(a) != key(c)
    d = _Block()
    d.fc.weight.requires_grad_(False)
    assert key(a) != key(d)
    e = _Block()
    e.norm = nn.LayerNorm(8).double()
    assert key(a) != key(e)
    counts = collections.Counter(map(type, keep))
    assert counts[torch.Tensor] and counts[nn.Parameter]  # what the keys name stays alive


class _LazyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.LazyLinear(8)

    def forward(self, x):
        h = self.norm(x)
        h += x
        return self.fc(h)


def test_a_fact_that_cannot_be_read_reads_the_module_alone(monkeypatch):
    # an uninitialized parameter has no shape: each block is traced on its own, as before (not
    # read from its source, as an untraceable forward is)
    model = nn.Sequential(_LazyBlock(), _LazyBlock())
    seen = count_traces(monkeypatch)
    sourced = []
    source_info = _guard._source_info
    monkeypatch.setattr(
        _guard, "_source_info", lambda a, m, *rest: sourced.append(m) or source_info(a, m, *rest)
    )
    slimgrad.convert_(model)
    # each traced once (its forward cannot read the mode: NOTE [One trace serves both modes])
    assert [seen[id(b)] for b in model] == [1, 1] and not [m for m in sourced if m in model]
    assert [type(b.norm) for b in model] == [nn.LayerNorm, nn.LayerNorm]  # written over: kept
    _step(model)


class _Reaching(nn.Module):
    # LayerNorm -> Linear; writes over the norm's output where its forward reaches a fact the
    # key cannot see (review33a): a buffer's value through buffers(), a setting in __slots__,
    # its own identity in a registry
    __slots__ = ("write",)
    registry: set = set()

    def __init__(self, how, write):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)
        self.how = how
        self.register_buffer("flag", torch.tensor(write))
        object.__setattr__(self, "write", write)  # the slot
        if write:
            _Reaching.registry.add(id(self))

    def forward(self, x):
        h = self.norm(x)
        if self.how == "buffers":
            write = bool(next(self.buffers()))
        elif self.how == "slot":
            write = self.write
        else:
            write = id(self) in _Reaching.registry
        if write:
            h += x
        return self.fc(h)


@pytest.mark.parametrize("how", ["buffers", "slot", "identity"])
def test_a_users_block_is_read_on_its_own(how):
    # equal facts, different forwards: outside a library's classes no reading is shared, so the
    # writer's norm stays torch's and the step runs as eager's
    plain, writer = _Reaching(how, False), _Reaching(how, True)
    keep: list = []
    assert _guard._alike_key(plain, keep) == _guard._alike_key(writer, keep)
    model = nn.Sequential(plain, writer)
    slimgrad.convert_(model)
    assert _kinds(model) == ["slimgrad", "torch"]
    _step(model)


def test_a_float_setting_is_keyed_by_its_sign():
    keep: list = []
    a, b = nn.LeakyReLU(0.0), nn.LeakyReLU(-0.0)
    assert _guard._alike_key(a, keep) != _guard._alike_key(b, keep)

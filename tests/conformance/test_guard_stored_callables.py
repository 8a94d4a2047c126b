"""Conformance: a callable stored on the module (or in a container the forward indexes) that writes
in place, in a forward torch.fx cannot trace (NOTE [Callables stored on the module] in
slimgrad/convert_handlers/inplace_guard.py).

Before, the source reader counted ``self.act_fn(h)`` (an attribute that is not a child module) and
``BODIES[k](h)`` as non-writing: a ``functools.partial(F.relu, inplace=True)`` or a lambda doing
``h.clamp_()`` over a LayerNorm's output left the norm converted and the converted backward raised
autograd's in-place error where eager trains. Each row checks the norm is kept and the gradients
equal eager's; a partial of a non-in-place function keeps the norm converted.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import kept_reason
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _clamp_(h):
    return h.clamp_(-1, 1)


_WRITERS = {
    "partial(F.relu, inplace=True)": functools.partial(F.relu, inplace=True),
    "partial(F.hardtanh, inplace=True)": functools.partial(
        F.hardtanh, min_val=-1.0, max_val=1.0, inplace=True
    ),
    "partial(torch.relu_)": functools.partial(torch.relu_),
    "lambda clamp_": lambda h: h.clamp_(-1, 1),
    "function clamp_": _clamp_,
    "Tensor.mul_ (method descriptor)": functools.partial(torch.Tensor.mul_, other=2.0),
}
_FRESH = {
    "partial(F.relu)": functools.partial(F.relu),
    "partial(F.gelu, approximate='tanh')": functools.partial(F.gelu, approximate="tanh"),
    "torch.relu": torch.relu,
    "Tensor.relu (method descriptor)": torch.Tensor.relu,
}
GLOBAL_TABLE: dict = {}


class _Attr(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)
        self.act_fn = fn

    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true: torch.fx cannot trace this forward
            return self.o(h)
        return self.o(self.act_fn(h))


class _Table(nn.Module):
    # a dict of callables on the module, indexed in forward
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)
        self.table = {"a": fn}

    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(self.table["a"](h))


class _Global(nn.Module):
    # a module-level dict of callables, indexed in forward
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)
        GLOBAL_TABLE["a"] = fn

    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:
            return self.o(h)
        return self.o(GLOBAL_TABLE["a"](h))


def _grads(m, x):
    m.zero_grad()
    m(x).square().sum().backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


@pytest.mark.parametrize("holder", [_Attr, _Table, _Global], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(_WRITERS))
def test_stored_writer_keeps_norm(holder, name):
    GLOBAL_TABLE.clear()
    torch.manual_seed(0)
    m = holder(_WRITERS[name])
    x = torch.randn(2, 3, 6)
    want = _grads(m, x)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.ln) is not None
    got = _grads(c, x)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("holder", [_Attr, _Table, _Global], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(_FRESH))
def test_stored_known_fresh_function_keeps_norm_converted(holder, name):
    GLOBAL_TABLE.clear()
    torch.manual_seed(0)
    m = holder(_FRESH[name])
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.ln) is None
    assert type(c.ln) is not nn.LayerNorm

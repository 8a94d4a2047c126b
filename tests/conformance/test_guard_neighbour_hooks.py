"""Conformance: hooks on the modules around an output-saving module, registered before convert_,
that write its output in place (NOTE [Hooks on the modules around an output-saving one] in
slimgrad/convert_handlers/inplace_guard.py).

Before, only hooks on the output-saving module itself were read: a parent's forward hook writing
its output (which is the norm's) or the next module's forward pre-hook writing its input left the
norm/activation converted, and the converted backward raised autograd's in-place error where eager
trains. Each row checks the module is kept and the gradients equal eager's; a hook that only reads
keeps it converted. (The same hooks registered after convert_: tests/conformance/
test_hooks_after_convert.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import kept_reason
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


_SAVERS = {
    "LayerNorm": lambda: nn.LayerNorm(6),
    "RMSNorm": lambda: nn.RMSNorm(6),
    "GELU": nn.GELU,
    "SiLU": nn.SiLU,
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
}


def _parent_writes(mod, inp, out):
    out.mul_(2.0)


def _next_writes(mod, args):
    args[0].mul_(2.0)


def _parent_reads(mod, inp, out):
    mod.seen = out.shape


def _next_reads(mod, args):
    mod.seen = args[0].shape


def _build(make):
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 6), make()), nn.Linear(6, 2))


def _grads(m, x):
    m.zero_grad()
    m(x).square().sum().backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


_HOOKS = {
    "parent forward hook": lambda m: m[0].register_forward_hook(_parent_writes),
    "parent forward hook (lambda)": lambda m: m[0].register_forward_hook(
        lambda mod, i, o: (o.mul_(2.0), None)[1]
    ),
    "next pre-hook": lambda m: m[1].register_forward_pre_hook(_next_writes),
    "next pre-hook (lambda)": lambda m: m[1].register_forward_pre_hook(
        lambda mod, a: (a[0].mul_(2.0), None)[1]
    ),
}


@pytest.mark.parametrize("hook", list(_HOOKS))
@pytest.mark.parametrize("saver", list(_SAVERS))
def test_neighbour_hook_writing_keeps_module(saver, hook):
    m = _build(_SAVERS[saver])
    _HOOKS[hook](m)
    x = torch.randn(3, 6)
    want = _grads(m, x)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c[0][1]) is not None
    got = _grads(c, x)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "add",
    [
        lambda m: m[0].register_forward_hook(_parent_reads),
        lambda m: m[1].register_forward_pre_hook(_next_reads),
    ],
    ids=["parent reads", "next reads"],
)
def test_neighbour_hook_reading_keeps_module_converted(add):
    m = _build(lambda: nn.LayerNorm(6))
    add(m)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c[0][1]) is None
    assert type(c[0][1]) is not nn.LayerNorm

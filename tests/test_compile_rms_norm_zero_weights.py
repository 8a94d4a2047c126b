"""Compiled converted HF RMSNorms whose weights have zeros, however the weight reaches the graph
(NOTE [RMSNorm's backward traced under torch.compile] in ``ops/rms_norm.py``).

The compiled norm's graph depends on nothing but the weight's shape and dtype, so one graph serves
every weight: a second model whose norm has a zero channel, a norm after a graph break, a compiled
function taking the weight as an input, a Parameter replaced by one with zeros, a state dict
loaded with zeros, tiny and subnormal weights, and SGD steps, all without a recompile and with
gradients within the error rule. (A guard on the weight seen while tracing got NaN gradients in
the first four: branch cllama27's review.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import slimgrad
from slimgrad.ops.rms_norm import hf_rms_norm
from slimgrad.testing import assert_within_rule

pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

BACKEND = "aot_eager_decomp_partition"  # inductor's partitioner and decompositions, no codegen
D = 17


class _Norms(torch.nn.Module):
    def __init__(self, brk: bool = False):
        super().__init__()
        self.brk = brk
        self.norms = torch.nn.ModuleList([LlamaRMSNorm(D) for _ in range(3)])

    def forward(self, x):
        for n in self.norms:
            x = n(x) * 1.5
            if self.brk:
                torch._dynamo.graph_break()
        return x


def _make(zero_at: int | None = None, brk: bool = False) -> _Norms:
    torch.manual_seed(0)
    m = _Norms(brk)
    for n in m.norms:
        torch.nn.init.normal_(n.weight)
    if zero_at is not None:
        with torch.no_grad():
            m.norms[1].weight[zero_at] = 0.0
    return m


_X = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
_DY = torch.linspace(-1, 1, _X.numel()).view(_X.shape)


def _grads(model, fn, dtype=torch.float32):
    x = _X.to(dtype).clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    fn(x).backward(_DY.to(dtype))
    return [x.grad] + [n.weight.grad for n in model.norms]


def _check(model, fn):
    # fn's gradients (model's parameters) against the same model's HF ops, float64 and float32
    ref = copy.deepcopy(model)
    for n in ref.modules():  # the converted norms' forward is HF's: run HF's class itself
        if isinstance(n, slimgrad.nn.HFRMSNorm):
            n.keep_y = False
    r64 = copy.deepcopy(ref).double()
    got = _grads(model, fn)
    assert all(torch.isfinite(g).all() for g in got)
    assert_within_rule(got, _grads(r64, r64, torch.float64), _grads(ref, ref), names=list("xabc"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_second_model_with_a_zero_weight():
    a, b = _make(), _make(zero_at=4)
    slimgrad.convert_(a)
    slimgrad.convert_(b)
    fa, fb = torch.compile(a, backend=BACKEND), torch.compile(b, backend=BACKEND)
    _check(a, fa)
    _check(b, fb)  # b may run a's graph: nothing in it depends on a's weights
    assert _graphs() == 1


def test_norms_after_graph_breaks():
    m = _make(zero_at=4, brk=True)
    slimgrad.convert_(m)
    _check(m, torch.compile(m, backend=BACKEND))


def test_weight_as_a_compiled_function_input():
    f = torch.compile(lambda x, w: hf_rms_norm(x, w, 1e-6), backend=BACKEND)
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(D, generator=g)
    w2 = w1.clone()
    w2[4] = 0.0
    for w in (w1, w2, w1, w2):
        xs, ws = _X.clone().requires_grad_(), w.clone().requires_grad_()
        f(xs, ws).backward(_DY)
        ref = []
        for dt in (torch.float32, torch.float64):
            xl, wl = _X.to(dt).clone().requires_grad_(), w.to(dt).clone().requires_grad_()
            (wl * (xl * torch.rsqrt(xl.pow(2).mean(-1, keepdim=True) + 1e-6))).backward(_DY.to(dt))
            ref.append([xl.grad, wl.grad])
        assert_within_rule([xs.grad, ws.grad], ref[1], ref[0], names=["dx", "dw"])
    assert _graphs() == 1


def test_replaced_parameter_and_loaded_state_dict_with_zeros():
    m = _make()
    slimgrad.convert_(m)
    f = torch.compile(m, backend=BACKEND)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # holds the old Parameter alive
    _check(m, f)
    w = m.norms[1].weight.detach().clone()
    w[4] = 0.0
    m.norms[1].weight = torch.nn.Parameter(w)
    _check(m, f)
    sd = copy.deepcopy(m.state_dict())
    sd["norms.2.weight"][[0, 16]] = 0.0
    sd["norms.0.weight"][3] = 1e-42  # subnormal
    m.load_state_dict(sd)
    _check(m, f)
    assert opt.param_groups[0]["params"][1] is not m.norms[1].weight


def test_sgd_steps_and_tiny_weights_do_not_recompile():
    m = _make()
    slimgrad.convert_(m)
    f = torch.compile(m, backend=BACKEND)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        f(_X.clone().requires_grad_()).square().sum().backward()
        opt.step()
        opt.zero_grad()
    frames = counters["frames"]["total"]
    for value in (0.0, 1e-42, 1e-37):
        with torch.no_grad():
            m.norms[1].weight[5] = value
        _check(m, f)
    assert counters["frames"]["total"] == frames  # no recompile for any weight value
    assert _graphs() == 1

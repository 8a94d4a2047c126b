"""``torch.utils.swap_tensors`` on a converted model's parameters and buffers after a step (NOTE
[Caches that hold no reference to a parameter] in slimgrad/_math/steps.py).

The per-parameter-version caches of the norms (LayerNorm, RMSNorm and HF RMSNorm's fallback
channels, GroupNorm's, BatchNorm's bad channels, In-Place ABN's side channels) held weak references
to the weights, 1 to 3 each after one step (eager: 0), and swap_tensors refuses a tensor with any:
``Module.to`` and ``load_state_dict`` under
``torch.__future__.set_swap_module_params_on_conversion(True)`` (what torch uses for DTensor
parameters) raised where eager runs. Each row: one step, swap_tensors on every parameter and
buffer, ``.to(float64)`` and ``load_state_dict`` with the flag set, then a step that matches
eager's after the same swaps; the storage swapped out is freed.
"""

from __future__ import annotations

import copy
import gc
import importlib
import weakref

import pytest
import torch
from torch import nn

import slimgrad

_abn = importlib.import_module("slimgrad._math.abn")
_norms = importlib.import_module("slimgrad._math.norms")
_batch_norm = importlib.import_module("slimgrad.ops.batch_norm")
_group_norm = importlib.import_module("slimgrad.ops.group_norm")


def _llama_rms_norm():
    tf = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    del tf
    return LlamaRMSNorm(16)


def _dense(norm):
    # a norm before a Linear keeps its output (and its fallback channels' inputs)
    return nn.Sequential(nn.Linear(8, 16), norm, nn.Linear(16, 4)), (6, 8)


def _conv(norm, act=None):
    layers = [nn.Conv2d(3, 8, 3), norm, act or nn.ReLU(), nn.Conv2d(8, 4, 1)]
    # 4 x 4 x 4 = 64 values per channel: above BatchNorm's few-values path (32), so its channels
    # are decided once per parameter version
    return nn.Sequential(*layers), (4, 3, 6, 6)


ROWS = {
    "LayerNorm": lambda: _dense(nn.LayerNorm(16)),
    "RMSNorm": lambda: _dense(nn.RMSNorm(16)),
    "LlamaRMSNorm": lambda: _dense(_llama_rms_norm()),
    "GroupNorm": lambda: _conv(nn.GroupNorm(2, 8)),
    "BatchNorm2d": lambda: _conv(nn.BatchNorm2d(8)),
    "InPlaceABN": lambda: _conv(nn.BatchNorm2d(8), nn.LeakyReLU(0.01)),
}
CONFIG = {"InPlaceABN": slimgrad.ConvertConfig(inplace_abn=True)}


def _step(m, x, opt):
    opt.zero_grad(set_to_none=True)
    out = m(x)
    out.square().sum().backward()
    grads = [p.grad for p in m.parameters()]
    opt.step()
    return out, grads


def _with_swap_flag(fn):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        fn()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _dead_entries() -> int:
    # cache entries whose anchored storage is gone (each drops itself as its storage dies)
    tables = (
        _norms._FB_CACHE,
        _group_norm._FB,
        _group_norm._BAD,
        _batch_norm._BAD_LAST,
        _batch_norm._BAD.entries,
        _abn._SIDE.entries,
    )
    n = 0
    for table in tables:
        for e in table.values():
            refs = e[0] if isinstance(e[0], tuple) else (e[0],)
            n += any(r is not None and r() is None for r in refs)
    return n


def _swap_each(m):
    # swap_tensors itself on every parameter and buffer, with a copy of its values
    for t in [*m.parameters(), *m.buffers()]:
        assert weakref.getweakrefcount(t) == 0
        twin = t.detach().clone()
        with torch.no_grad():
            torch.utils.swap_tensors(t, twin if type(t) is torch.Tensor else nn.Parameter(twin))


@pytest.mark.parametrize("row", list(ROWS))
def test_swap_after_a_step_as_eager(row):
    torch.manual_seed(0)
    eager, shape = ROWS[row]()
    slim = slimgrad.convert_(copy.deepcopy(eager), CONFIG.get(row))
    kinds = {type(m).__module__.split(".")[0] for m in slim.modules()}
    assert "slimgrad" in kinds, row  # the row converts something
    x = torch.randn(shape)
    models = (eager, slim)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for m, opt in zip(models, opts, strict=True):
        _step(m, x, opt)
        _step(m, x, opt)
    for m in models:
        _swap_each(m)
    # the storage swapped out is freed (the caches keep no reference to it)
    old = [weakref.ref(p.untyped_storage()) for p in slim.parameters()]
    _with_swap_flag(lambda: [m.to(torch.float64) for m in models])
    gc.collect()
    assert [r() for r in old] == [None] * len(old)
    assert _dead_entries() == 0  # the entries found from the freed storages went with them
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    _with_swap_flag(lambda: [m.load_state_dict(state) for m in models])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x64 = x.double()
    (eo, eg), (so, sg) = (_step(m, x64, opt) for m, opt in zip(models, opts, strict=True))
    assert torch.equal(so, eo)
    torch.testing.assert_close(sg, eg)
    for a, b in zip(slim.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b)
        assert a.dtype == torch.float64


@pytest.mark.parametrize("row", ["LayerNorm", "BatchNorm2d"])
def test_swapped_in_values_are_searched_again(row):
    # swapped to a weight with a zero channel (a fallback / bad channel), then replaced by a new
    # Parameter once its predecessor is freed: each forward decides from the values it is given
    torch.manual_seed(1)
    eager, shape = ROWS[row]()
    eager.double()
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(shape, dtype=torch.float64)
    for step in range(3):
        outs = []
        for m in (eager, slim):
            m.zero_grad(set_to_none=True)
            w = m[1].weight
            new = w.detach().clone()
            new[step] = 0.0
            if step < 2:
                with torch.no_grad():
                    torch.utils.swap_tensors(w, nn.Parameter(new))
            else:
                del w
                m[1].weight = nn.Parameter(new)
            out = m(x)
            out.square().sum().backward()
            outs.append((out, [p.grad for p in m.parameters()]))
        (eo, eg), (so, sg) = outs
        torch.testing.assert_close(so, eo)
        torch.testing.assert_close(sg, eg)


def test_a_fresh_alias_each_call_is_searched_again():
    # w.data made afresh each call: a new tensor (version 0) over w's memory that can take the id
    # of the last one; a write through w between two calls must be seen, as eager's op sees it
    w = nn.Parameter(torch.ones(16))
    b = nn.Parameter(torch.zeros(16))
    first = _norms.fallback_channels(w.data, b.data, torch.float32)
    with torch.no_grad():
        w[3] = 0.0
    for _ in range(3):
        assert _norms.fallback_channels(w.data, b.data, torch.float32).tolist() == [3]
    assert first.tolist() == []

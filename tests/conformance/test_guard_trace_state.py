"""Conformance: convert_'s torch.fx traces leave the model as it was (NOTE [A trace leaves the
model as it was] in slimgrad/convert_handlers/inplace_guard.py).

A trace runs the user's forward as Python on Proxies against the real module: before the fix a
dict cache filled in eval held a Proxy (the converted eval forward returned an ``_InplaceProxy``),
``self.steps += 1`` rebound a buffer to a Proxy (torch.save(state_dict) and load_state_dict
failed), appends and counters counted the traces, timm's ``attention_bias_cache`` got Proxy keys
(torch.save(model) failed) and abn's own trace advanced torch's generator. Each row compares the
converted model's state with an unconverted deepcopy's.
"""

from __future__ import annotations

import copy
import io
import random

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import untouched
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _DictCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.bias_table = nn.Parameter(torch.randn(6))
        self._cache = {}

    def forward(self, x):
        if self.training:
            b = self.bias_table * 2
        else:
            if "b" not in self._cache:
                self._cache["b"] = self.bias_table * 2
            b = self._cache["b"]
        return nn.functional.gelu(self.ln(self.fc(x))) + b


class _BufWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.register_buffer("ema", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = nn.functional.silu(self.ln(self.fc(x)))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean((0, 1)) * 0.1)
            self.steps += 1
        return h


class _Counters(nn.Module):
    # a list appended, a Python counter, a nested dict of lists, a plain tensor attribute written
    # in place with a constant (fx runs that write: no Proxy in it), a new attribute
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.seen = []
        self.calls = 0
        self.log = {"shapes": [], "n": 0}
        self.hits = torch.zeros(())

    def forward(self, x):
        self.calls += 1
        h = self.ln(self.fc(x))
        self.seen.append(h.shape[0])
        self.log["shapes"].append(h)
        self.log["n"] += 1
        self.hits += 1
        self.last = h
        return h.relu()


def _snapshot(m: nn.Module, versions: bool = True) -> list:
    # the root's attributes (its children are swapped by convert_; the report is added): each
    # value's type, the contents of lists and dicts (item types), tensors' values and version
    # counters; its buffers
    out = []
    for k, v in vars(m).items():
        if k.startswith("_slimgrad") or k == "_modules":
            continue
        row = [k, type(v).__name__]
        if isinstance(v, dict):
            row.append(sorted((str(kk), type(vv).__name__) for kk, vv in v.items()))
        elif isinstance(v, list):
            row.append([type(vv).__name__ for vv in v])
        elif isinstance(v, torch.Tensor):
            row.append((v.tolist(), v._version if versions else None))
        elif isinstance(v, (int, float, str, bool)):
            row.append(v)
        out.append(row)
    for k, b in m.named_buffers(recurse=False):
        out.append([k, type(b).__name__, b.tolist(), b._version if versions else None])
    return out


@pytest.mark.parametrize("make", [_DictCache, _BufWrite, _Counters], ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_convert_leaves_module_state(make, mode):
    torch.manual_seed(0)
    m = make().train(mode == "train")
    ref = copy.deepcopy(m)
    held = {k: v for k, v in vars(m).items() if isinstance(v, (dict, list, torch.Tensor))}
    rng = torch.random.get_rng_state()
    before = _snapshot(m)
    slimgrad.convert_(m)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert _snapshot(m) == before
    for k, v in held.items():  # the same objects, still the model's
        assert vars(m)[k] is v, k
    x = torch.randn(2, 3, 6)
    for train in (True, False, True):
        m.train(train)
        ref.train(train)
        y, r = m(x), ref(x)
        assert type(y) is torch.Tensor
        assert torch.equal(y, r)
    assert _snapshot(m, versions=False) == _snapshot(ref, versions=False)


def test_buffer_written_in_forward_saves_and_loads():
    torch.manual_seed(0)
    m = _BufWrite()
    steps = m.steps
    c = slimgrad.convert_(copy.deepcopy(m))
    slimgrad.convert_(m)
    assert m.steps is steps
    assert type(c.state_dict()["steps"]) is torch.Tensor
    torch.save(c.state_dict(), io.BytesIO())
    c.load_state_dict(_BufWrite().state_dict())
    x = torch.randn(2, 3, 6)
    for _ in range(3):
        c(x)
    assert c.steps.item() == 3


class _DrawsBnRelu(nn.Module):
    # a forward that draws a random number (the guard's trace is not used by abn then: abn traces
    # it itself) around a BatchNorm + ReLU pair
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.draws = []

    def forward(self, x):
        self.draws.append(torch.rand(()))
        return self.relu(self.bn(self.conv(x))) * (1 + 0 * random.random())


def test_inplace_abn_trace_leaves_rng_and_state():
    torch.manual_seed(0)
    random.seed(0)
    m = _DrawsBnRelu()
    rng, py = torch.random.get_rng_state(), random.getstate()
    slimgrad.convert_(m, slimgrad.ConvertConfig(inplace_abn=True))
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert random.getstate() == py
    assert m.draws == []


def test_untouched_restores_and_keeps_identity():
    m = _Counters()
    log, seen, hits = m.log, m.seen, m.hits
    with untouched(m):
        m.seen.append(1)
        m.log["shapes"].append(2)
        m.log["new"] = 3
        m.calls = 7
        m.hits += 1  # lands on the trace's copy
        m.extra = 1
        m._buffers["b"] = torch.ones(())
    assert m.seen is seen and seen == []
    assert m.log is log and log == {"shapes": [], "n": 0}
    assert m.calls == 0 and not hasattr(m, "extra") and "b" not in m._buffers
    assert m.hits is hits and hits.item() == 0 and hits._version == 0


_WRITES = {
    "add_": lambda t: t.add_(1),
    "__setitem__": lambda t: t.__setitem__(0, 5.0),
    "view": lambda t: t.view(-1).mul_(2),
    "out=": lambda t: torch.add(t, 1, out=t),
    "torch.ops": lambda t: torch.ops.aten.add_.Tensor(t, 1),
    "inplace=True": lambda t: nn.functional.relu(t, inplace=True),
    ".data=": lambda t: setattr(t, "data", t * 2),
}


@pytest.mark.parametrize("write", list(_WRITES))
def test_untouched_refuses_an_unrecorded_parameter_write(write):
    # a write fx would run (not record) on a parameter reached through a list is refused before
    # it runs: the weight keeps its values and its version
    m = nn.Linear(2, 2)
    m.held = [m.weight]
    w, v = m.weight.clone(), m.weight._version
    with pytest.raises(RuntimeError, match="would run '.*' on a tensor the model holds"):
        with untouched(m), torch.no_grad():
            _WRITES[write](m.held[0])
    assert torch.equal(m.weight, w) and m.weight._version == v


# the smallest configuration of each model that keeps one module of each class with an
# ``attention_bias_cache`` the default configuration has (efficientformerv2_s0: Attention2d and
# Attention2dDownsample; levit: Attention and AttentionDownsample); the input size it takes
_TIMM_CACHED = [
    ("levit_128s", {"depth": (1, 1, 1), "img_size": 64}, 64),
    ("efficientvit_m0", {"depth": [1, 1, 1], "img_size": 64}, 64),
    ("efficientformer_l1", {"depths": (1, 1, 1, 1)}, 224),
    ("efficientformerv2_s0", {"depths": (1, 1, 1, 1), "num_vit": 1}, 224),
    ("tiny_vit_5m_224", {"depths": (1, 1, 1, 1)}, 224),
]


@pytest.mark.parametrize("name,kw,size", _TIMM_CACHED, ids=[n for n, _, _ in _TIMM_CACHED])
def test_timm_attention_bias_cache_stays_empty(name, kw, size):
    from tests.conformance._timm_shim import timm

    if timm is None:
        pytest.skip("timm is not installed")
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, num_classes=5, **kw)
    ref = copy.deepcopy(m)
    slimgrad.convert_(m)
    caches = [
        (n, dict(d.attention_bias_cache))
        for n, d in m.named_modules()
        if hasattr(d, "attention_bias_cache")
    ]
    assert caches, name
    want = {
        n: dict(d.attention_bias_cache)
        for n, d in ref.named_modules()
        if hasattr(d, "attention_bias_cache")
    }
    assert all(c == want[n] for n, c in caches), [n for n, c in caches if c]
    torch.save(m, io.BytesIO())
    m.eval()
    ref.eval()
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        y, r = m(x), ref(x)
    assert type(y) is torch.Tensor
    assert torch.equal(y, r)


@pytest.mark.parametrize("make", [_DictCache, _BufWrite, _Counters], ids=lambda c: c.__name__)
def test_verify_after_convert(make):
    torch.manual_seed(0)
    m = make()
    c = slimgrad.convert_(copy.deepcopy(m))
    r = slimgrad.verify(m, c, torch.randn(2, 3, 6))
    assert r.ok, str(r)

"""An output kept on the module escapes in any container or object (NOTE [An output kept on the
module escapes]); a tensor's metadata kept there is no escape (review27e).

A LayerNorm output kept in an OrderedDict, a deque, a defaultdict, a SimpleNamespace or a plain
object on the module, written through ``.data`` after forward, gave gradients off by 0.7-1.2
(the walk opened plain dicts, lists, sets and tuples only); a SiLU output whose ``shape``,
``size(0)``, ``shape[-1]``, ``dtype`` or ``numel()`` was kept lost its saving.
"""

import collections
import copy
import types

import pytest
import torch
import torch.nn as nn

import slimgrad


class _Holder:
    pass


_HOW = ("ordereddict", "deque", "namespace", "object", "defaultdict", "dict")


class _Keeps(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(6, 6)
        self.op = nn.LayerNorm(6)
        self.od = collections.OrderedDict()
        self.dq = collections.deque(maxlen=4)
        self.ns = types.SimpleNamespace()
        self.obj = _Holder()
        self.dd = collections.defaultdict(list)
        self.d = {}

    def forward(self, x):
        h = self.op(self.fc(x))
        if self.how == "ordereddict":
            self.od["h"] = h
        elif self.how == "deque":
            self.dq.append(h)
        elif self.how == "namespace":
            self.ns.h = h
        elif self.how == "object":
            self.obj.h = h
        elif self.how == "defaultdict":
            self.dd["h"].append(h)
        else:
            self.d["h"] = h
        return x + h

    def kept(self):
        return {
            "ordereddict": lambda: self.od["h"],
            "deque": lambda: self.dq[-1],
            "namespace": lambda: self.ns.h,
            "object": lambda: self.obj.h,
            "defaultdict": lambda: self.dd["h"][-1],
            "dict": lambda: self.d["h"],
        }[self.how]()


@pytest.mark.parametrize("how", _HOW)
def test_an_output_kept_in_any_container_trains_as_eager(how):
    torch.manual_seed(0)
    base = nn.Sequential(_Keeps(how), nn.Tanh())
    x = torch.randn(4, 6)
    conv = copy.deepcopy(base)
    slimgrad.convert_(conv)
    grads = []
    for m in (base, conv):
        xi = x.clone().requires_grad_()
        loss = m(xi).pow(3).sum()
        m[0].kept().data.mul_(0.5)  # a write autograd cannot see
        loss.backward()
        grads.append([xi.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


_META = {
    "shape": lambda h: h.shape,
    "size0": lambda h: h.size(0),
    "shape_last": lambda h: h.shape[-1],
    "dtype": lambda h: h.dtype,
    "numel": lambda h: h.numel(),
    "h": lambda h: h,
}


class _Meta(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.act = nn.SiLU()
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        h = self.act(self.ln(self.fc(x)))
        self.m = _META[self.k](h)
        return self.fc2(h) + x


@pytest.mark.parametrize("k", list(_META))
def test_metadata_kept_on_the_module_keeps_the_saving(k):
    m = nn.Sequential(_Meta(k))
    slimgrad.convert_(m)
    rows = [r[:2] for r in slimgrad.report(m).eager_op]
    assert rows == ([("0.act", "SiLU")] if k == "h" else []), rows

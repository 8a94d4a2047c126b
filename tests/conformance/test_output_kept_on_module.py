"""Conformance: an output kept on a module past its forward, then written (issue 30, crashes30).

A block keeps an intermediate output on a module (``self.last = h`` for probing, ``setattr``,
``self.feats.append(h)``, ``self.cache[k] = h``, on a child, or a child keeping what it is given)
while only a residual add reads it. The user then writes the kept tensor after the loss was
built: through ``.data`` (no version bump) or under ``no_grad``. Eager keeps the op's input and
trains; before this change the converted op kept its output and computed wrong gradients
silently (``.data``) or raised (``no_grad``). NOTE [An output kept on the module escapes] in
convert_handlers/inplace_guard.py: the op now runs eager's op there (the report says why); the
same block without the store keeps its saving. Hardswish and ELU name themselves in that error
(GUIDE form) as the other output-keeping ops do.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.nn import _output_act
from slimgrad.nn._output_act import KEPT_ON_MODULE
from tests._readings import convert_and_read_afresh
from tests._threads import one_thread

OPS = {
    "SiLU": nn.SiLU,
    "GELU": nn.GELU,
    "Mish": nn.Mish,
    "Hardswish": nn.Hardswish,
    "ELU": nn.ELU,
    "LeakyReLU": nn.LeakyReLU,
    "LayerNorm": lambda: nn.LayerNorm(6),
    "RMSNorm": lambda: nn.RMSNorm(6),
    "GroupNorm": lambda: nn.GroupNorm(2, 6),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class _Keeper(nn.Module):
    # keeps what it is given on itself and returns a new tensor
    def forward(self, t):
        self.last = t
        return t * 2


class _Blk(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        gn = op == "GroupNorm"  # (N, C, L) for GroupNorm, (N, L, C) otherwise
        self.fc = nn.Conv1d(6, 6, 1) if gn else nn.Linear(6, 6)
        self.op = OPS[op]()
        self.probe = nn.Identity()
        self.keeper = _Keeper()
        self.last, self.feats, self.cache = None, [], {}


# one class per way of keeping h: traced by torch.fx, and read from source (``x.dim()`` is a Proxy
# in a trace: ``if`` on it cannot be traced)
class _Attr(_Blk):
    def forward(self, x):
        h = self.op(self.fc(x))
        self.last = h
        return x + h


class _Setattr(_Blk):
    def forward(self, x):
        h = self.op(self.fc(x))
        setattr(self, "last", h)  # noqa: B010 (the spelling under test)
        return x + h


class _Append(_Blk):
    def forward(self, x):
        h = self.op(self.fc(x))
        self.feats.append(h)
        return x + h


class _Item(_Blk):
    def forward(self, x):
        h = self.op(self.fc(x))
        self.cache["h"] = h
        return x + h


class _Child(_Blk):
    def forward(self, x):
        h = self.op(self.fc(x))
        self.probe.last = h
        return x + h


class _ChildKeeps(_Blk):
    def forward(self, x):
        h = self.op(self.fc(x))
        k = self.keeper(h)
        return x + h + 0 * k


class _AttrRead(_Blk):
    def forward(self, x):
        if x.dim() > 0:
            h = self.op(self.fc(x))
            self.last = h
        return x + h


class _SetattrRead(_Blk):
    def forward(self, x):
        if x.dim() > 0:
            h = self.op(self.fc(x))
            setattr(self, "last", h)  # noqa: B010 (the spelling under test)
        return x + h


class _AppendRead(_Blk):
    def forward(self, x):
        if x.dim() > 0:
            h = self.op(self.fc(x))
            self.feats.append(h)
        return x + h


class _ItemRead(_Blk):
    def forward(self, x):
        if x.dim() > 0:
            h = self.op(self.fc(x))
            self.cache["h"] = h
        return x + h


class _ChildRead(_Blk):
    def forward(self, x):
        if x.dim() > 0:
            h = self.op(self.fc(x))
            self.probe.last = h
        return x + h


class _ChildKeepsRead(_Blk):
    def forward(self, x):
        if x.dim() > 0:
            h = self.op(self.fc(x))
            k = self.keeper(h)
        return x + h + 0 * k


class _AttrLinear(_Blk):  # a Linear keeps h too: the converted op keeps y, shared with it
    def __init__(self, op: str) -> None:
        super().__init__(op)
        self.fc2 = nn.Conv1d(6, 6, 1) if op == "GroupNorm" else nn.Linear(6, 6)

    def forward(self, x):
        h = self.op(self.fc(x))
        self.last = h
        return x + self.fc2(h)


class _NoStoreLinear(_AttrLinear):  # the control: nothing kept, the op keeps its saving
    def forward(self, x):
        h = self.op(self.fc(x))
        return x + self.fc2(h)


STORES = {
    "attr": (_Attr, lambda b: b.last),
    "setattr": (_Setattr, lambda b: b.last),
    "append": (_Append, lambda b: b.feats[-1]),
    "item": (_Item, lambda b: b.cache["h"]),
    "child": (_Child, lambda b: b.probe.last),
    "child_keeps_input": (_ChildKeeps, lambda b: b.keeper.last),
    "attr/read": (_AttrRead, lambda b: b.last),
    "setattr/read": (_SetattrRead, lambda b: b.last),
    "append/read": (_AppendRead, lambda b: b.feats[-1]),
    "item/read": (_ItemRead, lambda b: b.cache["h"]),
    "child/read": (_ChildRead, lambda b: b.probe.last),
    "child_keeps_input/read": (_ChildKeepsRead, lambda b: b.keeper.last),
}


def _x(op: str) -> torch.Tensor:
    torch.manual_seed(1)  # 792 elements: above the few-elements threshold (the ops keep y)
    return torch.randn(4, 6, 33) if op == "GroupNorm" else torch.randn(4, 33, 6)


def _grads(model: nn.Module, kept, x: torch.Tensor, write: str):
    xi = x.clone().requires_grad_()
    loss = model(xi).pow(2).sum()
    if write == "data":
        kept(model[0]).data.mul_(0.5)
    else:
        with torch.no_grad():
            kept(model[0]).mul_(0.5)
    loss.backward()
    return [xi.grad, *(p.grad for p in model.parameters())]


# (op, store): of the 108 (every op x every store), the rows that together run every coverage arc
# (branch arcs of src/slimgrad and this file) any of them runs, with every op and every store kept
KEPT_ROWS = [
    ("SiLU", "attr"),
    ("SiLU", "attr/read"),
    ("SiLU", "append/read"),
    ("GELU", "attr/read"),
    ("Mish", "child/read"),
    ("Hardswish", "child_keeps_input"),
    ("ELU", "append"),
    ("ELU", "setattr/read"),
    ("LeakyReLU", "setattr"),
    ("LeakyReLU", "item"),
    ("LayerNorm", "item/read"),
    ("RMSNorm", "append/read"),
    ("GroupNorm", "child"),
    ("GroupNorm", "child_keeps_input/read"),
]


@pytest.mark.parametrize("op,store", KEPT_ROWS)
def test_output_kept_on_module_then_written_trains_as_eager(op, store):
    cls, kept = STORES[store]
    torch.manual_seed(0)
    base = nn.Sequential(cls(op), nn.Tanh())  # the block below the root
    x = _x(op)
    for write in ("data", "nograd"):
        eager = _grads(copy.deepcopy(base), kept, x, write)
        conv = copy.deepcopy(base)
        slimgrad.convert_(conv)
        assert isinstance(conv[0].op, slimgrad.nn.__dict__[op])  # converted, running eager's op
        got = _grads(conv, kept, x, write)
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op", ["SiLU", "LayerNorm", "GroupNorm"])
def test_output_kept_on_module_report_and_control(op):
    conv = nn.Sequential(_AttrLinear(op), nn.Tanh())
    rep = convert_and_read_afresh(conv)  # (the reading afresh: the same rows)
    assert conv[0].op.__dict__.get("keep_y") is False
    assert ("0.op", op, KEPT_ON_MODULE) in rep.eager_op
    ctl = nn.Sequential(_NoStoreLinear(op), nn.Tanh())
    rep = convert_and_read_afresh(ctl)
    # nothing kept on a module: the saving stays (for fc2, a Linear, where y is viewed as a matrix:
    # NOTE [A Linear keeps y itself only where y is viewed as a matrix])
    assert ctl[0].op.__dict__.get("keep_y", True) in (True, _output_act._FLAT)
    assert not rep.eager_op


@pytest.mark.parametrize(
    "name, fn",
    [
        ("hardswish", lambda x: slimgrad.ops.hardswish(x)),
        ("elu", lambda x: slimgrad.ops.elu(x)),
        ("elu", lambda x: slimgrad.ops.elu(x, alpha=-0.5)),
        ("elu", lambda x: slimgrad.ops.elu(x, alpha=0.0)),
    ],
)
def test_output_written_after_forward_error_in_slimgrad_form(name, fn):
    # a non-leaf input: on a leaf that requires grad the op keeps x, as eager (NOTE [An input the
    # graph holds] in slimgrad/ops/_output_act.py), and a write over y is no error there
    x = torch.randn(4, 33, 6, requires_grad=True) * 1
    y = fn(x)
    loss = (y * 2).sum()  # (keeps nothing of y)
    with torch.no_grad():
        y.mul_(0.5)
    with pytest.raises(RuntimeError, match=rf"^slimgrad\.ops\.{name}: .*keeps its output"):
        loss.backward()

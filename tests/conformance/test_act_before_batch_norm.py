"""An activation before a BatchNorm keeps y, which the BatchNorm keeps anyway (NOTE [An activation
before a BatchNorm is the table's] in convert_handlers/cnn.py, NOTE [A BatchNorm consumer keeps y]
in nn/_output_act.py; issue 30, misc30).

``Sequential(conv, Hardswish, bn)`` converted its Hardswish to ``HardswishAfterNorm``, which never
sees a BatchNorm output there and ran eager's op: 9,536 B saved, eager's. The table's module had
``keep_y`` off too, a BatchNorm counting as a consumer that keeps nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure

# {name: (class, its Function's node)}
_ACTS = {
    "Hardswish": (nn.Hardswish, "_HardswishFnBackward"),
    "SiLU": (nn.SiLU, "_SiluFnBackward"),
    "ELU": (nn.ELU, "_EluFnBackward"),
}


def _run(m, x):
    r = measure(lambda: m(x).square().sum(), timeline=False)
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    m(xi).square().sum().backward()
    return r, [xi.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize(
    ("act", "mode"),
    [("Hardswish", "train"), ("Hardswish", "eval"), ("SiLU", "train"), ("ELU", "eval")],
)
def test_act_before_batch_norm_keeps_y_below_eager(act, mode):
    torch.manual_seed(1)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), _ACTS[act][0](), nn.BatchNorm2d(4))
    slim = slimgrad.convert_(copy.deepcopy(eager))
    assert type(slim[1]).__module__ == f"slimgrad.nn.{act.lower()}"  # the table's, not *AfterNorm
    assert slim[1].keep_y
    for m in (eager, slim):
        getattr(m, mode)()
    x = torch.randn(2, 3, 13, 11)
    (re, ge), (rs, gs) = _run(eager, x), _run(slim, x)
    x_bytes = 2 * 4 * 11 * 9 * 4  # the conv's output, which eager's activation keeps
    side = rs.by_node[_ACTS[act][1]]  # y is the BatchNorm's: only the side information
    assert side < x_bytes // 8
    assert rs.saved_bytes == re.saved_bytes - x_bytes + side
    assert rs.peak_bytes <= re.peak_bytes
    for a, b in zip(ge, gs, strict=True):
        torch.testing.assert_close(b, a)


def test_act_after_batch_norm_is_still_claimed():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Identity(), nn.Hardswish())
    slimgrad.convert_(m)
    assert type(m[3]).__name__ == "HardswishAfterNorm"

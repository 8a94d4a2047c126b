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
    return measure(lambda: m(x).square().sum(), timeline=False)


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
    re, rs = _run(eager, x), _run(slim, x)
    x_bytes = 2 * 4 * 11 * 9 * 4  # the conv's output, which eager's activation keeps
    side = rs.by_node[_ACTS[act][1]]  # y is the BatchNorm's: only the side information
    assert side < x_bytes // 8
    assert rs.saved_bytes == re.saved_bytes - x_bytes + side
    assert rs.peak_bytes <= re.peak_bytes
    _same_grads(eager, slim, mode)


def test_act_after_batch_norm_is_still_claimed():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Identity(), nn.Hardswish())
    slimgrad.convert_(m)
    assert type(m[3]).__name__ == "HardswishAfterNorm"


_X_BYTES = 2 * 4 * 11 * 9 * 4  # one conv output of _run's input, float32


def _pair(eager, mode, seed=1):
    slim = slimgrad.convert_(copy.deepcopy(eager))
    for m in (eager, slim):
        getattr(m, mode)()
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 13, 11)
    return slim, _run(eager, x), _run(slim, x)


def _same_grads(eager, slim, mode, seed=1):
    # every gradient (the input's, every parameter's) within the error rule of eager's float64
    # result, with the second look where sums cancel (slimgrad.verify; NOTE [Gradients that
    # cancel]): an elementwise tolerance against eager's float32 bits failed a right conversion
    # on an AVX-512 CPU (one conv bias gradient 2.9e-5 off the float64 value, eager 8.5e-6)
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 13, 11)
    rep = slimgrad.verify(eager, slim, x, loss_fn=_weighted_sum, modes=(mode,), inference=False)
    assert rep.ok, str(rep)


def _weighted_sum(out):
    # fixed random weights: a loss whose gradients do not cancel through a training BatchNorm
    # (out.square().sum() after one is nearly constant: a 0.3% error upstream passed the rule)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return (out * w.to(out.dtype)).sum()


def test_act_before_a_claimed_batch_norm_keeps_x_in_training():
    # NOTE [Keep y only where the producer does not keep x]: the BatchNorm's output goes to a
    # SiLUAfterNorm, so in training it keeps that output, not its input: the first SiLU's y was
    # kept by nobody else (6,870 B where eager's op keeps 6,784 at 2x8x7x5)
    torch.manual_seed(1)
    conv = lambda: nn.Conv2d(4, 4, 1)  # noqa: E731
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SiLU(), nn.BatchNorm2d(4), nn.SiLU(), conv())
    slim, re, rs = _pair(eager, "train")
    assert type(slim[3]).__name__ == "SiLUAfterNorm"
    # the first SiLU keeps x (eager's op); the block keeps b once, for the norm and the conv
    assert "SiluBackward0" in rs.by_node and "_SiluFnBackward" not in rs.by_node
    assert rs.saved_bytes == re.saved_bytes - 2 * _X_BYTES
    assert rs.peak_bytes <= re.peak_bytes
    _same_grads(eager, slim, "train")


def test_act_before_a_batch_norm_that_keeps_nothing_keeps_x():
    # eval with a frozen affine: slimgrad's BatchNorm keeps nothing full-size, so the Hardswish's
    # y + side information was kept for nobody (6,814 B vs eager's op 6,720 at 2x8x7x5); read per
    # call from the BatchNorm's mode and gamma's requires_grad
    torch.manual_seed(1)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Hardswish(), nn.BatchNorm2d(4, affine=False))
    slim, re, rs = _pair(eager, "eval")
    assert rs.saved_bytes == re.saved_bytes - _X_BYTES  # the norm's x: eager's only extra
    assert "_HardswishFnBackward" not in rs.by_node
    _same_grads(eager, slim, "eval")
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Hardswish(), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1))
    slim, _, rs = _pair(eager, "eval")
    assert "_HardswishFnBackward" in rs.by_node  # gamma trains: the norm keeps y
    for m in (eager, slim):
        m[2].requires_grad_(False)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 13, 11)
    re, rs = _run(eager, x), _run(slim, x)
    assert rs.saved_bytes == re.saved_bytes - _X_BYTES
    assert "_HardswishFnBackward" not in rs.by_node
    _same_grads(eager, slim, "eval")


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_act_after_batch_norm_and_dropout_is_claimed(p):
    # _may_follow_bn steps over a Dropout: Sequential(conv, bn, Dropout(0), relu, conv) kept
    # eager's 6,784 B (BN input and ReLU output) at 2x8x7x5; with p > 0 in training the
    # ReLUAfterNorm sees a dropped tensor and runs eager's op
    torch.manual_seed(1)
    eager = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(p), nn.ReLU(), nn.Conv2d(4, 4, 1)
    )
    slim = slimgrad.convert_(copy.deepcopy(eager))
    assert type(slim[3]).__name__ == "ReLUAfterNorm"
    if p == 0:
        x = torch.randn(2, 3, 13, 11)
        re, rs = _run(eager, x), _run(slim, x)
        assert rs.saved_bytes == re.saved_bytes - _X_BYTES  # BN -> ReLU keeps one tensor
        assert rs.peak_bytes <= re.peak_bytes
    _same_grads(eager, slim, "train")  # verify draws one dropout mask for every side

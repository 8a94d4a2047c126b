"""verify's input gradients and its forwards without autograd (torch.no_grad, inference_mode).

Each stand-in below is a "converted" model wrong in one way only: its loss, parameter gradients
and grad-mode outputs are right, so a verify without these checks said OK.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad
from tests._verify_helpers import scale_grad


class _Net(nn.Module):
    """lin2(gelu(lin1(x))); ``wrong_dx`` puts a 0.1% error on dx only (no parameter sees it)."""

    def __init__(self, wrong_dx=False):
        super().__init__()
        self.lin1, self.lin2, self.wrong_dx = nn.Linear(5, 7), nn.Linear(7, 3), wrong_dx

    def forward(self, x, labels=None):
        h = scale_grad(x, 1.001) if self.wrong_dx else x  # a wrong input gradient, 0.1% off
        y = self.lin2(F.gelu(self.lin1(h)))
        return y if labels is None else F.cross_entropy(y, labels)


def _pair(**wrong):
    torch.manual_seed(0)
    m = _Net()
    bad = _Net(**wrong)
    bad.load_state_dict(m.state_dict())
    return m, bad


def test_a_wrong_input_gradient_fails():
    m, bad = _pair(wrong_dx=True)
    x = torch.randn(4, 5)
    rep = slimgrad.verify(m, bad, x, modes=("train",))
    assert rep.loss_ok and all(g.ok for g in rep.grads)  # loss and parameters are right
    assert all(o.ok for o in rep.runs[0].outputs)
    assert not rep.ok
    assert [(g.name, g.ok) for g in rep.runs[0].input_grads] == [("input", False)]
    assert "input: err" in str(rep)
    assert "input gradients: input, the rule against float64" in str(rep)


def test_input_gradients_are_named_by_position_and_keyword():
    m, bad = _pair(wrong_dx=True)
    x, labels = torch.randn(4, 5), torch.tensor([0, 2, 1, 0])
    rep = slimgrad.verify(m, bad, (x, labels), modes=("eval",))
    # the integer labels are left alone: no gradient, nothing compared
    assert [(g.name, g.ok) for g in rep.runs[0].input_grads] == [("input[0]", False)]
    rep = slimgrad.verify(m, bad, {"x": x, "labels": labels}, modes=("eval",))
    assert [(g.name, g.ok) for g in rep.runs[0].input_grads] == [("input.x", False)]
    rep = slimgrad.verify(m, copy.deepcopy(m), {"x": x, "labels": labels})
    assert rep.ok, str(rep)
    # NOTE [Which runs take input gradients]: the first run (train) steps on the inputs as given
    assert [(r.name, [g.name for g in r.input_grads]) for r in rep.runs] == [
        ("inputs (train)", []),
        ("inputs (eval)", ["input.x"]),
    ]


def test_an_input_that_requires_grad_is_compared_and_left_alone():
    m, bad = _pair(wrong_dx=True)
    x = torch.randn(4, 5, requires_grad=True)
    assert not slimgrad.verify(m, bad, x, modes=("train",)).ok
    rep = slimgrad.verify(m, copy.deepcopy(m), x)
    assert rep.ok, str(rep)
    assert x.grad is None  # the caller's tensor is never handed to a side


def test_a_model_may_still_write_over_its_input():
    # each side's input is a clone of a leaf that requires grad, not the leaf: an in-place write
    # over it works as it did when the input needed no grad
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x)

    torch.manual_seed(0)
    m = Writes()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(4, 5))
    assert rep.ok, str(rep)
    assert rep.runs[-1].input_grads[0].ok


class _NoGradShift(nn.Module):
    """Right with autograd on; without it (``when``: "no_grad" or "inference_mode") off by 1e-3."""

    def __init__(self, when=None):
        super().__init__()
        self.lin, self.when = nn.Linear(5, 3), when

    def forward(self, x):
        y = self.lin(x)
        if self.when == "no_grad" and not torch.is_grad_enabled():
            return y + 1e-3
        if self.when == "inference_mode" and torch.is_inference_mode_enabled():
            return y + 1e-3
        return y


@pytest.mark.parametrize("when", ["no_grad", "inference_mode"])
def test_a_wrong_output_without_autograd_fails(when):
    torch.manual_seed(0)
    m = _NoGradShift()
    bad = _NoGradShift(when)
    bad.load_state_dict(m.state_dict())
    x = torch.randn(4, 5)
    rep = slimgrad.verify(m, bad, x)
    assert rep.loss_ok and all(g.ok for r in rep.runs for g in r.grads + r.input_grads)
    assert all(o.ok for r in rep.runs for o in r.outputs)
    assert not rep.ok
    wrong = {"no_grad": ["no_grad: output", "inference_mode: output"]}.get(
        when, ["inference_mode: output"]
    )
    for r in rep.runs:  # train and eval
        assert [o.name for o in r.inference if not o.ok] == wrong, str(rep)
    assert f"output {wrong[0]}: err" in str(rep)
    assert slimgrad.verify(m, bad, x, inference=False).ok
    assert "without autograd: not run (inference=False)" in str(
        slimgrad.verify(m, bad, x, inference=False)
    )


class _AutocastNoGrad(nn.Module):
    """Under autocast without autograd, runs its linear in float32 (as ops/conv.py's no-graph
    path did): more accurate than eager's bfloat16, but not what eager returns."""

    def __init__(self, wrong=False):
        super().__init__()
        self.lin, self.wrong = nn.Linear(5, 3), wrong

    def forward(self, x):
        if self.wrong and not torch.is_grad_enabled():
            with torch.autocast("cpu", enabled=False):
                return F.linear(x.float(), self.lin.weight.float(), self.lin.bias.float())
        return self.lin(x)


def test_a_wrong_dtype_under_no_grad_autocast_fails():
    torch.manual_seed(0)
    m = _AutocastNoGrad()
    bad = _AutocastNoGrad(wrong=True)
    bad.load_state_dict(m.state_dict())
    x = torch.randn(4, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert slimgrad.verify(m, copy.deepcopy(m), x).ok
        rep = slimgrad.verify(m, bad, x)
    assert rep.loss_ok and all(o.ok for r in rep.runs for o in r.outputs)
    assert not rep.ok
    for ctx in ("no_grad", "inference_mode"):
        msg = (
            f"slimgrad.verify: output 'output' under torch.{ctx}() has the wrong dtype; "
            "expected torch.bfloat16 (eager's), got torch.float32."
        )
        assert msg in str(rep)


def test_a_wrong_dtype_with_autograd_fails():
    class Upcasts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            return self.lin(x).double()

    torch.manual_seed(0)
    m = _Plain()
    bad = Upcasts()
    bad.load_state_dict(m.state_dict())
    rep = slimgrad.verify(m, bad, torch.randn(4, 5), modes=("train",), inference=False)
    assert not rep.ok
    assert "output 'output' has the wrong dtype; expected torch.float32 (eager's), got" in str(rep)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x)


def test_a_converted_model_that_raises_without_autograd_fails():
    class Refuses(_Plain):
        def forward(self, x):
            if torch.is_inference_mode_enabled():
                raise RuntimeError("no inference mode here")
            return super().forward(x)

    torch.manual_seed(0)
    m = _Plain()
    bad = Refuses()
    bad.load_state_dict(m.state_dict())
    rep = slimgrad.verify(m, bad, torch.randn(4, 5), modes=("eval",))
    assert not rep.ok
    assert "the converted model raised under torch.inference_mode(); expected it to run" in (
        str(rep)
    )


def test_dropout_and_batchnorm_models_pass_and_keep_the_steps_buffers():
    # train mode: the forwards without autograd draw the step's dropout masks (same seed) and
    # start from the step's buffers; their running-statistics updates are undone
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Dropout(0.4), nn.Linear(6, 3))
    x = torch.randn(8, 5)
    rep = slimgrad.verify(m, copy.deepcopy(m), x)
    assert rep.ok, str(rep)
    assert [len(r.inference) for r in rep.runs] == [2, 2]
    # the eval run starts from the train step's running statistics, whether or not the forwards
    # without autograd ran in between (verify leaves the models themselves as they were)
    plain = slimgrad.verify(m, copy.deepcopy(m), x, inference=False)
    for r, p in zip(rep.runs, plain.runs):
        assert (r.loss_eager, r.loss_converted) == (p.loss_eager, p.loss_converted), r.name
    conv = slimgrad.convert_(copy.deepcopy(m))
    rep = slimgrad.verify(m, conv, x)
    assert rep.ok, str(rep)


def test_the_first_run_steps_on_the_inputs_as_given():
    # NOTE [Which runs take input gradients]: an input that needs no gradient (an image batch) is
    # stepped as such in the first run, so the path where the first layer computes no dx is the one
    # verified there; the later runs compare input gradients
    seen = []

    class Records(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            seen.append(x.requires_grad)
            return self.lin(x)

    torch.manual_seed(0)
    m = Records()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(4, 5), inference=False)
    assert rep.ok, str(rep)
    # train: eager, converted, float64 reference as given; eval: the three with input leaves
    assert seen == [False] * 3 + [True] * 3
    seen.clear()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(4, 5, requires_grad=True))
    assert [len(r.input_grads) for r in rep.runs] == [1, 1]

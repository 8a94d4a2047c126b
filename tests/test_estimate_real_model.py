"""``slimgrad.memory.estimate`` of a model whose constructor reads tensor values (NOTE [A model
built outside the estimate] in slimgrad/memory.py): timm's RegNet cannot be built under fake
tensors (``torch.unique`` of its widths); the error says so and names the way out, and a model built
before the estimate on real tensors gives the real step's figures and keeps its parameters'
gradients and buffers as they were."""

from __future__ import annotations

import pytest
import torch

from slimgrad.bench.cases.models import slim_copy
from slimgrad.bench.models import WithLoss
from slimgrad.memory import estimate, measure
from tests._threads import one_thread_each_test  # noqa: F401 (an autouse fixture)
from tests.conformance._timm_shim import timm


def _regnet(side):
    # the bench case timm_regnety_016's small model (regnety_002 at 2x3x32x32, its 1,000-class
    # head, cross-entropy), its last stage one block instead of seven (depth 7 of 13: the same
    # block, stem and head types, a third of the parameters); the constructor reads its widths'
    # values whatever the depth
    torch.manual_seed(0)
    eager = WithLoss(timm.create_model("regnety_002", pretrained=False, depth=7).train())

    def make_inputs():
        return torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2,))

    return (slim_copy(eager) if side == "slimgrad" else eager), make_inputs


def test_a_build_that_reads_values_gets_an_error_naming_the_way_out():
    def make():
        model, make_inputs = _regnet("eager")
        x, y = make_inputs()
        return (lambda: model(x, y)), model

    with pytest.raises(NotImplementedError) as err:
        estimate(make, timeline=False)
    msg = str(err.value)
    assert msg.startswith("slimgrad.memory.estimate: make_forward reads tensor values while it ")
    assert "_unique2" in msg and "Build the model before estimate, on real tensors" in msg


@pytest.mark.parametrize("side", ["eager", "slimgrad"])
def test_a_model_built_outside_gives_the_real_step(side):
    model, make_inputs = _regnet(side)
    grads = {n: None for n, _ in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    def make():
        torch.manual_seed(1)
        x, y = make_inputs()
        return (lambda: model(x, y)), model

    est = estimate(make, timeline=False)
    assert {n: p.grad for n, p in model.named_parameters()} == grads
    for n, b in model.named_buffers():
        assert type(b) is torch.Tensor and torch.equal(b, buffers[n]), n
    forward, module = make()
    real = measure(forward, module=module, timeline=False)
    assert (est.peak_bytes, est.saved_bytes, est.saved_param_bytes) == (
        real.peak_bytes,
        real.saved_bytes,
        real.saved_param_bytes,
    )


def test_the_real_gradients_stay_as_they_were():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    lin(torch.randn(2, 4)).sum().backward()
    lin.weight.grad = None  # a gradient to make, and one to add to
    bias_grad = lin.bias.grad.clone()

    def make():
        x = torch.randn(5, 4)
        return (lambda: lin(x).square().sum()), lin

    estimate(make, timeline=False)
    assert lin.weight.grad is None
    assert type(lin.bias.grad) is torch.Tensor and torch.equal(lin.bias.grad, bias_grad)


def test_gradients_accumulated_into_are_modelled():
    # a parameter that holds a .grad is added to in place by the real step; before, its fake
    # stand-in had none, so the estimate made new gradients (end 132,352 B where the step ends 0)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    m(x).sum().backward()
    m(x).sum().backward()  # warm: the step measured below is a steady one

    def make():
        return (lambda: m(x).sum()), m

    est = estimate(make, timeline=False)
    real = measure(lambda: m(x).sum(), module=m, timeline=False)
    assert est.end_bytes == real.end_bytes == 0
    assert est.peak_bytes == real.peak_bytes


def test_parameters_with_hooks_are_refused_before_any_change():
    lin = torch.nn.Linear(4, 3)
    lin.weight.register_post_accumulate_grad_hook(lambda p: None)

    def make():
        return (lambda: lin(torch.randn(2, 4)).sum()), lin

    w = lin.weight
    with pytest.raises(ValueError, match="without tensor hooks, got 'weight' with hooks"):
        estimate(make, timeline=False)
    assert lin.weight is w and lin.weight.grad is None

"""BatchNorm from its output (x̂ rebuilt as (b - β)/γ) against the error rule, through the
conv before it: NOTE [dx from the output] in slimgrad/ops/batch_norm.py.

The block is tests/ops/test_derived_rebuild.py's Conv-BN-SiLU-SE-Conv-BN (float32, 3x3x11x9 inputs;
the first BatchNorm keeps its output). Computing dx through aten's kernel with invstd' = 1/γ
rounded to float32 put the first conv's weight gradient outside the rule on 11 of 200 seeds (one
thread) and its error above eager's on average; a BatchNorm backward computed in float64 from x
itself fails the same rule on 4 of those seeds (eager's float32 error is sometimes far below its
typical size), so the rule is checked per seed where it is met and on average over a sweep.
"""

from __future__ import annotations

import copy

import pytest
import torch

from slimgrad.convert_handlers.cnn import convert_cnn_
from slimgrad.testing import assert_within_rule, max_abs_err, rule_ok
from tests._threads import one_thread
from tests.ops.test_derived_rebuild import _block, _grads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():  # the seeds below were found with one thread (the sums' association)
        yield


@pytest.fixture(scope="module")
def models():
    eager = _block(lambda x, g: x * g)
    slim = convert_cnn_(copy.deepcopy(eager))
    return eager, slim, copy.deepcopy(eager).double()


def _run(models, seed, shape=(3, 3, 11, 9)):
    eager, slim, ref = models
    torch.manual_seed(1000 + seed)
    x = torch.randn(*shape)
    return _grads(slim, x), _grads(ref, x.double()), _grads(eager, x)


def test_first_bn_keeps_its_output(models):
    _, slim, _ = models
    y = slim[:2](torch.randn(3, 3, 11, 9, requires_grad=True))
    ctx = y.grad_fn
    slim[2](y)  # the SiLU claims the output (NOTE [Derived saved inputs])
    assert ctx.b is not None and ctx.x is None and ctx.recipe is None


# seeds whose first conv weight gradient broke the rule with the kernel's rounded 1/γ
@pytest.mark.parametrize("seed", [51, 84, 89, 121])
def test_every_gradient_within_rule(models, seed):
    assert_within_rule(*_run(models, seed))


def test_conv_weight_gradient_as_accurate_as_eager_over_seeds(models):
    # the first conv's dW over 200 seeds (one thread): mean error 0.855x eager's (the kernel's
    # rounded 1/γ: 1.018x; the float64 control 0.835x); outside the rule on 4 seeds (kernel: 11,
    # control: 4)
    err = eager_err = 0.0
    outside = 0
    for seed in range(200):
        got, ref, eager = _run(models, seed)
        err += max_abs_err(got[0], ref[0])
        eager_err += max_abs_err(eager[0], ref[0])
        outside += not rule_ok(got[0], ref[0], eager[0])[0]
    assert err <= 0.9 * eager_err, err / eager_err
    assert outside <= 5, outside

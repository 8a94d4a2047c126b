"""``slimgrad.memory.estimate`` takes a converted BatchNorm's C-kernel path as the real CPU step
does: the same grants of the incoming gradient's buffer, saved bytes and peak (NOTE [Fake tensors
model BatchNorm's C kernel] in slimgrad/ops/batch_norm.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.memory import estimate, measure
from tests.conformance._timm_shim import timm
from tests.models._resnet_helpers import small_resnet

pytestmark = pytest.mark.skipif(
    not ownership.calibrated()
    or not ownership.storage_facts_available()
    or _backend.use_cpu(torch.ones(2, 2), "batch_norm") is None,
    reason="needs gradient-buffer reuse (the C++ storage facts) and the C BatchNorm kernel",
)


def _linear_bn():
    # BatchNorm1d between Linears: no kernel-internal temporaries beside it (aten's CPU
    # convolution_backward allocates a weight-sized one the fake kernel does not)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 16))
    m = slimgrad.convert_(m)
    x = torch.randn(64, 64)
    return (lambda: m(x).square().sum()), m


def _bn_first():
    # the BatchNorm's own input needs a gradient: dx is written over the ReLU's gradient
    torch.manual_seed(0)
    m = slimgrad.convert_(nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)))
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    return (lambda: m(x).square().sum()), m


def _resnet():
    torch.manual_seed(0)
    m = slimgrad.convert_(small_resnet("bottleneck", width=4, layers=(1, 1, 1, 1)))
    x = torch.randn(2, 3, 32, 32)
    return (lambda: m(x).square().sum()), m


def _timm_efficientnet():
    # timm's conv-BN-act pattern (BatchNormAct2d), the bench case timm_efficientnet_b0's small
    # model (test_efficientnet at 2x3x33x35) with its cross-entropy
    from slimgrad.bench.cases.models import slim_copy
    from slimgrad.bench.cases.timm import eager_timm

    torch.manual_seed(0)
    eager, make_inputs = eager_timm("efficientnet_b0", "cpu", torch.float32, small=True)
    m = slim_copy(eager)
    x, y = make_inputs()
    return (lambda: m(x, y)), m


def _key(s):
    return (s.nbytes, s.dtype, tuple(s.shape), s.kind)


def _compare(make):
    ownership.reset_reuse_count()
    forward, module = make()
    real = measure(forward, module=module, timeline=False)
    granted = ownership.reuse_count()
    ownership.reset_reuse_count()
    est = estimate(make, timeline=False)
    return real, granted, est, ownership.reuse_count()


@pytest.mark.parametrize(
    "make, grants",
    [
        # before: 1 of 2 grants estimated, a peak 3,072 B above the real one (111,688 B)
        (_linear_bn, 2),
        # before: 1 of 2 grants estimated, a peak 592 B above the real one (98,376 B)
        (_bn_first, 2),
        # before: 4 of the real step's 8 grants estimated (peaks equal: 191,504 B)
        (_resnet, 8),
        # before: 11 of 16 grants estimated, a peak 12,864 B above the real one (1,589,496 B);
        # 14 since smooth activations keep y only where their consumer is known to keep it
        # (session 32: the same peak 1,589,496 B and saved 368,644 B as with 16)
        pytest.param(
            _timm_efficientnet,
            14,
            marks=pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed"),
        ),
    ],
    ids=["linear_bn_relu", "bn_relu_conv", "small_resnet", "timm_efficientnet"],
)
def test_the_estimate_grants_batch_norms_gradient_as_the_real_step(make, grants):
    real, granted, est, est_granted = _compare(make)
    assert granted == est_granted == grants
    assert sorted(map(_key, est.saved), key=repr) == sorted(map(_key, real.saved), key=repr)
    assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)

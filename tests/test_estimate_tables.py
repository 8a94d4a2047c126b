"""``slimgrad.memory.estimate`` equals the real step whether or not the process has built the
bit-unpacking tables yet (NOTE [Bit tables outside every step] in slimgrad/_math/bits.py): a real
first step counted the 2,048 B table as made and kept by the cache while the estimate made it and
freed it after one use (timm mobilenetv3_large_100's small bench model: estimated 6,512,136 B
against the real first step's 6,514,184; that row of tests/test_memory_estimate_cases.py runs as
a process's first step: its FIRST_STEP)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad._math import bits as _bits
from slimgrad.memory import estimate, measure
from tests._threads import one_thread_each_test  # noqa: F401 (an autouse fixture)


def _cold():
    # the process's first use of the tables
    _bits._SPREAD.clear()
    _bits._SHIFTS.clear()


def _figures(step):
    return step.peak_bytes, step.saved_bytes, step.end_bytes


def _leaky_relu_model():
    # leaky_relu keeps its side bits and unpacks them with the 256-row table in backward
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(-0.2), nn.Dropout(0.25), nn.Linear(64, 8))
    m = slimgrad.convert_(m).train()
    x = torch.randn(16, 32)
    return (lambda: m(x).square().sum()), m


def _real(make):
    torch.manual_seed(1)
    forward, module = make()
    return measure(forward, module=module, timeline=False)


def _estimate(make):
    torch.manual_seed(1)
    return estimate(make, timeline=False)


@pytest.mark.parametrize("real_first", [True, False], ids=["real_first", "estimate_first"])
def test_tables_are_no_part_of_either_step(real_first):
    _cold()
    if real_first:
        real, est = _real(_leaky_relu_model), _estimate(_leaky_relu_model)
    else:
        est, real = _estimate(_leaky_relu_model), _real(_leaky_relu_model)
    assert _figures(est) == _figures(real)
    # a warm process: the same figures again
    assert _figures(_real(_leaky_relu_model)) == _figures(real)
    assert _figures(_estimate(_leaky_relu_model)) == _figures(real)
    # the cached tables are real tensors, whoever needed them first
    assert type(_bits._SPREAD[torch.device("cpu")]) is torch.Tensor
    assert all(type(t) is torch.Tensor for t in _bits._SHIFTS.values())

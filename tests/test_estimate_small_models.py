"""``memory.estimate`` equals the real CPU step's peak and saved bytes on small converted models
(issue 33), whatever ran before it in the process: each case clears FakeTensorMode's dispatch
cache first, and one test runs every case in a fresh interpreter in the reverse order. The
LayerNorm case covers NOTE [Fake tensors model the LayerNorm C backward] in
slimgrad/ops/layer_norm.py (the estimate ran the PyTorch backward's temporaries: 10,952 B estimated
for a 7,368 B step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import slimgrad
from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.memory import estimate, measure

pytestmark = pytest.mark.skipif(
    not all(
        _backend.cpu_kernel_would_run(torch.empty(1), s)
        for s in ("layer_norm", "output_act", "batch_norm")
    )
    or not ownership.calibrated(),
    reason="needs the CPU C kernels (a C compiler) and gradient-buffer reuse",
)

CASES = ("linear_ln_linear", "linear_gelu_linear", "linear_rmsnorm_linear", "conv_bn_relu")


def _build(name: str) -> nn.Module:
    if name == "linear_ln_linear":
        return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    if name == "linear_gelu_linear":
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    if name == "linear_rmsnorm_linear":
        return nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32), nn.Linear(32, 16))
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


def real_and_estimate(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(peak, saved) bytes of the real step under ``measure`` and of ``estimate``."""

    def make():
        torch.manual_seed(0)
        m = slimgrad.convert_(_build(name)).train()
        x = torch.randn(2, 3, 8, 8) if name == "conv_bn_relu" else torch.randn(2, 8, 16)

        def forward():
            return m(x).square().sum()

        return forward, m

    forward, model = make()
    forward().backward()  # warm-up: one-time tables stay out of the measured step
    for p in model.parameters():
        p.grad = None
    real = measure(forward, module=model)
    est = estimate(make)
    return (real.peak_bytes, real.saved_bytes), (est.peak_bytes, est.saved_bytes)


@pytest.mark.parametrize("name", CASES)
def test_estimate_is_the_real_step(name):
    FakeTensorMode.cache_clear()  # every fake op misses the dispatch cache, as in a fresh process
    real, est = real_and_estimate(name)
    assert est == real


def test_estimate_is_the_real_step_in_a_fresh_process_in_reverse_order():
    code = (
        "import json, sys\n"
        "from test_estimate_small_models import CASES, real_and_estimate\n"
        "print(json.dumps({n: real_and_estimate(n) for n in reversed(CASES)}))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(__file__), os.path.dirname(slimgrad.__path__[0])]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert list(got) == list(reversed(CASES))
    for name, (real, est) in got.items():
        assert est == real, name

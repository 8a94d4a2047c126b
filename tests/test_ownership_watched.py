"""A converted ResNet-50 step keeps its peak and its grants when watched (issue 31; NOTE [Forward
ownership from stated structure], C2 and C3).

The same step (slimgrad's torchvision-faithful ResNet-50 + cross-entropy, converted, 4x3x64x64,
after a warm-up step) runs unwatched, under a dispatch mode that counts the storages its ops read
and states that it keeps no tensor (``slimgrad.testing.OpObserver``), and under
``slimgrad.memory.measure(module=model)`` (attribution hooks that state the same). The unwatched
and mode peaks come from the CPU allocator (``torch.profiler``, tests/test_memory_truth.py), the
third from the tracker. Each must grant the forward writes and gradient buffers the unwatched step
grants, and its peak must be within 1% of the unwatched one. A mode that does not state it keeps
no tensor could keep any op's output: it is refused (tests/test_ownership_forward.py).
"""

from __future__ import annotations

import pytest
import torch

import slimgrad
from slimgrad import ownership
from slimgrad.bench import models
from slimgrad.memory import measure
from slimgrad.testing import OpObserver
from tests._ownership_helpers import reuse_on  # noqa: F401 (reuse_on: autouse fixture)
from tests.test_memory_truth import _real

B, S = 4, 64


class _CountStorages(OpObserver):
    # counts the distinct storages (data pointers) its ops read; keeps ints only
    def __init__(self) -> None:
        super().__init__()
        self.ptrs: set[int] = set()

    def see(self, func, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.layout == torch.strided:
                self.ptrs.add(a.data_ptr())


def _grants() -> tuple[int, int, int]:
    return tuple(ownership.reuse_count(k) for k in ("forward", "grad", "saved"))


@pytest.mark.slow
def test_a_converted_resnet50_step_keeps_its_peak_watched():
    torch.manual_seed(0)
    model = slimgrad.convert_(models.WithLoss(models.resnet50(num_classes=10)))
    x, y = torch.randn(B, 3, S, S), torch.randint(0, 10, (B,))
    model(x, y).backward()  # warm-up: one-time caches stay out of the measured steps

    def setup():
        for p in model.parameters():
            p.grad = None
        ownership.reset_reuse_count()

    def step(_):
        model(x, y).backward()

    mode = _CountStorages()

    def watched(_):
        with mode:
            model(x, y).backward()

    peak, _ = _real(setup, step)
    grants = _grants()
    mode_peak, _ = _real(setup, watched)
    mode_grants = _grants()
    setup()
    m = measure(lambda: model(x, y), module=model)
    measure_grants = _grants()

    assert grants[0] > 0 and grants[1] > 0, grants
    assert mode.ptrs
    assert mode_grants == grants
    assert measure_grants == grants
    assert abs(mode_peak - peak) <= 0.01 * peak, (mode_peak, peak)
    assert abs(m.peak_bytes - peak) <= 0.01 * peak, (m.peak_bytes, peak)

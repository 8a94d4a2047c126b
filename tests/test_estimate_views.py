"""``slimgrad.memory.estimate`` grants the buffer reuse the real step grants where a converted
Linear runs eager's ``F.linear`` and hands the op before it a view gradient (NOTE [Converted Linear
outside autocast] in slimgrad/nn/linear.py, NOTE [Ownership under fake tensors] and NOTE
[Calibration outside dispatch modes] in slimgrad/ownership.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import ownership
from slimgrad.memory import estimate, measure

pytestmark = pytest.mark.skipif(
    not ownership.calibrated() or not ownership.storage_facts_available(),
    reason="needs gradient-buffer reuse (the C++ storage facts)",
)


def _make():
    # each LayerNorm's incoming gradient is the next Linear's dx: on a 3-D input eager's F.linear
    # hands it on as a whole-storage view of a fresh 2-D product (term 2b)
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 16)
    )
    m = slimgrad.convert_(m)
    x = torch.randn(2, 8, 32)
    return (lambda: m(x).square().sum()), m


def _key(s):
    return (s.nbytes, s.dtype, s.shape, s.kind)


def _real():
    ownership.reset_reuse_count()
    forward, module = _make()
    step = measure(forward, module=module, timeline=False)
    return step, ownership.reuse_count()


def _estimated():
    ownership.reset_reuse_count()
    step = estimate(_make, timeline=False)
    return step, ownership.reuse_count()


def _sorted_saved(step):
    return sorted(map(_key, step.saved), key=repr)


def test_the_estimate_grants_eager_linears_view_gradients_as_the_real_step():
    # before: 0 grants estimated (the fake view's base showed a use and a weak reference more)
    # where the real step granted 2, and a peak above the real one
    real, granted = _real()
    est, est_granted = _estimated()
    assert granted == est_granted == 2
    assert _sorted_saved(est) == _sorted_saved(real)
    assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)


def test_the_first_estimate_grants_as_a_later_one():
    # the fake dispatch cache decides whether an output gets a converter-memo weak reference:
    # cleared, the first estimate meets cache misses (before: fewer grants than the second)
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    first, n1 = _estimated()
    second, n2 = _estimated()
    assert n1 == n2 == 2
    assert first.peak_bytes == second.peak_bytes


def test_a_calibration_asked_inside_an_estimate_serves_the_real_step(monkeypatch):
    # the process's first question asked inside the estimate (FakeTensorMode): before, its view
    # signature was a fake one, and the real steps after it got 0 of their 2 grants
    for name in ("_BY_MODE", "_MODE", "_GRAD_REFCOUNT", "_SAVED_SIGS", "_VIEW_SIG"):
        monkeypatch.setattr(ownership, name, getattr(ownership, name))
    ownership._BY_MODE = {}
    ownership._MODE = None
    _, est_granted = _estimated()
    assert ownership._MODE is not None  # calibrated there
    _, granted = _real()
    assert granted == est_granted == 2

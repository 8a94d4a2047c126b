"""NOTE [Lean dispatcher kernels] in ``slimgrad/_library.py``: with grad off, a slimgrad custom op
called on meta tensors reaches the Meta kernel that ``register_fake`` installs (the fake
implementation), as torch's own kernels route it, not the Python implementation, which needs
values."""

from __future__ import annotations

import pytest
import torch

import slimgrad  # noqa: F401  (registers the ops)
from slimgrad._library import custom_op

_RAN: list[str] = []


@custom_op("_test_lean_meta", mutates_args=())
def _op(x: torch.Tensor) -> torch.Tensor:
    _RAN.append("implementation")
    return x * 2


@_op.register_fake
def _(x):
    _RAN.append("fake")
    return torch.empty_like(x)


@pytest.mark.parametrize("grad", [True, False])
def test_meta_inputs_reach_the_fake_implementation(grad):
    x = torch.empty(5, device="meta")
    _RAN.clear()
    with torch.set_grad_enabled(grad):
        y = torch.ops.slimgrad._test_lean_meta.default(x)
    assert _RAN == ["fake"]
    assert y.device.type == "meta" and y.shape == (5,)


def test_cpu_inputs_still_run_the_implementation_directly():
    x = torch.randn(5)
    _RAN.clear()
    with torch.no_grad():
        y = torch.ops.slimgrad._test_lean_meta.default(x)
    assert _RAN == ["implementation"]
    torch.testing.assert_close(y, x * 2)

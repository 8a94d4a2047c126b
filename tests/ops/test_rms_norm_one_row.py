"""RMSNorm over several trailing dims on an input that is one normalized row (its shape equals
``normalized_shape``, no batch dim): the backward made dx in (rows, D) = (1, 15) and reshaped it to
the input's shape only for inputs that were not 2-D, so autograd raised "returned an invalid
gradient ... got [1, 15] but expected shape compatible with [3, 5]" where eager trains (found by a
read-only sweep of norm shapes). Rows: affine or not, float32 and bfloat16, 2-D and 3-D inputs of
one row, and a batch of rows for contrast, each against eager's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from tests._threads import one_thread


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize(
    ("ns", "shape"), [((3, 5), (3, 5)), ((2, 3, 5), (2, 3, 5)), ((3, 5), (2, 3, 5))], ids=str
)
def test_rms_norm_of_one_row_over_several_dims(ns, shape, affine, dtype):
    with one_thread():
        torch.manual_seed(0)
        eager = nn.Sequential(
            nn.Linear(5, 5), nn.RMSNorm(ns, elementwise_affine=affine), nn.Linear(5, 5)
        ).to(dtype)
        slim = slimgrad.convert_(copy.deepcopy(eager))
        assert type(slim[1]) is not nn.RMSNorm
        x = torch.randn(shape, dtype=dtype)
        grads = []
        for m in (eager, slim):
            m(x).float().square().sum().backward()  # (raised before, on the converted side)
            grads.append({k: p.grad.float() for k, p in m.named_parameters()})
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        for k in grads[0]:
            torch.testing.assert_close(grads[1][k], grads[0][k], **tol)

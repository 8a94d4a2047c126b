"""In-place ABN's PyTorch backward (slimgrad._math.abn.bwd_torch): dγ = Σ dy (y - β) / γ summed in
float64 and divided once, as ops/batch_norm.py does. Multiplying by a rounded 1/γ (aten's kernel
with invstd' = 1/γ) and, on CUDA, accumulating in float32 put dγ past the error rule on an H200
(tests/ops/test_inplace_abn.py::test_cuda_both_backends_match_eager[identity-0.0-False-dtype0]:
2.77e-6 against a bound of 2.73e-6); on CPU the rounded 1/γ alone leaves dγ up to 0.66 eps from
the exact sum of the same products (these inputs), past what one rounding allows (0.5 eps).
"""

from __future__ import annotations

import pytest
import torch

from slimgrad._math import abn


def _inputs(shape, side):
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    z = torch.randn(shape, generator=g)
    dz = torch.randn(shape, generator=g) + 0.3 * z
    w = torch.rand(c, generator=g) + 0.5
    b = torch.randn(c, generator=g) * 0.2
    invstd = torch.rand(c, generator=g) + 0.5
    if side:
        w[1] = 0.0  # γ = 0: x̂ is kept for this channel (NOTE [Invertibility])
        idx = torch.tensor([1])
        xhat = torch.randn(shape[0], 1, *shape[2:], generator=g)
    else:
        idx, xhat = torch.zeros(0, dtype=torch.long), z.new_empty(shape[0], 0, *shape[2:])
    return z, dz, w, b, invstd, idx, xhat


@pytest.mark.parametrize(
    "shape", [(8, 64, 16, 16), (2, 3, 128, 128)], ids=["channel_groups", "batch_parts"]
)
@pytest.mark.parametrize("side", [False, True], ids=["rebuilt", "side_channel"])
@pytest.mark.parametrize("need_dx", [True, False])
def test_dweight_is_one_rounding_of_the_float64_sum(shape, side, need_dx):
    z, dz, w, b, invstd, idx, xhat = _inputs(shape, side)
    count = z.numel() // z.shape[1]
    _, dw, db = abn.bwd_torch(
        z, dz, w, b, invstd, idx, xhat, count, True, 1e-5, "identity", 0.0, need_dx=need_dx
    )
    # the same products in float64: identity activation, so the rebuilt input is z itself
    xh = (z.double() - b.double().view(1, -1, 1, 1)) / w.double().view(1, -1, 1, 1)
    if side:
        xh[:, 1] = xhat[:, 0].double()
    exact = (xh * dz.double()).sum((0, 2, 3))
    err = (dw.double() - exact).abs() / exact.abs()
    assert err.max() <= 0.5 * torch.finfo(torch.float32).eps, err.max()
    torch.testing.assert_close(db.double(), dz.double().sum((0, 2, 3)), rtol=1e-5, atol=1e-4)

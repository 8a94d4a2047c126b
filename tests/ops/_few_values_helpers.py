"""The few-values-per-channel sweep shared by tests/ops/test_bn_few_values.py and
tests/ops/test_abn_few_values.py (NOTE [Few values per channel] in slimgrad/ops/batch_norm.py):
its shapes, gammas and seeds, and one case's inputs."""

from __future__ import annotations

import torch

EPS = 1e-5
# (N, C) and (N, C, H, W) inputs with 2 to 8 values per channel
SHAPES = [(2, 5), (3, 5), (4, 5), (8, 5), (1, 5, 1, 2), (2, 5, 1, 1), (1, 5, 2, 2), (2, 5, 2, 2)]
GAMMAS = [1e-3, 0.1, 1.0, 10.0]
SEEDS = range(4)


def few_values_case(shape, gamma, seed, dt):
    """One case of the sweep at dtype ``dt``, drawn in float64 from ``seed``: the leaves ``z`` and
    the norm's ``w``, ``b`` and the per-channel affine's ``s``, ``t`` before it (all requiring
    grad), its output ``x = s z + t`` (the norm's input) and the loss weights ``r``:
    ``loss = Σ r * act(norm(x))``."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    z0 = torch.randn(shape, generator=g, dtype=torch.float64)
    r0 = torch.randn(shape, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(c, generator=g) < 0.3, -1.0, 1.0).double()
    w0 = gamma * (torch.rand(c, generator=g, dtype=torch.float64) + 0.5) * sign
    # |β| up to |γ| / 2 (the per-channel test's limit) and, on two channels, up to 3 |γ| (past the
    # rebuild limit of 4: side x̂)
    ratio = torch.tensor([0.0, 0.25, 0.5, 1.5, 3.0], dtype=torch.float64)[:c]
    b0 = w0.abs() * ratio * (torch.rand(c, generator=g, dtype=torch.float64) * 2 - 1)
    s0 = torch.rand(c, generator=g, dtype=torch.float64) * 2 + 1e-3
    t0 = torch.randn(c, generator=g, dtype=torch.float64)
    z, w, b, s, t = (v.to(dt).clone().requires_grad_() for v in (z0, w0, b0, s0, t0))
    sh = [1, -1] + [1] * (len(shape) - 2)
    x = z * s.view(sh) + t.view(sh)
    return (z, w, b, s, t), x, r0.to(dt)

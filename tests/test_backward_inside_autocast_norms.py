"""A converted norm's backward run inside ``torch.autocast`` gives the gradients of the backward
run outside it, bit for bit, as docs/faq.md says (NOTE [Row dots without autocast] in
slimgrad/_math/norms.py): the norms' row dots (a bmm, one of autocast's lower-precision ops) ran in
bfloat16 there, and the gradients upstream of a converted RMSNorm moved by a bf16 rounding (2.4e-4
at a gradient scale of 0.056 before)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad


def _norm(kind):
    if kind == "rms":
        return nn.RMSNorm(64)
    if kind == "rms_noaffine":
        return nn.RMSNorm(64, elementwise_affine=False)
    if kind == "ln":
        return nn.LayerNorm(64)
    return nn.GroupNorm(4, 64)


@pytest.mark.parametrize("kind", ["rms", "rms_noaffine", "ln", "gn"])
@pytest.mark.parametrize("rows", [3, 64])
def test_backward_inside_autocast_is_the_backward_outside(kind, rows):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), _norm(kind), nn.Linear(64, 10))
    c = slimgrad.convert_(copy.deepcopy(m))
    x = torch.randn(rows, 64)
    y = torch.randint(0, 10, (rows,))

    def grads(mod, inside):
        mod.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(mod(x), y)
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        return [p.grad.clone() for p in mod.parameters()]

    outside, inside = grads(c, False), grads(c, True)
    for a, b in zip(outside, inside, strict=True):
        assert torch.equal(a, b)
    eager = grads(m, True)  # eager's own backward: the same bits inside or outside here
    for a, b in zip(eager, grads(m, False), strict=True):
        assert torch.equal(a, b)

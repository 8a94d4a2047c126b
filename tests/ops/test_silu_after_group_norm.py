"""A SiLU (or Mish) applied to slimgrad GroupNorm's output keeps that output, its input, as eager's
SiLU does: the norm keeps it anyway, so the activation's y and side information would be the only
bytes it added (NOTE [An input its producer keeps] in ops/_output_act.py). The same bits and bytes
as the converted model with torch's SiLU; fewer bytes than before, with and without saved-tensor
hooks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.memory import measure

C = 32


def _model(act) -> nn.Sequential:
    torch.manual_seed(0)

    def blk():
        return nn.Sequential(nn.Conv2d(C, C, 3, padding=1, bias=False), nn.GroupNorm(8, C), act())

    return nn.Sequential(nn.Conv2d(3, C, 1), blk(), blk(), nn.Conv2d(C, 4, 1))


def _grads(m, x, w, hooks=None):
    m.zero_grad(set_to_none=True)
    x.grad = None
    if hooks is None:
        loss = (m(x) * w).sum()
    else:
        with hooks():
            loss = (m(x) * w).sum()
    loss.backward()
    return [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("act", [nn.SiLU, nn.Mish])
@pytest.mark.parametrize("shape", [(4, 16, 16), (3, 7, 11)])
def test_activation_after_group_norm_keeps_the_norms_output(act, shape):
    n, h, w_ = shape
    eager = _model(act)
    lean = slimgrad.convert_(copy.deepcopy(eager))
    # the same model with torch's activation: what keeping x costs after slimgrad's GroupNorm
    ref = slimgrad.convert_(copy.deepcopy(eager), filter_fn=lambda m, name: not isinstance(m, act))
    assert type(lean[1][2]) is not act and type(ref[1][2]) is act
    torch.manual_seed(1)
    x = torch.randn(n, 3, h, w_, requires_grad=True)
    w = torch.randn(n, 4, h, w_)
    for m in (lean, ref):
        _grads(m, x, w)
    ml = measure(lambda: (lean(x) * w).sum(), module=lean, timeline=False)
    mr = measure(lambda: (ref(x) * w).sum(), module=ref, timeline=False)
    # before: the side information of both SiLUs above (4x32x16x16: 689,336 against 672,256 B)
    assert (ml.saved_bytes, ml.peak_bytes) == (mr.saved_bytes, mr.peak_bytes)
    for a, b in zip(_grads(ref, x, w), _grads(lean, x, w)):
        assert torch.equal(a, b)  # eager's silu_backward on the same x
    save_on_cpu = torch.autograd.graph.save_on_cpu
    for a, b in zip(_grads(ref, x, w), _grads(lean, x, w, save_on_cpu)):
        assert torch.equal(a, b)

"""Converted convolutions under CPU autocast with no graph to record (no_grad, inference_mode, a
reentrant checkpoint's forward) return what eager returns: autocast casts eager's
aten::conv{n}d / conv_transpose{n}d, not the aten::convolution slimgrad calls, so ops/conv.py
applies autocast's cast itself on both paths."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.ops import conv as sconv

CASES = [(n, tr) for n in (1, 2, 3) for tr in (False, True)]
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),  # input already cast by an earlier autocast op
    (torch.float16, torch.float32),
    (torch.float64, torch.float64),  # autocast leaves float64 alone
]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
@pytest.mark.parametrize("xd,wd", DTYPES)
@pytest.mark.parametrize("n,transposed", CASES)
def test_functional_matches_eager_bit_for_bit(n, transposed, xd, wd, mode):
    name = f"conv_transpose{n}d" if transposed else f"conv{n}d"
    torch.manual_seed(0)
    x = torch.randn(2, 3, *[5] * n, dtype=xd)
    w = torch.randn(*((3, 4) if transposed else (4, 3)), *[3] * n, dtype=wd)
    b = torch.randn(4, dtype=wd)
    with torch.autocast("cpu", dtype=torch.bfloat16), mode():
        ref = getattr(F, name)(x, w, b, padding=1)
        out = getattr(sconv, name)(x, w, b, padding=1)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _stack():
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 4, 3, padding="same"))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_converted_stack_no_grad(mode):
    # The second conv sees the first one's bf16 output (it raised "expected scalar type
    # BFloat16 but found Float" before).
    torch.manual_seed(0)
    m = _stack()
    s = slimgrad.convert_(copy.deepcopy(m))
    assert slimgrad.report(s).converted, slimgrad.report(s)  # not eager vs eager
    x = torch.randn(2, 3, 9, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16), mode():
        ref, out = m(x), s(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_converted_stack_reentrant_checkpoint():
    torch.manual_seed(0)
    m = _stack()
    s = slimgrad.convert_(copy.deepcopy(m))
    assert slimgrad.report(s).converted, slimgrad.report(s)  # not eager vs eager
    x = torch.randn(2, 3, 9, 11, requires_grad=True)
    outs, grads = [], []
    for mod in (m, s):
        xx = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(mod, xx, use_reentrant=True)
        y.float().square().sum().backward()
        outs.append(y)
        grads.append([xx.grad] + [p.grad for p in mod.parameters()])
    assert outs[1].dtype == outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for g1, g0 in zip(grads[1], grads[0]):
        torch.testing.assert_close(g1, g0)

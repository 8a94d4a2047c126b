"""Conformance: a custom autograd Function that writes its input in place, applied to an
output-saving module's output (NOTE [A custom autograd Function that writes its input] in
slimgrad/convert_handlers/inplace_guard.py), in a forward torch.fx traces and in one it cannot.

Before, ``MyFn.apply(h)`` was one opaque node to torch.fx and a name to the source reading: a
LayerNorm whose output such a Function wrote stayed converted, and backward raised autograd's
in-place error where eager trains. Each writing Function (an in-place method, an ``out=``
argument, ``ctx.mark_dirty`` alone over a write the source does not name, a write of its second
argument, a forward with ``setup_context``) now keeps the norm eager with eager's gradients; a
Function that only reads keeps it converted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import kept_reason
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _MulInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class _OutArgument(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        torch.mul(x, 2.0, out=x)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


_KERNEL = {"double": lambda t: t.mul(2.0)}  # stands for a kernel whose write the source hides


class _MarkDirtyOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.copy_(_KERNEL["double"](x))
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class _WritesSecond(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, x):
        x.add_(s)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return None, g


class _SetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.mul_(2.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class _Reads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


def _apply(fn, h):
    return fn.apply(1.0, h) if fn is _WritesSecond else fn.apply(h)


class _Traced(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.o = nn.Linear(6, 2)
        self.fn = fn

    def forward(self, x):
        h = self.ln(self.fc(x))
        return self.o(_apply(self.fn, h))


class _Read(_Traced):
    def forward(self, x):
        h = self.ln(self.fc(x))
        if x.shape[-1] != 6:  # never true: torch.fx cannot trace this forward
            return self.o(h)
        if self.fn is _WritesSecond:
            h = _WritesSecond.apply(1.0, h)
        elif self.fn is _MulInPlace:
            h = _MulInPlace.apply(h)
        elif self.fn is _OutArgument:
            h = _OutArgument.apply(h)
        elif self.fn is _MarkDirtyOnly:
            h = _MarkDirtyOnly.apply(h)
        elif self.fn is _SetupContext:
            h = _SetupContext.apply(h)
        else:
            h = _Reads.apply(h)
        return self.o(h)


def _step(m, x):
    m.zero_grad(set_to_none=True)
    loss = m(x).square().sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


_WRITERS = [_MulInPlace, _OutArgument, _MarkDirtyOnly, _WritesSecond, _SetupContext]


@pytest.mark.parametrize("holder", [_Traced, _Read], ids=["traced", "source"])
@pytest.mark.parametrize("fn", _WRITERS, ids=lambda c: c.__name__.strip("_"))
def test_a_writing_function_keeps_the_norm_eager(fn, holder):
    if holder is _Read and fn is not _MulInPlace and fn is not _WritesSecond:
        # the source reading reads every branch: one writer there keeps the norm for all
        pytest.skip("one source-read row per route suffices")
    torch.manual_seed(0)
    m = holder(fn)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.ln) is not None
    assert type(c.ln) is nn.LayerNorm
    x = torch.randn(2, 3, 6)
    want_loss, want = _step(m, x)
    got_loss, got = _step(c, x)  # (a converted norm raised autograd's in-place error here)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_reading_function_keeps_the_norm_converted():
    torch.manual_seed(0)
    m = _Traced(_Reads)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.ln) is None
    assert type(c.ln) is not nn.LayerNorm
    x = torch.randn(2, 3, 6)
    want_loss, want = _step(m, x)
    got_loss, got = _step(c, x)
    torch.testing.assert_close(got_loss, want_loss)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)  # (rounding)

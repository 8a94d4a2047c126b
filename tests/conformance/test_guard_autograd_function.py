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

import pytest
import torch
from torch import nn

from tests._threads import one_thread
from tests.conformance._guard_rows import (
    assert_read_keeps_norm_converted,
    assert_write_keeps_norm_eager,
)


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


_WRITERS = [_MulInPlace, _OutArgument, _MarkDirtyOnly, _WritesSecond, _SetupContext]


@pytest.mark.parametrize("holder", [_Traced, _Read], ids=["traced", "source"])
@pytest.mark.parametrize("fn", _WRITERS, ids=lambda c: c.__name__.strip("_"))
def test_a_writing_function_keeps_the_norm_eager(fn, holder):
    if holder is _Read and fn is not _MulInPlace and fn is not _WritesSecond:
        # the source reading reads every branch: one writer there keeps the norm for all
        pytest.skip("one source-read row per route suffices")
    assert_write_keeps_norm_eager(lambda: holder(fn))


def test_a_reading_function_keeps_the_norm_converted():
    assert_read_keeps_norm_converted(lambda: _Traced(_Reads))

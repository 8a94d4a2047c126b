"""Compiled, a LayerNorm whose every channel is a fallback channel keeps what eager keeps (x,
mean and rstd), not y and a copy of x: NOTE [All-fallback LayerNorm under torch.compile] in
slimgrad/ops/layer_norm.py. Kept bytes measured as tests/test_compile_saved.py measures them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimgrad.ops import layer_norm
from tests.test_compile_saved import _op_step

N, D = 13, 16


def _weights(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    w, b = torch.randn(D, generator=g), torch.randn(D, generator=g)
    if kind == "tiny":
        w[:] = 1e-9  # every gamma ~ 0
    elif kind == "inf":
        w[3] = float("inf")  # a non-finite gamma: every channel (NOTE [LayerNorm with a non-finite
        # gamma] in slimgrad/_math/norms.py)
    return x, w, b


def _both(fn, inputs):
    torch._dynamo.reset()
    try:
        return _op_step(fn, inputs, compiled=True)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["tiny", "inf"])
def test_all_fallback_layer_norm_keeps_what_eager_keeps_under_compile(kind):
    inputs = _weights(kind)
    out, grads, kept, kept_inputs = _both(lambda x, w, b: layer_norm(x, (D,), w, b) * 2, inputs)
    e_out, e_grads, e_kept, e_kept_inputs = _both(
        lambda x, w, b: F.layer_norm(x, (D,), w, b) * 2, inputs
    )
    # eager's: mean and rstd (8 B per row) beside x and the weight (inputs, by reference); before:
    # y (4 B/elt) + a copy of x (4 B/elt) + the int64 table + mean and rstd = 1,896 B beside w, b
    assert (kept, kept_inputs) == (e_kept, e_kept_inputs) == (8 * N, 4 * N * D + 4 * D)
    torch.testing.assert_close(out, e_out, rtol=0, atol=0, equal_nan=True)
    for a, e in zip(grads, e_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


def test_layer_norm_with_one_fallback_channel_keeps_its_output_under_compile():
    x, w, b = _weights("plain")
    b[:] = 0.1
    w[3] = 1e-9  # one fallback channel: y, mean, rstd, its column of x and the table
    out, grads, kept, kept_inputs = _both(lambda x, w, b: layer_norm(x, (D,), w, b) * 2, (x, w, b))
    # x is not kept (at most w and b among the inputs; the traced backward's partitioner may fold
    # b into what it keeps of y: NOTE [LayerNorm's backward traced under torch.compile]), nor a
    # copy of all of it
    assert kept_inputs <= 2 * 4 * D and 4 * N * D < kept < 2 * 4 * N * D

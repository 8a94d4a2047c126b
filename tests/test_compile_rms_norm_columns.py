"""The compiled HF RMSNorm backward patches its fallback columns once, not three times (NOTE
[RMSNorm's fallback columns in the traced backward] in ``ops/rms_norm.py``).

The traced backward used to ``index_copy`` the table's columns into three N x D tensors; now it
masks them out of the fused from-output terms and puts them in place in dx only (and in the
D-sized dgamma). Counted on the ops the compiled backward runs (``aot_eager_decomp_partition``:
inductor's decompositions and partitioner, its graph run op by op), with and without fallback
channels; the gradients meet the error rule either way (tests/test_compile_rms_norm.py covers
the rule and the saved bytes for both).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from slimgrad.ops.rms_norm import hf_rms_norm
from slimgrad.testing import assert_within_rule

BACKEND = "aot_eager_decomp_partition"
ROWS, D = 21, 17


def _full_width_patches(zeros):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, D, generator=g).requires_grad_()
    w = torch.randn(D, generator=g)
    for i in zeros:
        w[i] = 0.0
    w.requires_grad_()

    def fn(x, w):
        return hf_rms_norm(x, w, 1e-6, "llama")

    torch._dynamo.reset()
    try:
        y = torch.compile(fn, backend=BACKEND, fullgraph=True)(x, w)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            y.backward(dy)
    finally:
        torch._dynamo.reset()
    n = 0
    for e in prof.events():
        # index_copy decomposes to index_put (whose body is an index_put_): one patch, one event
        if e.name in ("aten::index_copy", "aten::index_put", "aten::scatter"):
            n += bool(e.input_shapes) and list(e.input_shapes[0]) == [ROWS, D]
    # the rule for the gradients, against eager HF math in float32 / float64
    ref = []
    for dt in (torch.float32, torch.float64):
        xl = x.detach().to(dt).requires_grad_()
        wl = w.detach().to(dt).requires_grad_()
        yr = wl * (xl * torch.rsqrt(xl.pow(2).mean(-1, keepdim=True) + 1e-6))
        yr.backward(dy.to(dt))
        ref.append([xl.grad, wl.grad])
    assert_within_rule([x.grad, w.grad], ref[1], ref[0], names=["dx", "dw"])
    return n


@pytest.mark.parametrize("zeros", [(), (0, 5, 16)])
def test_one_full_width_patch(zeros):
    assert _full_width_patches(zeros) == 1  # dx's; the old backward made 3

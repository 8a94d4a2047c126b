"""The gated MLP's straight backward (NOTE [The gated MLP's straight backward] in
slimgrad/ops/gated_mlp.py) frees dg's buffer once dx and dWg are made, before du's matmuls, as
the general path does: its step peak is the live set below, exactly, in the real CPU step and in
``memory.estimate`` (issue 33: the Llama-3-8B-like estimate gained one tokens x intermediate
buffer, 224 MiB, when the straight backward kept dg alive until it returned)."""

from __future__ import annotations

import torch

from slimgrad.memory import estimate, measure
from slimgrad.ops.gated_mlp import gated_mlp

T, D, N = 24, 40, 72  # tokens, hidden, intermediate (I below): every product distinct


def _make():
    torch.manual_seed(0)
    x = torch.randn(T, D, requires_grad=True)
    wg, wu, wd = (torch.nn.Parameter(torch.randn(*s) * 0.1) for s in ((N, D), (N, D), (D, N)))
    dy = torch.randn(T, D)
    return lambda: gated_mlp(x, wg, wu, wd), dy


def _peak_formula(held: int) -> int:
    # float32: kept g, u (2 TI) and what the step holds beside them (``held``) under every
    # backward op; then the backward's own buffers at its three highest points: after dWg (a/du,
    # dh/da/dg, dx, dWd, dWg), at du Wu (du, dx, du Wu, dWd, dWg; dg freed) and after dWu (du,
    # dx, dWd, dWg, dWu)
    ti, td, id_ = T * N * 4, T * D * 4, N * D * 4
    return 2 * ti + held + max(2 * ti + td + 2 * id_, ti + 2 * td + 2 * id_, ti + td + 3 * id_)


def test_straight_backward_frees_dg_before_du_matmuls():
    forward, dy = _make()
    m = measure(forward, grad=dy)
    # held: the output y (T x D; dy is the caller's). With dg alive until the return:
    # 2 TI + TD + (2 TI + TD + 3 ID) = 69,888 B
    assert m.peak_bytes == _peak_formula(T * D * 4) == 62_976
    assert m.saved_bytes == 2 * T * N * 4  # g and u (x is the caller's)


def test_straight_backward_peak_estimated_exactly():
    def make():
        forward, _ = _make()
        return lambda: forward().sum()

    real = measure(make())
    est = estimate(make, device="cpu")
    assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)
    # held: the loss and its gradient, one float each (y is freed after the sum)
    assert real.peak_bytes == _peak_formula(8) == 59_144

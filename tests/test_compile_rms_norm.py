"""HF RMSNorm under torch.compile: HF's own ops inside a non-reentrant checkpoint (NOTE [RMSNorm's
backward traced under torch.compile] in ``ops/rms_norm.py``). The partitioner keeps the norm's
input x alone, even where the output feeds a linear whose backward reads it (compiled eager keeps
x, y and rstd there); no slimgrad op and nothing that depends on the weight's values is in the
graph; gradients are eager's math, within the error rule for weights with zeros (gamma = 0).

Compiled with ``aot_eager_decomp_partition`` (inductor's decompositions and min-cut partitioner,
no C++ build); one test runs inductor itself.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from slimgrad.memory import _storage, _walk_savers
from slimgrad.ops.rms_norm import HF_VARIANTS, hf_rms_norm
from slimgrad.testing import assert_within_rule

BACKEND = "aot_eager_decomp_partition"


def _weight(d: int, zeros: tuple[int, ...], variant: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(d, generator=g)
    # gamma(w) = 0 at these channels: w = 0, or w = -1 where gamma is 1 + w
    zero = -1.0 if variant == "gemma" else 0.0
    for i in zeros:
        w[i] = zero
    return w


def _step(x, w, variant, compiled, backend=BACKEND):
    def fn(x, w):
        return hf_rms_norm(x, w, 1e-6, variant)

    f = torch.compile(fn, backend=backend, fullgraph=True) if compiled else fn
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = f(xl, wl)
    found = _walk_savers([y.grad_fn])
    skip = {_storage(t)._cdata for t in (xl, wl)}
    kept = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in skip)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y.backward(dy)
    names = {e.name for e in prof.events()}
    return y.detach(), (xl.grad, wl.grad), kept, names


def _reference(x, w, variant):
    # eager HF math in float32 and float64 (the error rule's eager and ref64)
    fwd = HF_VARIANTS[variant][0]
    out = []
    for dt in (torch.float32, torch.float64):
        xl = x.detach().to(dt).requires_grad_()
        wl = w.detach().to(dt).requires_grad_()
        y, _ = fwd(xl, wl, 1e-6)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dt)
        y.backward(dy)
        out.append((xl.grad, wl.grad))
    return out


def _kept_norm_linear(x, w, lin, variant, how):
    # bytes the autograd graph keeps for hf_rms_norm(x, w) @ lin.T, the leaves excluded, and the
    # leaves' bytes it keeps; how: "compiled", "uncompiled" (the converted op) or "eager"
    # (HF's ops compiled: compiled eager)
    def fn(x, w, lin):
        if how == "eager":
            return HF_VARIANTS[variant][0](x, w, 1e-6)[0] @ lin.t()
        return hf_rms_norm(x, w, 1e-6, variant) @ lin.t()

    f = fn if how == "uncompiled" else torch.compile(fn, backend=BACKEND, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, lin)]
    out = f(*leaves)
    found = _walk_savers([out.grad_fn])
    own = {_storage(t)._cdata for t in leaves}
    kept = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in own)
    kept_leaves = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k in own)
    out.backward(torch.ones_like(out))
    return kept, kept_leaves, [t.grad for t in leaves]


# the weights with and without zeros share one compile per variant: nothing in the graph depends
# on the weight's values (fullgraph=True would fail on a data-dependent branch)
ZEROS = [(), (0, 5, 16)]


@pytest.mark.parametrize("variant", ["llama", "gemma"])
def test_compiled_norm_before_a_linear_keeps_x_alone(variant):
    torch._dynamo.reset()
    try:
        for zeros in ZEROS:
            _check_norm_before_a_linear(variant, zeros)
    finally:
        torch._dynamo.reset()


def _check_norm_before_a_linear(variant, zeros):
    g = torch.Generator().manual_seed(0)
    rows, d, o = 21, 17, 11  # odd, prime sizes
    x = torch.randn(3, 7, d, generator=g)
    w = _weight(d, zeros, variant)
    lin = torch.randn(o, d, generator=g)
    kept, kept_leaves, grads = _kept_norm_linear(x, w, lin, variant, "compiled")
    kept_eager, _, grads_eager = _kept_norm_linear(x, w, lin, variant, "eager")
    kept_ref, _, grads_ref = _kept_norm_linear(x, w, lin, variant, "uncompiled")
    # the checkpoint's input x (a leaf here) and nothing else: rstd and y are made again in
    # backward, for the norm's backward and the linear's weight gradient
    assert (kept, kept_leaves) == (0, (rows + 1 + o) * d * 4)  # x, w, lin
    # the uncompiled converted op keeps y (shared with the linear) + rstd + per fallback channel
    # its index (8 B) and input column; compiled eager keeps y and rstd besides x
    assert kept_ref == rows * d * 4 + rows * 4 + len(zeros) * (8 + rows * 4)
    assert kept_eager >= rows * d * 4 + rows * 4
    # the rule against float64 and eager float32 HF math
    ref = []
    for dt in (torch.float32, torch.float64):
        xl, wl, ll = (t.detach().to(dt).requires_grad_() for t in (x, w, lin))
        out = HF_VARIANTS[variant][0](xl, wl, 1e-6)[0] @ ll.t()
        out.backward(torch.ones_like(out))
        ref.append([xl.grad, wl.grad, ll.grad])
    names = ["dx", "dw", "dlin"]
    assert_within_rule(grads, ref[1], ref[0], names=names)
    assert_within_rule(grads_ref, ref[1], ref[0], names=names)
    # HF's ops differentiated by autograd, as compiled eager differentiates them
    for a, b in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("variant", ["llama", "gemma"])
def test_compiled_keeps_no_more_than_uncompiled_and_meets_the_rule(variant):
    torch._dynamo.reset()
    try:
        for zeros in ZEROS:
            _check_keeps_no_more_than_uncompiled(variant, zeros)
    finally:
        torch._dynamo.reset()


def _check_keeps_no_more_than_uncompiled(variant, zeros):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 17, generator=g)  # odd, prime sizes
    w = _weight(17, zeros, variant)
    y, grads, kept, names = _step(x, w, variant, compiled=True)
    y_ref, grads_ref, kept_ref, _ = _step(x, w, variant, compiled=False)
    # no slimgrad op runs: no side table, no opaque backward
    assert not [n for n in names if n.startswith("slimgrad::")], names
    # the uncompiled op's Memory line: y, rstd (4 B/row) and, per fallback channel, its index
    # (8 B) and input column (4 B/row); compiled keeps only its input x (a leaf here)
    rows, k = 21, len(zeros)
    assert kept_ref == rows * 17 * 4 + rows * 4 + k * (8 + rows * 4)
    assert kept == 0
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the forward is HF's ops, traced
    (e32, r64) = _reference(x, w, variant)
    assert_within_rule(list(grads), list(r64), list(e32), names=["dx", "dw"])
    assert_within_rule(list(grads_ref), list(r64), list(e32), names=["dx", "dw"])


@pytest.mark.slow  # inductor's C++ build: about a minute on two loaded CPU cores
def test_backward_under_inductor_meets_the_rule():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 33, generator=g)
    w = _weight(33, (3,), "llama")
    try:
        _, grads, kept, names = _step(x, w, "llama", compiled=True, backend="inductor")
    finally:
        torch._dynamo.reset()
    assert not [n for n in names if n.startswith("slimgrad::")], names
    assert kept == 0
    e32, r64 = _reference(x, w, "llama")
    assert_within_rule(list(grads), list(r64), list(e32), names=["dx", "dw"])

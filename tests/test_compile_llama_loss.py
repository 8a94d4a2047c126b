"""The fused LM loss under torch.compile, one chunk: traced, not an opaque backward op (NOTE [The
fused loss traced under torch.compile] in ``ops/linear_cross_entropy.py``).

Where one chunk holds every token, the compiled loss is eager's cross_entropy(linear(h, W, b))
inside a non-reentrant checkpoint: backward recomputes the logits in traced (fusable) ops, no
``slimgrad::linear_cross_entropy_bwd`` call runs, nothing N x V is kept (hidden and the targets
only), and the loss and gradients meet the error rule. Chunked shapes keep the custom op.

Compiled with ``aot_eager_decomp_partition`` (inductor's decompositions and min-cut partitioner,
no C++ build).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from slimgrad.memory import _storage, _walk_savers
from slimgrad.ops.linear_cross_entropy import linear_cross_entropy
from slimgrad.testing import assert_within_rule

BACKEND = "aot_eager_decomp_partition"
N0, N1, H, V = 2, 13, 7, 11  # odd, prime sizes


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N0, N1, H, generator=g)
    w = torch.randn(V, H, generator=g) / H**0.5
    b = torch.randn(V, generator=g)
    t = torch.randint(0, V, (N0, N1), generator=g)
    t[0, 3] = t[1, 7] = -100  # ignored tokens
    return h, w, b, t


def _run(h, w, b, t, compiled, chunk_size=None, **kw):
    def fn(h, w, b, t):
        return linear_cross_entropy(h, w, t, b, chunk_size=chunk_size, **kw)

    f = torch.compile(fn, backend=BACKEND, fullgraph=True) if compiled else fn
    hl, wl, bl = (x.detach().clone().requires_grad_() for x in (h, w, b))
    loss = f(hl, wl, bl, t)
    skip = {_storage(x)._cdata for x in (wl, bl)}
    found = _walk_savers([loss.grad_fn])
    kept = sum(_storage(x).nbytes() for k, (x, _) in found.items() if k not in skip)
    dl = torch.randn(loss.shape, generator=torch.Generator().manual_seed(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward(dl)
    names = {e.name for e in prof.events()}
    return loss.detach(), [hl.grad, wl.grad, bl.grad], kept, names


def _reference(h, w, b, t, reduction, label_smoothing):
    out = []
    for dt in (torch.float32, torch.float64):
        hl, wl, bl = (x.detach().to(dt).requires_grad_() for x in (h, w, b))
        z = F.linear(hl, wl, bl).reshape(-1, V)
        loss = F.cross_entropy(
            z, t.reshape(-1), reduction=reduction, label_smoothing=label_smoothing
        )
        loss = loss.reshape(t.shape) if reduction == "none" else loss
        dl = torch.randn(loss.shape, generator=torch.Generator().manual_seed(2)).to(dt)
        loss.backward(dl)
        out.append((loss.detach(), [hl.grad, wl.grad, bl.grad]))
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_one_chunk_is_traced_keeps_no_logits_and_meets_the_rule(reduction, label_smoothing):
    h, w, b, t = _inputs()
    torch._dynamo.reset()
    try:
        loss, grads, kept, names = _run(
            h, w, b, t, True, reduction=reduction, label_smoothing=label_smoothing
        )
    finally:
        torch._dynamo.reset()
    # traced: backward's recompute is in the compiled graph, not the opaque op's eager body
    assert "slimgrad::linear_cross_entropy_bwd" not in names
    # hidden (N x H float32) and the targets (N int64), nothing N x V (the uncompiled op keeps
    # hidden, the targets and lse)
    assert kept == N0 * N1 * H * 4 + N0 * N1 * 8
    _, _, kept_eager_op, _ = _run(
        h, w, b, t, False, reduction=reduction, label_smoothing=label_smoothing
    )
    assert kept <= kept_eager_op
    (l32, g32), (l64, g64) = _reference(h, w, b, t, reduction, label_smoothing)
    assert_within_rule(loss, l64, l32, names=["loss"])
    assert_within_rule(grads, g64, g32, names=["dh", "dW", "db"])


def test_chunked_keeps_the_opaque_backward():
    # more tokens than a chunk: the custom op, whose chunk loop bounds the logits alive
    h, w, b, t = _inputs()
    torch._dynamo.reset()
    try:
        loss, grads, _, names = _run(h, w, b, t, True, chunk_size=8)
    finally:
        torch._dynamo.reset()
    assert "slimgrad::linear_cross_entropy_bwd" in names
    (l32, g32), (l64, g64) = _reference(h, w, b, t, "mean", 0.0)
    assert_within_rule(loss, l64, l32, names=["loss"])
    assert_within_rule(grads, g64, g32, names=["dh", "dW", "db"])

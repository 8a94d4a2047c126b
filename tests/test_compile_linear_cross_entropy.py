"""The fused loss under torch.compile: plain ops in a checkpoint (NOTE [The fused loss traced under
torch.compile] in ``slimgrad/_math/linear_cross_entropy.py``).

No slimgrad custom op runs in the compiled step; the partitioner keeps the checkpoint's inputs
alone (here the target: hidden and weight are the caller's leaves), no chunk x V logits and no lse;
the loss and every gradient are within the error rule of eager's ``cross_entropy(linear(...))``.
Compiled with ``aot_eager_decomp_partition`` (inductor's decompositions and min-cut partitioner,
no C++ build).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from slimgrad.memory import _storage, _walk_savers
from slimgrad.ops import linear_cross_entropy
from slimgrad.testing import assert_within_rule

BACKEND = "aot_eager_decomp_partition"
N, H, V = 37, 8, 53  # odd and prime; chunk_size=16: three chunks, the last one short


def _eager(h, w, b, t, reduction, eps, scale, cap):
    z = F.linear(h, w, b) * scale
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return F.cross_entropy(z, t, ignore_index=-100, label_smoothing=eps, reduction=reduction)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype)
    b = torch.randn(V, generator=g, dtype=dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100
    return h, w, b, t


def _run(fn, h, w, b, t, gout):
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    loss = fn(*leaves, t)
    found = _walk_savers([loss.grad_fn])
    own = {_storage(x)._cdata for x in leaves}
    kept = sum(_storage(x).nbytes() for k, (x, _) in found.items() if k not in own)
    loss.backward(gout)
    return [loss.detach()] + [x.grad for x in leaves], kept


CASES = [
    ("mean", 0.0, 1.0, None),
    ("sum", 0.1, 1.0, None),
    ("none", 0.0, 0.5, 3.0),
]


@pytest.mark.parametrize(("reduction", "eps", "scale", "cap"), CASES)
def test_compiled_loss_keeps_inputs_only_and_is_within_rule(reduction, eps, scale, cap):
    h, w, b, t = _data()

    def ours(h, w, b, t):
        return linear_cross_entropy(
            h, w, t, b, label_smoothing=eps, reduction=reduction, chunk_size=16,
            logit_scale=scale, logit_softcap=cap,
        )  # fmt: skip

    gout = torch.rand(N) if reduction == "none" else torch.tensor(0.7)
    torch._dynamo.reset()
    try:
        f = torch.compile(ours, backend=BACKEND, fullgraph=True)
        _run(f, h, w, b, t, gout)  # compiles forward and backward
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got, kept = _run(f, h, w, b, t, gout)
    finally:
        torch._dynamo.reset()
    names = [e.name for e in prof.events()]
    assert not [n for n in names if n.startswith("slimgrad::")], "a custom op in the step"
    # the target (int64), saved by reference: no lse (4 B/token), no chunk x V logits
    assert kept == N * 8, kept
    eager = _run(lambda *a: _eager(*a, reduction, eps, scale, cap), h, w, b, t, gout)[0]
    d64 = [x.double() for x in (h, w, b)]
    ref = _run(lambda *a: _eager(*a, reduction, eps, scale, cap), *d64, t, gout.double())[0]
    assert_within_rule(got, ref, eager, names=["loss", "dh", "dw", "db"])

"""In-place ABN on both kernel backends against eager BatchNorm + activation, on any device: run on
CUDA by tests/ops/test_inplace_abn.py and on CPU under TRITON_INTERPRET=1 by
tests/kernels/test_inplace_abn.py (NOTE [Kernel backend choice], NOTE [Same forward as eager])."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimgrad.kernels import _backend
from slimgrad.ops.inplace_abn import inplace_abn
from slimgrad.testing import assert_within_rule


def _eager(x, rm, rv, w, b, act, param):
    y = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    if act == "leaky_relu":
        return F.leaky_relu(y, param)
    return F.elu(y, param) if act == "elu" else y


def _run(fn, x0, w0, b0, g, act, param):
    x = x0.detach().clone().requires_grad_()
    w, b = w0.detach().clone().requires_grad_(), b0.detach().clone().requires_grad_()
    rm = torch.zeros(w.shape, device=w.device, dtype=w.dtype)
    rv = torch.ones(w.shape, device=w.device, dtype=w.dtype)
    out = fn(x * 1, rm, rv, w, b, act, param)
    grads = torch.autograd.grad(out, [x, w, b], g)
    return out.detach(), list(grads), (rm, rv)


def _slim(x, rm, rv, w, b, act, param):
    return inplace_abn(x, rm, rv, w, b, True, 0.1, 1e-5, act, param)


def check_backends(device, act, param, dtype=torch.float32, channels_last=False):
    """Both backends: output and running statistics bit for bit eager's (the forward is eager's
    kernel on either backend), gradients within the error rule (for 16-bit inputs with float32
    parameters, dweight is exempt: documented in ops/inplace_abn.py), layout kept."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 6, 5, 7, generator=gen) * 2 + 0.5
    g = torch.randn(4, 6, 5, 7, generator=gen)
    w0 = torch.rand(6, generator=gen) + 0.5
    w0[0] = -w0[0]
    b0 = torch.randn(6, generator=gen) * 0.2
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x0, g = (t.to(device, dtype).to(memory_format=fmt) for t in (x0, g))
    w0, b0 = w0.to(device), b0.to(device)
    ref = _run(_eager, x0, w0, b0, g, act, param)
    ref64 = _run(_eager, x0.double(), w0.double(), b0.double(), g.double(), act, param)
    names = ["out", "dx", "dw", "db"]
    keep = [0, 1, 2, 3] if dtype in (torch.float32, torch.float64) else [0, 1, 3]
    for backend in ("torch", "triton"):
        with _backend.set_backend(backend):
            out, grads, stats = _run(_slim, x0, w0, b0, g, act, param)
        assert torch.equal(out, ref[0]), f"{backend}: output differs from eager's"
        for a, r in zip(stats, ref[2]):
            assert torch.equal(a, r), f"{backend}: running statistics differ from eager's"
        got, want64, eager = [out, *grads], [ref64[0], *ref64[1]], [ref[0], *ref[1]]
        assert_within_rule(
            [got[i] for i in keep],
            [want64[i] for i in keep],
            [eager[i] for i in keep],
            names=[f"{backend}:{names[i]}" for i in keep],
        )
        assert grads[0].is_contiguous(memory_format=fmt)

"""The gated MLP under torch.compile: eager's ops with ``down(act(g) * u)`` inside a non-reentrant
checkpoint (NOTE [The gated MLP traced under torch.compile] in ``ops/gated_mlp.py``). The
partitioner keeps g and u (and x), never act(g) or the product, which compiled eager keeps for
the down projection's weight gradient; no slimgrad op runs in the compiled step; gradients are
eager's math within the error rule.

Compiled with ``aot_eager_decomp_partition`` (inductor's decompositions and min-cut partitioner,
no C++ build).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from slimgrad.memory import _storage, _walk_savers
from slimgrad.ops.gated_mlp import _fwd_torch, gated_mlp, gated_mlp_fused
from slimgrad.testing import assert_within_rule

BACKEND = "aot_eager_decomp_partition"
ROWS, D, HID, OUT = 21, 13, 17, 11  # odd, prime sizes


def _leaves(fused: bool, bias: bool, dt=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, D, generator=g)
    wg = torch.randn(2 * HID if fused else HID, D, generator=g) / 4
    wu = None if fused else torch.randn(HID, D, generator=g) / 4
    wd = torch.randn(OUT, HID, generator=g) / 4
    bg = torch.randn(wg.shape[0], generator=g) if bias else None
    bu = torch.randn(HID, generator=g) if bias and not fused else None
    bd = torch.randn(OUT, generator=g) if bias else None
    return [None if t is None else t.to(dt).requires_grad_() for t in (x, wg, bg, wu, bu, wd, bd)]


def _run(how: str, act: str, fused: bool, bias: bool, dt=torch.float32):
    # (y, grads, kept bytes without the leaves, slimgrad op names seen in the step)
    def fn(x, wg, bg, wu, bu, wd, bd):
        if how == "eager":
            return _fwd_torch(x, wg, bg, wu, bu, wd, bd, act, fused)
        if fused:
            return gated_mlp_fused(x, wg, wd, bg, bd, act)
        return gated_mlp(x, wg, wu, wd, bg, bu, bd, act)

    f = fn if how in ("uncompiled", "eager") else torch.compile(fn, backend=BACKEND, fullgraph=True)
    if how == "compiled eager":
        f = torch.compile(lambda *a: _fwd_torch(*a, act, fused), backend=BACKEND, fullgraph=True)
    leaves = _leaves(fused, bias, dt)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = f(*leaves)
        found = _walk_savers([y.grad_fn])
        own = {_storage(t)._cdata for t in leaves if t is not None}
        kept = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in own)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dt)
        y.backward(dy)
    names = {e.name for e in prof.events() if e.name.startswith("slimgrad::")}
    return y.detach(), [t.grad for t in leaves if t is not None], kept, names


# each act, each layout (separate or fused gate/up weights) and biases appear once: the traced
# graph's act and the layout's split are separate choices, so a row per pair adds no path
@pytest.mark.parametrize(
    ("act", "fused", "bias"),
    [("silu", False, False), ("gelu_tanh", False, True), ("silu", True, False)],
)
def test_compiled_gated_mlp_keeps_g_and_u_alone(act, fused, bias):
    torch._dynamo.reset()
    try:
        y, grads, kept, names = _run("compiled", act, fused, bias)
        y_ce, grads_ce, kept_ce, _ = _run("compiled eager", act, fused, bias)
    finally:
        torch._dynamo.reset()
    y_ref, grads_ref, kept_ref, _ = _run("uncompiled", act, fused, bias)
    assert not names, names  # no custom op (glu_act_recompute) in the compiled step
    gu = 2 * ROWS * HID * 4  # g and u, float32
    assert kept == gu
    assert kept <= kept_ref  # the uncompiled op keeps g and u (x is a leaf)
    assert kept_ce >= gu + ROWS * HID * 4  # compiled eager keeps the product h besides
    # the forward is eager's ops, traced: compiled eager's bits (the decompositions round
    # act(g) as compiled eager does, not as the uncompiled kernel)
    torch.testing.assert_close(y, y_ce, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref)
    ref = []
    for dt in (torch.float32, torch.float64):
        _, gr, _, _ = _run("eager", act, fused, bias, dt)
        ref.append(gr)
    assert_within_rule(grads, ref[1], ref[0])
    for a, b in zip(grads, grads_ce, strict=True):  # compiled eager's formulas
        torch.testing.assert_close(a, b)


def test_compiled_gated_mlp_no_recompile_across_steps():
    torch._dynamo.reset()
    leaves = _leaves(False, False)
    x, wg, _, wu, _, wd, _ = leaves
    params = [wg, wu, wd]
    opt = torch.optim.SGD(params, lr=0.1)
    f = torch.compile(lambda x, a, b, c: gated_mlp(x, a, b, c), backend=BACKEND)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                opt.zero_grad()
                f(x, *params).square().sum().backward()
                opt.step()
    finally:
        torch._dynamo.reset()


def test_compiled_gated_mlp_outside_the_lean_case():
    # float64 is no compiled lean case: the Function path runs, with eager's gradients
    torch._dynamo.reset()
    try:
        y, grads, _, _ = _run("compiled", "silu", False, True, torch.float64)
    finally:
        torch._dynamo.reset()
    y_ref, grads_ref, _, _ = _run("eager", "silu", False, True, torch.float64)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b)

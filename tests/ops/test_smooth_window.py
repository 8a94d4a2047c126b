"""NOTE [A window from eager's own forward error]: the hard window follows from the forward error
of the op whose output is kept, decided once per process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slimgrad._math import smooth
from tests.ops._output_act_helpers import hard_count


def _accurate(spec):
    # eager's op correctly rounded: the fixed width is all the inverse needs
    return lambda x: spec.f(x.double()).to(x.dtype)


def _off(spec, err):
    # eager's op off by err (absolute) everywhere, as a less accurate vector kernel
    return lambda x: (spec.f(x.double()) + err).to(x.dtype)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_window_follows_forward_error(name):
    spec = {s.name: s for s in (*smooth.GELU.values(), smooth.SILU, smooth.MISH)}[name]
    inv = smooth.inverse(spec)
    w0 = spec.window[torch.float32]
    accurate = dataclasses.replace(spec, op=_accurate(spec))
    assert smooth._measured_window(accurate, inv, torch.float32, "cpu") == w0
    # 3e-7 off: the gradient from y is ~3e-7 / |x - x*| off, past the rule's bound (~1e-6 plus
    # eager's own backward error) up to |x - x*| ~ 0.3 (times the sample margin)
    off = dataclasses.replace(spec, op=_off(spec, 3e-7))
    w = smooth._measured_window(off, inv, torch.float32, "cpu")
    assert 0.2 < w <= smooth._GRID_R
    for dtype in (torch.bfloat16, torch.float16):  # their rounding dominates: the fixed width
        assert smooth._measured_window(accurate, inv, dtype, "cpu") == spec.window[dtype]


def test_window_decided_once_and_used(monkeypatch):
    spec = dataclasses.replace(smooth.GELU["none"], name="gelu_window_test")
    spec = dataclasses.replace(spec, op=_off(spec, 2e-7))
    calls = []
    measured = smooth._measured_window

    def counting(*args):
        calls.append(args[2])
        return measured(*args)

    monkeypatch.setattr(smooth, "_measured_window", counting)
    monkeypatch.setitem(smooth._INVERSES, spec.name, smooth.inverse(smooth.GELU["none"]))
    monkeypatch.setattr(smooth, "_DECIDED", {})
    w, tail = smooth._window(spec, torch.float32)
    assert smooth._window(spec, torch.float32) == (w, tail) and calls == [torch.float32]
    assert w > spec.window[torch.float32]
    # the forward's side table holds every element within the decided window
    torch.manual_seed(0)
    x = torch.randn(40_000) * 0.3 - 0.75
    y, bits, idx, xs = smooth.smooth_fwd(spec, x, spec.op, fallback=False)
    assert idx.numel() == hard_count(spec, x) > int(((x + 0.7518).abs() < 0.03).sum())


def test_first_decision_inside_the_op(monkeypatch):
    # the first call that needs the window may run inside the op's own kernel (below autograd,
    # under the memory tracker): the decision runs there, and the bytes follow from it
    import slimgrad.ops  # noqa: F401
    from slimgrad.memory import measure

    G = __import__("sys").modules["slimgrad.ops.gelu"]
    monkeypatch.setattr(smooth, "_DECIDED", {})
    torch.manual_seed(0)
    x0 = torch.randn(5000) + 1.0
    m = measure(lambda: G.gelu(x0.clone().requires_grad_() * 1).sum())
    k = hard_count(smooth.GELU["none"], x0)
    assert 0 < k and m.saved_bytes == 5000 * 4 + 5000 // 8 + 8 * k

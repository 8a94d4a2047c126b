"""Shared checks for the output-based activations (each tests/ops/test_<stem>.py subclasses
them)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from slimgrad.memory import measure
from slimgrad.ops._output_act import FALLBACK_DIV, _window, inverse
from slimgrad.testing import assert_within_rule, gradcheck_inplace

SHAPES = [(7,), (13, 29), (3, 5, 17)]


@dataclass
class Case:
    name: str
    slim: Callable  # (x, inplace) -> y
    eager: Callable  # (x) -> y, out-of-place torch
    eager_saves_output: bool = False  # eager keeps y (relu/sigmoid/tanh), else x
    bits: bool = False  # keeps 1 bit/elt besides y (leaky_relu slope < 0, elu alpha < 0)
    keeps_y: bool = True
    spec: object = None  # SmoothSpec of gelu/silu/mish
    scale: float = 3.0  # input ~ N(0, scale^2)
    double_backward: bool = True
    tail: float | None = None  # elu: x below it kept exactly (NOTE [ELU's tail])

    def __repr__(self) -> str:
        return self.name


def hard_count(spec, x: torch.Tensor) -> int:
    """Hard elements by the documented rule: |x - x*| < window (the decided one: NOTE [A window
    from eager's own forward error]), x < tail, non-finite."""
    xf = x.detach().float()
    w, tail = _window(spec, x.dtype, x.device)
    hard = ((xf - inverse(spec).x_star).abs() < w) | ~torch.isfinite(xf)
    if tail is not None:
        hard |= xf < tail
    return int(hard.sum())


def dense_tail(case: Case, x: torch.Tensor) -> bool:
    """elu: the tail table would hold as many bytes as x, so x is kept densely."""
    if case.tail is None:
        return False
    k, n, elt = int((x < case.tail).sum()), x.numel(), x.element_size()
    return k > 0 and k * (4 + elt) >= n * elt


def expected_saved(case: Case, x: torch.Tensor) -> int:
    """The docstring's memory contract for one call on x (input created in the step)."""
    n, elt = x.numel(), x.element_size()
    bits = (n + 7) // 8
    if case.tail is not None:
        if dense_tail(case, x):
            return n * elt
        k = int((x < case.tail).sum())
        return n * elt + (bits if case.bits else 0) + k * (4 + elt)
    if case.spec is not None:
        if x.dtype == torch.float64:
            return n * elt  # float64 keeps x densely
        k = hard_count(case.spec, x)
        if k * FALLBACK_DIV > n:
            return n * elt  # dense x only
        return n * elt + bits + k * (4 + elt)
    return (n * elt if case.keeps_y else 0) + (bits if case.bits else 0)


def _rand(shape, dtype=torch.float32, scale=3.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)


def _run(fn, x, g):
    x = x.detach().clone().requires_grad_()
    y = fn(x * 1)  # a non-leaf so in-place forms are allowed
    (gx,) = torch.autograd.grad(y, x, g)
    return y.detach(), gx


class OutputActTests:
    CASES: list[Case] = []
    COMPILE_CASES: list[Case] = []

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", self.CASES, ids=[c.name for c in self.CASES])
        if "ccase" in metafunc.fixturenames:
            cc = self.COMPILE_CASES or self.CASES[:1]
            metafunc.parametrize("ccase", cc, ids=[c.name for c in cc])

    # 1. gradcheck float64 ------------------------------------------------------------------------
    @pytest.mark.parametrize("inplace", [False, True])
    def test_gradcheck(self, case, inplace, device):
        x = _rand((5, 7), torch.float64, case.scale).to(device).requires_grad_()
        if inplace:
            assert gradcheck_inplace(lambda t: case.slim(t * 1, True), x)
        else:
            assert torch.autograd.gradcheck(lambda t: case.slim(t, False), (x,))

    # 2. against eager, every shape, both forms
    # -----------------------------------------------------
    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("inplace", [False, True])
    def test_matches_eager_fp32(self, case, shape, inplace, device):
        x = _rand(shape, scale=case.scale).to(device)
        g = torch.randn(shape).to(device)
        y, gx = _run(lambda t: case.slim(t, inplace), x, g)
        ye, gxe = _run(case.eager, x, g)
        _, gx64 = _run(case.eager, x.double(), g.double())
        torch.testing.assert_close(y, ye)
        torch.testing.assert_close(gx, gxe)
        assert_within_rule(gx, gx64, gxe)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_low_precision_within_rule(self, case, dtype):
        x = _rand((31, 37), dtype, case.scale)
        g = torch.randn(31, 37).to(dtype)
        y, gx = _run(lambda t: case.slim(t, False), x, g)
        ye, gxe = _run(case.eager, x, g)
        _, gx64 = _run(case.eager, x.double(), g.double())
        torch.testing.assert_close(y, ye)
        assert_within_rule(gx, gx64, gxe)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_autocast(self, case, dtype):
        torch.manual_seed(1)
        lin = torch.nn.Linear(19, 23)
        x = torch.randn(11, 19) * case.scale

        def step(act):
            lin.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                h = lin(x)
                y = act(h)
            y.float().square().sum().backward()
            return y.detach(), lin.weight.grad.clone()

        y, gw = step(lambda h: case.slim(h, False))
        ye, gwe = step(case.eager)
        assert y.dtype == ye.dtype == dtype
        torch.testing.assert_close(y, ye)
        torch.testing.assert_close(gw, gwe, atol=2e-2 * gwe.abs().max().item(), rtol=2e-2)

    def test_backward_inputs_subset(self, case):
        torch.manual_seed(2)
        x = torch.randn(9, 13, requires_grad=True)
        w = torch.randn(13, 11, requires_grad=True)
        out = {}
        for tag, fn in (("slim", lambda t: case.slim(t, False)), ("eager", case.eager)):
            x.grad = w.grad = None
            fn(x @ w).square().sum().backward(inputs=[w])
            assert x.grad is None
            out[tag] = w.grad.clone()
        torch.testing.assert_close(out["slim"], out["eager"])

    # 4. memory contract
    # ----------------------------------------------------------------------------
    @pytest.mark.parametrize("inplace", [False, True])
    def test_memory_contract(self, case, inplace):
        x0 = _rand((23, 41), scale=case.scale)
        case.slim(x0.clone().requires_grad_() * 1, inplace).sum().backward()  # build tables once
        m = measure(lambda: case.slim(x0.clone().requires_grad_() * 1, inplace).sum())
        assert m.saved_bytes == expected_saved(case, x0)
        me = measure(lambda: case.eager(x0.clone().requires_grad_() * 1).sum())
        assert me.saved_bytes == x0.numel() * 4
        if case.spec is None and not case.bits and case.tail is None:
            assert m.saved_bytes <= me.saved_bytes
        if case.tail is not None:  # besides y (shared with the next layer): at most eager's x
            assert m.saved_bytes - x0.numel() * 4 * (not dense_tail(case, x0)) <= me.saved_bytes

    def test_memory_shared_with_next_linear(self, case):
        """Linear -> act -> Linear: slimgrad's act adds bits/table at most; eager adds x."""
        torch.manual_seed(3)
        fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        x = torch.randn(32, 16) * case.scale

        def step(act):
            return lambda: fc2(act(fc1(x))).sum()

        step(lambda h: case.slim(h, False))().backward()
        m = measure(step(lambda h: case.slim(h, False)))
        me = measure(step(case.eager))
        h = fc1(x).detach()
        hid = h.numel() * 4
        extra = m.saved_bytes - me.floor_bytes
        assert me.floor_bytes == hid  # fc2's input (fc1's input x is not created in the step)
        fallback = case.spec is not None and hard_count(case.spec, h) * FALLBACK_DIV > h.numel()
        fallback = fallback or dense_tail(case, h)
        y_shared = (case.keeps_y or case.spec is not None) and not fallback
        assert extra == expected_saved(case, h) - (hid if y_shared else 0)
        assert me.saved_bytes == me.floor_bytes + (0 if case.eager_saves_output else hid)
        if case.eager_saves_output or fallback:
            assert m.saved_bytes == me.saved_bytes
        elif case.tail is not None:
            assert m.saved_bytes <= me.saved_bytes
        else:
            assert m.saved_bytes < me.saved_bytes

    # 5. in-place safety
    # ----------------------------------------------------------------------------
    def test_inplace_on_saved_tensor_raises(self, case):
        x = torch.randn(6, 5, requires_grad=True)
        a = x * 2
        b = a * a  # saves a
        case.slim(a, True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            b.sum().backward()

    def test_inplace_on_leaf_refused(self, case):
        x = torch.randn(4, requires_grad=True)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            case.slim(x, True)

    # 6. adversarial
    # ----------------------------------------------------------------------------------
    def test_retain_graph_two_passes(self, case):
        x0 = _rand((8, 9), scale=case.scale)
        res = []
        for fn in (lambda t: case.slim(t, False), case.eager):
            x = x0.clone().requires_grad_()
            y = fn(x * 1).square().sum()
            y.backward(retain_graph=True)
            y.backward()
            res.append(x.grad)
        torch.testing.assert_close(res[0], res[1])

    def test_create_graph(self, case):
        # float64: eager's second derivatives for every op (the smooth ones keep x in float64)
        x0 = _rand((6, 7), torch.float64, case.scale)
        x = x0.clone().requires_grad_()
        (g,) = torch.autograd.grad(case.slim(x * 1, False).square().sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        xe = x0.clone().requires_grad_()
        (ge,) = torch.autograd.grad(case.eager(xe * 1).square().sum(), xe, create_graph=True)
        (gge,) = torch.autograd.grad(ge.sum(), xe)
        torch.testing.assert_close(g, ge)
        torch.testing.assert_close(gg, gge)
        assert torch.autograd.gradgradcheck(lambda t: case.slim(t * 1, False), (x,))

    def test_create_graph_float32(self, case):
        # eager's second derivatives, or (smooth ops keeping y, bits and a table: f'' is not
        # there) a slimgrad error when the first derivative is differentiated; never a silent None
        x0 = _rand((23, 29), torch.float32, case.scale)  # > DENSE_MAX: the table path
        x = x0.clone().requires_grad_()
        (g,) = torch.autograd.grad(case.slim(x * 1, False).square().sum(), x, create_graph=True)
        xe = x0.clone().requires_grad_()
        (ge,) = torch.autograd.grad(case.eager(xe * 1).square().sum(), xe, create_graph=True)
        torch.testing.assert_close(g, ge)
        dense = case.spec is not None and hard_count(case.spec, x0) * FALLBACK_DIV > x0.numel()
        if case.double_backward or dense:
            (gg,) = torch.autograd.grad(g.sum(), x)
            (gge,) = torch.autograd.grad(ge.sum(), xe)
            torch.testing.assert_close(gg, gge)
        else:
            with pytest.raises(RuntimeError, match=r"slimgrad\.ops\.\w+: a second derivative"):
                torch.autograd.grad(g.sum(), x, allow_unused=True)

    @pytest.mark.parametrize("inplace", [False, True])
    def test_hooks_and_retain_grad(self, case, inplace):
        x0 = _rand((5, 6), scale=case.scale)
        res = []
        for fn in (lambda t: case.slim(t, inplace), case.eager):
            x = x0.clone().requires_grad_()
            y = fn(x * 1)
            y.retain_grad()
            seen = []
            y.register_hook(lambda g, seen=seen: seen.append(g.clone()) or g * 2)
            (y * torch.arange(30.0).view(5, 6) / 30).sum().backward()
            res.append((x.grad, y.grad, seen[0]))
        for a, b in zip(*res):
            torch.testing.assert_close(a, b)

    def test_views_and_noncontiguous(self, case):
        base0 = _rand((10, 12), scale=case.scale)
        g = torch.randn(6, 5)
        res = []
        for fn in (lambda t: case.slim(t, False), case.eager):
            base = base0.clone().requires_grad_()
            v = base.t()[2:8, ::2]  # non-contiguous view of a leaf
            assert not v.is_contiguous()
            (gx,) = torch.autograd.grad(fn(v), base, g)
            res.append(gx)
        torch.testing.assert_close(res[0], res[1])
        # in-place on a non-contiguous view of a non-leaf
        res = []
        for fn in (lambda t: case.slim(t, True), lambda t: t.copy_(case.eager(t.clone()))):
            base = base0.clone().requires_grad_()
            h = base * 1
            v = h.t()[2:8, ::2]
            fn(v)
            (gx,) = torch.autograd.grad((h * h).sum(), base)
            res.append((h.detach(), gx))
        torch.testing.assert_close(res[0], res[1])

    @pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
    def test_layout_as_eager(self, case, layout):
        # eager keeps the input's layout; its backward follows the incoming gradient's (NOTE
        # [Layout of the smooth activations]); values as eager's
        torch.manual_seed(5)
        base = _rand((2, 6, 5, 3), scale=case.scale)
        make = {
            "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
            "transposed": lambda t: t.transpose(1, 3),
            "sliced": lambda t: t[:, ::2],
        }[layout]
        shape = make(base).shape
        grads = {
            "contiguous": torch.randn(shape),
            "as_input": make(torch.randn(base.shape)),
            "channels_last": torch.randn(shape).contiguous(memory_format=torch.channels_last),
            "expanded": torch.randn(1).expand(shape),
        }
        for gname, g in grads.items():
            res = []
            for fn in (lambda t: case.slim(t, False), case.eager):
                leaf = base.clone().requires_grad_()
                h = make(leaf * 1)
                y = fn(h)
                (gh,) = torch.autograd.grad(y, h, g)
                res.append((y.detach(), gh))
            (y, gh), (ye, ghe) = res
            assert y.stride() == ye.stride(), (gname, y.stride(), ye.stride())
            assert gh.stride() == ghe.stride(), (gname, gh.stride(), ghe.stride())
            torch.testing.assert_close(y, ye)
            torch.testing.assert_close(gh, ghe)
        # in place on such a view: values and gradients as eager's
        res = []
        for fn in (lambda t: case.slim(t, True), lambda t: t.copy_(case.eager(t.clone()))):
            leaf = base.clone().requires_grad_()
            h = make(leaf * 1)
            y = fn(h)
            assert y is h
            (gl,) = torch.autograd.grad(y, leaf, grads["contiguous"])
            res.append((y.detach(), gl))
        torch.testing.assert_close(res[0], res[1])

    @pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
    def test_no_grad_saves_nothing(self, case, mode, monkeypatch):
        import slimgrad.ops._output_act as oa

        def boom(*a, **k):
            raise AssertionError("side information computed without autograd")

        monkeypatch.setattr(oa, "smooth_fwd", boom)
        monkeypatch.setattr(oa, "smooth_fwd_c", boom)
        for mod_name in ("gelu", "silu", "mish"):
            mod = __import__(f"slimgrad.ops.{mod_name}", fromlist=["x"])
            # ops that imported smooth_fwd by name (gelu); silu/mish reach oa.smooth_fwd
            monkeypatch.setattr(mod, "smooth_fwd", boom, raising=False)
        x = torch.randn(4, 5, requires_grad=True)
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with ctx:
            y = case.slim(x, False)
            y2 = case.slim(x * 1, True)
        assert y.grad_fn is None and y2.grad_fn is None
        torch.testing.assert_close(y, case.eager(x).detach())
        torch.testing.assert_close(y2, y)

    def test_nan_inf_propagate(self, case):
        vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.0, 1e30, -1e30]
        x0 = torch.tensor(vals)
        g = torch.ones(len(vals))
        y, gx = _run(lambda t: case.slim(t, False), x0, g)
        ye, gxe = _run(case.eager, x0, g)
        torch.testing.assert_close(y, ye, equal_nan=True)
        torch.testing.assert_close(gx, gxe, equal_nan=True)

    @pytest.mark.parametrize("shape", [(0,), (3, 0, 2)])
    def test_zero_size(self, case, shape):
        for inplace in (False, True):
            x = torch.randn(shape, requires_grad=True)
            y = case.slim(x * 1, inplace)
            assert y.shape == torch.Size(shape)
            y.sum().backward()
            assert x.grad.shape == torch.Size(shape)

    # compile
    # -----------------------------------------------------------------------------------------
    def test_compile_aot_eager(self, ccase):
        torch._dynamo.reset()
        lin = torch.nn.Linear(12, 10)
        x0 = torch.randn(7, 12) * ccase.scale

        def f(x, act):
            return act(lin(x)).square().sum()

        comp = torch.compile(
            lambda x: f(x, lambda h: ccase.slim(h, False)), backend="aot_eager", fullgraph=True
        )
        res = []
        for fn in (comp, lambda x: f(x, ccase.eager)):
            x = x0.clone().requires_grad_()
            lin.zero_grad()
            out = fn(x)
            out.backward()
            res.append((out.detach(), x.grad, lin.weight.grad.clone()))
        for a, b in zip(*res):
            torch.testing.assert_close(a, b)


def all_float32_between(lo: float, hi: float, stride: int = 1) -> torch.Tensor:
    """Every float32 in [lo, hi] (every ``stride``-th), in increasing bit-pattern order per sign."""
    parts = []
    ranges = ([(lo, min(hi, -0.0))] if lo < 0 else []) + ([(max(lo, 0.0), hi)] if hi > 0 else [])
    for a, b in ranges:
        ia = torch.tensor([a], dtype=torch.float32).view(torch.int32).item()
        ib = torch.tensor([b], dtype=torch.float32).view(torch.int32).item()
        parts.append(
            torch.arange(min(ia, ib), max(ia, ib) + 1, stride, dtype=torch.int32).view(
                torch.float32
            )
        )
    return torch.cat(parts)


def all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


def grid_errors(spec, fwd, bwd_exact, x: torch.Tensor):
    """(ours, eager) pointwise |f' - ref64| on x with g = 1, through the op's side info +
    backward."""
    from slimgrad.ops._output_act import smooth_fwd, smooth_grad

    ours = torch.empty(x.numel(), dtype=torch.float64)
    eager = torch.empty(x.numel(), dtype=torch.float64)
    step = 1 << 21
    for a in range(0, x.numel(), step):
        xc = x[a : a + step]
        y, bits, idx, xs = smooth_fwd(spec, xc, fwd, fallback=False)
        g = torch.ones_like(xc)
        gr = smooth_grad(spec, g, y, bits, idx, xs, bwd_exact)
        ref = spec.df(xc.double())
        ours[a : a + step] = (gr.double() - ref).abs()
        eager[a : a + step] = (bwd_exact(g, xc).double() - ref).abs()
    return ours, eager


def assert_grid_within_rule(ours, eager, atol: float) -> None:
    # where eager's own gradient is NaN with a finite float64 reference (bf16 tanh-GELU with x^3
    # overflowing) the rule has no bound: those points are left out (ours is finite there)
    keep = ~torch.isnan(eager)
    ours, eager = ours[keep], eager[keep]
    bound = 2 * float(eager.max()) + atol
    assert float(ours.max()) <= bound, (float(ours.max()), bound)
    assert not math.isnan(float(ours.max()))

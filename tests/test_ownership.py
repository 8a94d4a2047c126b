"""The 15 ownership cases (research/selective_inplace.md section 6), retain_graph, checkpoint.

Each case runs twice, with reuse on and under ``reuse_disabled()``, and compares every gradient,
captured gradient and hooked tensor bit for bit; it also asserts whether reuse happened. For each
unsafe case a "reckless" Function that overwrites its incoming gradient unconditionally shows the
case really corrupts something (so the refusal is what keeps the result right).
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch.autograd.function import once_differentiable

from slimgrad import _ext, ownership
from tests._ownership_helpers import (  # reuse_on: an autouse fixture
    Double,
    ExpSaved,
    reuse_on,  # noqa: F401
    storage_use_count,
)


class _Reckless(torch.autograd.Function):
    """y = 2x; backward overwrites g unconditionally (inplace-abn PR #218 / Liger RMSNorm style)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out.mul_(2)


class _ReturnsSaved(torch.autograd.Function):
    """loss = sum(y * w) for a root call; backward hands down its saved w itself as dL/dy."""

    @staticmethod
    def forward(ctx, y, w):
        ctx.save_for_backward(w)
        return (y * w).sum()

    @staticmethod
    def backward(ctx, grad_out):
        (w,) = ctx.saved_tensors
        return w, None  # valid: only used as the root, grad_out == 1


N = 7  # prime


def _case(name, fn_cls):
    """Run case ``name`` with the y = 2x Function ``fn_cls``; return {label: tensor} to compare."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, generator=g).requires_grad_()
    w = torch.randn(N, generator=g)
    out: dict[str, torch.Tensor] = {}

    def F(t):
        return fn_cls.apply(t)

    h = x * 1.5
    if name == "plain_chain":
        y = F(h)
        (y * w).sum().backward()
    elif name == "used_twice":
        y = F(h)
        ((y * w).sum() + y.sin().sum()).backward()
    elif name == "y_plus_y":
        y = F(h)
        ((y + y) * w).sum().backward()
    elif name == "retain_grad":
        y = F(h)
        y.retain_grad()
        (y * w).sum().backward()
        out["y.grad"] = y.grad
    elif name == "hook_keeps":
        y = F(h)
        kept = []
        h.register_hook(lambda t: None)
        y.register_hook(lambda t: kept.append(t))
        (y * w).sum().backward()
        out["kept"] = kept[0]
    elif name == "hook_new":
        y = F(h)
        seen = []
        y.register_hook(lambda t: (seen.append(t.clone()), t * 3)[1])
        (y * w).sum().backward()
        out["seen"] = seen[0]
    elif name == "sum_expanded":
        y = F(h)
        y.sum().backward()
    elif name == "sibling_leaf":
        x2 = torch.randn(N, generator=g).requires_grad_()
        y = F(h)
        ((y + x2) * w).sum().backward()
        out["x2.grad"] = x2.grad
    elif name == "sibling_pending":  # Gemma-2: the residual branch still needs the same gradient
        x2 = torch.randn(N, generator=g).requires_grad_()
        r = x2 * 1.25  # created before F: its backward runs after F's, on the same gradient
        y = F(h)
        ((y + r) * w).sum().backward()
        out["x2.grad"] = x2.grad
    elif name == "upstream_saved":
        y = F(h)
        w2 = w.clone()
        _ReturnsSaved.apply(y, w2).backward()
        out["w2"] = w2
    elif name == "user_gradient":
        y = F(h)
        G = torch.randn(N, generator=g)
        y.backward(gradient=G)
        out["G"] = G
    elif name == "grad_of_x_and_y":
        y = F(h)
        dx, dy = torch.autograd.grad((y * w).sum(), [x, y])
        out["dx"], out["dy"] = dx, dy
        return out, x
    elif name == "cat_slice":
        y = F(h)
        c = torch.cat([y, h * 3])
        (c * torch.cat([w, w])).sum().backward()
    elif name == "reshape_view":
        y = F(h.view(1, N)).reshape(N)
        (y * w).sum().backward()
    elif name == "create_graph":
        y = F(h.sin())
        (y * w).sum().backward(create_graph=True)
        gx = x.grad
        out["x.grad"] = gx.detach().clone()
        x.grad = None
        (gx * w).sum().backward()
        out["x.grad2"] = x.grad
        return out, x
    else:
        raise AssertionError(name)
    out["x.grad"] = x.grad
    return out, x


SAFE = [
    "plain_chain",
    "used_twice",
    "y_plus_y",
    "retain_grad",
    "hook_new",
    "sibling_leaf",
    "reshape_view",  # a whole-storage view whose base only the view holds (term 2b)
]
UNSAFE = [
    "hook_keeps",
    "sum_expanded",
    "sibling_pending",
    "upstream_saved",
    "user_gradient",
    "grad_of_x_and_y",
]
CONSERVATIVE = ["cat_slice", "create_graph"]  # safe here, refused by design


def _run(name, fn_cls=Double, disabled=False):
    ownership.reset_reuse_count()
    if disabled:
        with ownership.reuse_disabled():
            out, _ = _case(name, fn_cls)
    else:
        out, _ = _case(name, fn_cls)
    return out, ownership.reuse_count("grad")


def _assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] is not None and b[k] is not None, k
        assert torch.equal(a[k], b[k]), f"{k} differs: {a[k]} vs {b[k]}"


def test_calibrated_on_this_interpreter():
    assert ownership.calibrated(), f"calibration failed on Python {sys.version}"
    assert ownership._VIEW_SIG is not None, "view calibration (term 2b) failed"


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", SAFE + UNSAFE + CONSERVATIVE)
def test_case_matches_out_of_place_bitwise(name):
    ref, n_off = _run(name, disabled=True)
    got, n_on = _run(name)
    assert n_off == 0
    _assert_bitwise(got, ref)
    assert (n_on > 0) == (name in SAFE), f"{name}: reuse count {n_on}"


@pytest.mark.parametrize("name", UNSAFE)
def test_unsafe_case_really_corrupts_without_the_predicate(name):
    ref, _ = _run(name, disabled=True)
    try:
        bad, _ = _run(name, fn_cls=_Reckless)
    except RuntimeError as e:  # the expanded gradient: in-place on overlapping memory
        assert "single memory location" in str(e) or "overlap" in str(e)
        return
    assert any(not torch.equal(bad[k], ref[k]) for k in ref), "case does not exercise corruption"


def test_two_gradients_each_taken():
    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, ga, gb):
            ba = ownership.take(ga)
            bb = ownership.take(gb)
            if ba is not None and bb is not None:
                return ba.mul_(2).add_(bb.mul_(3))
            return ga * 2 + gb * 3

    def go(disabled):
        x = torch.randn(N, generator=torch.Generator().manual_seed(9)).requires_grad_()
        w = torch.randn(N, generator=torch.Generator().manual_seed(10))
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if disabled else _null():
            a, b = Two.apply(x * 1)
            ((a * w).sum() + (b * w * w).sum()).backward()
        return x.grad, ownership.reuse_count("grad")

    g0, n0 = go(True)
    g1, n1 = go(False)
    assert (n0, n1) == (0, 2)
    assert torch.equal(g0, g1)


def test_retain_graph_twice():
    def go(disabled):
        x = torch.randn(N, generator=torch.Generator().manual_seed(3)).requires_grad_()
        w = torch.randn(N, generator=torch.Generator().manual_seed(4))
        ownership.reset_reuse_count()
        ctx = ownership.reuse_disabled() if disabled else _null()
        with ctx:
            loss = (Double.apply(x * 1.5).sin() * w).sum()
            loss.backward(retain_graph=True)
            first = x.grad.clone()
            loss.backward()
        return first, x.grad, ownership.reuse_count("grad")

    f0, g0, n0 = go(True)
    f1, g1, n1 = go(False)
    assert n0 == 0 and n1 == 2
    assert torch.equal(f0, f1) and torch.equal(g0, g1)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_nesting(reentrant):
    def block(t):
        return Double.apply(t.sin()).cos()

    def outer(t):
        return ckpt.checkpoint(block, t * 1.1, use_reentrant=reentrant) * 2

    def go(disabled):
        x = torch.randn(N, generator=torch.Generator().manual_seed(5)).requires_grad_()
        w = torch.randn(N, generator=torch.Generator().manual_seed(6))
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if disabled else _null():
            y = ckpt.checkpoint(outer, x, use_reentrant=reentrant)
            (y * w).sum().backward()
        return x.grad, ownership.reuse_count("grad")

    g0, n0 = go(True)
    g1, n1 = go(False)
    assert n0 == 0
    assert torch.equal(g0, g1)
    assert n1 >= 1  # the recomputed Function's backward gets a fresh gradient from cos's backward


def test_env_var_disables(monkeypatch):
    monkeypatch.setenv("SLIMGRAD_NO_REUSE", "1")
    _, n = _run("plain_chain")
    assert n == 0
    monkeypatch.setenv("SLIMGRAD_NO_REUSE", "0")
    _, n = _run("plain_chain")
    assert n == 1


def test_failed_calibration_never_reuses(monkeypatch):
    monkeypatch.setattr(ownership, "_GRAD_REFCOUNT", None)
    assert not ownership.calibrated()
    _, n = _run("plain_chain")
    assert n == 0


def test_refcount_baseline_matches_independent_probe():
    # Re-measure the engine's refcount on a gradient with the same call depth as take(),
    # independently of ownership's own calibration Function.
    seen = []

    def probe(t):
        return sys.getrefcount(t), t._use_count()

    class P(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x + 1

        @staticmethod
        def backward(ctx, grad_out):
            seen.append(probe(grad_out))
            return grad_out

    x = torch.randn(3, requires_grad=True)
    (P.apply(x) * 2).sum().backward()
    assert ownership.calibrated()
    assert seen == [ownership._GRAD_REFCOUNT["plain"]]


def test_refused_outside_backward_and_in_grad_mode():
    g = torch.randn(N)
    assert not ownership.reusable(g)
    assert ownership.take(None) is None


def test_reuse_count_bad_kind():
    with pytest.raises(ValueError, match="slimgrad.ownership.reuse_count: unknown kind"):
        ownership.reuse_count("nope")


# Saved tensors ----------------------------------------------------------------------------------


class _ExpSavedOutput(torch.autograd.Function):
    """y = exp(x) saved as the output itself (shared with the caller)."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors
        buf = ownership.take_saved(ctx, y)
        if buf is not None:
            return buf.mul_(grad_out)
        return grad_out * y


def _saved_run(fn, x_seed=7, keep_output=False, retain=False):
    x = torch.randn(N, generator=torch.Generator().manual_seed(x_seed)).requires_grad_()
    w = torch.randn(N, generator=torch.Generator().manual_seed(8))
    ownership.reset_reuse_count()
    y = fn.apply(x * 1.0)
    loss = (y * w).sum()
    kept = y if keep_output else None
    del y
    loss.backward(retain_graph=retain)
    return x, loss, kept, ownership.reuse_count("saved")


def test_saved_tensor_reused_at_last_use():
    x, _, _, n = _saved_run(ExpSaved)
    assert n == 1
    torch.testing.assert_close(
        x.grad,
        (x.detach() * 1.0).exp() * torch.randn(N, generator=torch.Generator().manual_seed(8)),
        rtol=0,
        atol=0,
    )


def test_saved_tensor_second_backward_raises_clearly():
    x = torch.randn(N, requires_grad=True)
    ownership.reset_reuse_count()
    loss = ExpSaved.apply(x * 1.0).sum()  # only ExpSaved keeps tensors in this graph
    loss.backward()
    assert ownership.reuse_count("saved") == 1
    with pytest.raises(RuntimeError, match="tests._ExpSaved: backward ran a second time"):
        loss.backward()


def test_saved_tensor_retain_graph_not_reused():
    x, loss, _, n = _saved_run(ExpSaved, retain=True)
    assert n == 0
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=0)


def test_saved_output_held_by_user_not_reused():
    x, _, kept, n = _saved_run(_ExpSavedOutput, keep_output=True)
    assert n == 0
    assert torch.equal(kept, (x.detach() * 1.0).exp())


def test_saved_output_dropped_by_user():
    # The output's Python object is gone; the saved tensor is then held by autograd only. Either
    # decision is safe; what matters is the gradient.
    x, _, _, n = _saved_run(_ExpSavedOutput)
    w = torch.randn(N, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(x.grad, (x.detach() * 1.0).exp() * w, rtol=0, atol=0)


def test_saved_tensor_shared_with_a_pending_graph_not_reused():
    x = torch.randn(N, requires_grad=True)
    w = torch.randn(N)
    ownership.reset_reuse_count()
    y = _ExpSavedOutput.apply(x * 1.0)
    l1 = (y * w).sum()
    yd = y.detach().requires_grad_()
    l2 = yd.sin().sum()  # another graph saves the same storage for a backward that has not run yet
    del y
    l1.backward()
    assert ownership.reuse_count("saved") == 0
    l2.backward()
    e = x.detach().exp()
    torch.testing.assert_close(x.grad, e * w, rtol=0, atol=0)
    torch.testing.assert_close(yd.grad, e.cos(), rtol=0, atol=0)


def test_saved_reuse_under_memory_tracker_lowers_backward_peak_by_one_buffer():
    from slimgrad.memory import measure

    n = 1031
    x = torch.randn(n, requires_grad=True)

    def step():
        return ExpSaved.apply(x).sum()

    peaks = []
    for disabled in (True, False):
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if disabled else _null():
            m = measure(step)
        bwd_peak = max(live for i, _, live in m.timeline if i > m.backward_start)
        peaks.append((bwd_peak, ownership.reuse_count("saved")))
        x.grad = None
    (off, n_off), (on, n_on) = peaks
    assert (n_off, n_on) == (0, 1)
    assert off - on == n * 4  # dx written into the dead exp(x) buffer instead of a new one


def test_saved_reuse_refused_when_a_pack_hook_keeps_the_tensor():
    kept = []

    def pack(t):
        a = t.detach()
        kept.append(a)
        return a

    x = torch.randn(N, requires_grad=True)
    ownership.reset_reuse_count()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ExpSaved.apply(x * 1.0).sum()
    loss.backward()
    assert ownership.reuse_count("saved") == 0
    assert torch.equal(kept[0], x.detach().exp())


def test_switch_is_seen_by_other_threads():
    # autograd runs CUDA backward functions on device threads: the switch must be process-wide
    import threading

    seen = []
    with ownership.reuse_disabled():
        th = threading.Thread(target=lambda: seen.append(ownership._disabled()))
        th.start()
        th.join()
    assert seen == [True]
    assert not ownership._disabled()


class _DoubleOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        buf = ownership.take(grad_out)
        if buf is not None:
            return buf.mul_(2)
        return grad_out * 2


class _DoubleViaHelper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        return _helper(grad_out)


def _helper(g):  # one frame too many: take() must refuse, whatever the count
    buf = ownership.take(g)
    return buf.mul_(2) if buf is not None else g * 2


@pytest.mark.parametrize("name", SAFE + UNSAFE)
def test_once_differentiable_backward(name):
    ref, _ = _run(name, disabled=True)
    got, n_on = _run(name, fn_cls=_DoubleOnce)
    _assert_bitwise(got, ref)
    assert (n_on > 0) == (name in SAFE), f"{name}: reuse count {n_on}"


def test_take_from_a_helper_frame_is_refused():
    ref, _ = _run("plain_chain", disabled=True)
    got, n = _run("plain_chain", fn_cls=_DoubleViaHelper)
    _assert_bitwise(got, ref)
    assert n == 0


def test_hook_that_keeps_the_storage_object_is_refused():
    def go(fn_cls, disabled=False):
        x = torch.randn(N, generator=torch.Generator().manual_seed(11)).requires_grad_()
        w = torch.randn(N, generator=torch.Generator().manual_seed(12))
        kept = []
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if disabled else _null():
            y = fn_cls.apply(x * 1.5)
            y.register_hook(lambda g: kept.append((g.untyped_storage(), g.shape)))
            (y * w).sum().backward()
        st, shape = kept[0]
        seen = torch.empty(0).set_(st, 0, shape)  # what the storage's keeper reads later
        return seen.clone(), x.grad, ownership.reuse_count("grad")

    ref_seen, ref_grad, _ = go(Double, disabled=True)
    seen, grad, n = go(Double)
    assert n == 0
    assert torch.equal(seen, ref_seen) and torch.equal(grad, ref_grad)
    bad_seen, _, _ = go(_Reckless)
    assert not torch.equal(bad_seen, ref_seen)  # the case is real: an overwrite would show


# Gradients that arrive as views (NOTE [Gradient-buffer ownership], term 2b) ---------------------
#
# Each case: the y = 2x Function F sits where its incoming gradient is a view; runs with reuse on,
# under reuse_disabled(), and with the reckless Function (for the unsafe cases, to show that an
# overwrite there really corrupts something). Every gradient and kept tensor is compared bit for
# bit.

B, T, DI, DH = 2, 3, 5, 4  # 3-D activations (B, T, D) as in a transformer block


class _Upstream(torch.autograd.Function):
    """Identity forward; backward hands down ``make(g)`` as the gradient (a view of some kind)."""

    @staticmethod
    def forward(ctx, x, make):
        ctx.make = make
        return x.view_as(x) * 1

    @staticmethod
    def backward(ctx, g):
        return ctx.make(g), None


class _SavedAsGrad(torch.autograd.Function):
    """Identity forward that saves a fresh tensor w; backward hands down a view of w itself."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return w.view(g.shape), None


class _TwoViews(torch.autograd.Function):
    """a + b forward; backward hands both inputs whole-storage views of ONE buffer."""

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        base = g * 1
        return base.view(g.shape), base.view(g.shape)


def _deref(ref):
    # what a weak reference's holder reads later: the tensor if it is still alive (out of place it
    # is not: nothing else keeps it), else a sentinel
    t = ref()
    return torch.full((1,), -1.0) if t is None else t.clone()


def _view_case(name, fn_cls):
    """Run view case ``name``; return ({label: tensor}, retain-graph second pass or None)."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(B, T, DI, generator=gen).requires_grad_()
    w1 = torch.randn(DH, DI, generator=gen).requires_grad_()
    b1 = torch.randn(DH, generator=gen).requires_grad_()
    w2 = torch.randn(3, DH, generator=gen).requires_grad_()
    b2 = torch.randn(3, generator=gen).requires_grad_()
    wl = torch.randn(B, T, 3, generator=gen)
    wn = torch.randn(B, T, DH, generator=gen)
    out: dict[str, torch.Tensor] = {}

    def F(t):
        return fn_cls.apply(t)

    def lin2(t):  # its backward hands F a reshape view of the 2-D mm result
        return torch.nn.functional.linear(t, w2, b2)

    h = torch.nn.functional.linear(x, w1, b1)  # (B, T, DH)
    if name == "linear3d":
        (lin2(F(h)) * wl).sum().backward()
    elif name == "linear3d_chain":  # F2 hands F1 the very view it overwrote
        (lin2(F(F(h))) * wl).sum().backward()
    elif name == "linear3d_retain_graph":
        loss = (lin2(F(h)) * wl).sum()
        loss.backward(retain_graph=True)
        out["x.grad1"] = x.grad.clone()
        loss.backward()
    elif name == "base_kept_by_hook":  # a hook keeps the (B*T, DH) base of F's incoming view
        kept = []
        v = F(h).view(B * T, DH)
        v.register_hook(kept.append)
        (v.view(B, T, DH) * wn).sum().backward()
        out["kept"] = kept[0]
    elif name == "base_kept_by_prehook":  # the same through a node prehook inside nn.Linear
        kept = []
        z = lin2(F(h))
        node = z.grad_fn.next_functions[0][0].next_functions[1][0]  # ViewBackward0 of F(h)
        assert type(node).__name__ == "ViewBackward0", node
        node.register_prehook(lambda gi: kept.append(gi[0]))
        (z * wl).sum().backward()
        out["kept"] = kept[0]
    elif name == "grad_of_base":  # autograd.grad captures the base itself (the engine holds it)
        v = F(h).view(B * T, DH)
        dx, dv = torch.autograd.grad((v.view(B, T, DH) * wn).sum(), [x, v])
        return {"dx": dx, "dv": dv}
    elif name == "base_retain_grad":
        v = F(h).view(B * T, DH)
        v.retain_grad()
        (v.view(B, T, DH) * wn).sum().backward()
        out["v.grad"] = v.grad
    elif name == "base_weakref":  # a later hook reads the base through a weak reference
        refs, seen = [], []
        z = lin2(F(h))
        node = z.grad_fn.next_functions[0][0].next_functions[1][0]  # ViewBackward0 of F(h)
        node.register_prehook(lambda gi: refs.append(weakref.ref(gi[0])))  # the 2-D base
        h.register_hook(lambda t: seen.append(_deref(refs[0])))
        (z * wl).sum().backward()
        out["seen"] = seen[0]
    elif name == "grad_weakref":  # the same on the view itself
        refs, seen = [], []
        y = F(h)
        y.register_hook(lambda t: refs.append(weakref.ref(t)))
        h.register_hook(lambda t: seen.append(_deref(refs[0])))
        (lin2(y) * wl).sum().backward()
        out["seen"] = seen[0]
    elif name == "two_views":  # two whole-storage views of one buffer, two pending backwards
        (_TwoViews.apply(F(h), F(h * 0.5)) * wn).sum().backward()
    elif name == "cat_halves":  # chunk-like: each backward gets a half of one buffer
        (torch.cat([F(h), F(h * 0.5)], dim=-1) * torch.cat([wn, wn], dim=-1)).sum().backward()
    elif name == "partial_slice":  # a view of part of a buffer nobody else reads
        (
            torch.cat([F(h), torch.ones(B, T, 1)], dim=-1)
            * torch.randn(B, T, DH + 1, generator=gen)
        ).sum().backward()
    elif name in ("offset_view", "expanded", "overlap_strided", "as_strided_whole", "transposed"):
        make = {
            "offset_view": lambda g: torch.cat([g.reshape(-1)[:1], g.reshape(-1)])[1:].view(
                g.shape
            ),
            "expanded": lambda g: (g[:1] * 1).expand(g.shape),
            "overlap_strided": lambda g: (
                (g * 1).reshape(-1)[: g.shape[-1]].as_strided(g.shape, (0, 0, 1))
            ),
            "as_strided_whole": lambda g: torch.as_strided(g * 1, g.shape, g.stride(), 0),
            "transposed": lambda g: (g * 1).transpose(0, 2).contiguous().transpose(0, 2),
        }[name]
        (_Upstream.apply(F(h), make) * wn).sum().backward()
    elif name == "saved_view":  # the upstream's saved tensor, dead once its backward ran
        wsave = torch.randn(B, T, DH, generator=gen)
        (_SavedAsGrad.apply(F(h), wsave * 1) * wn).sum().backward()
    elif name == "saved_view_user_holds":  # the saved tensor is also the user's
        wsave = torch.randn(B, T, DH, generator=gen)
        (_SavedAsGrad.apply(F(h), wsave) * wn).sum().backward()
        out["wsave"] = wsave
    elif name == "saved_view_retain_graph":  # the graph keeps the saved tensor for a 2nd pass
        loss = (_SavedAsGrad.apply(F(h), torch.randn(B, T, DH, generator=gen) * 1) * wn).sum()
        loss.backward(retain_graph=True)
        assert ownership.reuse_count("grad") == 0  # first pass: the graph still holds w
        out["x.grad1"] = x.grad.clone()
        loss.backward()
    elif name == "checkpoint":

        def block(t):
            return lin2(F(t.sin()))

        def outer(t):
            return ckpt.checkpoint(block, t * 1.1, use_reentrant=False) * 2

        (ckpt.checkpoint(outer, h, use_reentrant=False) * wl).sum().backward()
    else:
        raise AssertionError(name)
    out["x.grad"] = x.grad
    for k, p in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        if p.grad is not None:
            out[k + ".grad"] = p.grad
    return out


# name -> reuses granted (exact): the view cases that are safe and granted
VIEW_GRANTED = {
    "linear3d": 1,
    "linear3d_chain": 2,
    "linear3d_retain_graph": 2,  # only incoming gradients: the second pass is exact
    "as_strided_whole": 1,
    "transposed": 1,  # non-contiguous but dense over its whole storage
    "saved_view": 1,  # the saved tensor was released with its node: the view is all that is left
    "saved_view_retain_graph": 1,  # the second pass only (asserted inside the case)
    "checkpoint": 1,
    "base_retain_grad": 1,  # retain_grad stores a clone of the base's gradient
    # the first F's view is refused (the second view shares the storage); once it is gone, the
    # second F's view is the only way to the buffer and is granted
    "two_views": 1,
}
# safe or not, refused; the ones marked unsafe corrupt something when overwritten unconditionally
VIEW_REFUSED_UNSAFE = [
    "base_kept_by_hook",
    "base_kept_by_prehook",
    "base_weakref",
    "grad_weakref",
    "expanded",
    "overlap_strided",
    "saved_view_user_holds",
    "grad_of_base",
]
# cases where an unconditional overwrite corrupts something (or autograd raises)
CORRUPTIBLE = VIEW_REFUSED_UNSAFE + ["two_views", "saved_view_retain_graph"]
VIEW_REFUSED_SAFE = ["cat_halves", "partial_slice", "offset_view"]  # partial coverage, by design


def _view_run(name, fn_cls=Double, disabled=False):
    ownership.reset_reuse_count()
    with ownership.reuse_disabled() if disabled else _null():
        out = _view_case(name, fn_cls)
    return out, ownership.reuse_count("grad")


@pytest.fixture(params=["ext", "python"])
def view_path(request, monkeypatch):
    # NOTE [View gradients asked in C++]: term 2b asked by the extension's view_base (counted, so
    # a case that never reaches it cannot pass for it), or by _view_sig in Python
    assert ownership.storage_facts_available() and ownership._view_base_sig() is not None
    calls = []
    if request.param == "python":
        monkeypatch.setattr(ownership, "_VIEW_EXT", [None])
    else:
        real = ownership._VIEW_BASE
        monkeypatch.setattr(ownership, "_VIEW_BASE", lambda t: calls.append(1) or real(t))
    monkeypatch.setattr(
        ownership, "_view_sig", lambda t, f, real=ownership._view_sig: calls.append(0) or real(t, f)
    )
    return request.param, calls


@pytest.mark.parametrize("name", list(VIEW_GRANTED) + VIEW_REFUSED_UNSAFE + VIEW_REFUSED_SAFE)
def test_view_gradient_case_bitwise(name, view_path):
    ref, n_off = _view_run(name, disabled=True)
    path, calls = view_path
    got, n_on = _view_run(name)
    if name in VIEW_GRANTED or calls:  # every view question went the way the fixture chose
        assert set(calls) == {1 if path == "ext" else 0}, calls
    assert n_off == 0
    _assert_bitwise(got, ref)
    if name in VIEW_GRANTED:
        assert n_on == VIEW_GRANTED[name], f"{name}: reuse count {n_on}"
    else:
        assert n_on == 0, f"{name}: reuse granted, count {n_on}"


@pytest.mark.parametrize("name", CORRUPTIBLE)
def test_view_unsafe_case_really_corrupts_without_the_predicate(name):
    ref, _ = _view_run(name, disabled=True)
    try:
        bad, _ = _view_run(name, fn_cls=_Reckless)
    except RuntimeError as e:  # overlapping memory, or autograd's version check on a saved w
        msg = str(e)
        assert (
            "single memory location" in msg or "overlap" in msg or "modified by an inplace" in msg
        )
        return
    assert any(not torch.equal(bad[k], ref[k]) for k in ref), "case does not exercise corruption"


def test_view_gradient_is_really_a_view_and_is_overwritten():
    # The 3-D linear case is the one that matters: the gradient F receives is a view of the 2-D
    # mm result, and with reuse dx is written into that very buffer.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, DI, generator=gen).requires_grad_()
    lin1, lin2 = torch.nn.Linear(DI, DH), torch.nn.Linear(DH, 3)
    h = lin1(x)
    y = Double.apply(h)
    info = {}

    def on_dy(t):
        info["view"], info["dy"] = t._is_view(), t.data_ptr()

    y.register_hook(on_dy)  # keeps no reference
    h.register_hook(lambda t: info.__setitem__("dx", t.data_ptr()))
    ownership.reset_reuse_count()
    lin2(y).sum().backward()
    assert info["view"] and ownership.reuse_count("grad") == 1
    assert info["dx"] == info["dy"]


def test_view_base_pair_measured_at_the_first_view_question_that_can(monkeypatch):
    # NOTE [View gradients asked in C++]: a first view question where a calibration would be
    # disturbed asks _view_sig (the same grants) and measures nothing; the next one measures
    assert ownership.storage_facts_available()
    monkeypatch.setattr(ownership, "_VIEW_EXT", [])
    with monkeypatch.context() as m:
        m.setattr(ownership, "_calibration_undisturbed", lambda: False)
        assert _view_run("linear3d")[1] == VIEW_GRANTED["linear3d"]
        assert ownership._VIEW_EXT == []
    asked = []
    real = ownership._VIEW_BASE
    monkeypatch.setattr(ownership, "_VIEW_BASE", lambda t: asked.append(1) or real(t))
    assert _view_run("linear3d")[1] == VIEW_GRANTED["linear3d"]
    assert ownership._VIEW_EXT and ownership._VIEW_EXT[0] is not None
    assert len(asked) > 1  # the measurement's probes, then the question


def test_failed_view_calibration_refuses_views_only(monkeypatch):
    monkeypatch.setattr(ownership, "_VIEW_SIG", None)
    assert _view_run("linear3d")[1] == 0
    assert _view_run("linear3d_chain")[1] == 1  # F1 gets F2's plain dx


def test_view_calibration_failure_refuses_views_only(monkeypatch):
    for name in ("_GRAD_REFCOUNT", "_SAVED_SIGS", "_STORAGE_SIG", "_VIEW_SIG"):
        monkeypatch.setattr(ownership, name, getattr(ownership, name))  # restored afterwards
    monkeypatch.setattr(ownership, "_view_sig", lambda t, f: None)  # the view probe fails
    ownership._calibrate()
    assert ownership.calibrated() and ownership._VIEW_SIG is None
    monkeypatch.undo()  # the real _view_sig and the import-time calibration
    assert ownership._VIEW_SIG is not None


@pytest.mark.parametrize("accumulate", [False, True], ids=["grad_none", "grad_accumulates"])
def test_gradient_shared_with_a_parameters_accumulate_grad(accumulate):
    # The data-parallel case without the wrapper (NOTE [Gradient-buffer ownership], "Distributed"):
    # ``z = F(h) + pos`` hands one gradient to pos's AccumulateGrad and to F's backward. Whatever
    # take decides, pos.grad (what DDP's bucket would reduce) and x.grad are reuse-off's bits: a
    # grant before AccumulateGrad had read the gradient would double pos.grad.
    def run(reuse: bool):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(N, generator=g).requires_grad_()
        pos = torch.nn.Parameter(torch.randn(N, generator=g))
        for _ in range(2 if accumulate else 1):  # no_sync-style accumulation into pos.grad
            with contextlib.nullcontext() if reuse else ownership.reuse_disabled():
                ((Double.apply(x * 1) + pos) * torch.arange(N)).sum().backward()
        return x.grad, pos.grad

    ownership.reset_reuse_count()
    on = run(True)
    granted = ownership.reuse_count("grad")
    off = run(False)
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(on[1], torch.arange(N, dtype=on[1].dtype) * (2 if accumulate else 1))
    assert granted == (2 if accumulate else 1)  # AccumulateGrad copied it first: a safe grant


# NOTE [Calibration per call mode] in ownership.py -------------------------------------------------

_AFTER_FAILED_COMPILE = r"""
import torch
from slimgrad import _ext, ownership

class D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        buf = ownership.take(g)
        return g.mul_(2) if buf is not None else g * 2

def reuses():
    ownership.reset_reuse_count()
    x = torch.randn(8, requires_grad=True)
    (D.apply(x * 1) * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((8,), 6.0))
    return ownership.reuse_count()

class Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t._is_view()  # Dynamo cannot trace this: fullgraph raises
        return t * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2

mode = ownership._call_mode()
assert reuses() == 1
try:
    torch.compile(lambda t: Bad.apply(t), fullgraph=True)(torch.randn(3, requires_grad=True))
except Exception:
    pass
else:
    raise SystemExit("the trace was expected to fail")
print("MODE_CHANGED", ownership._call_mode() != mode)
print("REUSES", reuses(), reuses())
"""


def test_reuse_survives_a_failed_compile():
    # A failed Dynamo trace leaves CPython's eval-frame hook installed, which adds one reference to
    # every argument of a nested call; reuse was refused for the rest of the process. Own process:
    # the hook cannot be removed afterwards.
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _AFTER_FAILED_COMPILE], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    if "MODE_CHANGED True" not in out.stdout:
        pytest.skip("this torch/Python leaves no eval-frame hook after a failed trace")
    assert "REUSES 1 1" in out.stdout, out.stdout


def test_new_call_mode_calibrates_once_and_only_undisturbed(monkeypatch):
    real = ownership._call_mode()
    # 100 more holders of the mode probe: every question, one plain call deep, sees a new call mode
    held = [ownership._MODE_PROBE] * 100  # noqa: F841  (held for the test)
    monkeypatch.setattr(ownership, "_BY_MODE", dict(ownership._BY_MODE))
    monkeypatch.setattr(ownership, "_MODE", ownership._MODE)
    before = ownership._BY_MODE[real]

    def run():
        ownership.reset_reuse_count()
        x = torch.randn(6, requires_grad=True)
        (Double.apply(x * 1) * 3).sum().backward()
        assert torch.equal(x.grad, torch.full((6,), 6.0))
        return ownership.reuse_count()

    # saved-tensor hooks active (checkpointing, save_on_cpu): no calibration there, reuse refused
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not ownership._ensure_calibrated()
    assert real + 100 not in ownership._BY_MODE
    # undisturbed: calibrated once (inside backward), the same baselines as at import
    assert run() == 1
    assert ownership._BY_MODE[real + 100] == before
    assert ownership._MODE == real + 100
    assert run() == 1


def test_calibration_leaves_the_global_rng_alone(monkeypatch):
    # import slimgrad and a new call mode's calibration (mid-training, inside a backward) must not
    # draw from torch's global generator: a seeded run's data and dropout masks would shift
    real = ownership._call_mode()
    # 200 more holders of the mode probe: every question, one plain call deep, sees a new call mode
    held = [ownership._MODE_PROBE] * 200  # noqa: F841  (held for the test)
    monkeypatch.setattr(ownership, "_BY_MODE", dict(ownership._BY_MODE))
    monkeypatch.setattr(ownership, "_MODE", ownership._MODE)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert ownership._ensure_calibrated() and real + 200 in ownership._BY_MODE
    assert torch.equal(torch.get_rng_state(), state)


# Storage facts without a storage object (NOTE [Storage facts without a storage object]) ------


class _DoubleSeen(Double):
    """Double that records the storage use count and data pointer of what it returns."""

    seen: list = []

    @staticmethod
    def backward(ctx, grad_out):
        buf = ownership.take(grad_out)
        out = buf.mul_(2) if buf is not None else grad_out * 2
        _DoubleSeen.seen.append((buf is not None, storage_use_count(out), out.data_ptr()))
        return out


def test_granted_gradient_is_summed_in_place_by_the_engine():
    # h feeds a mean (its gradient is an expand: the engine cannot sum into it) and, later in
    # forward, _DoubleSeen: so _DoubleSeen's backward runs first and the engine sums the mean's
    # gradient into the buffer _DoubleSeen returned, in place only if the checks left no second
    # holder of its storage (a storage object made by a check stays alive with the storage).
    x = torch.randn(N, requires_grad=True)
    h = x * 1.5
    b = h.mean()
    a = _DoubleSeen.apply(h) * 3
    got = []
    h.register_hook(lambda g: got.append(g.data_ptr()))
    _DoubleSeen.seen.clear()
    ownership.reset_reuse_count()
    (a.sum() + b).backward()
    ((granted, count, ptr),) = _DoubleSeen.seen
    assert granted and ownership.reuse_count("grad") == 1
    assert count == 1  # nothing but the tensor holds the storage after the checks
    assert got == [ptr]  # the sum went into the granted buffer: no new allocation
    torch.testing.assert_close(x.grad, torch.full((N,), 1.5 * (6 + 1 / N)), rtol=0, atol=0)


def test_storage_object_only_torch_keeps_is_not_a_holder():
    # A hook that asks for the storage object and drops it: PyTorch keeps that object alive with
    # the storage (one more use), nobody holds it, so reuse is still granted (and bitwise the same).
    def go(disabled):
        x = torch.randn(N, generator=torch.Generator().manual_seed(3)).requires_grad_()
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if disabled else _null():
            y = Double.apply(x * 1.5)
            y.register_hook(lambda g: g.untyped_storage().nbytes() and None)
            (y * 3).sum().backward()
        return x.grad, ownership.reuse_count("grad")

    ref, _ = go(True)
    got, n = go(False)
    assert n == 1
    assert torch.equal(got, ref)


def test_storage_facts_read_what_the_storage_object_says():
    import numpy as np

    assert ownership.storage_facts_available(), _ext.error()
    big = torch.empty(100)
    big.resize_(10)  # the storage keeps its 400 bytes
    ts = [
        torch.empty(3),
        torch.randn(4, 5, dtype=torch.float64).t(),
        torch.zeros(7, dtype=torch.int8),
        big,
        torch.from_numpy(np.ones(5, dtype=np.float32)),
    ]
    for t in ts:
        f = _ext.facts(t)
        assert f[0] == t._use_count()
        assert f[1] == storage_use_count(t)
        assert ownership._storage_nbytes(t) == t.untyped_storage().nbytes()
        assert _ext.facts(t)[3] == 1  # the storage object untyped_storage() made
    assert not ownership._dense_whole(big)  # covers 40 of its storage's 400 bytes
    assert ownership._torch_owned(torch.empty(5)) and ownership._torch_owned(torch.randn(2, 3) + 1)
    assert not ownership._torch_owned(torch.from_numpy(np.ones(5, dtype=np.float32)))
    assert not ownership._torch_owned(torch.frombuffer(bytearray(8), dtype=torch.float32))
    assert not ownership._torch_owned(torch.ones(4).share_memory_())
    fresh = torch.empty(6)
    for check in (ownership._torch_owned, ownership._dense_whole, ownership._storage_alone):
        assert check(fresh)
    assert storage_use_count(fresh) == 1  # none of the checks made a storage object
    assert _ext.facts(fresh)[3] == 0
    view = fresh.view(2, 3)
    assert _ext.facts(view)[6] == _ext.facts(fresh)[6] != _ext.facts(torch.empty(6))[6]
    assert _ext.facts(fresh)[1] == 2  # the view's TensorImpl holds the storage too


def _without_extension(monkeypatch):
    # as if the C++ extension could not be built (no compiler, a compile error)
    monkeypatch.setattr(ownership, "_FACTS", None)
    monkeypatch.setattr(ownership, "_STORAGE_SIG", None)
    monkeypatch.setattr(
        _ext, "_state", {"module": None, "error": "simulated", "tried": True, "seconds": 0.0}
    )


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", SAFE + UNSAFE + CONSERVATIVE)
def test_without_the_extension_nothing_is_granted_and_results_are_the_same(monkeypatch, name):
    ref, _ = _run(name, disabled=True)
    _without_extension(monkeypatch)
    assert not ownership.storage_facts_available()
    got, n_on = _run(name)
    _assert_bitwise(got, ref)
    assert n_on == 0, f"{name}: reuse count {n_on}"
    assert not ownership._storage_alone(torch.empty(3))
    assert not ownership._torch_owned(torch.empty(3))


def test_storages_on_reused_heap_memory_are_still_torch_owned():
    # A StorageImpl allocated where freed data lay keeps that data in its padding: only the words
    # the layout calibration located (size, deleter) may decide, never such a word (a first
    # version also compared a word the import-time samples shared by chance, and refused storages
    # at random later in a process).
    for size in (24, 30, 40, 56, 64):
        junk = [torch.full((size,), -1, dtype=torch.int32) for _ in range(300)]
        del junk
        fresh = [torch.empty(size) for _ in range(300)] + [torch.ones(size) * 2 for _ in range(50)]
        assert all(ownership._torch_owned(t) for t in fresh)
        assert all(ownership._dense_whole(t) for t in fresh)
        assert all(storage_use_count(t) == 1 for t in fresh)


def test_a_refused_alias_gets_no_storage_object():
    # Another tensor shares the storage (one use more) and no storage object exists: refused
    # without making one, so once the alias is gone the buffer is a fresh one again (and the
    # engine may sum into it in place).
    t = torch.empty(9)
    alias = t.view(3, 3)
    assert storage_use_count(t) == 2
    assert not ownership._storage_alone(t)
    assert storage_use_count(t) == 2  # nothing was added by the check
    del alias
    assert storage_use_count(t) == 1 and ownership._storage_alone(t)
    held = torch.empty(9)
    keep = held.untyped_storage()
    assert not ownership._storage_alone(held)  # a storage object someone holds
    del keep
    assert ownership._storage_alone(held)  # now only PyTorch keeps it alive


# The backward's chain (term 3): a fact of the running node's class, no frame read ---------------


def test_chain_is_decided_by_the_functions_backward():
    import functools

    from slimgrad._autograd import first_order

    def wrap(fn):
        @functools.wraps(fn)
        def inner(ctx, *args):
            return fn(ctx, *args)

        return inner

    class FirstOrder(Double):
        @staticmethod
        @first_order("tests.first_order")
        def backward(ctx, g):
            return g * 2

    class Wrapped(Double):
        @staticmethod
        @wrap
        def backward(ctx, g):
            return g * 2

    kinds = {
        c: ownership._chain_of(c._backward_cls) for c in (Double, _DoubleOnce, FirstOrder, Wrapped)
    }
    want = {Double: "plain", _DoubleOnce: "once", FirstOrder: "first_order", Wrapped: None}
    assert kinds == want
    assert ownership._caller() is None  # outside backward: no running node, no chain


def test_take_from_a_tensor_hook_is_refused():
    got = []
    x = torch.randn(N, requires_grad=True)
    y = Double.apply(x * 1.5)
    y.register_hook(lambda g: got.append(ownership.take(g)))
    ownership.reset_reuse_count()
    (y * 3).sum().backward()
    assert got == [None]
    assert ownership.reuse_count("grad") == 1  # Double's own take, after the hook
    torch.testing.assert_close(x.grad, torch.full((N,), 9.0), rtol=0, atol=0)


class _TakeOnly(torch.autograd.Function):
    """y = 2x whose backward only asks ``take`` (and records the answer)."""

    taken: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        buf = ownership.take(grad_out)
        _TakeOnly.taken.append(buf is not None)
        return grad_out * 2


def test_take_asks_in_few_calls_and_never_recalibrates(monkeypatch):
    # NOTE [One call per backward question]: in the steady state take reads the call mode from
    # the probe it passes (no _ensure_calibrated), refuses a refcount no chain has before reading
    # the running node, and grants with one extension call for the per-call terms
    from tests._host_calls import slimgrad_calls

    assert ownership.calibrated()
    if not ownership.storage_facts_available():
        pytest.skip(f"no C++ extension here: {_ext.error()}")
    asked = []
    real = ownership._ensure_calibrated
    monkeypatch.setattr(ownership, "_ensure_calibrated", lambda *a: asked.append(1) or real(*a))
    x = torch.randn(6, requires_grad=True)

    def granted():
        (_TakeOnly.apply(x * 1) * 3).sum().backward()

    def refused():  # the add hands one gradient to both its inputs: one reference more
        h = x * 1
        (_TakeOnly.apply(h) + h).sum().backward()

    granted()  # _TakeOnly's chain is decided on its first question (once per class)
    _TakeOnly.taken.clear()
    granted_calls = slimgrad_calls(granted)
    refused_calls = slimgrad_calls(refused)
    assert _TakeOnly.taken == [True, False]
    assert asked == []
    # take, compiling, getrefcount, _grad_ok, the probe's getrefcount (+ the node, the
    # extension's facts and the counter's lock when granted)
    assert refused_calls <= 5
    assert granted_calls <= 8


class _GrantOnly(torch.autograd.Function):
    """y = 2x whose backward asks ``grant`` (with the probe ``_GrantOnly.probe``) and records."""

    granted: list = []
    probe: object = None

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        ok = ownership.grant(grad_out, _GrantOnly.probe)
        _GrantOnly.granted.append(ok)
        return grad_out * 2


def test_grant_answers_as_take_in_fewer_calls_and_only_with_the_probe(monkeypatch):
    # NOTE [One call per backward question]: grant, asked directly from a backward that has
    # checked compiling() itself, gives take's answers (granted alone, refused beside a second
    # consumer, refused with reuse disabled) and counts its grants; another object than
    # ownership.PROBE never grants (its refcount is no call mode)
    from tests._host_calls import slimgrad_calls

    assert ownership.calibrated()
    if not ownership.storage_facts_available():
        pytest.skip(f"no C++ extension here: {_ext.error()}")
    x = torch.randn(6, requires_grad=True)

    def granted():
        (_GrantOnly.apply(x * 1) * 3).sum().backward()

    def refused():  # the add hands one gradient to both its inputs: one reference more
        h = x * 1
        (_GrantOnly.apply(h) + h).sum().backward()

    monkeypatch.setattr(_GrantOnly, "probe", ownership.PROBE)
    granted()  # the chain is decided on the first question (once per class)
    _GrantOnly.granted.clear()
    before = ownership.reuse_count("grad")
    granted_calls = slimgrad_calls(granted)
    refused_calls = slimgrad_calls(refused)
    assert _GrantOnly.granted == [True, False]
    assert ownership.reuse_count("grad") == before + 1
    # grant, getrefcount twice (+ the node, the extension's facts and the counter's lock when
    # granted): take's question without take's frame and its compile check
    assert refused_calls <= 3
    assert granted_calls <= 6
    with ownership.reuse_disabled():
        granted()
    monkeypatch.setattr(_GrantOnly, "probe", object())
    granted()
    assert _GrantOnly.granted[2:] == [False, False]

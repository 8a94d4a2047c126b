import contextlib
import copy
import gc
import json
import math
import warnings
import weakref

import pytest
import torch
from torch import nn

from slimgrad.nn.reversible import (
    AdditiveCoupling,
    AffineCoupling,
    ReversibleSequential,
    check_invertible,
)
from slimgrad.testing import assert_within_rule
from tests.nn._reversible_helpers import (
    QuantisedPlain,
    ScaleShift,
    additive_blocks,
    affine_blocks,
    conv_fn,
    grads,
    pair,
)

F64 = torch.float64


def weighted_sum(r):
    return lambda y: (y * r).sum()


def assert_equal_list(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i} differs: max |diff| {(u - v).abs().max():.3e}"


# ---------------------------------------------------------------------------- gradcheck, plain
@pytest.mark.parametrize("kind", ["additive", "affine", "mixed"])
def test_gradcheck_float64(kind):
    c = 5  # odd: halves of 3 and 2
    if kind == "additive":
        blocks = additive_blocks(2, c)
    elif kind == "affine":
        blocks = affine_blocks(2, c)
    else:
        blocks = [*additive_blocks(1, c), ScaleShift(c), *affine_blocks(1, c)]
    rev = ReversibleSequential(*[b.double() for b in blocks])
    names = [n for n, _ in rev.named_parameters()]
    ps = [p.detach().clone().requires_grad_(True) for p in rev.parameters()]
    x = torch.randn(2, c, 3, 4, dtype=F64, requires_grad=True)

    def fn(x, *ps):
        return torch.func.functional_call(rev, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *ps), fast_mode=True)


@pytest.mark.parametrize("kind", ["additive", "affine", "mixed"])
@pytest.mark.parametrize("shape", [(2, 6, 5, 7), (3, 5, 4, 3)])
def test_equals_plain_chain_float64(kind, shape, device):
    c = shape[1]
    if kind == "additive":
        blocks = additive_blocks(4, c)
    elif kind == "affine":
        blocks = affine_blocks(4, c)
    else:
        blocks = [*additive_blocks(2, c), ScaleShift(c), *affine_blocks(1, c)]
    rev, plain = pair(blocks, device=device)
    x = torch.randn(*shape, dtype=F64, device=device, requires_grad=True)
    loss = weighted_sum(torch.randn(*shape, dtype=F64, device=device))
    got, ref = grads(rev, x, loss), grads(plain, x, loss)
    torch.testing.assert_close(got, ref)


def test_float32_within_rule():
    shape = (2, 6, 5, 5)
    blocks = additive_blocks(8, 6)
    rev32, plain32 = pair(copy.deepcopy(blocks), torch.float32)
    _, plain64 = pair(copy.deepcopy(blocks), F64)
    x = torch.randn(*shape)
    r = torch.randn(*shape)
    out = grads(rev32, x.clone().requires_grad_(), weighted_sum(r))
    eager = grads(plain32, x.clone().requires_grad_(), weighted_sum(r))
    ref = grads(plain64, x.double().requires_grad_(), weighted_sum(r.double()))
    assert_within_rule(out, ref, eager, atol=1e-5)


@pytest.mark.parametrize("subset", ["x", "params_of_block_2", "params"])
def test_backward_inputs_subsets(subset):
    rev, plain = pair(additive_blocks(4, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    pick = {
        "x": lambda m: [x],
        "params_of_block_2": lambda m: list(m[2].parameters()),
        "params": lambda m: list(m.parameters()),
    }[subset]
    res = []
    for m in (rev, plain):
        ins = pick(m)
        (m(x) * r).sum().backward(inputs=ins)
        res.append([t.grad.clone() for t in ins])
        for t in ins:
            t.grad = None
        assert all(p.grad is None for p in m.parameters())
    torch.testing.assert_close(res[0], res[1])


def test_only_late_blocks_need_grad():
    # early blocks frozen, x constant: backward stops after the last block that needs a gradient
    rev, plain = pair(additive_blocks(5, 4))
    for m in (rev, plain):
        for blk in list(m)[:3]:
            blk.requires_grad_(False)
    x = torch.randn(2, 4, 3, 3, dtype=F64)
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    for m in (rev, plain):
        (m(x) * r).sum().backward()
    for p, q in zip(rev.parameters(), plain.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad)
    rep = rev.last_reconstruction.per_block_abs
    assert all(math.isnan(e) for e in rep[:3]) and not any(math.isnan(e) for e in rep[3:])


def test_shared_weights_across_blocks_and_halves():
    # one F module reused by every block and as G: its gradient sums over all uses
    torch.manual_seed(0)
    f = conv_fn(2, 2)
    blocks = [AdditiveCoupling(f, f) for _ in range(3)]
    rev, plain = pair(blocks)
    assert len(list(rev.parameters())) == 2
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    loss = weighted_sum(torch.randn(2, 4, 3, 3, dtype=F64))
    torch.testing.assert_close(grads(rev, x, loss), grads(plain, x, loss))


# ----------------------------------------------------------------------------------- exact mode
@pytest.mark.parametrize("n", [8, 64])
def test_exact_mode_bit_identical_to_plain(n):
    # weights scaled by 0.5: the stream stays within int32's range at 2^-20 (|values| < 2048; it
    # reaches ~570 at N = 64), so no promotion to int64 happens (warnings are errors here)
    blocks = additive_blocks(n, 4, seed=3, scale=0.5)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(2, 4, 8, 8)
    r = torch.randn(2, 4, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
    want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))
    assert_equal_list(got, want)
    rep = rev.last_reconstruction
    assert rep.max_abs == 0.0 and len(rep.per_block_abs) == n


@pytest.mark.parametrize(
    "case", ["plain", "retain_graph", "user_holds_saved", "pack_hook_keeps", "no_reuse"]
)
def test_exact_mode_rebuilds_into_its_saved_stream_only_when_it_owns_it(case):
    # The last block rebuilds its input into the saved integer stream (one stream-sized buffer
    # less at the backward's peak) only when ownership grants it: not under retain_graph, not
    # when the user holds the saved tensor, not with reuse disabled. Gradients bit-identical in
    # every case; a stream the user holds is left intact.
    from slimgrad import ownership
    from slimgrad.memory import measure

    blocks = additive_blocks(4, 8, seed=3, scale=0.5)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(2, 8, 8, 8)
    r = torch.randn(2, 8, 8, 8)
    want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))[1:]  # [dx, *dparams]
    held = []

    def forward():
        xl = x.clone().requires_grad_()
        if case == "pack_hook_keeps":  # a saved_tensors_hooks pair that keeps what it packs
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: held.append(t) or t, lambda t: t
            ):
                y = rev(xl)
            held.append(held[0].clone())
        else:
            y = rev(xl)
        if case == "user_holds_saved":
            held.append(y.grad_fn.saved_tensors[0])
            held.append(held[0].clone())
        return (y * r).sum(), xl

    for p in rev.parameters():
        p.grad = None
    loss, xl = forward()
    ownership.reset_reuse_count()
    with ownership.reuse_disabled() if case == "no_reuse" else contextlib.nullcontext():
        loss.backward(retain_graph=case == "retain_graph")
    assert ownership.reuse_count("saved") == (1 if case == "plain" else 0)
    assert_equal_list([xl.grad, *[p.grad for p in rev.parameters()]], want)
    if case in ("user_holds_saved", "pack_hook_keeps"):
        assert torch.equal(held[0], held[1])
    if case == "retain_graph":  # the kept stream gives the same gradients a second time
        for p in rev.parameters():
            p.grad = None
        xl.grad = None
        loss.backward()
        assert_equal_list([xl.grad, *[p.grad for p in rev.parameters()]], want)

    # exact bytes: the granted rebuild needs one int32 stream (4 B/elt) less at the peak
    def peak():
        (rev(x.clone().requires_grad_()) * r).sum().backward()  # warm-up
        return measure(lambda: (rev(x.clone().requires_grad_()) * r).sum()).peak_bytes

    on = peak()
    with ownership.reuse_disabled():
        off = peak()
    assert off - on == x.numel() * 4


def test_exact_mode_int32_overflow_promotes_to_int64_bit_identical():
    # unscaled, the 64-block stream grows past 2^11 = int32's range at 2^-20: forward warns and
    # continues in int64 (8 B/elt); results stay bit-identical to the reference network
    memory = pytest.importorskip("slimgrad.memory")
    blocks = additive_blocks(64, 4, seed=3)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(2, 4, 8, 8)
    r = torch.randn(2, 4, 8, 8)
    with pytest.warns(RuntimeWarning, match="int32 stream would overflow .* continuing in int64"):
        got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
    want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))
    assert_equal_list(got, want)
    assert want[0].abs().max() > 2048  # the case really overflows int32 on the grid
    # explicit int64: no warning, same bits, the saved stream is 8 B/elt
    rev64 = ReversibleSequential(*copy.deepcopy(blocks), exact=True, stream_dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_equal_list(grads(rev64, x.clone().requires_grad_(), weighted_sum(r)), want)
        m = memory.measure(lambda: (rev64(x * 1) * r).sum())
    assert m.saved_bytes == x.numel() * 8


def test_exact_mode_int32_never_overflows_silently():
    # a single coupling whose F output alone leaves int32 (|F| ~ 3000 > 2048): promoted, exact
    big = AdditiveCoupling(nn.Conv2d(2, 2, 1, bias=False), nn.Conv2d(2, 2, 1, bias=False))
    with torch.no_grad():
        big.F.weight.fill_(1000.0)
        big.G.weight.zero_()
    x = torch.full((1, 4, 3, 3), 1.5)
    rev = ReversibleSequential(copy.deepcopy(big), exact=True)
    with pytest.warns(RuntimeWarning, match="continuing in int64"):
        y = rev(x)
    assert torch.equal(y[:, :2], torch.full((1, 2, 3, 3), 1.5 + 3000.0))
    with pytest.warns(RuntimeWarning, match="continuing in int64"):
        assert check_invertible(rev, x) == 0.0


@pytest.mark.parametrize(
    "value, bits", [(1e4, 50), (float("inf"), 20), (float("nan"), 20), (3e13, 20)]
)
def test_exact_mode_int64_overflow_raises(value, bits):
    # int64 is the widest stream: leaving it raises (input or F/G output; NaN/inf too)
    rev = ReversibleSequential(
        *additive_blocks(2, 4), exact=True, grid_bits=bits, stream_dtype=torch.int64
    )
    x = torch.full((1, 4, 3, 3), value, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"would overflow its int64 range; expected \|stream\|"):
        rev(x)
    with pytest.raises(RuntimeError, match="would overflow its int64 range"), torch.no_grad():
        rev(x)
    with pytest.raises(RuntimeError, match="would overflow its int64 range"):
        check_invertible(rev, x.detach())


def test_exact_mode_reversible_false_is_the_same_network():
    blocks = additive_blocks(6, 5, seed=4)
    a = ReversibleSequential(*copy.deepcopy(blocks), exact=True)
    b = ReversibleSequential(*copy.deepcopy(blocks), exact=True, reversible=False)
    x = torch.randn(2, 5, 4, 4)
    r = torch.randn(2, 5, 4, 4)
    assert_equal_list(
        grads(a, x.clone().requires_grad_(), weighted_sum(r)),
        grads(b, x.clone().requires_grad_(), weighted_sum(r)),
    )


def test_float_mode_reports_reconstruction_error():
    # float32, weights scaled up: the stream grows and the rebuild drifts; the report says so
    blocks = additive_blocks(16, 4, seed=1, scale=3.0)
    rev = ReversibleSequential(*blocks)
    assert rev.last_reconstruction is None
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="expected relative reconstruction error <= 1e-05"):
        rev(x).sum().backward()
    rep = rev.last_reconstruction
    assert len(rep.per_block_abs) == 16
    assert rep.max_abs > 0 and rep.max_rel > 0
    assert rep.max_abs == max(rep.per_block_abs)
    # the same chain in exact mode rebuilds exactly
    ex = ReversibleSequential(*copy.deepcopy(blocks), exact=True, stream_dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex(x).sum().backward()
    assert ex.last_reconstruction.max_abs == 0.0
    # the module-level check agrees: float drifts, exact does not
    assert check_invertible(rev, x.detach()) > 0
    assert check_invertible(ex, x.detach()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, F64])
def test_grid_rounding_in_low_precision_equals_float64(dtype):
    # NOTE [Exact-mode integer stream]: F's output is rounded onto the grid in
    # float32 (or float64 for float64 F) and added as grid units; it must be the float64 result.
    from slimgrad.ops.reversible import _grid_units, grid_round

    bits = 20
    s = 2.0**bits
    k = torch.arange(-6, 7, dtype=F64)
    ties = (k + 0.5) / s  # exact ties: round half to even on the grid
    vals = torch.cat(
        [
            ties,
            torch.tensor(
                [0.0, -0.0, 2.0**-30, -(2.0**-21), 2.0**-149, 1e-3, -7.25, 3e8, -(2.0**40)]
            ),
            torch.randn(2000, dtype=F64) * torch.logspace(-8, 8, 2000, dtype=F64),
        ]
    ).to(dtype)
    want = grid_round(vals, bits)
    got = _grid_units(vals, s).double() / s
    assert torch.equal(got, want)
    assert torch.equal(got.signbit(), want.signbit())  # -0.0 stays -0.0


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exact_mode_bit_identical_in_each_dtype(dtype):
    # float32 F: the float32 rounding path; float64 F: the stream is F's input itself (in-place
    # forward sums only where nothing aliases it)
    blocks = [b.to(dtype) for b in additive_blocks(6, 5, seed=5)]
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(2, 5, 6, 6, dtype=dtype) * 4
    r = torch.randn(2, 5, 6, 6, dtype=dtype)
    got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
    want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))
    assert_equal_list(got, want)
    assert rev.last_reconstruction.max_abs == 0.0


# ------------------------------------------------------------------- memcnn's failures, fixed
def test_no_grad_and_inference_mode_keep_input_and_build_no_graph():
    rev, plain = pair(additive_blocks(3, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    before = x.detach().clone()
    with torch.no_grad():
        y = rev(x)
    assert y.grad_fn is None and torch.equal(x.detach(), before)
    with torch.inference_mode():
        y2 = rev(x)
    assert torch.equal(x.detach(), before)
    torch.testing.assert_close(y, plain(x).detach())
    torch.testing.assert_close(y2, y)


def test_input_readable_after_forward_without_backward():
    rev, _ = pair(additive_blocks(3, 4))
    h = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    x = h * 1  # a non-leaf the chain consumes
    before = x.detach().clone()
    y = rev(x)
    assert torch.equal(x.detach(), before)
    assert torch.equal(x.sum(), before.sum())
    del y


def test_view_input_leaves_siblings_intact():
    rev, plain = pair(additive_blocks(3, 4))
    base = torch.randn(4, 4, 3, 3, dtype=F64, requires_grad=True)
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    outs = []
    for m in (rev, plain):
        h = base * 1
        first, second = h.chunk(2, 0)
        before = h.detach().clone()
        loss = (m(first) * r).sum() + (second**2).sum()
        assert torch.equal(h.detach(), before)
        loss.backward()
        assert torch.equal(h.detach(), before)
        outs.append(base.grad.clone())
        base.grad = None
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("order", ["w(x)+x", "x+w(x)"])
def test_residual_around_chain(order):
    rev, plain = pair(additive_blocks(3, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    res = []
    for m in (rev, plain):
        y = m(x) + x if order == "w(x)+x" else x + m(x)
        res.append([y, *torch.autograd.grad((y * r).sum(), [x, *m.parameters()])])
    torch.testing.assert_close(res[0], res[1])


def test_leaf_input_gets_its_gradient_once():
    rev, plain = pair(additive_blocks(3, 4))
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    (rev(x) * r).sum().backward()
    g_rev = x.grad.clone()
    x.grad = None
    (plain(x) * r).sum().backward()
    torch.testing.assert_close(g_rev, x.grad)  # memcnn: exactly 2x
    assert not any(p.grad is None for p in rev.parameters())


def test_output_of_relu_feeds_the_chain():
    # an op that saved its output (ReLU, Sigmoid) before the chain: memcnn raised "modified by an
    # inplace operation"; nothing is written here
    rev, plain = pair(additive_blocks(3, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    res = []
    for m in (rev, plain):
        res.append(torch.autograd.grad((m(torch.relu(x).sigmoid()) * r).sum(), [x]))
    torch.testing.assert_close(res[0], res[1])


@pytest.mark.parametrize("exact", [False, True])
def test_hook_captured_tensors_are_untouched(exact):
    # Hooks on the chain and inside F/G (these fire again in the recompute) keep references to
    # their inputs; the rebuild must not overwrite them (rebuilt buffers are reused in place only
    # when nothing else aliases them). Exact mode hands F and G images (copies) of its integer
    # stream.
    rev, _ = pair(additive_blocks(3, 4), exact=exact)
    seen: dict = {}
    rev.register_forward_hook(lambda m, inp, out: seen.setdefault("chain", []).append(inp[0]))
    for i, blk in enumerate(rev):
        for name, fn in (("F", blk.F), ("G", blk.G)):
            fn.register_forward_hook(
                lambda m, inp, out, k=(i, name): seen.setdefault(k, []).append(inp[0])
            )
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    x0 = x.detach().clone()
    y = rev(x)
    fwd = {k: v[0].detach().clone() for k, v in seen.items()}
    y.sum().backward()
    assert seen["chain"][0] is x and torch.equal(x, x0)
    for k, v in seen.items():
        if k == "chain":
            continue
        assert len(v) == 2  # forward, then the recompute
        assert torch.equal(v[0], fwd[k])  # forward tensors are never written
        torch.testing.assert_close(v[1], fwd[k])  # the recompute's input, still intact


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exact_hook_captured_outputs_are_untouched(dtype):
    # exact-mode backward rounds F's recomputed output onto the grid in place, but only when no
    # one else holds it: outputs a forward hook kept (in forward and in the recompute) stay intact
    blocks = [b.to(dtype) for b in additive_blocks(3, 4, seed=6)]
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    kept = []
    for blk in list(rev)[:2]:  # the last block's F and G keep no hook: the in-place path runs
        for fn in (blk.F, blk.G):
            fn.register_forward_hook(lambda m, inp, out: kept.append((out, out.clone())))
    x = torch.randn(2, 4, 5, 5, dtype=dtype)
    r = torch.randn(2, 4, 5, 5, dtype=dtype)
    got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
    assert len(kept) == 8  # 4 hooked modules, forward and recompute
    for out, at_hook in kept:
        assert torch.equal(out, at_hook)
    assert_equal_list(got, grads(ref, x.clone().requires_grad_(), weighted_sum(r)))


@pytest.mark.parametrize("exact", [False, True])
def test_hook_captured_gradients_are_untouched(exact):
    # Backward hooks inside F and G see gradients of the recompute; backward sums the stream's
    # gradients in place only where no hook can have seen them.
    blocks = additive_blocks(4, 4, seed=2)
    rev = ReversibleSequential(*copy.deepcopy(blocks), exact=exact)
    ref = QuantisedPlain(copy.deepcopy(blocks)) if exact else nn.Sequential(*copy.deepcopy(blocks))
    seen = []

    def keep(m, grad_in, grad_out):
        seen.append([(g, g.clone()) for g in (*grad_in, *grad_out) if g is not None])

    for blk in rev:
        for fn in (blk.F, blk.G):
            fn.register_full_backward_hook(keep)
    x = torch.randn(2, 4, 5, 5)
    r = torch.randn(2, 4, 5, 5)
    got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
    want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))
    if exact:
        assert_equal_list(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(seen) == 8
    for pairs in seen:
        for g, at_hook in pairs:
            assert torch.equal(g, at_hook)


def test_dropout_reproduced_bit_for_bit_and_caller_rng_untouched():
    blocks = additive_blocks(4, 4, dropout=0.5)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(2, 4, 5, 5)
    r = torch.randn(2, 4, 5, 5)
    torch.manual_seed(7)
    want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))
    after_ref = torch.rand(3)
    torch.manual_seed(7)
    got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
    after_rev = torch.rand(3)
    assert_equal_list(got, want)
    assert torch.equal(after_rev, after_ref)


def test_dropout_float64_equals_plain(device):
    # on CUDA this also covers the device RNG state, captured and replayed per F and G
    rev, plain = pair(additive_blocks(3, 4, dropout=0.3), device=device)
    x = torch.randn(2, 4, 5, 5, dtype=F64, device=device, requires_grad=True)
    loss = weighted_sum(torch.randn(2, 4, 5, 5, dtype=F64, device=device))
    torch.manual_seed(3)
    got = grads(rev, x, loss)
    torch.manual_seed(3)
    ref = grads(plain, x, loss)
    torch.testing.assert_close(got, ref)


def test_batchnorm_running_stats_update_once_per_step():
    blocks = additive_blocks(3, 4, bn=True)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    rev = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(4, 4, 3, 3)
    r = torch.randn(4, 4, 3, 3)
    for _ in range(2):
        got = grads(rev, x.clone().requires_grad_(), weighted_sum(r))
        want = grads(ref, x.clone().requires_grad_(), weighted_sum(r))
        assert_equal_list(got, want)
    bufs_rev = dict(rev.named_buffers())
    bufs_ref = {k.removeprefix("blocks."): v for k, v in ref.named_buffers()}
    assert bufs_rev.keys() == bufs_ref.keys()
    for k, v in bufs_rev.items():
        assert torch.equal(v, bufs_ref[k]), k
        if k.endswith("num_batches_tracked"):
            assert int(v) == 2  # memcnn: 3 per step


def test_autograd_grad_and_retain_graph_twice():
    blocks = additive_blocks(4, 4)
    rev = ReversibleSequential(*blocks, exact=True)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    r = torch.randn(2, 4, 3, 3)
    y = rev(x)
    loss = (y * r).sum()
    g1 = torch.autograd.grad(loss, [x, *rev.parameters()], retain_graph=True)
    g2 = torch.autograd.grad(loss, [x, *rev.parameters()])
    want = torch.autograd.grad((ref(x) * r).sum(), [x, *ref.parameters()])
    assert_equal_list(list(g1), list(want))
    assert_equal_list(list(g2), list(want))
    # .backward twice accumulates exactly 2x
    x.grad = None
    loss = (rev(x) * r).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert_equal_list([x.grad, *[p.grad for p in rev.parameters()]], [2 * g for g in want])


def test_create_graph_raises_clearly_and_reversible_false_supports_it():
    rev, _ = pair(additive_blocks(2, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(rev(x).pow(2).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.nn.ReversibleSequential: a second"):
        g.sum().backward()
    rev.reversible = False
    (g,) = torch.autograd.grad(rev(x).pow(2).sum(), [x], create_graph=True)
    assert g.requires_grad
    g.sum().backward()
    assert x.grad is not None


def test_cpu_bf16_autocast_matches_plain_autocast():
    blocks = additive_blocks(4, 4)
    x = torch.randn(2, 4, 6, 6)
    r = torch.randn(2, 4, 6, 6)
    # exact mode: the recompute re-enters the forward's autocast, so grads match to the bit
    rev = ReversibleSequential(*copy.deepcopy(blocks), exact=True)
    ref = QuantisedPlain(copy.deepcopy(blocks))
    res = []
    for m in (rev, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res.append(grads(m, x.clone().requires_grad_(), weighted_sum(r)))
    assert_equal_list(res[0], res[1])
    # float mode: as close to plain autocast as the fp32 rebuild allows (memcnn/revlib: 5.5%)
    rev, plain = pair(copy.deepcopy(blocks), torch.float32)
    res = []
    for m in (rev, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res.append(grads(m, x.clone().requires_grad_(), weighted_sum(r)))
    for a, b in zip(res[0], res[1]):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_no_reference_cycle_when_backward_never_runs():
    rev, _ = pair(additive_blocks(3, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        y = rev(x)
        node = weakref.ref(y.grad_fn)
        freed = []
        weakref.finalize(y.untyped_storage(), freed.append, True)
        del y
        assert freed == [True]  # freed by reference counting, no gc pass needed
        assert node() is None
    finally:
        gc.enable()


def test_inplace_write_to_output_is_detected():
    rev, _ = pair(additive_blocks(2, 4))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    y = rev(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_full_backward_hook_on_the_chain():
    rev, _ = pair(additive_blocks(2, 4))
    got = []
    rev.register_full_backward_hook(lambda m, gi, go: got.append((gi[0], go[0])))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    rev(x).sum().backward()
    assert len(got) == 1
    torch.testing.assert_close(got[0][0], x.grad)


def test_compile_aot_eager_one_documented_break():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1)
            self.rev = ReversibleSequential(*additive_blocks(3, 4))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.rev(self.stem(x)).mean((2, 3)))

    counters = torch._dynamo.utils.counters  # loads Dynamo: the next eager call builds the
    torch.manual_seed(0)  # compiler.disable wrapper (built inside the first trace otherwise)
    eager = Net()
    x = torch.randn(2, 3, 6, 6)
    y0 = eager(x)
    y0.sum().backward()
    comp = copy.deepcopy(eager)
    for p in comp.parameters():
        p.grad = None
    torch._dynamo.reset()
    counters.clear()
    y = torch.compile(comp, backend="aot_eager")(x)
    y.sum().backward()
    torch.testing.assert_close(y, y0)
    torch.testing.assert_close(
        [p.grad for p in comp.parameters()], [p.grad for p in eager.parameters()]
    )
    breaks = list(counters["graph_break"])
    assert len(breaks) == 1 and "disable" in breaks[0], breaks  # the chain runs eagerly


# ------------------------------------------------------------------------ couplings, API, errors
def test_affine_scale_cannot_reach_zero():
    blk = AffineCoupling(nn.Conv2d(2, 4, 1), nn.Conv2d(2, 4, 1), clamp=2.0).double()
    with torch.no_grad():
        for conv in (blk.F, blk.G):
            conv.weight.zero_()
            conv.bias.fill_(-1e6)  # log-scale far below any floor
    x = torch.randn(1, 4, 3, 3, dtype=F64)
    y = blk(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(blk.inverse(y), x)


def test_check_invertible_flags_a_wrong_inverse():
    class Bad(ScaleShift):
        def inverse(self, y):
            return y - self.b

    torch.manual_seed(0)
    good = additive_blocks(1, 4)[0]
    x = torch.randn(2, 4, 3, 3)
    assert check_invertible(good, x) < 1e-5
    bad = Bad(4)
    with torch.no_grad():
        bad.a.fill_(0.5)
    assert check_invertible(bad, x) > 0.1
    with pytest.raises(TypeError, match="block has no inverse"):
        check_invertible(nn.ReLU(), x)


def test_check_invertible_does_not_touch_bn_stats_or_rng():
    blk = additive_blocks(1, 4, bn=True, dropout=0.5)[0]
    x = torch.randn(4, 4, 3, 3)
    bufs = {k: v.clone() for k, v in blk.named_buffers()}
    state = torch.get_rng_state()
    assert check_invertible(blk, x) < 1e-5  # dropout masks replayed
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in blk.named_buffers():
        assert torch.equal(v, bufs[k]), k


def test_state_dict_keys_like_sequential_and_indexing():
    blocks = additive_blocks(2, 4)
    rev = ReversibleSequential(*blocks)
    seq = nn.Sequential(*blocks)
    assert list(rev.state_dict().keys()) == list(seq.state_dict().keys())
    assert rev[1] is blocks[1] and len(rev) == 2 and list(rev) == blocks
    rev.inverse(rev(torch.randn(1, 4, 2, 2)))


@pytest.mark.parametrize("exact", [False, True])
def test_inside_torch_checkpoint(exact):
    # an outer non-reentrant checkpoint packs the chain's saved output (exact mode: its saved
    # stream, which backward may then rebuild into) with its own hooks and reruns the chain's
    # forward to unpack it; gradients are unchanged (exact mode: bit for bit)
    from torch.utils.checkpoint import checkpoint

    rev, plain = pair(additive_blocks(3, 4), exact=exact)
    if exact:
        plain = QuantisedPlain(list(plain))
    x = torch.randn(2, 4, 3, 3, dtype=F64, requires_grad=True)
    r = torch.randn(2, 4, 3, 3, dtype=F64)
    for _ in range(2):  # twice: the first backward's in-place rebuild must not leak into the next
        got = torch.autograd.grad(
            (checkpoint(rev, x, use_reentrant=False) * r).sum(), [x, *rev.parameters()]
        )
        want = torch.autograd.grad((plain(x) * r).sum(), [x, *plain.parameters()])
        if exact:
            assert_equal_list(list(got), list(want))
        else:
            torch.testing.assert_close(got, want)


def test_from_torch_shares_modules():
    seq = nn.Sequential(*additive_blocks(2, 4))
    rev = ReversibleSequential.from_torch(seq, exact=True)
    assert rev.exact and list(rev.state_dict()) == list(seq.state_dict())
    assert all(a is b for a, b in zip(rev.parameters(), seq.parameters()))
    with pytest.raises(TypeError, match="expected nn.Sequential"):
        ReversibleSequential.from_torch(nn.ModuleList(additive_blocks(1, 4)))


def test_split_dim_last():
    torch.manual_seed(0)
    blocks = [AdditiveCoupling(nn.Linear(3, 4), nn.Linear(4, 3), split_dim=-1) for _ in range(3)]
    rev, plain = pair(blocks)
    x = torch.randn(5, 7, dtype=F64, requires_grad=True)
    loss = weighted_sum(torch.randn(5, 7, dtype=F64))
    torch.testing.assert_close(grads(rev, x, loss), grads(plain, x, loss))


def test_errors():
    with pytest.raises(TypeError, match="block 0 is not invertible"):
        ReversibleSequential(nn.ReLU())
    with pytest.raises(NotImplementedError, match="exact=True needs additive couplings"):
        ReversibleSequential(*affine_blocks(1, 4), exact=True)
    with pytest.raises(ValueError, match="grid_bits .* expected an int in 1..30"):
        ReversibleSequential(*additive_blocks(1, 4), grid_bits=31)
    with pytest.raises(ValueError, match="grid_bits .* expected an int in 1..62"):
        ReversibleSequential(*additive_blocks(1, 4), grid_bits=63, stream_dtype=torch.int64)
    with pytest.raises(ValueError, match="stream_dtype .* expected torch.int32 or torch.int64"):
        ReversibleSequential(*additive_blocks(1, 4), exact=True, stream_dtype=torch.float64)
    with pytest.raises(ValueError, match="same dim"):
        ReversibleSequential(
            AdditiveCoupling(nn.Identity(), nn.Identity(), split_dim=1),
            AdditiveCoupling(nn.Identity(), nn.Identity(), split_dim=2),
        )
    with pytest.raises(ValueError, match="warn_rel_error .* expected a float > 0 or None"):
        ReversibleSequential(*additive_blocks(1, 4), warn_rel_error=-1.0)
    with pytest.raises(ValueError, match="clamp"):
        AffineCoupling(nn.Identity(), nn.Identity(), clamp=0.0)
    with pytest.raises(TypeError, match="F must be an nn.Module"):
        AdditiveCoupling(lambda t: t, nn.Identity())
    with pytest.raises(ValueError, match="cannot split the input in two"):
        ReversibleSequential(*additive_blocks(1, 4))(torch.randn(2, 1, 3, 3))


# ----------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("exact", [False, True])
def test_memory_flat_in_depth(exact):
    memory = pytest.importorskip("slimgrad.memory")
    x0 = torch.randn(2, 8, 8, 8)
    r = torch.randn(2, 8, 8, 8)
    res = {}
    for n in (4, 8):
        rev, plain = pair(additive_blocks(n, 8), torch.float32, exact=exact)
        if exact:
            plain = QuantisedPlain(list(plain))
        for m in (rev, plain):  # warm-up: caches (sample indices) are built outside the count
            (m(x0 * 1) * r).sum().backward()
        got = [memory.measure(lambda m=m: (m(x0 * 1) * r).sum()) for m in (rev, plain)]
        res[n] = (got, sum(p.numel() * p.element_size() for p in rev.parameters()))
    out_bytes = x0.numel() * 4  # float32 output, or exact mode's int32 stream
    for n in (4, 8):
        (m_rev, _), _ = res[n]
        # contract: the chain keeps exactly its output (the r kept by the loss's mul is an input)
        assert m_rev.saved_bytes == out_bytes
        assert m_rev.by_node == {"_ReversibleChainFnBackward": out_bytes}
    (r4, p4), w4 = res[4]
    (r8, p8), w8 = res[8]
    per_block_rev = (r8.peak_bytes - r4.peak_bytes - (w8 - w4)) / 4
    per_block_plain = (p8.peak_bytes - p4.peak_bytes - (w8 - w4)) / 4
    assert abs(per_block_rev) <= 1024  # beyond weight gradients: diagnostic samples only
    assert per_block_plain >= 4 * x0.numel()  # eager keeps >= one activation per block
    assert p8.saved_bytes - p4.saved_bytes >= 4 * 2 * x0.numel() * 4


def test_bench_case_small(tmp_path):
    pytest.importorskip("slimgrad.memory")
    from slimgrad.bench import harness
    from slimgrad.bench.cases import reversible as case

    plain, ckpt, rev, make_inputs = case.build(3, small=True)
    res = []
    for m in (plain, ckpt, rev):
        x, r = make_inputs()
        m(x, r).backward()
        res.append([x.grad, *[p.grad for p in m.parameters()]])
    torch.testing.assert_close(res[1], res[0])
    # float mode rebuilds each block's input (rounding): the error rule against float64
    plain64 = copy.deepcopy(plain).double()
    x, r = make_inputs()
    x64 = x.detach().double().requires_grad_()
    plain64(x64, r.double()).backward()
    assert_within_rule(res[2], [x64.grad, *[p.grad for p in plain64.parameters()]], res[0])
    # `slimgrad bench reversible` runs the sweep through the shared harness
    assert harness.get_case("reversible").run is case.run_sweep
    assert "reversible" in harness.case_names()
    out = case.run_sweep(depths=(3,), small=True, repeat=1, warmup=0, out_dir=tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "reversible.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["n_blocks"]) for r in recs] == [("rev", 3), ("ckpt", 3), ("exact", 3)]
    assert out["case"] == "reversible" and len(out["suite_records"]) == 3
    by = {r["variant"]: r for r in recs}
    assert by["rev"]["slimgrad"]["saved_bytes"] == 2 * 8 * 8 * 8 * 4  # the chain output only
    assert by["exact"]["slimgrad"]["saved_bytes"] == 2 * 8 * 8 * 8 * 4  # its int32 stream
    # checkpoint keeps its inputs in its hooks' closure: they show in retained, not saved, bytes
    assert by["ckpt"]["eager"]["saved_bytes"] > by["ckpt"]["slimgrad"]["retained_bytes"]
    assert by["ckpt"]["slimgrad"]["retained_bytes"] > by["rev"]["slimgrad"]["saved_bytes"]
    assert by["rev"]["slimgrad"]["peak_bytes"] < by["rev"]["eager"]["peak_bytes"]
    assert by["exact"]["grads_bit_identical"] and by["ckpt"]["grads_bit_identical"]
    assert by["exact"]["reconstruction_max_abs"] == 0.0
    assert all(r["grad"]["ok"] for r in recs)
    # time is the bench's to judge (interleaved pairs, median ratio): here only that every record
    # carries its timings, and the float record the F+G share of a plain step
    for r in recs:
        assert r["time_ratio_min"] <= r["time_ratio"] <= r["time_ratio_max"], r
        assert math.isfinite(r["time_ratio"]) and r["time_ratio"] > 0
    assert math.isfinite(by["rev"]["fg_over_plain"]) and by["rev"]["fg_over_plain"] > 0
    assert "fg_over_plain" not in by["exact"] and "fg_over_plain" not in by["ckpt"]
    assert [r["grad_check"] for r in recs] == ["reported", "asserted", "asserted"]
    assert by["exact"]["stream_bytes_per_elt"] == 4.0 and by["exact"]["grid_bits"] == 20
    assert [r["case"] for r in out["grad_reported"]] == ["reversible_n3"]


@pytest.fixture(scope="module")
def sweep_records():
    return {}  # case name -> its real record, run once for both rows below


@pytest.mark.parametrize("failing", ["rev", "exact"])
def test_bench_sweep_verdict_float_reported_exact_asserted(monkeypatch, failing, sweep_records):
    # `slimgrad bench reversible` exits 1 iff the returned grad["ok"] is False: a float-mode
    # rule violation (its documented drift) is reported, an exact-mode one fails the sweep
    pytest.importorskip("slimgrad.memory")
    from slimgrad.bench import harness
    from slimgrad.bench.cases import reversible as case

    real = harness.run_case

    def run_case(c, **kw):
        if c.name not in sweep_records:
            sweep_records[c.name] = real(c, **kw)
        rec = copy.deepcopy(sweep_records[c.name])
        if c.name == case._name(failing, 2):
            bad = {"name": "x", "err": 1.0, "bound": 0.5, "eager_err": 0.1, "max_abs": 1.0}
            rec["grad"] = {**rec["grad"], "ok": False, "violations": [bad]}
        return rec

    monkeypatch.setattr(harness, "run_case", run_case)
    out = case.run_sweep(depths=(2,), variants=("rev", "exact"), small=True, repeat=1, warmup=0)
    by = {r["variant"]: r for r in out["suite_records"]}
    assert by[failing]["grad"]["ok"] is False  # the record keeps the honest figures
    if failing == "rev":
        assert out["grad"]["ok"] and by["rev"]["grad_check"] == "reported"
        assert out["grad_reported"][0]["rule_ok"] is False
    else:
        assert not out["grad"]["ok"] and out["grad"]["failed_cases"] == ["reversible_exact_n2"]


@pytest.mark.parametrize("exact", [False, True])
def test_parameter_changed_between_forward_and_backward_raises_like_autograd(exact):
    # Issue 15: an optimizer step between forward and backward gave wrong gradients with only a
    # float-drift warning; eager raises autograd's in-place error, and so does the chain now.
    dt = torch.float32 if exact else F64
    rev, plain = pair(additive_blocks(2, 4), dtype=dt, exact=exact)
    x = torch.randn(2, 4, 5, 5, dtype=dt, requires_grad=True)
    for model in (plain, rev):
        loss = model(x).square().sum()
        with torch.no_grad():
            next(model.parameters()).add_(0.01)  # what optimizer.step() does
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


class _Captured(nn.Module):
    def __init__(self, c_in, c_out, t):
        super().__init__()
        self.conv, self.t = nn.Conv2d(c_in, c_out, 3, padding=1), t

    def forward(self, x):
        return self.conv(x) * self.t


@pytest.mark.parametrize("kind", ["leaf", "nonleaf", "other_module"])
def test_captured_tensor_requiring_grad_is_refused(kind):
    # Issue 15: a tensor requiring grad that F or G captured but that is not one of the chain's
    # parameters silently got no gradient; the backward now refuses it clearly.
    torch.manual_seed(0)
    leaf = torch.rand(1, 2, 1, 1, dtype=F64, requires_grad=True)
    other = nn.Linear(1, 1).double()
    t = {"leaf": leaf, "nonleaf": leaf * 2, "other_module": other.weight.view(1, 1, 1, 1)}[kind]
    blk = AdditiveCoupling(_Captured(2, 2, t).double(), conv_fn(2, 2).double())
    rev = ReversibleSequential(blk)
    x = torch.randn(2, 4, 5, 5, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="uses a tensor that requires grad but is not a"):
        rev(x).sum().backward()
    # a buffer or a detached tensor is fine
    blk.F.t = t.detach()
    rev(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    "coupling,exact", [("additive", False), ("additive", True), ("affine", False)]
)  # exact mode takes additive couplings only
def test_wrong_shape_from_F_is_a_clear_error(coupling, exact):
    # Issue 15: an F returning a broadcastable or wrong shape gave a bare broadcasting error (or
    # silently broadcast); the chain names the coupling and the expected shape.
    c = AdditiveCoupling if coupling == "additive" else AffineCoupling
    wrong = nn.Conv2d(2, 1, 3, padding=1)  # 1 channel: broadcasts over the 2-channel half
    ok = nn.Conv2d(2, 2 if coupling == "additive" else 4, 3, padding=1)
    rev = ReversibleSequential(c(wrong, ok), exact=exact)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="F or G returned the wrong shape; expected"):
        rev(x)


def test_sole_refuses_a_storage_object_someone_holds():
    # _sole gates the in-place rebuild of a stream half: a storage object a hook keeps (it can
    # read the buffer later) is a holder; one PyTorch merely keeps alive is not; an alias is
    import importlib

    rev_ops = importlib.import_module("slimgrad.ops.reversible")
    t = torch.randn(4)
    assert rev_ops._sole(t)
    keep = t.untyped_storage()
    assert not rev_ops._sole(t)  # counted 2 uses, which the old check took for its own object
    del keep
    assert rev_ops._sole(t)
    alias = t.view(2, 2)
    assert not rev_ops._sole(t)
    del alias
    assert rev_ops._sole(t)

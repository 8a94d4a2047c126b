"""Issue 30 classes 1 and 7, round 35: the activations' held-leaf path, their second derivatives.

- A view whose ``_base`` does not name the leaf (a tensor subclass's leaf, whose views are aliases
  of a plain tensor that requires no grad; a view of a leaf that is itself a view of a tensor
  without grad) is memory the graph holds too: the activation keeps x, as eager, not y and side
  information (NOTE [An input the graph holds] in slimgrad/ops/_output_act.py).
- Hardtanh/ReLU6 (half precision with a bound the dtype cannot represent: 1 bit/elt) and LeakyReLU
  (any slope: y) kept more than eager on such a leaf; they keep x there now.
- Second derivatives: eager's bit for bit where x is kept (Hardswish's x path, an empty input, an
  in-place call whose dense path is known from shape and dtype); a ``slimgrad.ops.<op>`` error
  where y, bits and a table are kept, never autograd's "does not require grad" (NOTE [Second
  derivatives of the smooth activations]).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad
import slimgrad.ops as so
from slimgrad.memory import measure


class Sub(torch.Tensor):
    pass


def _leaf(shape, kind, dtype=torch.float32):
    x = (torch.randn(shape) * 3).to(dtype)
    if kind == "sub":
        return x.as_subclass(Sub).requires_grad_()
    if kind == "leaf_view":  # a leaf that is a view of a tensor that requires no grad
        return x.reshape(-1).view(shape).requires_grad_()
    return x.requires_grad_()


_ROWS = {
    # act, leaf kind, input of the activation from the leaf, dtype
    "hardswish_sub_t": (nn.Hardswish, "sub", lambda x: x.t(), torch.float32),
    "silu_sub_as_strided": (
        nn.SiLU,
        "sub",
        lambda x: x.as_strided((48, 40), (1, 48)),
        torch.float32,
    ),
    "elu_neg_leaf_view_t": (lambda: nn.ELU(-0.5), "leaf_view", lambda x: x.t(), torch.float32),
    "hardtanh_f16_leaf": (lambda: nn.Hardtanh(-0.7, 0.7), "plain", lambda x: x.t(), torch.float16),
}


@pytest.mark.parametrize("row", list(_ROWS))
def test_activation_on_a_held_leaf_keeps_eagers_bytes(row):
    act, kind, as_input, dtype = _ROWS[row]
    torch.manual_seed(0)
    eager = nn.Sequential(act(), nn.Linear(40, 16)).to(dtype)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = _leaf((40, 48), kind, dtype)

    def step(m):
        return m(as_input(x)).float().sum()

    res, grads = [], []
    for m in (eager, slim):
        step(m).backward()  # first-use caches outside the measured step
        r = measure(lambda m=m: step(m), module=m, timeline=False)
        res.append((r.saved_bytes, r.peak_bytes))
        x.grad = None
        m.zero_grad(set_to_none=True)
        step(m).backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
        x.grad = None
    # eager's saved bytes exactly, its peak at most (the converted Linear's own margin)
    assert res[1][0] == res[0][0] and res[1][1] <= res[0][1], res
    for ge, gs in zip(*grads, strict=True):
        assert torch.equal(gs.as_subclass(torch.Tensor), ge.as_subclass(torch.Tensor))


def test_leaky_relu_on_a_leaf_keeps_no_byte():
    # a positive slope kept y (7,680 B) where eager's x is the leaf (0 B): y * 2 keeps nothing
    x = torch.randn(40, 48, requires_grad=True)
    saved = []
    for f in (lambda t: F.leaky_relu(t, 0.1), lambda t: so.leaky_relu(t, 0.1)):
        step = lambda f=f: (f(x) * 2).sum()  # noqa: E731
        step().backward()
        saved.append(measure(step, timeline=False).saved_bytes)
    assert saved[1] == saved[0] == 0


def _second(fn, x0, cot, v, prep=lambda t: t, inplace=False):
    x = x0.clone().requires_grad_()
    h = prep(x)
    y = fn(h * 1 if inplace else h)
    (gx,) = torch.autograd.grad(y, x, cot, create_graph=True)
    (g2,) = torch.autograd.grad((gx * v).sum(), x)
    return gx.detach(), g2


_EAGERS = {
    "hardswish_leaf": (so.hardswish, F.hardswish, (40, 48), torch.float32, False),
    "hardswish_few": (so.hardswish, F.hardswish, (3, 5), torch.float32, False),
    "hardswish_f64": (so.hardswish, F.hardswish, (40, 48), torch.float64, False),
    "silu_empty": (so.silu, F.silu, (3, 0), torch.float32, False),
    "mish_empty_f64": (so.mish, F.mish, (3, 0), torch.float64, False),
    "silu_inplace_few": (so.silu_, lambda t: F.silu(t, inplace=True), (3, 5), torch.float32, True),
    "hardswish_inplace_f64": (
        so.hardswish_,
        lambda t: F.hardswish(t, inplace=True),
        (40, 48),
        torch.float64,
        True,
    ),
}


@pytest.mark.parametrize("row", list(_EAGERS))
def test_second_derivatives_where_x_is_kept_are_eagers(row):
    slim, eager, shape, dtype, inplace = _EAGERS[row]
    gen = torch.Generator().manual_seed(2)
    x0, cot, v = (torch.randn(shape, generator=gen, dtype=dtype) * 3 for _ in range(3))
    # a leaf for the held-leaf row, else a non-leaf (x * 1) as the activation's input
    prep = (lambda t: t) if row == "hardswish_leaf" else (lambda t: t * 1)
    got = [_second(f, x0, cot, v, prep, inplace) for f in (slim, eager)]
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["silu", "mish"])
def test_refused_second_derivative_is_slimgrads_error_on_a_transposed_input(op):
    # y, bits and a table kept (float32, 1,920 elements); the transposed input kept a detached
    # alias of y, so with a cotangent without history the first derivative had none and the next
    # differentiation raised autograd's "element 0 of tensors does not require grad"
    fn = getattr(so, op)
    x = torch.randn(48, 40, requires_grad=True)
    y = fn((x * 1).t())
    (gx,) = torch.autograd.grad(y, x, torch.randn(40, 48), create_graph=True)
    with pytest.raises(RuntimeError, match=rf"slimgrad\.ops\.{op}: a second derivative"):
        torch.autograd.grad(gx.sum(), x)


def test_in_place_dense_fallback_refuses_at_the_create_graph_backward():
    # every element at SiLU's minimum: more than 1/16 hard, so in place keeps a copy of x made
    # outside the graph; nothing ties a refusal to x, so the create_graph backward raises itself
    x = torch.full((40, 48), -1.2785, requires_grad=True)
    y = so.silu_(x * 1)
    with pytest.raises(RuntimeError, match=r"slimgrad\.ops\.silu: a backward with create_graph"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    # first derivatives still run, eager's formula on the copy
    (g,) = torch.autograd.grad(so.silu_(x * 1).sum(), x)
    assert torch.equal(g, torch.autograd.grad(F.silu(x * 1).sum(), x)[0])


def test_hardsigmoid_second_derivative_refused_as_eager_refuses():
    # eager has none (aten::hardsigmoid_backward is not differentiable in torch); slimgrad's kept
    # leaf raises its own error, not a silent result
    x = torch.randn(40, 48, requires_grad=True)
    w = torch.randn(40, 48)
    for fn, msg in ((F.hardsigmoid, "hardsigmoid_backward"), (so.hardsigmoid, "slimgrad")):
        (gx,) = torch.autograd.grad((fn(x) * w).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match=msg):
            torch.autograd.grad(gx.sum(), x)


def test_compiled_region_on_a_leaf_keeps_the_side_information_only():
    # NOTE [An input the graph holds]: Dynamo guards on requires_grad, not on is_leaf, so a
    # compiled region on a leaf keeps what it keeps on any input: over compiled eager's (nothing of
    # the leaf), SiLU's bits and table; inputs away from SiLU's minimum: no hard element, the bits
    from slimgrad.memory import _storage, _walk_savers

    torch.manual_seed(0)
    eager = nn.Sequential(nn.SiLU(), nn.Linear(48, 16))
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = (torch.rand(64, 48) * 3).requires_grad_()  # in [0, 3): x* = -1.28 is far
    kept = []
    for m in (eager, slim):
        torch._dynamo.reset()
        c = torch.compile(m, backend="aot_eager")
        c(x).sum().backward()
        loss = c(x).sum()
        skip = {_storage(t)._cdata for t in (x, *m.parameters())}
        found = _walk_savers([loss.grad_fn])
        kept.append(sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in skip))
    assert kept[0] == 64 * 48 * 4  # y, kept by the Linear
    assert kept[1] - kept[0] == 64 * 48 // 8  # the bits, 1/8 B/elt, and no table

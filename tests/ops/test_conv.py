import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import slimgrad
from slimgrad.memory import measure
from slimgrad.ops import _derived
from slimgrad.ops.batch_norm import batch_norm
from slimgrad.ops.conv import (
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from slimgrad.testing import assert_within_rule, grads_of

CASES = [
    # (ours, torch's, nd, transposed, kwargs)
    (conv1d, F.conv1d, 1, False, dict(stride=2, padding=1, dilation=1, groups=1)),
    (conv2d, F.conv2d, 2, False, dict(stride=(1, 2), padding=(2, 1), dilation=(2, 1), groups=1)),
    (conv2d, F.conv2d, 2, False, dict(stride=1, padding="same", dilation=1, groups=3)),
    (conv3d, F.conv3d, 3, False, dict(stride=1, padding=1, groups=1)),
    (conv_transpose1d, F.conv_transpose1d, 1, True, dict(stride=2, padding=1, output_padding=1)),
    (conv_transpose2d, F.conv_transpose2d, 2, True, dict(stride=2, padding=0, groups=3)),
    (conv_transpose3d, F.conv_transpose3d, 3, True, dict(stride=1, padding=1)),
]


def _make(nd, transposed, groups, dtype, k=3, cin=3, cout=6):
    if nd == 3:  # keep 3-D gradcheck cheap
        k, cout = 2, 3 * groups
    x = torch.randn(
        2 if nd < 3 else 1, cin, *([7, 5, 5] if nd < 3 else [4, 3, 3])[:nd], dtype=dtype
    )
    if transposed:
        w = torch.randn(cin, cout // groups, *([k] * nd), dtype=dtype)
    else:
        w = torch.randn(cout, cin // groups, *([k] * nd), dtype=dtype)
    b = torch.randn(cout, dtype=dtype)
    return x, w, b


@pytest.mark.parametrize("ours,ref,nd,transposed,kw", CASES)
def test_gradcheck(ours, ref, nd, transposed, kw):
    x, w, b = _make(nd, transposed, kw.get("groups", 1), torch.float64)
    args = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda x, w, b: ours(x, w, b, **kw), args)


@pytest.mark.parametrize("ours,ref,nd,transposed,kw", CASES)
@pytest.mark.parametrize("need", ["all", "x", "w", "wb", "b"])
def test_matches_eager_all_grad_subsets(ours, ref, nd, transposed, kw, need):
    x, w, b = _make(nd, transposed, kw.get("groups", 1), torch.float32)
    outs = []
    for fn in (ours, ref):
        xs = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(*xs, **kw)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        pick = {"all": xs, "x": xs[:1], "w": xs[1:2], "wb": xs[1:], "b": xs[2:]}[need]
        y.backward(g, inputs=pick)
        outs.append([y] + [t.grad for t in xs])
    for a, e in zip(*outs):
        torch.testing.assert_close(a, e)


def test_frozen_weight_keeps_nothing_and_no_input_grad_keeps_input():
    x0 = torch.randn(4, 6, 13, 11)
    w = torch.randn(5, 6, 3, 3)
    wt = w.clone().requires_grad_()
    x_bytes = x0.numel() * 4

    def step(fn, x_grad, weight):
        def f():
            x = x0 * 1
            if x_grad:
                x.requires_grad_()
            return fn(x, weight, padding=1).sum()

        return f

    # frozen W, x needs grad (the input is created in the step and needs grad: leaf).
    assert measure(step(conv2d, True, w)).saved_bytes == 0
    assert measure(step(F.conv2d, True, w)).saved_bytes == x_bytes
    # x needs no grad, W trainable: only x is kept, as eager.
    assert measure(step(conv2d, False, wt)).saved_bytes == x_bytes
    assert measure(step(F.conv2d, False, wt)).saved_bytes == x_bytes


def test_autocast_bf16_does_not_keep_weight_copy_when_input_needs_no_grad():
    x0 = torch.randn(2, 4, 9, 9)
    w = torch.randn(8, 4, 3, 3, requires_grad=True)

    def step(fn):
        def f():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(x0 * 1, w).float().sum()

        return f

    x_bf16 = x0.numel() * 2
    assert measure(step(conv2d)).saved_bytes == x_bf16
    assert measure(step(F.conv2d)).saved_bytes == x_bf16 + w.numel() * 2


def test_autocast_bf16_within_rule():
    x = torch.randn(2, 5, 11, 7)
    w = torch.randn(7, 5, 3, 3)
    res = {}
    for name, fn, dt, ac in [
        ("ours", conv2d, torch.float32, True),
        ("eager", F.conv2d, torch.float32, True),
        ("ref", F.conv2d, torch.float64, False),
    ]:
        xs = [x.to(dt).requires_grad_(), w.to(dt).requires_grad_()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            y = fn(*xs, padding=1)
        assert y.dtype == (torch.bfloat16 if ac else torch.float64)
        res[name] = [y.float()] + grads_of((y.double() * y.double().cos()).sum(), xs)
    assert_within_rule(res["ours"], res["ref"], res["eager"], atol=1e-2)


def test_channels_last_and_noncontiguous():
    x = torch.randn(2, 4, 9, 8).to(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)
    xt = torch.randn(2, 4, 8, 9).transpose(2, 3)
    for inp in (x, xt):
        outs = []
        for fn in (conv2d, F.conv2d):
            a, b = inp.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(a, b, stride=2)
            y.backward(torch.ones_like(y))
            outs.append((y, a.grad, b.grad, y.is_contiguous(memory_format=torch.channels_last)))
        for u, v in zip(*outs):
            if isinstance(u, bool):
                assert u == v
            else:
                torch.testing.assert_close(u, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4, 2, 2), (3, 8, 5, 7), (2, 16, 1, 64)])
def test_frozen_weight_dx_in_eager_layout(shape, dtype):
    # NOTE [A stand-in for x]: a frozen stride-1 conv with as many output as input channels hands
    # back dx in eager's layout (channels_last here), with eager's bits; before, the expanded
    # stand-in gave a contiguous dx and the next op's backward copied it (peak above eager's)
    c = shape[1]
    x = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(c, c, 1, 1).to(dtype)
    g = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
    outs = []
    for fn in (conv2d, F.conv2d):
        a = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(fn(a, w), a, g)
        outs.append(dx)
    assert outs[0].stride() == outs[1].stride()
    assert torch.equal(outs[0], outs[1])
    a = x.clone().requires_grad_()
    eager = measure(lambda: (F.conv2d(a, w) * g).sum(), timeline=False)
    ours = measure(lambda: (conv2d(a, w) * g).sum(), timeline=False)
    assert ours.peak_bytes <= eager.peak_bytes
    assert ours.saved_bytes <= eager.saved_bytes


_CL = torch.channels_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("cin,cout,groups", [(4, 8, 1), (8, 4, 1), (8, 8, 2), (8, 8, 8)])
def test_frozen_weight_dx_in_eager_layout_when_the_conv_changes_shape(
    cin, cout, groups, stride, k, layout, dtype
):
    # NOTE [A stand-in for x]: where the incoming gradient cannot stand in for x (other channels
    # or size), an empty buffer with x's strides does: dx in eager's layout with eager's bits.
    # Before: a channels_last x got a contiguous dx (24 of the 32 channels_last cases), and a 3x3
    # stride-1 conv that changes channels gave other bits in float32
    fmt = _CL if layout == "channels_last" else torch.contiguous_format
    g = torch.Generator().manual_seed(cin * 100 + cout * 10 + groups + k)
    x = torch.randn(2, cin, 5, 7, generator=g).to(dtype).contiguous(memory_format=fmt)
    w = torch.randn(cout, cin // groups, k, k, generator=g).to(dtype)

    def dx_of(fn):
        a = x.clone().requires_grad_()
        y = fn(a, w, None, stride, k // 2, 1, groups)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        (dx,) = torch.autograd.grad(y, a, dy.contiguous(memory_format=fmt))
        return dx

    ours, eager = dx_of(conv2d), dx_of(F.conv2d)
    assert ours.stride() == eager.stride()
    assert torch.equal(ours, eager)

    def step(fn):
        a = x.clone().requires_grad_()
        return lambda: torch.tanh(fn(a * 1, w, None, stride, k // 2, 1, groups)).sum()

    e, o = measure(step(F.conv2d), timeline=False), measure(step(conv2d), timeline=False)
    assert o.saved_bytes < e.saved_bytes
    assert o.peak_bytes <= e.peak_bytes


@pytest.mark.parametrize("fmt", [torch.channels_last_3d, torch.contiguous_format])
def test_frozen_conv3d_and_transposed_dx_in_eager_layout(fmt):
    x = torch.randn(2, 4, 3, 5, 4).contiguous(memory_format=fmt)
    w3 = torch.randn(6, 4, 3, 3, 3)
    wt = torch.randn(4, 6, 2, 2, 2)
    for fn, ref, w, kw in (
        (conv3d, F.conv3d, w3, {"stride": 2, "padding": 1}),
        (conv_transpose3d, F.conv_transpose3d, wt, {"stride": 2}),
    ):
        outs = []
        for f in (fn, ref):
            a = x.clone().requires_grad_()
            y = f(a, w, **kw)
            (dx,) = torch.autograd.grad(y, a, torch.ones_like(y))
            outs.append(dx)
        assert outs[0].stride() == outs[1].stride(), fn.__name__
        assert torch.equal(outs[0], outs[1]), fn.__name__


def test_frozen_weight_sliced_x_dx_as_eager():
    # a non-dense x (a slice of a channels_last tensor): a dense buffer in the format eager's
    # backend copies x into (channels_last here), so eager's bits; before, the expanded stand-in
    # made the backend run its contiguous algorithm (other bits)
    base = torch.randn(2, 8, 5, 9).contiguous(memory_format=_CL)
    w = torch.randn(6, 4, 3, 3)
    outs = []
    for f in (conv2d, F.conv2d):
        a = base.clone().requires_grad_()
        y = f(a[:, 2:6, :, 1:8], w, padding=1)
        (dx,) = torch.autograd.grad(y, a, torch.ones_like(y))
        outs.append(dx)
    assert torch.equal(outs[0], outs[1])


def test_unbatched_and_errors():
    x = torch.randn(3, 8, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    torch.testing.assert_close(conv2d(x, w), F.conv2d(x, w))
    with pytest.raises(RuntimeError, match=r"slimgrad.ops.conv2d: unknown padding string"):
        conv2d(x, w, padding="full")
    with pytest.raises(RuntimeError, match=r"slimgrad.ops.conv2d: stride must be"):
        conv2d(x, w, stride=(1, 2, 3))
    with pytest.raises(TypeError, match=r"slimgrad.ops.conv2d: input and weight must be tensors"):
        conv2d([1.0], w)


def test_same_padding_even_kernel():
    x = torch.randn(2, 3, 9, 10, requires_grad=True)
    w = torch.randn(4, 3, 4, 2, requires_grad=True)
    y = conv2d(x, w, padding="same", dilation=(1, 3))
    with warnings.catch_warnings():  # eager warns once per process (TORCH_WARN_ONCE)
        warnings.simplefilter("ignore", UserWarning)
        ye = F.conv2d(x, w, padding="same", dilation=(1, 3))
    torch.testing.assert_close(y, ye)
    ga = torch.autograd.grad(y.square().sum(), (x, w))
    gb = torch.autograd.grad(ye.square().sum(), (x, w))
    torch.testing.assert_close(ga, gb)


def test_no_grad_and_inference_mode_take_plain_path():
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3, requires_grad=True)
    with torch.no_grad():
        assert conv2d(x, w).grad_fn is None
    with torch.inference_mode():
        torch.testing.assert_close(conv2d(x, w), F.conv2d(x, w))


def _bn_relu(h, bn_w, bn_b, act="relu"):
    C = h.shape[1]
    rm, rv = torch.zeros(C, dtype=h.dtype), torch.ones(C, dtype=h.dtype)
    b = batch_norm(h, rm, rv, bn_w, bn_b, True, 0.1, 1e-5)
    return b, _derived.activation(b, act)


def test_derived_input_keeps_bn_output_only():
    # Conv(frozen) -> BN -> ReLU -> Conv keeps b only (+ eager's O(C)); eager keeps h and relu(b).
    x0 = torch.randn(4, 5, 12, 9)
    w1 = torch.randn(6, 5, 3, 3)
    w2 = torch.randn(7, 6, 3, 3, requires_grad=True)
    g = torch.randn(6).requires_grad_()
    be = (g.detach().abs() * torch.empty(6).uniform_(-0.45, 0.45)).requires_grad_()  # |β| < |γ|/2
    full = 4 * 6 * 10 * 7 * 4
    rm, rv = torch.zeros(6), torch.ones(6)

    def slim():
        h = conv2d(x0, w1)
        b = batch_norm(h, rm, rv, g, be, True, 0.1, 1e-5)
        return conv2d(_derived.activation(b, "relu"), w2).sum()

    def eager():
        h = F.conv2d(x0, w1)
        b = F.batch_norm(h, rm, rv, g, be, True, 0.1, 1e-5)
        return F.conv2d(torch.relu(b), w2).sum()

    ms, me = measure(slim), measure(eager)
    assert me.saved_bytes == 2 * full + 2 * 6 * 4  # h, relu(b), save_mean, save_invstd
    # b, and per channel: save_mean, save_invstd (γ and β kept as themselves, not copies: NOTE
    # [BatchNorm keeps its parameters, not copies])
    assert ms.saved_bytes == full + 2 * 6 * 4


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
def test_derived_chain_gradcheck(act):
    x = torch.randn(3, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(4, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 4, 1, 1, dtype=torch.float64, requires_grad=True)
    g = torch.tensor([1.2, -0.7, 0.9, 2.0], dtype=torch.float64, requires_grad=True)
    be = torch.tensor([0.1, 0.3, -0.2, 0.0], dtype=torch.float64, requires_grad=True)

    def f(x, w1, w2, g, be):
        h = conv2d(x, w1, padding=1)
        _, r = _bn_relu(h, g, be, act)
        return conv2d(r, w2)

    assert torch.autograd.gradcheck(f, (x, w1, w2, g, be))


def test_inplace_on_kept_bn_output_raises():
    x = torch.randn(3, 2, 5, 4, requires_grad=True)
    w2 = torch.randn(3, 4, 1, 1, requires_grad=True)
    h = conv2d(x, torch.randn(4, 2, 3, 3), padding=1)
    b, r = _bn_relu(h, torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True))
    y = conv2d(r, w2)
    b.mul_(2)  # the tensor the conv keeps instead of r
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_on_derived_input_after_conv_is_harmless():
    # The conv recomputes r from b, so changing r afterwards cannot corrupt dW (eager would raise).
    x = torch.randn(3, 2, 5, 4)
    w2 = torch.randn(3, 4, 1, 1, requires_grad=True)
    h = conv2d(x, torch.randn(4, 2, 3, 3), padding=1)
    b, r = _bn_relu(h, torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True))
    y = conv2d(r, w2)
    (gw_ref,) = torch.autograd.grad(y.sum(), w2, retain_graph=True)
    r.add_(1)
    (gw,) = torch.autograd.grad(y.sum(), w2)
    torch.testing.assert_close(gw, gw_ref)


def test_recipe_input_changed_raises():
    # conv -> BN (no activation): the BN keeps how to recompute its input; changing the conv input
    # in place before backward must raise, not give a wrong gradient.
    x = torch.randn(3, 2, 5, 4)
    w = torch.randn(4, 2, 3, 3, requires_grad=True)
    xi = x * 1
    h = conv2d(xi, w, padding=1)
    b = batch_norm(
        h,
        None,
        None,
        torch.ones(4, requires_grad=True),
        None,
        True,
        0.1,
        1e-5,
        recompute_input="always",
    )
    xi.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.square().sum().backward()


@pytest.mark.parametrize("w_grad", [True, False])
def test_compile_aot_eager_fullgraph_matches(w_grad):
    # dynamo traces the selective-saving Function (no graph break); the derived/recipe registries
    # are skipped while tracing.
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=w_grad)

    def f(x, w):
        return conv2d(x, w, padding=1).square().sum()

    torch._dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    ins = [x, w] if w_grad else [x]
    ga = torch.autograd.grad(cf(x, w), ins)
    gb = torch.autograd.grad(f(x, w), ins)
    torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("grad", [False, True])
def test_errors_raise_where_eager_raises_with_eager_types(grad):
    # Issue 15: a float bias on an integer input was dropped (eager raises); error types follow
    # eager's (RuntimeError for bad values, TypeError for string padding of a transposed conv).
    xi, wi = torch.randint(0, 5, (1, 2, 5, 5)), torch.randint(0, 5, (3, 2, 3, 3))
    wf = wi.float().requires_grad_(grad)
    cases = [
        (conv2d, F.conv2d, (xi, wi, torch.randn(3))),
        (conv2d, F.conv2d, (xi, wf, torch.randn(3))),
        (conv2d, F.conv2d, (torch.randn(5, 5), wf)),
        (conv2d, F.conv2d, (torch.randn(1, 2, 5, 5), wf, None, 2, "same")),
        (conv2d, F.conv2d, (torch.randn(1, 2, 5, 5), wf, None, 1, "full")),
        (conv_transpose2d, F.conv_transpose2d, (torch.randn(1, 3, 5, 5), wf, None, 1, "same")),
        (conv2d, F.conv2d, (torch.randn(1, 1, 4, 3), torch.randn(1, 2, 2), None, 1, "same")),
    ]
    for ours, eager, args in cases:
        with pytest.raises(Exception) as ref:
            eager(*args)
        with pytest.raises(type(ref.value), match=r"slimgrad.ops.conv"):
            ours(*args)


def test_double_backward_gradgradcheck():
    # Issue 15: conv / conv_transpose were once_differentiable (autograd.grad(...,
    # allow_unused=True) returned None); second derivatives are now eager's.
    torch.manual_seed(0)
    d = torch.float64
    x = torch.randn(2, 3, 5, 5, dtype=d, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=d, requires_grad=True)
    b = torch.randn(4, dtype=d, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w, b: conv2d(x, w, b, 2, 1), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x: conv2d(x, w.detach(), None, 1, 1), (x,))
    assert torch.autograd.gradgradcheck(lambda w: conv2d(x.detach(), w, b.detach()), (w,))
    wt = torch.randn(3, 2, 3, dtype=d, requires_grad=True)
    x1 = torch.randn(2, 3, 4, dtype=d, requires_grad=True)
    f = lambda x, w: conv_transpose1d(x, w, None, 2, 0, 1)  # noqa: E731
    assert torch.autograd.gradgradcheck(f, (x1, wt))
    # allow_unused: eager's answer (a tensor), not None
    (gx,) = torch.autograd.grad(conv2d(x, w).square().sum(), x, create_graph=True)
    (gw,) = torch.autograd.grad(gx.sum(), w, allow_unused=True)
    (gx_e,) = torch.autograd.grad(F.conv2d(x, w).square().sum(), x, create_graph=True)
    (gw_e,) = torch.autograd.grad(gx_e.sum(), w, allow_unused=True)
    torch.testing.assert_close(gw, gw_e)


def test_double_backward_through_derived_input():
    # x = act(b) kept as b (NOTE [Derived saved inputs]): the second derivative recomputes x with
    # eager's differentiable activation from b, which carries b's graph.
    torch.manual_seed(1)
    d = torch.float64
    x = torch.randn(3, 2, 4, 4, dtype=d, requires_grad=True)
    w = torch.randn(3, 2, 1, 1, dtype=d, requires_grad=True)
    g, bb = torch.ones(2, dtype=d), torch.zeros(2, dtype=d)

    def f(x, w):
        r = _derived.activation(batch_norm(x, None, None, g, bb, True), "silu")
        assert _derived.lookup(r) is not None
        return conv2d(r, w)

    def f_eager(x, w):
        return F.conv2d(F.silu(F.batch_norm(x, None, None, g, bb, True)), w)

    grads = []
    for fn in (f, f_eager):
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        (gw,) = torch.autograd.grad(fn(xs, ws).sin().sum(), ws, create_graph=True)
        grads.append(torch.autograd.grad(gw.square().sum(), (xs, ws)))
    for o, e in zip(*grads, strict=True):
        torch.testing.assert_close(o, e)


def test_torch_func_transforms_and_jit_trace():
    # Issue 15: torch.func transforms run eager's convolution; torch.jit.trace refuses clearly.
    from torch.func import grad, jacrev, vmap

    torch.manual_seed(0)
    x, w = torch.randn(3, 2, 4, 7), torch.randn(5, 4, 3)
    torch.testing.assert_close(vmap(lambda t: conv1d(t, w))(x), vmap(lambda t: F.conv1d(t, w))(x))
    torch.testing.assert_close(
        grad(lambda t: conv1d(t, w, padding=1).sin().sum())(x[0]),
        grad(lambda t: F.conv1d(t, w, padding=1).sin().sum())(x[0]),
    )
    torch.testing.assert_close(
        jacrev(lambda v: conv1d(x[0], v))(w), jacrev(lambda v: F.conv1d(x[0], v))(w)
    )
    with pytest.raises(RuntimeError, match="slimgrad.ops.conv1d: torch.jit.trace"):
        torch.jit.trace(lambda t: conv1d(t, w), x[0].requires_grad_())


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_batch_of_zero_before_the_loss_peaks_as_eager(dims):
    # dW's call reads only x's shape; at a batch of 0 the stand-in for x views the loss's
    # expanded 1 instead of a fresh 0-d tensor (4 bytes above eager's peak before)
    conv = torch.nn.Sequential(getattr(torch.nn, f"Conv{dims}d")(3, 5, 3))
    conv_s = slimgrad.convert_(copy.deepcopy(conv))
    assert type(conv_s[0]).__module__.startswith("slimgrad")
    x = torch.randn(0, 3, *([6] * dims))
    peaks = [measure(lambda m=m: m(x).sum()).peak_bytes for m in (conv, conv_s)]
    assert peaks[1] <= peaks[0]


def _batch_of_zero_as_eager(eager, x):
    # a converted copy of eager peaks as eager on x (a batch of 0) and gives eager's parameter
    # gradients, bit for bit and in their layouts; returns the two measurements
    slim = slimgrad.convert_(copy.deepcopy(eager))
    assert type(slim[0]).__module__.startswith("slimgrad")
    runs = [measure(lambda m=m: m(x).sum(), timeline=False) for m in (eager, slim)]
    assert runs[1].peak_bytes == runs[0].peak_bytes
    grads = []
    for m in (eager, slim):
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b) and b.stride() == a.stride()
    return runs


@pytest.mark.parametrize("tail", ["ReLU", "BatchNorm2d"])
def test_a_batch_of_zero_through_a_fresh_empty_gradient_peaks_as_eager(tail):
    # the gradient a ReLU or BatchNorm hands the conv at a batch of 0 is a fresh empty tensor:
    # no element for W's stand-in to view (4 fresh bytes above eager's peak before); dW and db
    # are the sums over no element, zeros, as eager's
    torch.manual_seed(0)
    after = torch.nn.ReLU() if tail == "ReLU" else torch.nn.BatchNorm2d(5)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), after)
    runs = _batch_of_zero_as_eager(eager, torch.randn(0, 3, 7, 7))
    assert runs[1].saved_bytes == runs[0].saved_bytes


@pytest.mark.parametrize("tail", ["ReLU", "Identity"])
def test_a_batch_of_zero_in_channels_last_peaks_as_eager(tail):
    # dW of a batch of 0 is made in W's layout: a contiguous one for a channels_last W was copied
    # into W's layout when accumulated (Conv2d(4, 8, 3): peak 2,344 B vs eager's 1,192)
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), getattr(torch.nn, tail)())
    eager = eager.to(memory_format=torch.channels_last)
    _batch_of_zero_as_eager(
        eager, torch.randn(0, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    )

import importlib
import types

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops import _derived
from slimgrad.ops.batch_norm import batch_norm
from slimgrad.ops.conv import conv2d
from slimgrad.testing import assert_within_rule, grads_of

EPS = 1e-5


@pytest.fixture(autouse=True)
def _from_output_at_any_count(monkeypatch):
    # the from-output path's tests use small shapes: let it run at any count per channel (NOTE [Few
    # values per channel] in ops/batch_norm.py; tests/ops/test_bn_few_values.py covers that rule)
    monkeypatch.setattr(importlib.import_module("slimgrad.ops.batch_norm"), "_MAX_FEW", 0)


def _params(C, dtype=torch.float32, seed=0):
    # both signs of γ; |β| < |γ| / 2 so every channel is recovered from the output
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(C, dtype=dtype).uniform_(0.5, 1.5, generator=g)
    w = w * torch.where(torch.rand(C, generator=g) < 0.3, -1.0, 1.0).to(dtype)
    b = w.abs() * torch.empty(C, dtype=dtype).uniform_(-0.45, 0.45, generator=g)
    return w, b


def _block(bn, act_fn, x, w, b, rm, rv, training, momentum=0.1):
    """BN -> act -> (x̂ consumer) with the given functions; returns outputs to compare."""
    y = bn(x, rm, rv, w, b, training, momentum, EPS)
    return y, act_fn(y)


def _ours_act(act):
    return lambda y: _derived.activation(y, act)


def _eager_act(act):
    return {
        "relu": torch.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
    }[act]


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "silu"])
@pytest.mark.parametrize("training", [True, False])
def test_gradcheck(act, training):
    C = 3
    x = torch.randn(4, C, 3, 5, dtype=torch.float64, requires_grad=True)
    w, b = (t.requires_grad_() for t in _params(C, torch.float64))
    rm, rv = torch.randn(C, dtype=torch.float64), torch.rand(C, dtype=torch.float64) + 0.5

    def f(x, w, b):
        y = batch_norm(x, rm.clone(), rv.clone(), w, b, training, 0.1, EPS)
        return y if act == "none" else _derived.activation(y, act)

    assert torch.autograd.gradcheck(f, (x, w, b))


@pytest.mark.parametrize(
    "shape,act",
    [((5, 3), "relu"), ((4, 3, 7), "gelu_tanh"), ((3, 5, 4, 7), "silu"), ((2, 3, 3, 4, 5), "relu")],
)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("need", ["all", "x", "wb", "w", "b"])
def test_matches_eager(shape, act, training, need):
    C = shape[1]
    x0 = torch.randn(*shape) * 2 + 1
    w0, b0 = _params(C)
    res = []
    for bn, act_fn in ((batch_norm, _ours_act(act)), (F.batch_norm, _eager_act(act))):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        rm, rv = torch.zeros(C) + 0.3, torch.ones(C) * 1.7
        y, r = _block(bn, act_fn, x, w, b, rm, rv, training)
        up = torch.randn(r.shape, generator=torch.Generator().manual_seed(1))
        pick = {"all": [x, w, b], "x": [x], "wb": [w, b], "w": [w], "b": [b]}[need]
        (r * up).sum().backward(inputs=pick)
        res.append([y, r, rm, rv, x.grad, w.grad, b.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e)


def test_momentum_none_track_false_affine_false():
    x0 = torch.randn(6, 4, 5)
    for mod_kw in [dict(momentum=None), dict(track_running_stats=False), dict(affine=False)]:
        from slimgrad.nn.batch_norm import BatchNorm1d

        e = torch.nn.BatchNorm1d(4, **mod_kw)
        s = BatchNorm1d(4, **mod_kw)
        for _ in range(2):
            outs = []
            for m in (s, e):
                x = x0.clone().requires_grad_()
                r = _derived.activation(m(x), "relu") if m is s else torch.relu(m(x))
                r.pow(2).sum().backward()
                outs.append([r, x.grad] + [t.clone() for t in m.state_dict().values()])
            for a, b in zip(*outs):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", ["zero", "tiny", "large_beta", "many_bad"])
def test_weight_near_zero_channels_exact(case):
    C = 6
    x = torch.randn(5, C, 4, 3, dtype=torch.float64, requires_grad=True)
    w, b = _params(C, torch.float64)
    if case == "zero":
        w[1] = 0.0
    elif case == "tiny":
        w[2] = 1e-30
    elif case == "large_beta":
        b[0], w[0] = 50.0, 0.01
    else:
        w[:3] = 0.0
    w.requires_grad_()
    b.requires_grad_()

    def f(x, w, b):
        y = batch_norm(x, None, None, w, b, True, 0.1, EPS)
        return _derived.activation(y, "silu")

    assert torch.autograd.gradcheck(f, (x, w, b))
    # no inf / NaN anywhere, and equal to eager
    outs = []
    for fn in (f, lambda x, w, b: F.silu(F.batch_norm(x, None, None, w, b, True, 0.1, EPS))):
        xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        outs.append(grads_of(fn(*xs).sin().sum(), xs))
    for a, e in zip(*outs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e)


def test_memory_bn_relu_conv_keeps_one_tensor():
    N, C, H, W = 4, 6, 9, 7
    x0 = torch.randn(N, C, H, W)
    w, b = (t.requires_grad_() for t in _params(C))
    wc = torch.randn(5, C, 3, 3, requires_grad=True)
    rm, rv = torch.zeros(C), torch.ones(C)
    full = N * C * H * W * 4

    def step(ours):
        def f():
            h = x0 * 1  # created in the step
            if ours:
                r = _derived.activation(batch_norm(h, rm, rv, w, b, True, 0.1, EPS), "relu")
                return conv2d(r, wc).sum()
            r = torch.relu(F.batch_norm(h, rm, rv, w, b, True, 0.1, EPS))
            return F.conv2d(r, wc).sum()

        return f

    ms, me = measure(step(True)), measure(step(False))
    # eager: x, relu(b) + save_mean, save_invstd; ours: b + save_mean, save_invstd (γ and β are
    # kept as themselves, not copied: NOTE [BatchNorm keeps its parameters, not copies])
    assert me.saved_bytes == 2 * full + 2 * C * 4
    assert ms.saved_bytes == full + 2 * C * 4
    assert ms.peak_bytes < me.peak_bytes


def test_memory_eval_frozen_affine_keeps_nothing_full_size():
    N, C, H, W = 3, 5, 8, 7
    x0 = torch.randn(N, C, H, W)
    w, b = _params(C)
    rm, rv = torch.randn(C), torch.rand(C) + 0.5

    m_e = measure(lambda: F.batch_norm((x0 * 1).requires_grad_() * 1, rm, rv, w, b).sum())
    m_s = measure(lambda: batch_norm((x0 * 1).requires_grad_() * 1, rm, rv, w, b).sum())
    assert m_e.saved_bytes == N * C * H * W * 4
    # ours: nothing (the running statistics, γ and β are kept as themselves, not copied; invstd is
    # computed in backward: NOTE [BatchNorm keeps its parameters, not copies])
    assert m_s.saved_bytes == 0
    assert m_s.peak_bytes <= m_e.peak_bytes


def test_conv_bn_keeps_recipe_not_input():
    # conv -> BN without activation (a ResNet bn3 / downsample): the BN input is not kept.
    N, C, H, W = 3, 4, 7, 6
    x0 = torch.randn(N, 3, H, W)
    wc = torch.randn(C, 3, 3, 3, requires_grad=True)
    w, b = (t.requires_grad_() for t in _params(C))

    def step(ours):
        def f():
            xin = x0 * 1
            if ours:
                h = conv2d(xin, wc, padding=1)
                y = batch_norm(h, None, None, w, b, True, 0.1, EPS, recompute_input="always")
            else:
                h = F.conv2d(xin, wc, padding=1)
                y = F.batch_norm(h, None, None, w, b, True, 0.1, EPS)
            return (y + 1).relu_().sum()

        return f

    full_in, full = N * 3 * H * W * 4, N * C * H * W * 4
    ms, me = measure(step(True)), measure(step(False))
    assert me.saved_bytes == full_in + 2 * full + 2 * C * 4
    assert ms.saved_bytes == full_in + full + 2 * C * 4  # xin (conv), relu output; no BN input


def test_function_applied_with_an_empty_holder_keeps_the_recipe_as_batch_norm():
    # batch_norm hands its Function x's recipe (holder == [recipe]); applied directly with an empty
    # holder (the older way to call it) the Function looks the recipe up itself: no IndexError,
    # and the same kept bytes and gradients as through batch_norm
    sbn = importlib.import_module("slimgrad.ops.batch_norm")
    N, C, H, W = 3, 4, 7, 6
    x0 = torch.randn(N, 3, H, W)
    wc = torch.randn(C, 3, 3, 3, requires_grad=True)
    w, b = (t.requires_grad_() for t in _params(C))

    def step(direct):
        def f():
            h = conv2d(x0 * 1, wc, padding=1)
            if direct:
                args = (None, None, True, 0.1, EPS, [], "always", False)
                y = sbn._BatchNormFn.apply(h, w, b, *args)
                assert y.grad_fn.recipe is not None  # kept how to rebuild h, not h
            else:
                y = batch_norm(h, None, None, w, b, True, 0.1, EPS, recompute_input="always")
            return (y + 1).relu_().sum()

        return f

    ms, md = measure(step(False)), measure(step(True))
    assert md.saved_bytes == ms.saved_bytes
    grads = [grads_of(step(d)(), (wc, w, b)) for d in (False, True)]
    for a, c in zip(*grads, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_retain_graph_two_passes_and_second_pass_without_retain_raises():
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    w, b = (t.requires_grad_() for t in _params(3))
    wc = torch.randn(2, 3, 1, 1, requires_grad=True)
    y = conv2d(_derived.activation(batch_norm(x, None, None, w, b, True, 0.1, EPS), "relu"), wc)
    g1 = torch.autograd.grad(y.sum(), (x, w, b, wc), retain_graph=True)
    g2 = torch.autograd.grad(y.sum(), (x, w, b, wc))
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y.sum(), (x, w, b, wc))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("keep_output", [False, True])
def test_gradgradcheck(training, keep_output):
    # Issue 15: double backward was once_differentiable (a silent None with allow_unused); it
    # now gives eager's second derivatives whether x, its recipe or b (an activation follows)
    # was kept.
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w, b = (t.double().requires_grad_() for t in _params(3))

    def f(x, w, b):
        y = batch_norm(
            x, torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype), w, b, training, 0.1, EPS
        )
        if keep_output:  # what a following slimgrad activation asks: keep b instead of x
            assert _derived.claim_source(y) == training
        return torch.tanh(y)

    assert torch.autograd.gradgradcheck(f, (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x: f(x, w.detach(), b.detach()), (x,))


def test_inplace_on_input_before_backward_raises():
    x = torch.randn(4, 3, 5, requires_grad=True)
    h = x * 1
    w, b = (t.requires_grad_() for t in _params(3))
    y = batch_norm(h, None, None, w, b, True, 0.1, EPS)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_on_output_after_activation_raises():
    x = torch.randn(4, 3, 5, requires_grad=True)
    w, b = (t.requires_grad_() for t in _params(3))
    y = batch_norm(x, None, None, w, b, True, 0.1, EPS)
    r = _derived.activation(y, "relu")
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        r.sum().backward()


def test_residual_add_on_output_falls_back_exactly():
    # ResNet's bn3: `out += identity` before the ReLU. Nothing is claimed; gradients stay exact.
    x0, idt0 = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    w0, b0 = _params(3)
    res = []
    for bn, act in ((batch_norm, _ours_act("relu")), (F.batch_norm, torch.relu)):
        x, idt, w, b = (t.clone().requires_grad_() for t in (x0, idt0, w0, b0))
        out = bn(x * 1, None, None, w, b, True, 0.1, EPS)
        out += idt
        r = act(out)
        r.pow(2).sum().backward()
        res.append([r, x.grad, idt.grad, w.grad, b.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e)


def test_output_shared_with_other_branch_pending_grad():
    # b feeds the activation and a residual branch whose gradient arrives separately.
    x0 = torch.randn(4, 3, 5, 5)
    w0, b0 = _params(3)
    wc = torch.randn(3, 3, 3, 3)
    res = []
    for bn, act, cv in (
        (batch_norm, _ours_act("relu"), conv2d),
        (F.batch_norm, torch.relu, F.conv2d),
    ):
        x, w, b, c = (t.clone().requires_grad_() for t in (x0, w0, b0, wc))
        y = bn(x, None, None, w, b, True, 0.1, EPS)
        z = cv(act(y), c, padding=1) + y * 3
        z.sin().sum().backward()
        res.append([z, x.grad, w.grad, b.grad, c.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e)


def test_hooks_and_retain_grad():
    x0 = torch.randn(4, 3, 5, 5)
    w0, b0 = _params(3)
    res = []
    for bn, act in ((batch_norm, _ours_act("relu")), (F.batch_norm, torch.relu)):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = bn(x, None, None, w, b, True, 0.1, EPS)
        y.retain_grad()
        y.register_hook(lambda g: g * 2)
        r = act(y)
        r.register_hook(lambda g: g + 1)
        r.pow(2).sum().backward()
        res.append([y.grad, x.grad, w.grad, b.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e)


def test_no_grad_inference_mode_views_and_errors():
    x = torch.randn(4, 3, 5)
    w, b = _params(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    with torch.no_grad():
        y = batch_norm(x, rm, rv, w, b, True, 0.1, EPS)
        assert _derived.activation(y, "relu").grad_fn is None
    with torch.inference_mode():
        torch.testing.assert_close(batch_norm(x, rm, rv, w, b), F.batch_norm(x, rm, rv, w, b))
    # a view of the output is not tagged: it takes the eager path, still exact
    xr = x.clone().requires_grad_()
    y = batch_norm(xr, None, None, w, b, True, 0.1, EPS)
    r = _derived.activation(y[:, :2], "relu")
    assert _derived.lookup(r) is None
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        batch_norm(torch.randn(1, 3, requires_grad=True), None, None, training=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        F.batch_norm(torch.randn(1, 3), None, None, training=True)
    with pytest.raises(ValueError, match="slimgrad.ops._derived: unknown activation"):
        _derived.activation(y, "tanh")


def test_zero_size_batch_like_eager():
    x = torch.randn(0, 3, 4, requires_grad=True)
    w, b = (t.requires_grad_() for t in _params(3))
    y = batch_norm(x, torch.zeros(3), torch.ones(3), w, b, True, 0.1, EPS)
    ye = F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, True, 0.1, EPS)
    assert y.shape == ye.shape == (0, 3, 4)
    ga = torch.autograd.grad(_derived.activation(y, "relu").sum(), (x, w, b))
    gb = torch.autograd.grad(torch.relu(ye).sum(), (x, w, b))
    torch.testing.assert_close(ga, gb, equal_nan=True)


def test_channels_last():
    x0 = torch.randn(3, 4, 6, 5).to(memory_format=torch.channels_last)
    w0, b0 = _params(4)
    wc = torch.randn(2, 4, 3, 3)
    res = []
    for bn, act, cv in (
        (batch_norm, _ours_act("relu"), conv2d),
        (F.batch_norm, torch.relu, F.conv2d),
    ):
        x, w, b, c = (t.clone().requires_grad_() for t in (x0, w0, b0, wc))
        z = cv(act(bn(x, None, None, w, b, True, 0.1, EPS)), c)
        z.square().sum().backward()
        assert x.grad.is_contiguous(memory_format=torch.channels_last)
        res.append([z, x.grad, w.grad, b.grad, c.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e)


def test_autocast_bf16_block_within_rule():
    x0 = torch.randn(4, 3, 8, 8)
    wc1, wc2 = torch.randn(6, 3, 3, 3) * 0.3, torch.randn(5, 6, 3, 3) * 0.3
    w0, b0 = _params(6)
    res = {}
    for name, dt, ac, ours in [
        ("ours", torch.float32, True, True),
        ("eager", torch.float32, True, False),
        ("ref", torch.float64, False, False),
    ]:
        ts = [t.to(dt).requires_grad_() for t in (x0, wc1, wc2, w0, b0)]
        x, c1, c2, w, b = ts
        cv = conv2d if ours else F.conv2d
        bn = batch_norm if ours else F.batch_norm
        act = _ours_act("relu") if ours else torch.relu
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            z = cv(act(bn(cv(x, c1, padding=1), None, None, w, b, True, 0.1, EPS)), c2)
        res[name] = [z.double()] + grads_of((z.double().sin()).sum(), ts)
    assert_within_rule(res["ours"], res["ref"], res["eager"], atol=1e-2)


def test_recomputed_input_gives_bitwise_same_gradients():
    # The recipe re-runs the same conv on the same tensors: the BN gradients equal, bit for bit,
    # those computed from the kept input (recompute_input="never").
    x0 = torch.randn(3, 4, 9, 7)
    wc = torch.randn(5, 4, 3, 3)
    w0, b0 = _params(5)
    res = []
    for recompute in ("always", "never"):
        x, c, w, b = (t.clone().requires_grad_() for t in (x0, wc, w0, b0))
        h = conv2d(x * 1, c, padding=1)
        y = batch_norm(h, None, None, w, b, True, 0.1, EPS, recompute_input=recompute)
        y = y + 0.5  # no activation: the recipe (or x) is what the BN keeps
        (y.relu() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        res.append([x.grad, c.grad, w.grad, b.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_inside_checkpoint_same_gradients():
    # Correct under non-reentrant checkpoint (memory: see the limitation in ops/_derived.py).
    from torch.utils.checkpoint import checkpoint

    x0 = torch.randn(3, 4, 6, 5)
    w0, b0 = _params(4)
    c1, c2 = torch.randn(4, 4, 3, 3), torch.randn(2, 4, 1, 1)
    res = []
    for bn, act, cv in (
        (batch_norm, _ours_act("relu"), conv2d),
        (F.batch_norm, torch.relu, F.conv2d),
    ):
        x, w, b, k1, k2 = (t.clone().requires_grad_() for t in (x0, w0, b0, c1, c2))

        def block(x, w, b, k1, k2, bn=bn, act=act, cv=cv):
            h = cv(x, k1, padding=1)
            return cv(act(bn(h, None, None, w, b, True, 0.1, EPS)), k2)

        z = checkpoint(block, x, w, b, k1, k2, use_reentrant=False)
        z.sin().sum().backward()
        res.append([z, x.grad, w.grad, b.grad, k1.grad, k2.grad])
    for a, e in zip(*res):
        torch.testing.assert_close(a, e)


def test_memory_channels_kept_from_input():
    # Channels whose output cannot be inverted accurately keep their input channel (a copy);
    # beyond half the channels the whole input is kept instead (2 full-size tensors, as eager).
    N, C, H, W = 4, 6, 5, 7
    x0 = torch.randn(N, C, H, W)
    wc = torch.randn(3, C, 1, 1, requires_grad=True)
    full, per_c = N * C * H * W * 4, N * H * W * 4
    for n_bad, expect in [(0, full), (1, full + per_c), (3, full + 3 * per_c), (4, 2 * full)]:
        w, b = _params(C)
        b[:n_bad] = 3.0 * w[:n_bad].abs()  # |β| > |γ| / 2
        w.requires_grad_()
        b.requires_grad_()

        def step(w=w, b=b):
            h = x0 * 1
            y = batch_norm(h, None, None, w, b, True, 0.1, EPS)
            return conv2d(_derived.activation(y, "relu"), wc).sum()

        # + per channel: mean, invstd (γ, β kept as themselves); the int64 list of copied channels
        # is held once per parameter version (NOTE [Decided once per parameter version]), made
        # outside the step
        assert measure(step).saved_bytes == expect + 2 * C * 4


@pytest.fixture(params=["torch", "cpu"])
def backend(request, monkeypatch):
    # the PyTorch path, and the C kernel's one-pass channel sums (kernels/cpu/batch_norm.c)
    from slimgrad.kernels import _backend, _cpu

    if request.param == "cpu" and _cpu.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    with _backend.set_backend(request.param):
        yield request.param


def _assert_float32_within_rule(x0, w0, b0, up, act):
    # BN -> act in float32, ours and eager's, against float64: every gradient within the rule
    res = {}
    for name, dt, ours in [
        ("ref", torch.float64, False),
        ("eager", torch.float32, False),
        ("ours", torch.float32, True),
    ]:
        x, w, b = (t.to(dt).requires_grad_() for t in (x0, w0, b0))
        y = (batch_norm if ours else F.batch_norm)(x, None, None, w, b, True, 0.1, EPS)
        r = (_ours_act if ours else _eager_act)(act)(y)
        res[name] = grads_of((r * up.to(dt)).sum(), [x, w, b])
    assert_within_rule(res["ours"], res["ref"], res["eager"], names=["x", "weight", "bias"])


@pytest.mark.parametrize("ratio", [0.0, 0.45, 2.0, 16.0])
def test_float32_grads_within_rule_for_beta_over_gamma(ratio, backend):
    # |β/γ| near and beyond the threshold where x̂ stops being recovered from b (float32, data
    # with and without a large channel mean); every gradient within the error rule, on both
    # backends.
    C = 6
    gen = torch.Generator().manual_seed(7)
    for trial in range(8):
        mu = 5.0 * (trial % 2)
        x0 = torch.randn(16, C, 9, 9, dtype=torch.float64, generator=gen) * 3 + mu
        sign = torch.tensor([1, -1, 1, -1, 1, -1.0], dtype=torch.float64)
        w0 = torch.empty(C, dtype=torch.float64).uniform_(0.05, 2, generator=gen) * sign
        b0 = w0.abs() * ratio * torch.tensor([1, 1, -1, -1, 1, 1.0], dtype=torch.float64)
        up = torch.randn(16, C, 9, 9, dtype=torch.float64, generator=gen)
        _assert_float32_within_rule(x0, w0, b0, up, "relu")


@pytest.mark.parametrize("shape", [(16, 6, 9, 9), (5, 3, 7), (33, 4), (2, 5, 3, 4, 5)])
def test_c_channel_sums_match_the_pytorch_path(shape, monkeypatch):
    # kernels/cpu/batch_norm.c: per-channel Σ b, Σ dy, Σ dy·b in float64, the same bits for any
    # thread count and equal to a float64 reference to ~1e-15; the gradients equal the PyTorch
    # path's up to float32 rounding of the mean (the PyTorch path rounds each dy·(b - mean))
    from slimgrad.kernels import _backend, _cpu
    from slimgrad.ops.batch_norm import _channel_sums_c

    if _cpu.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(shape, generator=gen) * 2 + 1
    up = torch.randn(shape, generator=gen)
    red = [d for d in range(len(shape)) if d != 1]
    want = torch.stack(
        [x0.double().sum(red), up.double().sum(red), (up.double() * x0.double()).sum(red)]
    )
    sums = []
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            with _backend.set_backend("cpu"):
                sums.append(_channel_sums_c(up, x0))
        finally:
            torch.set_num_threads(1)
    assert torch.equal(sums[0], sums[1])
    torch.testing.assert_close(sums[0], want, rtol=1e-13, atol=1e-12)

    got = {}
    w0, b0 = _params(shape[1], seed=4)
    for backend in ("torch", "cpu"):
        with _backend.set_backend(backend):
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            y = batch_norm(x, None, None, w, b, True, 0.1, EPS)
            r = _derived.activation(y, "relu")
            got[backend] = grads_of((r * up).sum(), [x, w, b])
    torch.testing.assert_close(got["cpu"], got["torch"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(16, 6, 9, 9), (5, 3, 7), (33, 4), (2, 5, 3, 4, 5)])
def test_c_whole_backward_matches_the_pytorch_path(shape, affine, monkeypatch):
    # kernels/cpu/batch_norm.c's bn_bwd_from_output_f32 (one call: sums, coefficients, dx): dx and
    # dγ have the bits of the PyTorch coefficient path fed the same C channel sums (the same
    # float64 coefficients, the same fused multiply-add rounding as torch.addcmul) for any thread
    # count, and match the all-PyTorch path (whose float64 dot rounds each product first) to
    # float32 rounding; dβ is the float64 Σ dy rounded once
    import sys

    from slimgrad.kernels import _backend, _cpu

    bn_mod = sys.modules["slimgrad.ops.batch_norm"]
    if _cpu.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(shape, generator=gen) * 2 + 1
    up = torch.randn(shape, generator=gen)
    w0, b0 = _params(shape[1], seed=6) if affine else (None, None)
    whole = bn_mod._bwd_from_output_c
    got = {}
    for variant, backend in (("torch", "torch"), ("sums only", "cpu"), ("whole", "cpu")):
        if variant == "sums only":
            monkeypatch.setattr(bn_mod, "_bwd_from_output_c", lambda *a: None)
        try:
            with _backend.set_backend(backend):
                x = x0.clone().requires_grad_()
                wb = [t.clone().requires_grad_() for t in (w0, b0) if t is not None]
                y = batch_norm(x, None, None, *(wb or [None, None]), True, 0.1, EPS)
                r = _derived.activation(y, "relu")
                got[variant] = grads_of((r * up).sum(), [x, *wb])
        finally:
            monkeypatch.setattr(bn_mod, "_bwd_from_output_c", whole)
    c1, split = got["whole"], got["sums only"]
    # the kernel alone, on fixed inputs: the same bits for any thread count
    ctx = types.SimpleNamespace(
        b=x0,
        save_invstd=torch.rand(shape[1], generator=gen) + 0.5,
        weight_v=w0,
        bias_v=b0,
        bad=None,
    )
    with _backend.set_backend("cpu"):
        outs = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            try:
                outs.append(bn_mod._bwd_from_output_c(ctx, up, True, affine, affine))
            finally:
                torch.set_num_threads(1)
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(c1[:2], split[:2]):
        assert torch.equal(a, b)
    torch.testing.assert_close(c1, got["torch"], rtol=1e-5, atol=1e-5)
    if affine:
        red = [d for d in range(len(shape)) if d != 1]
        mask = (torch.nn.functional.batch_norm(x0, None, None, w0, b0, True) > 0).double()
        want = (up.double() * mask).sum(red)  # dβ = Σ dy: float64 sum rounded once
        torch.testing.assert_close(c1[2], want.float(), rtol=0, atol=0)
        torch.testing.assert_close(got["torch"][2], want.float(), rtol=0, atol=0)


def test_float32_some_channels_kept_from_input_within_rule(backend):
    # two of six channels cannot be inverted from the output (γ = 0, |β| >> |γ|) and are kept from
    # the input; the rest come from the output (on "cpu", through the C channel sums): every
    # gradient within the error rule
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(8, 6, 7, 7, dtype=torch.float64, generator=gen) * 2 + 3
    up = torch.randn(8, 6, 7, 7, dtype=torch.float64, generator=gen)
    w0, b0 = _params(6, torch.float64, seed=5)
    w0[1], b0[4], w0[4] = 0.0, 40.0, 0.3
    _assert_float32_within_rule(x0, w0, b0, up, "silu")


@pytest.mark.parametrize("training", [True, False])
def test_only_bias_needs_grad_matches_eager(training):
    # Issue 15: training with only the bias requiring grad crashed ("'NoneType' object is not
    # callable"): nothing full-size is kept then, and dβ = Σ dy.
    torch.manual_seed(0)
    x, dy = torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    w, b = _params(3)
    out = []
    for fn in (batch_norm, F.batch_norm):
        bb = b.clone().requires_grad_()
        rm, rv = torch.zeros(3), torch.ones(3)
        y = fn(x, rm, rv, w, bb, training, 0.1, EPS)
        y.backward(dy)
        out.append((y.detach(), bb.grad, rm, rv))
    for o, e in zip(*out, strict=True):
        torch.testing.assert_close(o, e)


def test_errors_raise_where_eager_raises_with_eager_types():
    # Issue 15: aten.native_batch_norm does not check the (C,) arguments' sizes (eager's
    # torch.batch_norm does): a wrong-size weight or running_mean ran silently.
    x = torch.randn(2, 6, 5, requires_grad=True)
    cases = [
        (None, None, torch.randn(4), None, True),
        (None, None, None, torch.randn(4), True),
        (torch.zeros(4), torch.ones(4), None, None, True),
        (torch.zeros(6), torch.ones(5), None, None, False),
        (None, None, None, None, False),
    ]
    for rm, rv, w, b, training in cases:
        with pytest.raises(RuntimeError):
            F.batch_norm(x, rm, rv, w, b, training)
        with pytest.raises(RuntimeError, match="slimgrad.ops.batch_norm"):
            batch_norm(x, rm, rv, w, b, training)


def test_torch_func_transforms_and_jit_trace():
    # Issue 15: torch.func transforms run eager's batch_norm; torch.jit.trace refuses clearly.
    from torch.func import grad, jacrev, vmap

    torch.manual_seed(0)
    x = torch.randn(3, 4, 3, 5)
    w, b = _params(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    for training in (True, False):

        def f(t, fn=batch_norm, training=training):
            return fn(t, None if training else rm, None if training else rv, w, b, training)

        def e(t, training=training):
            return f(t, F.batch_norm, training)

        torch.testing.assert_close(vmap(f)(x), vmap(e)(x))
        torch.testing.assert_close(grad(lambda t: f(t).sin().sum())(x[0]),
                                   grad(lambda t: e(t).sin().sum())(x[0]))  # fmt: skip
        torch.testing.assert_close(jacrev(f)(x[0]), jacrev(e)(x[0]))
    with pytest.raises(RuntimeError, match="slimgrad.ops.batch_norm: torch.jit.trace"):
        torch.jit.trace(lambda t: batch_norm(t, None, None, w, b, True), x[0].requires_grad_())


def test_empty_one_dim_input_like_eager():
    # tests/opinfo finding: the (C,) size check refused an empty 1-D input eager accepts.
    for training in (True, False):
        x = torch.empty(0, requires_grad=True)
        e = F.batch_norm(x, torch.empty(0), torch.empty(0), training=training)
        y = batch_norm(x, torch.empty(0), torch.empty(0), training=training)
        torch.testing.assert_close(y, e)


@pytest.mark.parametrize("training", [True, False])
def test_parameters_kept_as_themselves_modified_in_place_raises_as_eager(training):
    # NOTE [BatchNorm keeps its parameters, not copies]: γ and the running statistics are kept as
    # themselves (eager's saved variables), so an in-place change before backward raises as eager
    # does (a copy used to hide it and keep 2-5 values per channel more than eager)
    for fn in (batch_norm, F.batch_norm):
        x = torch.randn(4, 3, 6, 5, requires_grad=True)
        w, b = (t.requires_grad_() for t in _params(3))
        rm, rv = torch.zeros(3), torch.ones(3)
        y = fn(x * 1, rm, rv, w, b, training, 0.1, EPS)
        with torch.no_grad():
            w.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        if not training:
            x2 = torch.randn(4, 3, 6, 5, requires_grad=True)
            w2 = torch.ones(3)  # frozen γ: eval keeps nothing full-size
            y2 = fn(x2 * 1, rm, rv, w2, None, False, 0.1, EPS)
            rv.add_(1)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y2.sum().backward()


def _conv_bn_relu_block(convert=True):
    import slimgrad

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(inplace=True),
    )
    return slimgrad.convert_(m) if convert else m


def test_host_call_budget_conv_bn_relu():
    # issue 32: Python calls of and from slimgrad's code, counted (deterministic), not timed. A
    # Conv(1x1)-BN-ReLU-Conv(3x3)-BN-ReLU step (the first BN keeps its conv's recipe, then the
    # output its ReLU claims; the C backward writes dx over the granted gradient): 301 calls per
    # fwd + bwd (291 before NOTE [Backward without autocast] in slimgrad/_autograd.py: each conv
    # and BatchNorm node's backward attribute asks whether autocast is on, 2 calls each; 287
    # before NOTE [A recipe that reads x from eager's conv node]: the recipe's
    # first tensor read through a property at the BN's lookup, and a plain copy made when the BN
    # adopts it, the price of a conv input not held past its node's backward; 285 before NOTE [A
    # recipe made in a
    # checkpoint's forward]: each conv asks for the
    # innermost saved-tensor hooks, 2 calls, the price of a conv input held past a checkpoint
    # region; 282 before NOTE [A lookup across a checkpoint boundary]: the region a claim and a
    # conv's lookup are made in, 3 calls, the price of a wrong gradient under saved-tensor hooks
    # and checkpoint; 286 before NOTE [Two watchers in one call]; 294 before the ReLU's inline
    # source test and the C backward's reuse of backward's checks; 418 before the records without
    # frames, the inline registry reads and NOTE [Arguments known to be plain]); one BatchNorm
    # forward on a 1x1 conv's output 21 (17 before the recipe's property and its plain copy: the
    # lookup's read, pinned() and its read; 18; 32), a ReLU on an input that is no source,
    # with a source registered, 3 (6)
    from tests._host_calls import slimgrad_calls

    m = _conv_bn_relu_block()
    x = torch.randn(2, 4, 8, 8, requires_grad=True)

    def step():
        m(x * 1).sum().backward()
        for p in m.parameters():
            p.grad = None

    step()
    assert slimgrad_calls(step) <= 301
    conv, bn, relu = m[0], m[1], m[2]
    y = conv(x)
    b = bn(y)  # a registered source: the registry is not empty
    assert _derived.is_source(b)
    other = torch.randn(2, 8, 8, 8, requires_grad=True) * 1
    assert slimgrad_calls(lambda: bn(y)) <= 21
    assert slimgrad_calls(lambda: relu(other)) <= 3


def test_module_parameters_replaced_after_a_call_are_used():
    # NOTE [Arguments known to be plain]: the objects a module last passed as they are; new
    # Parameter and buffer objects are unwrapped and used: the same bits as a module that had
    # them from the start
    import copy

    import slimgrad

    base = _conv_bn_relu_block(convert=False)
    x = torch.randn(2, 4, 8, 8)
    m = slimgrad.convert_(copy.deepcopy(base))
    assert slimgrad.report(m).converted, slimgrad.report(m)  # not eager vs eager
    m(x).sum().backward()  # the first call stores the objects
    fresh = copy.deepcopy(base)
    for net in (m, fresh):
        bn = net[1]
        bn.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
        bn.bias = torch.nn.Parameter(torch.linspace(-0.2, 0.2, 8))
        bn.running_mean = torch.zeros(8)
    fresh = slimgrad.convert_(fresh)
    for net in (m, fresh):
        net.zero_grad()
        net(x).sum().backward()
    for a, e in zip(m.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=0, atol=0)
    torch.testing.assert_close(m[1].running_mean, fresh[1].running_mean, rtol=0, atol=0)
    assert m[1].running_mean.abs().sum() > 0  # the new buffer was updated

"""slimgrad.ops.inplace_abn: gradients, eager equality, in-place safety, memory, compile."""

from __future__ import annotations

import contextlib
import copy
import importlib

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.inplace_abn import inplace_abn
from slimgrad.testing import assert_within_rule, gradcheck_inplace
from tests.ops._inplace_abn_helpers import check_backends


@pytest.fixture(autouse=True)
def _in_place_at_any_count(monkeypatch):
    # these tests use small shapes for the op's own path: let it run at any count per channel
    # (NOTE [Few values per channel in InPlaceABN]; tests/ops/test_abn_few_values.py covers that)
    monkeypatch.setattr(importlib.import_module("slimgrad.ops.inplace_abn"), "_MAX_FEW", 0)


ACTS = [("identity", 0.0), ("leaky_relu", 0.01), ("leaky_relu", 3.0), ("elu", 1.0), ("elu", 0.3)]
SHAPES = [(5, 3), (3, 5, 7), (3, 5, 4, 3), (2, 3, 3, 2, 5)]


def act_ref(t, act, param):
    if act == "leaky_relu":
        return F.leaky_relu(t, param)
    if act == "elu":
        return F.elu(t, param)
    return t


def eager(x, rm, rv, w, b, training, act, param, momentum=0.1, eps=1e-5):
    return act_ref(F.batch_norm(x, rm, rv, w, b, training, momentum, eps), act, param)


def params(c, dtype=torch.float64, device="cpu", signed=True):
    w = torch.randn(c, dtype=dtype, device=device)
    if not signed:
        w = w.abs() + 0.1
    b = torch.randn(c, dtype=dtype, device=device) * 0.5
    return w.requires_grad_(), b.requires_grad_()


def run_both(x0, w, b, training, act, param, g=None, rm=None, rv=None):
    """Returns (out, grads, ref_out, ref_grads, (rm, rv), (ref_rm, ref_rv)); grads wrt (x, w, b)."""
    c = x0.shape[1]
    if rm is None:
        rm = torch.randn(c, dtype=x0.dtype, device=x0.device) * 0.1
        rv = torch.rand(c, dtype=x0.dtype, device=x0.device) + 0.5
    rm1, rv1, rm2, rv2 = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    g = torch.randn_like(x0) if g is None else g
    xa = x0.clone().requires_grad_()
    out = inplace_abn(xa * 1, rm1, rv1, w, b, training, 0.1, 1e-5, act, param)
    ga = torch.autograd.grad((out * g).sum(), [xa, w, b])
    xb = x0.clone().requires_grad_()
    ref = eager(xb, rm2, rv2, w, b, training, act, param)
    gb = torch.autograd.grad((ref * g).sum(), [xb, w, b])
    return out.detach(), ga, ref.detach(), gb, (rm1, rv1), (rm2, rv2)


# ---------------------------------------------------------------------------------------------
# 1. gradcheck in float64


@pytest.mark.parametrize("act,param", ACTS)
@pytest.mark.parametrize("training", [True, False])
def test_gradcheck(act, param, training):
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    w, b = params(4)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    if training:
        rm = rv = None

    def fn(x, w, b):
        return inplace_abn(x * 1, rm, rv, w, b, training, 0.1, 1e-5, act, param)

    assert gradcheck_inplace(fn, x, w, b)


@pytest.mark.parametrize("act,param", [("leaky_relu", 0.01), ("elu", 1.0)])
def test_gradcheck_zero_weight_channels(act, param):
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    w, b = params(4)
    with torch.no_grad():
        w[1] = 0.0
        w[3] = 1e-310  # subnormal: the output cannot be inverted
    assert gradcheck_inplace(
        lambda x, w, b: inplace_abn(x * 1, None, None, w, b, True, 0.1, 1e-5, act, param), x, w, b
    )


# ---------------------------------------------------------------------------------------------
# 2. equality with eager BatchNorm{1,2,3}d + activation


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act,param", ACTS)
@pytest.mark.parametrize("training", [True, False])
def test_matches_eager_float64(shape, act, param, training, device):
    x0 = (torch.randn(shape, dtype=torch.float64) * 1.7 + 0.3).to(device)
    w, b = params(shape[1], device=device)
    out, ga, ref, gb, stats, ref_stats = run_both(x0, w, b, training, act, param)
    torch.testing.assert_close(out, ref)
    for a, r in zip(ga, gb):
        torch.testing.assert_close(a, r)
    torch.testing.assert_close(stats, ref_stats, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act,param", ACTS)
def test_cuda_both_backends_match_eager(act, param, channels_last, dtype):
    # the forward is eager's own kernel (cuDNN where F.batch_norm picks it) on either backend: bit
    # for bit; the backward (Triton by default on CUDA) within the rule
    check_backends(torch.device("cuda"), act, param, dtype, channels_last)


@pytest.mark.parametrize("act,param", ACTS)
@pytest.mark.parametrize("training", [True, False])
def test_float32_within_rule(act, param, training, device):
    x0 = (torch.randn(4, 7, 5, 3) * 2 + 1).to(device)
    w, b = params(7, torch.float32, device)
    g = torch.randn_like(x0)
    out, ga, ref, gb, stats, ref_stats = run_both(x0, w, b, training, act, param, g=g)
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _, _, ref64, g64, _, _ = run_both(x0.double(), w64, b64, training, act, param, g=g.double())
    assert_within_rule([out, *ga], [ref64, *g64], [ref, *gb], names=["out", "dx", "dw", "db"])
    torch.testing.assert_close(stats, ref_stats)


@pytest.mark.parametrize("act,param", [("leaky_relu", 0.01), ("elu", 1.0)])
def test_any_sign_of_weight(act, param):
    x0 = torch.randn(6, 5, 4, dtype=torch.float64)
    w = torch.tensor([-2.0, -0.3, 0.7, -1e-3, 4.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.1, -0.2, 0.3, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    out, ga, ref, gb, _, _ = run_both(x0, w, b, True, act, param)
    torch.testing.assert_close(out, ref)
    for a, r in zip(ga, gb):
        torch.testing.assert_close(a, r)


def test_affine_none_and_no_running_stats():
    x0 = torch.randn(4, 3, 5, dtype=torch.float64)
    g = torch.randn_like(x0)
    xa = x0.clone().requires_grad_()
    out = inplace_abn(xa * 1, None, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.1)
    (dx,) = torch.autograd.grad((out * g).sum(), [xa])
    xb = x0.clone().requires_grad_()
    ref = F.leaky_relu(F.batch_norm(xb, None, None, None, None, True), 0.1)
    (rdx,) = torch.autograd.grad((ref * g).sum(), [xb])
    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(dx, rdx)


@pytest.mark.parametrize("which", [[0], [1], [2], [1, 2], [0, 2]])
def test_backward_inputs_subsets(which):
    x0 = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = params(4)
    g = torch.randn_like(x0)
    xa = x0.clone().requires_grad_()
    out = inplace_abn(xa * 1, None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.2)
    leaves = [xa, w, b]
    (out * g).sum().backward(inputs=[leaves[i] for i in which])
    got = [leaves[i].grad for i in which]
    for t in leaves:
        t.grad = None
    xb = x0.clone().requires_grad_()
    ref = eager(xb, None, None, w, b, True, "leaky_relu", 0.2)
    ref_leaves = [xb, w, b]
    want = torch.autograd.grad((ref * g).sum(), [ref_leaves[i] for i in which])
    for i, a, r in zip(which, got, want):
        assert a is not None, f"grad {i} missing"
        torch.testing.assert_close(a, r)
    for i in set(range(3)) - set(which):
        assert leaves[i].grad is None


def test_eval_mode_param_grads_only():
    # eval-mode fine-tuning of the affine parameters with a frozen input
    x0 = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = params(4)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    out = inplace_abn(x0.clone(), rm, rv, w, b, False, 0.1, 1e-5, "elu", 1.0)
    gw, gb_ = torch.autograd.grad(out.sum(), [w, b])
    ref = eager(x0, rm, rv, w, b, False, "elu", 1.0)
    rw, rb = torch.autograd.grad(ref.sum(), [w, b])
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(gb_, rb)


# ---------------------------------------------------------------------------------------------
# 3. channels that cannot be inverted (NOTE [Invertibility])


@pytest.mark.parametrize("act,param", ACTS)
def test_zero_and_tiny_weight_channels_exact(act, param):
    x0 = torch.randn(4, 6, 5) * 3 + 2
    w = torch.tensor([1.0, 0.0, -0.0, 1e-30, 1e-4, -0.8], requires_grad=True)
    b = torch.tensor([0.2, 0.5, -0.5, 0.0, 1.0, 0.1], requires_grad=True)
    g = torch.randn_like(x0)
    out, ga, ref, gb, _, _ = run_both(x0, w, b, True, act, param, g=g)
    for t in (out, *ga):
        assert torch.isfinite(t).all()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _, _, ref64, g64, _, _ = run_both(x0.double(), w64, b64, True, act, param, g=g.double())
    assert_within_rule([out, *ga], [ref64, *g64], [ref, *gb], names=["out", "dx", "dw", "db"])
    # the weight gradient of the zero-weight channels is the one that needs the kept x̂
    assert ga[1][1].abs() > 0


def test_elu_saturated_channel_exact():
    # bias -12 puts the pre-activation far below -ln(256): ELU's inverse would lose everything.
    x0 = torch.randn(8, 3, 6)
    w = torch.tensor([1.0, 1.0, 2.0], requires_grad=True)
    b = torch.tensor([0.0, -12.0, -3.0], requires_grad=True)
    g = torch.randn_like(x0)
    out, ga, ref, gb, _, _ = run_both(x0, w, b, True, "elu", 1.0, g=g)
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _, _, ref64, g64, _, _ = run_both(x0.double(), w64, b64, True, "elu", 1.0, g=g.double())
    assert_within_rule([out, *ga], [ref64, *g64], [ref, *gb], names=["out", "dx", "dw", "db"])


def test_large_bias_to_weight_ratio_channel_is_kept_exactly():
    # |b| / |w| = 84: rebuilding x̂ = (y - b) / w from fp32 z would lose ~7 bits (measured dweight
    # error 3.2e-4 vs eager's 3.9e-7 when forced). That channel keeps its x̂ (NOTE [Invertibility]).
    torch.manual_seed(0)
    n, c, s = 2, 4, 25
    x0 = torch.randn(n, c, s) * 2
    w = torch.tensor([-1.5, 0.8, 1.2, 0.0371], requires_grad=True)
    b = torch.tensor([-0.28, -0.13, 1.89, 3.111], requires_grad=True)
    g = torch.randn_like(x0)
    out, ga, ref, gb, _, _ = run_both(x0, w, b, True, "elu", 1.0, g=g)
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _, _, ref64, g64, _, _ = run_both(x0.double(), w64, b64, True, "elu", 1.0, g=g.double())
    assert_within_rule([out, *ga], [ref64, *g64], [ref, *gb], names=["out", "dx", "dw", "db"])
    m = measure(lambda: inplace_abn(x0 * 1, None, None, w, b, True, 0.1, 1e-5, "elu", 1.0).sum())
    assert m.saved_bytes == n * c * s * 4 + c * 4 + n * 1 * s * 4 + 8  # one kept channel


def test_side_tensor_memory_is_bounded():
    # k non-invertible channels keep exactly N * k * S float32 values; their int64 indices are
    # held once per parameter version, not per call (NOTE [Decided once per parameter version]
    # in slimgrad/_math/abn.py), made outside the step's ops: the tracker does not count them.
    n, c, s = 4, 6, 10
    x0 = torch.randn(n, c, s)
    w = torch.ones(c, requires_grad=True)
    b = torch.zeros(c, requires_grad=True)
    with torch.no_grad():
        w[[1, 4]] = 0.0
    m = measure(lambda: inplace_abn(x0 * 1, None, None, w, b, True, 0.1, 1e-5).sum())
    assert m.saved_bytes == n * c * s * 4 + c * 4 + n * 2 * s * 4


# ---------------------------------------------------------------------------------------------
# 4. memory contract


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_memory_saved_is_output_plus_invstd(dtype):
    n, c, h, w_ = 3, 8, 7, 5
    x0 = torch.randn(n, c, h, w_, dtype=dtype)
    w, b = params(c, dtype, signed=False)  # |w| >= 0.1 and |b| <= 0.4: every channel is rebuilt
    with torch.no_grad():
        b.clamp_(-0.4, 0.4)
    rm, rv = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)

    def step():
        return inplace_abn(x0 * 1, rm, rv, w, b, True, 0.1, 1e-5, "leaky_relu", 0.01).sum()

    m = measure(step)
    esize = x0.element_size()
    assert m.saved_bytes == x0.numel() * esize + c * esize
    assert m.saved_input_bytes == 2 * c * esize  # weight and bias (plain tensors here)


def test_memory_peak_below_eager_chain():
    # Conv -> norm+act -> Conv: saved and peak against BatchNorm2d + LeakyReLU(inplace=True).
    torch.manual_seed(0)
    conv1 = torch.nn.Conv2d(8, 8, 3, padding=1)
    conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
    bn = torch.nn.BatchNorm2d(8)
    x = torch.randn(4, 8, 16, 16)
    up = torch.randn(4, 8, 16, 16)

    def eager_step():
        return (conv2(F.leaky_relu_(bn(conv1(x)), 0.01)) * up).sum()

    def slim_step():
        h = inplace_abn(conv1(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, True)
        return (conv2(h) * up).sum()

    me, ms = measure(eager_step), measure(slim_step)
    act = x.numel() * 4
    # eager keeps conv1's output (BatchNorm's input), the activation, mean and invstd; slimgrad the
    # activation and invstd
    assert me.saved_bytes - ms.saved_bytes == act + 8 * 4
    assert ms.peak_bytes < me.peak_bytes


@pytest.mark.parametrize("shape", [(4, 16, 2048), (8, 2, 16384)])
def test_backward_full_size_buffers_at_most_two(shape):
    # Backward peak: saved z + dx + chunk temporaries (dz existed before the step). Both shapes
    # have chunks of numel / 16 values: one channel, or (8, 2, 16384) one sample of a channel,
    # since its channels exceed 4 * budget and are split over batch ranges.
    x0 = torch.randn(shape)
    w, b = params(shape[1], torch.float32, signed=False)
    g = torch.randn(shape)
    x = x0.clone().requires_grad_()
    m = measure(lambda: inplace_abn(x * 1, None, None, w, b, True), grad=g)
    full = x0.numel() * 4
    chunk = full // 16
    # x * 1 backward allocates x's gradient too: 3 full-size tensors + a few chunk temporaries
    assert m.peak_bytes <= 3 * full + 4 * chunk + 1024


@pytest.mark.parametrize("act,param", [("leaky_relu", 0.05), ("elu", 1.0)])
@pytest.mark.parametrize("training", [True, False])
def test_channels_split_over_batch_match_eager(act, param, training):
    # 2 channels of 6 x 9000 values: each is split over batch ranges (NOTE [Chunked backward])
    x0 = torch.randn(6, 2, 9000, dtype=torch.float64)
    w, b = params(2)
    out, ga, ref, gb, stats, ref_stats = run_both(x0, w, b, training, act, param)
    torch.testing.assert_close(out, ref)
    for a_, r in zip(ga, gb):
        torch.testing.assert_close(a_, r)


# ---------------------------------------------------------------------------------------------
# 5. in-place safety and adversarial autograd cases


def test_input_saved_by_other_op_raises():
    x = torch.randn(3, 4, 5, requires_grad=True)
    h = x * 1
    s = h.sin()  # saves h
    out = inplace_abn(h, None, None, None, None, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (s + out).sum().backward()


def test_leaf_input_raises():
    x = torch.randn(3, 4, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        inplace_abn(x, None, None, None, None, True)


def test_shared_gradient_residual_branch():
    # PR #218's failure: the add hands the same gradient tensor to both branches.
    torch.manual_seed(0)
    conv_a = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    conv_b = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    w, b = params(4)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)

    def run(norm):
        other = conv_b(x)  # created first: its gradient is still pending when norm runs backward
        out = other + norm(conv_a(x))
        (out * out).sum().backward()
        grads = [p.grad.clone() for p in (*conv_a.parameters(), *conv_b.parameters(), w, b)]
        for p in (*conv_a.parameters(), *conv_b.parameters(), w, b):
            p.grad = None
        return grads

    got = run(lambda h: inplace_abn(h, None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.1))
    want = run(lambda h: eager(h, None, None, w, b, True, "leaky_relu", 0.1))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


def test_retain_graph_twice():
    x0 = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = params(4)
    xa = x0.clone().requires_grad_()
    out = inplace_abn(xa * 1, None, None, w, b, True, 0.1, 1e-5, "elu", 1.0)
    loss = (out * out).sum()
    first = torch.autograd.grad(loss, [xa, w, b], retain_graph=True)
    second = torch.autograd.grad(loss, [xa, w, b])
    for a, r in zip(first, second):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    xb = x0.clone().requires_grad_()
    ref = eager(xb, None, None, w, b, True, "elu", 1.0)
    want = torch.autograd.grad((ref * ref).sum(), [xb, w, b])
    for a, r in zip(second, want):
        torch.testing.assert_close(a, r)


def test_create_graph_first_order_ok_double_backward_errors():
    x0 = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = params(4)
    xa = x0.clone().requires_grad_()
    out = inplace_abn(xa * 1, None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.1)
    (dx,) = torch.autograd.grad((out * out).sum(), [xa], create_graph=True)
    xb = x0.clone().requires_grad_()
    ref = eager(xb, None, None, w, b, True, "leaky_relu", 0.1)
    (rdx,) = torch.autograd.grad((ref * ref).sum(), [xb])
    torch.testing.assert_close(dx.detach(), rdx)
    with pytest.raises(RuntimeError, match="slimgrad.ops.inplace_abn: a second derivative"):
        dx.sum().backward()


def test_sum_loss_expanded_gradient():
    x0 = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = params(4)
    for act, param in ACTS:
        xa = x0.clone().requires_grad_()
        out = inplace_abn(xa * 1, None, None, w, b, True, 0.1, 1e-5, act, param)
        got = torch.autograd.grad(out.sum(), [xa, w, b])
        xb = x0.clone().requires_grad_()
        want = torch.autograd.grad(eager(xb, None, None, w, b, True, act, param).sum(), [xb, w, b])
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r)


def test_grad_hook_on_output_and_checkpoint():
    x0 = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = params(4)

    def slim(h):
        out = inplace_abn(h * 1, None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.1)
        out.register_hook(lambda g: g * 3)  # a hook that rewrites the incoming gradient
        return (out * out).sum()

    def ref(h):
        out = eager(h * 1, None, None, w, b, True, "leaky_relu", 0.1)
        out.register_hook(lambda g: g * 3)
        return (out * out).sum()

    want = torch.autograd.grad(ref(x0.clone().requires_grad_()), [w, b])
    got = torch.autograd.grad(slim(x0.clone().requires_grad_()), [w, b])
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)
    xc = x0.clone().requires_grad_()
    got_ckpt = torch.autograd.grad(
        torch.utils.checkpoint.checkpoint(slim, xc, use_reentrant=False), [xc, w, b]
    )
    want_ckpt = torch.autograd.grad(ref(xc), [xc, w, b])
    for a, r in zip(got_ckpt, want_ckpt):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("kind", ["slice", "transpose"])
def test_view_input(kind):
    x0 = torch.randn(3, 8, 5, 4, dtype=torch.float64)
    w, b = params(4)
    g = torch.randn(3, 8, 5, 4, dtype=torch.float64)

    def take(t):
        v = t[:, 2:6]
        return v.transpose(2, 3) if kind == "transpose" else v

    xa = x0.clone().requires_grad_()
    base = xa * 1
    out = inplace_abn(take(base), None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.1)
    assert out._base is base
    got = torch.autograd.grad((base * g).sum(), [xa, w, b])
    xb = x0.clone().requires_grad_()
    base_ref = xb * 1
    normed = eager(take(base_ref), None, None, w, b, True, "leaky_relu", 0.1)
    if kind == "transpose":
        normed = normed.transpose(2, 3)
    full = torch.cat([base_ref[:, :2], normed, base_ref[:, 6:]], dim=1)
    want = torch.autograd.grad((full * g).sum(), [xb, w, b])
    torch.testing.assert_close(base.detach(), full.detach())
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode(mode):
    x0 = torch.randn(3, 4, 5)
    w, b = params(4, torch.float32)
    rm, rv = torch.zeros(4), torch.ones(4)
    rm2, rv2 = torch.zeros(4), torch.ones(4)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        x = x0.clone()
        out = inplace_abn(x, rm, rv, w, b, True, 0.1, 1e-5, "leaky_relu", 0.01)
        assert out.data_ptr() == x.data_ptr()
        assert out.grad_fn is None
        ref = eager(x0, rm2, rv2, w, b, True, "leaky_relu", 0.01)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close((rm, rv), (rm2, rv2))


def test_channels_last_no_copy():
    x0 = torch.randn(3, 5, 4, 6).to(memory_format=torch.channels_last)
    w, b = params(5, torch.float32)
    g = torch.randn(3, 5, 4, 6).to(memory_format=torch.channels_last)
    xa = x0.clone().requires_grad_()
    h = xa * 1
    ptr = h.data_ptr()
    out = inplace_abn(h, None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.01)
    assert out.data_ptr() == ptr
    assert out.is_contiguous(memory_format=torch.channels_last)
    got = torch.autograd.grad((out * g).sum(), [xa, w, b])
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    xb = x0.clone().requires_grad_()
    ref = eager(xb, None, None, w, b, True, "leaky_relu", 0.01)
    want = torch.autograd.grad((ref * g).sum(), [xb, w, b])
    torch.testing.assert_close(out.detach(), ref.detach())
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


def test_channels_last_no_full_size_copy_in_memory():
    # same saved bytes and the same peak as the contiguous layout: no layout copy anywhere
    x0 = torch.randn(8, 32, 16, 16)
    w = (torch.rand(32) + 0.5).requires_grad_()
    b = (torch.randn(32) * 0.1).requires_grad_()
    g = torch.randn(8, 32, 16, 16)
    res = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = x0.to(memory_format=fmt).requires_grad_()
        gg = g.to(memory_format=fmt)
        m = measure(lambda x=x: inplace_abn(x * 1, None, None, w, b, True), grad=gg)
        res.append((m.saved_bytes, m.peak_bytes))
    assert res[0][0] == res[1][0]
    assert abs(res[0][1] - res[1][1]) <= 1024


def test_channels_last_3d():
    x0 = torch.randn(2, 3, 4, 3, 5).to(memory_format=torch.channels_last_3d)
    w, b = params(3)
    out, ga, ref, gb, _, _ = run_both(x0.double(), w, b, True, "elu", 1.0)
    torch.testing.assert_close(out, ref)
    for a, r in zip(ga, gb):
        torch.testing.assert_close(a, r)


# ---------------------------------------------------------------------------------------------
# 6. low precision and autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,param", [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.0)])
def test_autocast_cpu(dtype, act, param):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 6, 3, padding=1)
    w, b = params(6, torch.float32, signed=True)
    x = torch.randn(4, 3, 7, 5)
    g = torch.randn(4, 6, 7, 5)
    leaves = [*conv.parameters(), w, b]

    def run(norm, ac, double=False):
        rm, rv = torch.zeros(6, dtype=torch.float64 if double else torch.float32), torch.ones(6)
        rv = rv.to(rm.dtype)
        ps = [p.detach().double().requires_grad_() for p in leaves] if double else leaves
        with torch.autocast("cpu", dtype=dtype, enabled=ac):
            h = F.conv2d(x.double() if double else x, ps[0], ps[1], padding=1)
            out = norm(h, rm, rv, ps[2], ps[3])
        loss = (out.float() * g).sum() if not double else (out * g.double()).sum()
        grads = torch.autograd.grad(loss, ps)
        return out, list(grads), (rm, rv)

    slim = run(lambda h, rm, rv, w, b: inplace_abn(h, rm, rv, w, b, True, 0.1, 1e-5, act, param),
               True)  # fmt: skip
    ref = run(lambda h, rm, rv, w, b: eager(h, rm, rv, w, b, True, act, param), True)
    ref64 = run(lambda h, rm, rv, w, b: eager(h, rm, rv, w, b, True, act, param), False, True)
    assert slim[0].dtype == ref[0].dtype == dtype
    assert slim[2][0].dtype == torch.float32
    assert_within_rule([slim[0], *slim[1]], [ref64[0], *ref64[1]], [ref[0], *ref[1]],
                       names=["out", "conv_w", "conv_b", "w", "b"])  # fmt: skip
    torch.testing.assert_close(slim[2], ref[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_and_params(dtype):
    # a model cast to bf16/fp16 entirely: the rule against eager at the same dtype
    x0 = (torch.randn(4, 5, 9) * 2 + 1).to(dtype)
    w, b = (t.detach().to(dtype).requires_grad_() for t in params(5, torch.float32))
    g = torch.randn(4, 5, 9).to(dtype)
    rm, rv = torch.zeros(5, dtype=dtype), torch.ones(5, dtype=dtype)
    out, ga, ref, gb, _, _ = run_both(x0, w, b, True, "leaky_relu", 0.01, g=g, rm=rm, rv=rv)
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _, _, ref64, g64, _, _ = run_both(x0.double(), w64, b64, True, "leaky_relu", 0.01,
                                      g=g.double())  # fmt: skip
    assert out.dtype == dtype and ga[0].dtype == dtype and ga[1].dtype == dtype
    assert_within_rule([out, *ga], [ref64, *g64], [ref, *gb], names=["out", "dx", "dw", "db"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_fp32_params(dtype):
    # bf16/fp16 input, fp32 weights (what autocast produces). out, dx and db obey the rule. dweight
    # is rebuilt from the saved z, rounded to the input dtype, so its error is that dtype's rounding
    # of sum|dy * xhat| (documented), where eager, reading the exact input, is near fp32.
    x0 = (torch.randn(4, 5, 9) * 2 + 1).to(dtype)
    w, b = params(5, torch.float32)
    g = torch.randn(4, 5, 9).to(dtype)
    out, ga, ref, gb, stats, ref_stats = run_both(x0, w, b, True, "leaky_relu", 0.01, g=g,
                                                  rm=torch.zeros(5), rv=torch.ones(5))  # fmt: skip
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _, _, ref64, g64, _, _ = run_both(x0.double(), w64, b64, True, "leaky_relu", 0.01,
                                      g=g.double())  # fmt: skip
    assert out.dtype == dtype and ga[0].dtype == dtype and ga[1].dtype == torch.float32
    assert stats[0].dtype == torch.float32
    torch.testing.assert_close(stats, ref_stats)
    assert_within_rule([out, ga[0], ga[2]], [ref64, g64[0], g64[2]], [ref, gb[0], gb[2]],
                       names=["out", "dx", "db"])  # fmt: skip
    u = torch.finfo(dtype).eps
    xhat = F.batch_norm(x0.double(), None, None, training=True)
    pre = xhat * w64.detach().view(1, -1, 1) + b64.detach().view(1, -1, 1)
    scale = (g.double() * torch.where(pre > 0, 1.0, 0.01)).abs()
    bound = 4 * u * (scale * (xhat.abs() + 1)).sum(dim=(0, 2))
    assert ((ga[1].double() - g64[1]).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# 7. edge sizes and errors


def test_one_value_per_channel_in_training_same_error_as_torch():
    x = torch.randn(1, 4)
    with pytest.raises(ValueError) as ours:
        inplace_abn(x.clone(), None, None, None, None, True)
    with pytest.raises(ValueError) as theirs:
        F.batch_norm(x.clone(), None, None, training=True)
    assert str(ours.value) == str(theirs.value)
    # eval mode with one value is fine, as in torch
    out = inplace_abn(x.clone(), torch.zeros(4), torch.ones(4), None, None, False)
    torch.testing.assert_close(out, F.leaky_relu(F.batch_norm(x, torch.zeros(4), torch.ones(4))))


def test_zero_size_batch():
    x = torch.randn(0, 3, 4, requires_grad=True)
    w, b = params(3, torch.float32)
    rm, rv = torch.zeros(3), torch.ones(3)
    out = inplace_abn(x * 1, rm, rv, w, b, True)
    assert out.shape == (0, 3, 4)
    dx, dw, db = torch.autograd.grad(out.sum(), [x, w, b])
    ref = eager(x, torch.zeros(3), torch.ones(3), w, b, True, "leaky_relu", 0.01)
    rdx, rdw, rdb = torch.autograd.grad(ref.sum(), [x, w, b])
    torch.testing.assert_close((dx, dw, db), (rdx, rdw, rdb))
    torch.testing.assert_close((rm, rv), (torch.zeros(3), torch.ones(3)))


@pytest.mark.parametrize(
    "act,param,exc,match",
    [
        ("relu", 0.0, ValueError, "activation must be invertible"),
        ("gelu", 0.0, ValueError, "activation must be invertible"),
        ("leaky_relu", 0.0, ValueError, "slope must be finite and > 0"),
        ("leaky_relu", -0.1, ValueError, "slope must be finite and > 0"),
        ("elu", 0.0, ValueError, "alpha must be finite and > 0"),
        ("elu", float("nan"), ValueError, "alpha must be finite and > 0"),
        (None, 0.0, TypeError, "activation must be a str"),
    ],
)
def test_refused_activations(act, param, exc, match):
    with pytest.raises(exc, match=match) as info:
        inplace_abn(torch.randn(3, 4), None, None, None, None, True, 0.1, 1e-5, act, param)
    assert str(info.value).startswith("slimgrad.ops.inplace_abn: ")


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"expected shape \(4,\), got \(3,\)"):
        inplace_abn(torch.randn(3, 4), None, None, torch.ones(3), None, True)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        inplace_abn(torch.randn(4), None, None, None, None, True)
    with pytest.raises(TypeError, match="must be floating point"):
        inplace_abn(torch.ones(3, 4, dtype=torch.long), None, None, None, None, True)
    with pytest.raises(ValueError, match="running statistics are needed in eval mode"):
        inplace_abn(torch.randn(3, 4), None, None, None, None, False)


# ---------------------------------------------------------------------------------------------
# 8. torch.compile


def test_compile_aot_eager_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    w, b = params(4, torch.float32)
    rm, rv = torch.zeros(4), torch.ones(4)
    rm2, rv2 = torch.zeros(4), torch.ones(4)
    x = torch.randn(2, 3, 5, 5)

    def f(x, rm, rv, conv=conv, w=w, b=b):
        h = inplace_abn(conv(x), rm, rv, w, b, True, 0.1, 1e-5, "leaky_relu", 0.01)
        return (h * h).sum()

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    leaves = [*conv.parameters(), w, b]
    got = torch.autograd.grad(cf(x, rm, rv), leaves)
    want = torch.autograd.grad(f(x, rm2, rv2), leaves)
    # traced, the ops take their PyTorch path (eager: the C kernels): the same math, another
    # summation order, so both are judged against float64 (the conv bias gradient is rounding
    # noise around 0: training BatchNorm removes it)
    conv64 = copy.deepcopy(conv).double()
    w64, b64 = (t.detach().double().requires_grad_() for t in (w, b))
    loss64 = f(x.double(), rm.clone().double(), rv.clone().double(), conv64, w64, b64)
    ref = torch.autograd.grad(loss64, [*conv64.parameters(), w64, b64])
    assert_within_rule(list(got), list(ref), list(want))
    torch.testing.assert_close((rm, rv), (rm2, rv2))


def _abn_grads(disabled: bool, siblings: bool, device="cpu"):
    from slimgrad import ownership
    from slimgrad.nn.inplace_abn import InPlaceABN

    torch.manual_seed(0)
    convs = torch.nn.ModuleList(torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(2)).to(device)
    norms = torch.nn.ModuleList(InPlaceABN(4) for _ in range(2)).to(device)
    x = torch.randn(3, 4, 7, 5).to(device).requires_grad_()
    ownership.reset_reuse_count()
    reuse = ownership.reuse_disabled() if disabled else contextlib.nullcontext()
    # deterministic cuDNN convolutions: the comparison is bit for bit (no effect on CPU)
    with reuse, torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        if siblings:  # PR #218's case: AddBackward hands the SAME gradient tensor to both branches
            h = norms[0](convs[0](x)) + norms[1](convs[1](x))
        else:  # a plain chain: each block's incoming gradient is dead after it
            h = norms[1](convs[1](norms[0](convs[0](x))))
        h.square().sum().backward()
    grads = [p.grad for p in list(convs.parameters()) + list(norms.parameters())] + [x.grad]
    return grads, ownership.reuse_count("grad")


@pytest.mark.parametrize("siblings", [False, True])
def test_dx_reuses_dead_incoming_gradient_bitwise(siblings, device):
    # on CUDA: backward runs on the engine's device thread, and dx comes from the Triton kernels
    off, n_off = _abn_grads(disabled=True, siblings=siblings, device=device)
    on, n_on = _abn_grads(disabled=False, siblings=siblings, device=device)
    assert n_off == 0
    # siblings: the first branch to run sees the gradient still held for the second and must not
    # write it; the second, running last, may (nobody else can see it any more). Where the
    # ownership calibration refuses this torch (torch 2.11 hands a backward its gradient with use
    # count 2), nothing is reused and the gradients must still match.
    from slimgrad import ownership

    assert n_on == ((1 if siblings else 2) if ownership.calibrated() else 0)
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_torch_func_transforms_and_jit_trace():
    # Issue 15: torch.func transforms run eager's batch_norm + activation (out of place);
    # torch.jit.trace refuses clearly.
    from torch.func import grad, vmap

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4, 5), torch.rand(4) + 0.5, torch.randn(4)
    for act, param in (("leaky_relu", 0.1), ("elu", 1.0), ("identity", 0.0)):

        def ours(t, act=act, param=param):
            return inplace_abn(t * 1, None, None, w, b, True, 0.1, 1e-5, act, param)

        def eager(t, act=act, param=param):
            y = F.batch_norm(t, None, None, w, b, True, 0.1, 1e-5)
            return {"leaky_relu": lambda: F.leaky_relu(y, param), "elu": lambda: F.elu(y, param),
                    "identity": lambda: y}[act]()  # fmt: skip

        torch.testing.assert_close(grad(lambda t: ours(t).sin().sum())(x),
                                   grad(lambda t: eager(t).sin().sum())(x))  # fmt: skip
        torch.testing.assert_close(vmap(ours)(x.unsqueeze(1)), vmap(eager)(x.unsqueeze(1)))
    with pytest.raises(RuntimeError, match="slimgrad.ops.inplace_abn: torch.jit.trace"):
        torch.jit.trace(lambda t: inplace_abn(t * 1, None, None, w, b, True), x.requires_grad_())

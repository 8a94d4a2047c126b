import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad.memory import measure
from slimgrad.ops.group_norm import _fallback_channels, _GroupNormFn, group_norm
from slimgrad.ops.layer_norm import fallback_channels
from slimgrad.testing import assert_within_rule, rule_ok

# the first three keep the output (odd and prime sizes); the last three run eager's group_norm (a
# backward that would not fit in eager's bytes: test_small_shapes_run_eager_exactly; groups of 3)
SHAPES = [((5, 6, 7), 2), ((2, 4, 3, 7), 2), ((7, 32, 3), 2), ((3, 6, 7), 2), ((5, 32), 2)]
SHAPES += [((5, 9), 3)]


def _params(c, dtype, kind="normal"):
    w = 1 + 0.5 * torch.randn(c, dtype=torch.float64)
    b = 0.5 * torch.randn(c, dtype=torch.float64)
    if kind == "zero":
        w[::2] = 0
    elif kind == "tiny":
        w[::3] = 1e-4
        b = 3 * torch.randn(c, dtype=torch.float64)
    return w.to(dtype), b.to(dtype)


def _run(fn, x, g_, w, b, dy, inputs=None):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_() if w is not None else None
    b = b.detach().clone().requires_grad_() if b is not None else None
    y = fn(x, g_, w, b, 1e-5)
    y.backward(dy, inputs=inputs(x, w, b) if inputs else None)
    return [
        y.detach(),
        x.grad,
        w.grad if w is not None else None,
        b.grad if b is not None else None,
    ]


@pytest.mark.parametrize("kind", ["normal", "zero", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,groups", SHAPES)
def test_matches_eager_within_rule(dtype, shape, groups, kind):
    x = (3 * torch.randn(shape) + 1).to(dtype)
    w, b = _params(shape[1], dtype, kind)
    dy = torch.randn(shape).to(dtype)
    out = _run(group_norm, x, groups, w, b, dy)
    eager = _run(F.group_norm, x, groups, w, b, dy)
    ref = _run(F.group_norm, x.double(), groups, w.double(), b.double(), dy.double())
    for o in out:
        assert torch.isfinite(o).all()
    assert_within_rule(out, ref, eager, names=["y", "dx", "dw", "db"])
    torch.testing.assert_close(out[0], eager[0], rtol=0, atol=0)


def test_tiny_groups_run_eager():
    x = torch.randn(5, 9, requires_grad=True)
    y = group_norm(x, 3)
    assert type(y.grad_fn).__name__ == "NativeGroupNormBackward0"
    y = group_norm(torch.randn(7, 32, 3, requires_grad=True), 1)
    assert type(y.grad_fn).__name__ == "_GroupNormFnBackward"


def test_gradcheck_and_errors():
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    w, b = _params(4, torch.float64, "zero")
    w.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, b: group_norm(x, 2, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x: group_norm(x, 4), (x,))
    with pytest.raises(RuntimeError, match="slimgrad.ops.group_norm: channels must split"):
        group_norm(torch.randn(2, 5, 3), 2)
    # Issue 15: double backward gives eager's second derivatives (it was refused)
    assert torch.autograd.gradgradcheck(lambda x, w, b: group_norm(x, 2, w, b), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x: group_norm(x, 2), (x,))


def test_memory_contract_and_subsets():
    n, c, hw = 3, 8, 11
    w, b = _params(c, torch.float32, "zero")
    b.zero_()
    w.requires_grad_()
    b.requires_grad_()
    k = fallback_channels(w, b, torch.float32).numel()
    assert k == 4
    x0 = torch.randn(n, c, hw, requires_grad=True)
    m = measure(lambda: group_norm(x0 * 1, 2, w, b).sum())
    assert m.saved_bytes == 4 * n * c * hw + 8 * n * 2 + 4 * n * k * hw + 8 * k
    me = measure(lambda: F.group_norm(x0 * 1, 2, w, b).sum())
    assert me.saved_bytes == 4 * n * c * hw + 8 * n * 2
    dy = torch.randn(n, c, hw)
    for pick in (lambda x, w, b: [x], lambda x, w, b: [w, b]):
        out = _run(group_norm, x0, 2, w, b, dy, inputs=pick)
        ref = _run(F.group_norm, x0, 2, w, b, dy, inputs=pick)
        for o, r in zip(out, ref):
            assert (o is None) == (r is None)
            if o is not None:
                torch.testing.assert_close(o, r)


def test_compile_autocast_inplace_error_zero_size_nan():
    torch._dynamo.reset()
    w, b = _params(6, torch.float32, "zero")
    f = torch.compile(group_norm, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 6, 8)
    dy = torch.randn(5, 6, 8)
    assert type(group_norm(x.requires_grad_(), 3).grad_fn).__name__ == "_GroupNormFnBackward"
    x = x.detach()
    out = _run(lambda *a: f(*a), x, 3, w, b, dy)
    ref = _run(F.group_norm, x, 3, w, b, dy)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, ye = group_norm(x.bfloat16(), 3, w, b), F.group_norm(x.bfloat16(), 3, w, b)
    assert ya.dtype == ye.dtype
    torch.testing.assert_close(ya, ye)
    xx = x.clone().requires_grad_()
    y = group_norm(xx, 3)
    y.relu_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    e = torch.randn(0, 6, 8, requires_grad=True)
    group_norm(e, 3, w.clone().requires_grad_()).sum().backward()
    assert e.grad.shape == (0, 6, 8)
    xn = x.clone()
    xn[0, 0, 0] = float("nan")
    out = _run(group_norm, xn, 3, w, b, dy)
    ref = _run(F.group_norm, xn, 3, w, b, dy)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, equal_nan=True)


# A fast subset of the grid in NOTE [RMSNorm and GroupNorm in half precision] (ops/rms_norm.py)
# holding cases where rebuilding xhat from a half-precision output broke the rule for dgamma
# ((1, 8, 16) fp16 seeds 13 and 24 with "tiny" weights; (2, 4, 3, 7) fp16 seed 5).
HALF_GRID = [((1, 8, 16), 2, "tiny"), ((2, 4, 3, 7), 2, "normal"), ((3, 6, 7), 2, "tiny")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sweep(dtype):
    old_fails = 0
    for shape, groups, kind in HALF_GRID:
        for seed in range(25):
            torch.manual_seed(seed)
            x = (3 * torch.randn(shape) + 1).to(dtype)
            w, b = _params(shape[1], dtype, kind)
            dy = torch.randn(shape).to(dtype)
            eager = _run(F.group_norm, x, groups, w, b, dy)
            ref = _run(F.group_norm, x.double(), groups, w.double(), b.double(), dy.double())
            out = _run(group_norm, x, groups, w, b, dy)
            assert_within_rule(out, ref, eager, names=["y", "dx", "dw", "db"])
            # the float32 path (keeps y, rebuilds xhat) forced at half precision
            old = _run(lambda *a: _GroupNormFn.apply(*a)[0], x, groups, w, b, dy)
            old_fails += not rule_ok(old[2], ref[2], eager[2])[0]
    # the grid does find the failures of the output-only path in fp16. In bf16 its failures here
    # were all in channels with |beta| > |gamma|, which keep their input since issue 15's
    # sample #27 (NOTE [GroupNorm's fallback channels]); the full grid was not rerun.
    if dtype == torch.float16:
        assert old_fails > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_eager_with_eager_memory(dtype):
    n, c, hw, groups = 3, 8, 11, 2
    w, b = (t.requires_grad_() for t in _params(c, dtype))
    x0 = torch.randn(n, c, hw, dtype=dtype, requires_grad=True)
    y = group_norm(x0, groups, w, b)
    assert type(y.grad_fn).__name__ == "NativeGroupNormBackward0"
    m = measure(lambda: group_norm(x0 * 1, groups, w, b).sum())
    me = measure(lambda: F.group_norm(x0 * 1, groups, w, b).sum())
    # x + mean and rstd in x's dtype (2 B each per sample and group), as eager
    assert m.saved_bytes == me.saved_bytes == 2 * n * c * hw + 4 * n * groups
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = group_norm(x0, groups, w, b)
        y32 = group_norm(x0.float(), groups, w.float(), b.float())  # autocast keeps fp32 here
    assert type(y.grad_fn).__name__ == "NativeGroupNormBackward0"
    assert type(y32.grad_fn).__name__ == "_GroupNormFnBackward"


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_noncontiguous_layouts_match_eager(layout):
    # Adversarial F1: channels_last crashed in backward, transposed/sliced in forward. Such
    # inputs take eager's path: same values, output strides and gradients, bit for bit.
    torch.manual_seed(0)
    w, b = _params(8, torch.float32)
    if layout == "channels_last":
        x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = torch.randn(6, 5, 8).transpose(1, 2)
    else:
        x = torch.randn(2, 8, 12)[:, :, ::2]
    assert not x.is_contiguous()

    def run(fn, dy):
        # The input itself is a non-leaf view (clone() would make a sliced input contiguous).
        base = x.detach().clone().requires_grad_()
        wr, br = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        xv = base * 1
        if layout == "sliced":
            xv = base.new_zeros(2, 8, 12).index_copy(2, torch.arange(0, 12, 2), base)[:, :, ::2]
        assert xv.stride() == x.stride()
        y = fn(xv, 2, wr, br, 1e-5)
        y.backward(dy)
        return [y.detach(), base.grad, wr.grad, br.grad]

    dy_t = torch.randn(x.shape[::-1]).permute(*range(x.dim() - 1, -1, -1))
    for dy in (torch.randn(x.shape), dy_t):
        out, eager = run(group_norm, dy), run(F.group_norm, dy)
        for o, e in zip(out, eager, strict=True):
            torch.testing.assert_close(o, e, rtol=0, atol=0)
            assert o.stride() == e.stride()


@pytest.mark.parametrize("dy_layout", ["channels_last", "transposed", "expanded"])
def test_contiguous_input_any_gradient_layout_matches_eager(dy_layout):
    # Issue 15: a contiguous input with a channels_last (or transposed, or stride-0) incoming
    # gradient crashed in backward ("view size is not compatible").
    torch.manual_seed(1)
    w, b = _params(8, torch.float32)
    x = torch.randn(2, 8, 5, 5)
    if dy_layout == "channels_last":
        dy = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    elif dy_layout == "transposed":
        dy = torch.randn(2, 8, 5, 5).transpose(2, 3).contiguous().transpose(2, 3)
    else:
        dy = torch.randn(2, 8, 1, 1).expand(2, 8, 5, 5)
    assert not dy.is_contiguous()
    out = _run(group_norm, x, 2, w, b, dy)
    ref = _run(F.group_norm, x.double(), 2, w.double(), b.double(), dy.double())
    eager = _run(F.group_norm, x, 2, w, b, dy)
    for o, r, e in zip(out, ref, eager, strict=True):
        assert_within_rule(o, r, e)


def test_expanded_input_matches_eager():
    # Issue 15: an expanded (stride-0) input crashed ("Expected X.is_contiguous").
    torch.manual_seed(2)
    w, b = _params(4, torch.float32)
    for x in (torch.randn(1, 4, 6, 6).expand(3, 4, 6, 6), torch.randn(3, 4, 1).expand(3, 4, 9)):
        dy = torch.randn(x.shape)
        out = _run(group_norm, x, 2, w, b, dy)
        eager = _run(F.group_norm, x, 2, w, b, dy)
        for o, e in zip(out, eager, strict=True):
            torch.testing.assert_close(o, e)


def test_channels_last_unet_block_after_convert_matches_eager():
    # Issue 15: a channels_last Conv -> GroupNorm -> SiLU block failed in backward after convert_.
    import slimgrad

    torch.manual_seed(3)
    block = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU()
    ).to(memory_format=torch.channels_last)
    ours = __import__("copy").deepcopy(block)
    slimgrad.convert_(ours)
    assert slimgrad.report(ours).converted, slimgrad.report(ours)  # not eager vs eager
    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    grads = []
    for m in (block, ours):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(torch.randn_like(y, memory_format=torch.channels_last).mul_(0).add_(1))
        grads.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()])
    for o, e in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(o, e)


def test_torch_func_transforms_and_jit_trace():
    # Issue 15: torch.func transforms run eager's group_norm; torch.jit.trace refuses clearly.
    from torch.func import grad, jacrev, vmap

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 4, 9), torch.randn(4), torch.randn(4)
    torch.testing.assert_close(
        vmap(lambda t: group_norm(t, 2, w, b))(x), vmap(lambda t: F.group_norm(t, 2, w, b))(x)
    )
    torch.testing.assert_close(
        grad(lambda t: group_norm(t, 2, w, b).sin().sum())(x[0]),
        grad(lambda t: F.group_norm(t, 2, w, b).sin().sum())(x[0]),
    )
    torch.testing.assert_close(
        jacrev(lambda t: group_norm(t, 2))(x[0]), jacrev(lambda t: F.group_norm(t, 2))(x[0])
    )
    with pytest.raises(RuntimeError, match="slimgrad.ops.group_norm: torch.jit.trace"):
        torch.jit.trace(lambda t: group_norm(t, 2, w, b), x[0].requires_grad_())


def test_channels_last_input_without_grad_weight_grad_does_not_crash():
    # tests/opinfo finding: torch 2.13's CPU GroupNorm backward segfaults for a channels_last
    # input that needs no gradient while weight or bias does; slimgrad runs eager's contiguous
    # kernels there (values within the rule, eager's output layout).
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5).contiguous(memory_format=torch.channels_last)
    w, b = _params(6, torch.float32)
    g = torch.randn(4, 6, 5, 5)
    out = _run(lambda x, G, w, b, e: group_norm(x.detach(), G, w, b, e), x, 3, w, b, g)
    ref = _run(lambda x, G, w, b, e: F.group_norm(x.detach().contiguous(), G, w, b, e),
               x.double(), 3, w.double(), b.double(), g.double())  # fmt: skip
    eager_contig = _run(lambda x, G, w, b, e: F.group_norm(x.detach().contiguous(), G, w, b, e),
                        x, 3, w, b, g)  # fmt: skip
    assert out[0].stride() == F.group_norm(x, 3, w, b).stride()
    for i in (0, 2, 3):
        assert_within_rule(out[i], ref[i], eager_contig[i])


# Issue 15: the OpInfo sample group_norm f32 #27 ((20, 6, 10, 10), 6 groups, x uniform in [-9, 9],
# these weights; |beta/gamma| = 3.57, 0.61, 1.89, 2.65, 0.88, 0.82) broke the rule for dgamma:
# channel 2 (|beta/gamma| 1.89) was rebuilt from y and came out one ulp past eager's value. The
# fix (NOTE [GroupNorm's fallback channels]): dgamma from float64 products, and channels with
# |beta| > |gamma| keep their input. Over these 150 cotangents the old code broke the rule at
# seeds 63 (dgamma of channel 2: 1.51x the bound) and 148 (channel 4, |beta/gamma| 0.88, rebuilt
# either way: 1.96x). Over 1,000 it broke it 6 times, the fixed code twice (157: channel 4, 1.14x;
# 225: channel 0, a kept channel computed from x, one ulp past eager's value: eager's own float32
# mean and rstd alone put 5.1e-6 of error into that dgamma): the rule's statistics.
GN27_W = (-2.3832, 7.1667, 4.1655, 2.6393, 7.1194, -8.0099)
GN27_B = (-8.5152, -4.3871, -7.8703, -6.9821, -6.2652, 6.5803)


def test_opinfo_group_norm_27_within_rule_over_cotangents():
    n, c, hw, groups = 20, 6, 100, 6
    gen = torch.Generator().manual_seed(0)
    x = torch.empty(n, c, 10, 10).uniform_(-9, 9, generator=gen)
    w, b = torch.tensor(GN27_W), torch.tensor(GN27_B)
    assert _fallback_channels(w, b, torch.float32, groups).tolist() == [0, 2, 3]
    # memory contract: y + mean, rstd + the kept channels' input and their int64 indices
    k = 3
    x0 = x.clone().requires_grad_()
    m = measure(lambda: group_norm(x0 * 1, groups, w, b).sum())
    assert m.saved_bytes == 4 * n * c * hw + 8 * n * groups + 4 * n * k * hw + 8 * k
    ref_x, ref_w, ref_b = x.double(), w.double(), b.double()
    for seed in range(150):
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
        out = _run(group_norm, x, groups, w, b, dy)
        eager = _run(F.group_norm, x, groups, w, b, dy)
        ref = _run(F.group_norm, ref_x, groups, ref_w, ref_b, dy.double())
        assert_within_rule(out, ref, eager, names=["y", "dx", "dw", "db"])


# NOTE [GroupNorm's backward within eager's bytes] (ops/group_norm.py): where the output-keeping
# path applies, a step peaks at no more bytes than eager's, alone (nothing keeps y) and before a
# layer that keeps y; before, its backward held float32 xhat and g and float64 copies of dy and y
# for the whole small batch ((4, 16, 7, 7) in one group: peak 77,319 B against eager's 37,800).
LEAN = [
    ((4, 16, 7, 7), 1),
    ((4, 16, 7, 7), 16),
    ((3, 13, 7), 1),
    ((2, 64, 3, 3), 32),
    ((5, 6, 7), 2),
    ((8, 32, 16, 16), 8),
]


def _conv(c, dim):
    return (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[dim - 3](c, c, 1)


class _Half(torch.nn.Module):
    # keeps nothing of its input; after the norm, the norm's output is not the model's output
    # (where it is, the norm runs eager's op: NOTE [Modules whose output is the model's output])
    def forward(self, x):
        return x * 0.5


@pytest.mark.parametrize("after", [False, True], ids=["alone", "conv_after"])
@pytest.mark.parametrize("shape,groups", LEAN)
def test_step_peak_and_saved_never_above_eager(shape, groups, after):
    import copy

    import slimgrad
    from slimgrad.ops.group_norm import _backward_fits

    assert _backward_fits(shape, groups, 4)
    c = shape[1]
    gen = torch.Generator().manual_seed(sum(shape) + groups)
    torch.manual_seed(groups)
    mods = [_conv(c, len(shape)), torch.nn.GroupNorm(groups, c)]
    eager = torch.nn.Sequential(*mods, _conv(c, len(shape)) if after else _Half())
    with torch.no_grad():  # |bias| < |weight|: no fallback channel
        eager[1].weight.copy_(torch.rand(c, generator=gen) + 0.5)
        eager[1].bias.copy_((torch.rand(c, generator=gen) - 0.5) * 0.8)
    slim = copy.deepcopy(eager)
    slimgrad.convert_(slim)
    assert slimgrad.report(slim).converted, slimgrad.report(slim)  # not eager vs eager
    x, w = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    grads = []
    for m in (copy.deepcopy(eager).double(), eager, slim):
        d = next(m.parameters()).dtype
        m.zero_grad(set_to_none=True)
        (m(x.to(d)) * w.to(d)).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert type(slim[1](x * 1).grad_fn).__name__ == "_GroupNormFnBackward"
    assert_within_rule(grads[2], grads[0], grads[1])
    me = measure(lambda: (eager(x) * w).sum(), timeline=False)
    ms = measure(lambda: (slim(x) * w).sum(), timeline=False)
    assert ms.saved_bytes <= me.saved_bytes, (ms.saved_bytes, me.saved_bytes)
    assert ms.peak_bytes <= me.peak_bytes, (ms.peak_bytes, me.peak_bytes)
    # eager keeps x (and the next layer y); the lean path keeps y (shared with the next layer)
    assert me.saved_bytes - ms.saved_bytes == (x.numel() * 4 if after else 0)


@pytest.mark.parametrize(
    "shape,groups", [((3, 6, 7), 2), ((5, 32), 2), ((1, 16, 16), 16), ((2, 4, 9), 1)]
)
def test_small_shapes_run_eager_exactly(shape, groups):
    # where the backward's float64 sums would not fit in the bytes of x it saves
    # (_backward_fits), group_norm is eager's: the same node, bits and bytes
    from slimgrad.ops.group_norm import MIN_GROUP_NUMEL, _backward_fits

    assert shape[1] // groups * math.prod(shape[2:]) >= MIN_GROUP_NUMEL
    assert not _backward_fits(shape, groups, 4)
    gen = torch.Generator().manual_seed(len(shape) + groups)
    x0 = torch.randn(shape, generator=gen).requires_grad_()
    w, b = _params(shape[1], torch.float32)
    dy = torch.randn(shape, generator=gen)
    assert type(group_norm(x0 * 1, groups, w, b).grad_fn).__name__ == "NativeGroupNormBackward0"
    out = _run(group_norm, x0, groups, w, b, dy)
    ref = _run(F.group_norm, x0, groups, w, b, dy)
    for o, r in zip(out, ref, strict=True):
        assert torch.equal(o, r)
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    m = measure(lambda: (group_norm(x0 * 1, groups, wr, br) * dy).sum(), timeline=False)
    me = measure(lambda: (F.group_norm(x0 * 1, groups, wr, br) * dy).sum(), timeline=False)
    assert (m.saved_bytes, m.peak_bytes) == (me.saved_bytes, me.peak_bytes)
    n = shape[0]
    assert m.saved_bytes == x0.numel() * 4 + 8 * n * groups  # x + mean, rstd (eager's)


# The incoming gradient is shared (a residual add), so dx cannot take dy's buffer and y is kept by
# nobody else: the lean backward holds y, dy and dx where eager holds x, dy and dx, so it must
# allocate nothing but dx, dgamma and dbeta. Before the C kernel (kernels/cpu/group_norm.c: its
# sums in registers) and unmaterialized gradients for mean and rstd, (4, 16, 7, 7) in one group
# peaked at 39,462 B (eager 37,800; 89,863 before the chunked backward), (8, 32, 16, 16) in 8
# groups at 795,398 (787,208); now 37,799 and 787,207.
def test_residual_step_peak_never_above_eager():
    import copy

    import slimgrad
    from slimgrad.kernels import _backend

    if _backend.use_cpu(torch.empty(1), "group_norm") is None:
        pytest.skip("C kernels unavailable: the PyTorch backward's float64 sums need their bytes")

    class Res(torch.nn.Module):
        def __init__(self, c, g):
            super().__init__()
            self.conv, self.gn = torch.nn.Conv2d(c, c, 1), torch.nn.GroupNorm(g, c)

        def forward(self, x):
            h = self.conv(x)
            return self.gn(h) + h

    failures = []
    for shape, g in (((4, 16, 7, 7), 1), ((8, 32, 16, 16), 8)):
        torch.manual_seed(0)
        eager = Res(shape[1], g)
        slim = copy.deepcopy(eager)
        slimgrad.convert_(slim)
        assert slimgrad.report(slim).converted, slimgrad.report(slim)  # not eager vs eager
        x, w = torch.randn(shape), torch.randn(shape)
        for m in (eager, slim):
            (m(x) * w).sum().backward()
        me, ms = (measure(lambda m=m: (m(x) * w).sum(), timeline=False) for m in (eager, slim))  # noqa: B023
        assert ms.saved_bytes <= me.saved_bytes
        if ms.peak_bytes > me.peak_bytes:
            failures.append((shape, g, ms.peak_bytes, me.peak_bytes))
    assert not failures, failures


@pytest.mark.parametrize("kind", ["normal", "tiny", "nobias", "noaffine"])
@pytest.mark.parametrize(
    "shape,groups",
    [
        ((4, 16, 7, 7), 1),
        ((4, 16, 7, 7), 16),
        ((20, 6, 10, 10), 6),
        ((3, 13, 7), 1),
        ((1, 4, 300), 2),
        ((7, 32, 3), 2),  # rows of fewer than 4 values: the row sums are computed twice
    ],
)
def test_cpu_kernel_same_bits_as_torch_path(shape, groups, kind):
    # kernels/cpu/group_norm.c: its float64 sums run in another order than the PyTorch path's,
    # its dx steps round as the PyTorch ops do (addcmul_ fused: fmaf); every gradient, every
    # mask, into dy's buffer or not: the same bits
    from slimgrad.kernels import _backend
    from slimgrad.ops.group_norm import _bwd_cpu, _bwd_torch, _fwd_torch

    if _backend.use_cpu(torch.empty(1), "group_norm") is None:
        pytest.skip("C kernels unavailable (no compiler, or SLIMGRAD_BACKEND forces another)")
    gen = torch.Generator().manual_seed(sum(shape) + groups)
    c = shape[1]
    x = 3 * torch.randn(shape, generator=gen) + 1
    w = torch.rand(c, generator=gen) + 0.5
    b = 0.8 * (torch.rand(c, generator=gen) - 0.5)  # |beta| < |gamma|: no fallback channel
    if kind == "tiny":  # fallback channels: weight ~ 0 and |beta| > |gamma|
        w[::3] = 1e-4
        b = 3 * torch.randn(c, generator=gen)
    w = None if kind == "noaffine" else w
    b = None if kind in ("nobias", "noaffine") else b
    dy = torch.randn(shape, generator=gen)
    y, mean, rstd, idx, xside = _fwd_torch(x, groups, w, b, 1e-5)
    assert (idx.numel() > 0) == (kind == "tiny")
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        want = _bwd_torch(dy, y, mean, rstd, idx, xside, w, b, groups, mask)
        got = _bwd_cpu(dy, y, mean, rstd, idx, xside, w, b, groups, mask)
        buf = dy.clone()
        into = _bwd_cpu(buf, y, mean, rstd, idx, xside, w, b, groups, mask, out=buf)
        for r, g, i in zip(want, got, into, strict=True):
            assert (r is None) == (g is None) == (i is None)
            if r is not None:
                assert torch.equal(g, r) and torch.equal(i, r)
        if mask[0]:
            assert into[0] is buf


def test_host_calls_per_call():
    # issue 32: the module passes the gate itself, decides the path once per shape, finds the
    # fallback channels once per parameter version, runs torch's forward inside its Function (no
    # custom-op wrappers), and the backward is one C call: 77 calls of and from slimgrad's code
    # per fwd + bwd of a converted GroupNorm (1,054 before: the PyTorch backward's 32 chunks of
    # Python), counted, not timed
    from slimgrad.nn import GroupNorm
    from tests._host_calls import slimgrad_calls

    torch.manual_seed(0)
    x = torch.randn(4, 16, 7, 7, requires_grad=True)
    gn = GroupNorm(1, 16)
    r = torch.randn(4, 16, 7, 7)

    def step():
        (gn(x) * r).sum().backward()

    for _ in range(2):
        step()
    assert type(gn(x).grad_fn).__name__ == "_GroupNormFnBackward"
    assert slimgrad_calls(step) <= 77


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["straight", "autocast", "dispatch_mode"])
def test_fallback_channels_found_once_per_weight_version(monkeypatch, path):
    # CONTRIBUTING.md, "Decide once": the fallback channels (a nonzero: a host sync on CUDA) are
    # found once per version of weight and bias on every path that takes plain parameters (the
    # general path under autocast or a dispatch mode found them on every call before), and a
    # change is seen: an in-place edit, an optimizer step, a new non-finite entry. Counted calls.
    gn_mod = importlib.import_module("slimgrad.ops.group_norm")
    found = []
    real = gn_mod._fallback_channels

    def counting(*a):
        found.append(1)
        return real(*a)

    monkeypatch.setattr(gn_mod, "_fallback_channels", counting)
    torch.manual_seed(0)
    x = torch.randn(3, 6, 5, 7, requires_grad=True)
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(6))
    b = torch.nn.Parameter(0.1 * torch.randn(6))
    opt = torch.optim.SGD([w, b], lr=0.1)

    def idx_of_step():
        if path == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = group_norm(x, 3, w, b)
        elif path == "dispatch_mode":
            with _PassThrough():
                y = group_norm(x, 3, w, b)
        else:
            y = group_norm(x, 3, w, b)
        assert type(y.grad_fn).__name__ == "_GroupNormFnBackward"
        idx = y.grad_fn.saved_tensors[3]
        assert idx.tolist() == real(w, b, torch.float32, 3).tolist()
        y.square().sum().backward()
        return idx.tolist()

    assert idx_of_step() == []
    n = len(found)
    for _ in range(3):  # unchanged weights: nothing found again
        assert idx_of_step() == []
    assert len(found) == n
    with torch.no_grad():  # an in-place edit: channel 1 falls back (|beta| > |gamma|)
        b[1] = 5.0
    assert idx_of_step() == [1]
    assert idx_of_step() == [1] and len(found) == n + 1
    with torch.no_grad():  # a new non-finite gamma: every channel of its group
        w[4] = float("inf")
    assert idx_of_step() == [1, 4, 5]
    with torch.no_grad():
        w[4] = 1.0
        b[1] = 0.0
        w.grad = torch.zeros_like(w)
        b.grad = torch.full_like(b, 50.0)  # the step moves |beta| past |gamma| on every channel
    opt.step()
    assert idx_of_step() == [0, 1, 2, 3, 4, 5]
    assert len(found) == n + 3


def test_estimate_equals_the_measured_step_when_channels_are_found_in_it():
    # memory.estimate (fake tensors) against the real step under the tracker, where the forward
    # finds its fallback channels inside the measured step (a new weight version). Before: the
    # real step's peak was 1 B below the estimate (``wide[idx] = True`` in _fallback_channels
    # made a 1-byte tensor outside the tracker, which saw it freed)
    from slimgrad.memory import estimate
    from slimgrad.nn import GroupNorm

    def make():
        torch.manual_seed(0)
        conv, gn = torch.nn.Conv2d(3, 16, 3, padding=1), GroupNorm(4, 16)
        conv2 = torch.nn.Conv2d(16, 8, 3, padding=1)
        model = torch.nn.Sequential(conv, gn, conv2)
        x = torch.randn(2, 3, 8, 8)
        return (lambda: model(x).square().sum()), model

    forward, model = make()
    forward().backward()  # one-time tables out of the measured step
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model[1].weight.mul_(1.0)  # a new version: the next forward finds its channels again
    real = measure(forward, module=model)
    est = estimate(make)
    assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)

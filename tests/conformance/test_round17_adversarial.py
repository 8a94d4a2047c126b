"""Conformance: adversarial cases for round 17's changes, converted against eager.

The changes under test: Linear/Conv1D on inputs of 3+ dims return the 2-D product and the caller
views it (NOTE [Linear's 2-D product]); ELU in place keeps y alone (NOTE [ELU in place]);
LayerNorm/RMSNorm/GroupNorm without materialized side-output gradients; GroupNorm's float32 CPU
backward in C (kernels/cpu/group_norm.c); ownership.take's cheaper facts; attention products as
reshape + bmm (NOTE [Attention matmuls as bmm]).

Each row runs eager and converted side by side: in-place writes on the output, hooks that keep a
gradient, gradients the caller keeps or passes twice, layouts of the input and of the incoming
gradient, requires_grad subsets, no_grad/inference_mode/save_on_cpu/autocast, torch.func,
gradcheck/gradgradcheck in float64, and exact saved/peak bytes from slimgrad's tracker. A strict
xfail is a finding, with its measured numbers.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.autograd.graph import save_on_cpu
from transformers.pytorch_utils import Conv1D as HFConv1D

import slimgrad
import slimgrad.ops as sops
from slimgrad.convert_handlers import inplace_guard as _inplace_guard
from slimgrad.memory import measure
from slimgrad.testing import rule_ok

GN = importlib.import_module("slimgrad.ops.group_norm")

# {name: (module builder, input shape, exact)}: exact compares gradients bit for bit; the norms'
# backwards are within the error rule, not bitwise (their own reduction orders): dx, dgamma, dbeta
# at 0.23-0.26 of the bound for LayerNorm, 0.28-0.38 RMSNorm, 0.07-0.19 GroupNorm (float32, these
# shapes, against float64)
MODULES = {
    "Linear-3d": (lambda: nn.Linear(6, 5), (3, 4, 6), True),
    "Linear-4d-nobias": (lambda: nn.Linear(6, 5, bias=False), (2, 3, 4, 6), True),
    "Conv1D-3d": (lambda: HFConv1D(5, 6), (3, 4, 6), True),
    "ELU-inplace": (lambda: nn.Sequential(nn.Linear(6, 6), nn.ELU(inplace=True)), (3, 40, 6), True),
    "ELU-inplace-a2.5": (
        lambda: nn.Sequential(nn.Linear(6, 6), nn.ELU(2.5, inplace=True)),
        (3, 40, 6),
        True,
    ),
    "LayerNorm": (lambda: nn.LayerNorm(6), (3, 4, 6), False),
    "RMSNorm": (lambda: nn.RMSNorm(6), (3, 4, 6), False),
    "GroupNorm": (lambda: nn.GroupNorm(2, 6), (3, 6, 10), False),
    "GroupNorm-16": (lambda: nn.GroupNorm(4, 16), (2, 16, 9), False),
}


class Scale(nn.Module):
    # a consumer after the module under test, inside the model: convert_ leaves a module that
    # keeps its output unconverted at the root model's output end (the caller may write there)
    def forward(self, y):
        return y * 1.5


def _is_slimgrad(m):
    return type(m).__module__.startswith("slimgrad.")


def _converted_leaves(mod):
    return [m for m in mod.modules() if not list(m.children())]


def _pair(name, post=None):
    # convert_ never replaces the model it is given: the module under test sits inside one, with
    # the same wrapper on the eager side; a post runs inside the model, after the module
    torch.manual_seed(0)
    inner = MODULES[name][0]()
    eager = nn.Sequential(inner, Scale()) if post is None else nn.Sequential(inner, Post(post))
    ours = copy.deepcopy(eager)
    slimgrad.convert_(ours)
    return eager, ours


def _assert_converted(ours):
    leaves = _converted_leaves(ours[0])
    assert leaves and all(_is_slimgrad(m) for m in leaves), [type(m) for m in leaves]


def _same(a, b, exact, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if exact:
        assert torch.equal(a, b), (what, (a.double() - b.double()).abs().max().item())
    else:
        torch.testing.assert_close(b, a, msg=what)


def _weight(shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape).sin()


def _outcome(fn):
    try:
        return fn()
    except RuntimeError as e:
        return type(e)
    # (only RuntimeError: any other exception fails the test)


POSTS = {
    "plain": lambda y: y,
    "relu_": lambda y: y.relu_(),
    "add_": lambda y: y.add_(1.0),
    "setitem": lambda y: (y.__setitem__((0,), 0.0), y)[1],
    "transpose_mul_": lambda y: y.transpose(0, 1).mul_(2.0).transpose(0, 1),
    "saved_then_written": lambda y: (y * 1, y.sigmoid(), y.mul_(2))[1],
}


class Post(nn.Module):
    # the write on the module's output, inside the model: convert_'s in-place guard sees it
    # (NOTE [In-place writers after output-saving modules]) and a consumer follows it
    def __init__(self, post):
        super().__init__()
        self.post = post

    def forward(self, y):
        return POSTS[self.post](y) * 1.5


def _post_run(mod, x):
    for p in mod.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    y = mod(x * 1.5)
    (y * _weight(y.shape)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in mod.parameters()]


@pytest.mark.parametrize("post", list(POSTS))
@pytest.mark.parametrize("name", list(MODULES))
def test_inplace_writes_on_output_match_eager(name, post):
    eager, ours = _pair(name, post)
    # an output-saving module (SAVES_OUTPUT) with a write after it stays eager's, with a reason;
    # every other module under test is slimgrad's
    for m in _converted_leaves(ours[0]):
        if post != "plain" and _inplace_guard.kept_reason(m) is not None:
            assert _inplace_guard._saves_output(m) and not _is_slimgrad(m), type(m)
        else:
            assert _is_slimgrad(m), (type(m), _inplace_guard.kept_reason(m))
    x = torch.randn(MODULES[name][1], generator=torch.Generator().manual_seed(1))
    a = _outcome(lambda: _post_run(eager, x))
    b = _outcome(lambda: _post_run(ours, x))
    if isinstance(a, type) or isinstance(b, type):
        assert a == b, (a, b)  # the same error kind, or both train
        return
    for i, (u, v) in enumerate(zip(a, b)):
        _same(u, v, MODULES[name][2], (name, post, i))


CONTEXTS = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "save_on_cpu": lambda: save_on_cpu(pin_memory=False),
    "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}
LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
    "expanded": lambda t: t[:1].expand_as(t),
    "zero_size": lambda t: t[:0],
    "channels_last": lambda t: (
        t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t
    ),
    "strided": lambda t: torch.cat([t, t], -1)[..., ::2],
}


def _ctx_run(mod, x, ctx, layout, x_req, p_req):
    for p in mod.parameters():
        p.grad = None
        p.requires_grad_(p_req)
    try:
        x = LAYOUTS[layout](x.clone()).requires_grad_(x_req)
        with CONTEXTS[ctx]():
            y = mod(x)
        if not y.requires_grad:
            return [y]
        (y * _weight(y.shape)).sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in mod.parameters()]
    finally:
        for p in mod.parameters():
            p.requires_grad_(True)


# (was a finding, issue 30: eager's HF Conv1D views a non-contiguous 3-D input
# (x.view(-1, nx)) and raises on a transposed or expanded one; the converted Conv1D computed. Now
# it raises the same error: NOTE [Conv1D views its input] in slimgrad/ops/linear.py)
CTX_CASES = [
    (name, ctx, layout)
    for name in MODULES
    if name not in ("ELU-inplace-a2.5", "GroupNorm")
    for ctx in CONTEXTS
    for layout in LAYOUTS
]


@pytest.mark.parametrize("name,ctx,layout", CTX_CASES)
def test_contexts_layouts_and_requires_grad_subsets(name, ctx, layout):
    eager, ours = _pair(name)
    _assert_converted(ours)
    x = torch.randn(MODULES[name][1], generator=torch.Generator().manual_seed(2))
    for x_req, p_req in ((True, True), (True, False), (False, True), (False, False)):
        a = _outcome(lambda x_req=x_req, p_req=p_req: _ctx_run(eager, x, ctx, layout, x_req, p_req))
        b = _outcome(lambda x_req=x_req, p_req=p_req: _ctx_run(ours, x, ctx, layout, x_req, p_req))
        if isinstance(a, type) or isinstance(b, type):
            assert a == b, (x_req, p_req, a, b)
            continue
        assert len(a) == len(b)
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, MODULES[name][2], (x_req, p_req, i))


def _alias_run(mod, shape, case):
    for p in mod.parameters():
        p.grad = None
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    g = torch.randn(mod(x).shape, generator=torch.Generator().manual_seed(2))
    kept = g.clone()
    if case == "kept":  # the caller keeps its gradient: it must not be written over
        mod(x * 1).backward(g)
    elif case == "same_tensor_twice":
        torch.autograd.backward([mod(x * 1), mod(x * 2)], [g, g])
    elif case == "views_of_one_buffer":
        big = torch.cat([g, g], 0)
        kept = big.clone()
        n = g.shape[0]
        torch.autograd.backward([mod(x * 1), mod(x * 2)], [big[:n], big[n:]])
        g = big
    elif case == "retain_graph_twice":
        y = mod(x * 1)
        y.backward(g, retain_graph=True)
        y.backward(g)
    return torch.equal(g, kept), [x.grad] + [p.grad for p in mod.parameters()]


@pytest.mark.parametrize(
    "case", ["kept", "same_tensor_twice", "views_of_one_buffer", "retain_graph_twice"]
)
@pytest.mark.parametrize("name", list(MODULES))
def test_aliasing_incoming_gradients(name, case):
    eager, ours = _pair(name)
    _assert_converted(ours)
    shape = MODULES[name][1]
    intact_e, ge = _alias_run(eager, shape, case)
    intact_o, go = _alias_run(ours, shape, case)
    assert intact_e and intact_o, "an incoming gradient the caller holds was written over"
    for i, (u, v) in enumerate(zip(ge, go)):
        _same(u, v, MODULES[name][2], (case, i))


HOOKS = ["tensor_hook", "retain_grad", "node_prehook", "multi_grad_hook", "input_hook"]


def _hook_run(mod, shape, case):
    kept = []
    for p in mod.parameters():
        p.grad = None
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    h = x * 1.5
    y = mod(h)
    z = y * 1.0
    if case == "tensor_hook":
        z.register_hook(kept.append)
    elif case == "retain_grad":
        z.retain_grad()
    elif case == "node_prehook":
        y.grad_fn.register_prehook(lambda gs: kept.append(gs[0]))
    elif case == "multi_grad_hook":
        torch.autograd.graph.register_multi_grad_hook([z], lambda gs: kept.append(gs[0]))
    elif case == "input_hook":
        h.register_hook(kept.append)
    (z * _weight(z.shape)).sum().backward()
    if case == "retain_grad":
        kept.append(z.grad)
    return kept, [x.grad] + [p.grad for p in mod.parameters()]


@pytest.mark.parametrize("case", HOOKS)
@pytest.mark.parametrize("name", list(MODULES))
def test_hooks_that_keep_gradients(name, case):
    # a gradient a hook keeps is never the buffer a later backward writes dx into
    eager, ours = _pair(name)
    _assert_converted(ours)
    shape = MODULES[name][1]
    ke, ge = _hook_run(eager, shape, case)
    ko, go = _hook_run(ours, shape, case)
    assert len(ke) == len(ko) == 1
    _same(ke[0], ko[0], MODULES[name][2], (case, "kept"))
    for i, (u, v) in enumerate(zip(ge, go)):
        _same(u, v, MODULES[name][2], (case, i))


@pytest.mark.parametrize("name", list(MODULES))
def test_full_backward_hook_on_module(name):
    eager, ours = _pair(name)
    _assert_converted(ours)
    x = torch.randn(MODULES[name][1], generator=torch.Generator().manual_seed(3))
    seen = []
    for mod in (eager, ours):
        kept = []
        handle = mod[0].register_full_backward_hook(
            lambda m, gi, go, k=kept: k.append((go[0], gi[0]))
        )
        seen.append((_outcome(lambda mod=mod: _post_run(mod, x)), kept))
        handle.remove()
    (a, ka), (b, kb) = seen
    if isinstance(a, type) or isinstance(b, type):  # eager's elu_ after its hook: view error
        assert a == b
        return
    for i, (u, v) in enumerate(zip(a, b)):
        _same(u, v, MODULES[name][2], i)
    assert len(ka) == len(kb) == 1
    assert torch.equal(ka[0][0], kb[0][0])
    _same(ka[0][1], kb[0][1], MODULES[name][2], "grad_input")


@pytest.mark.parametrize("name", list(MODULES))
def test_torch_func_transforms(name):
    eager, ours = _pair(name)
    _assert_converted(ours)
    x = torch.randn(MODULES[name][1], generator=torch.Generator().manual_seed(4))
    results = []
    for mod in (eager, ours):
        params = {k: v.detach() for k, v in mod.named_parameters()}

        def loss(p, xx, mod=mod):
            return torch.func.functional_call(mod, p, (xx,)).pow(2).sum()

        g = torch.func.grad(loss, argnums=(0, 1))(params, x)

        def per_sample(xx, mod=mod, p=params):
            return torch.func.functional_call(mod, p, (xx,))

        # vmap drops the batch dim: GroupNorm then sees (C, L), which eager refuses too
        v = _outcome(lambda f=per_sample: torch.func.vmap(f)(x))
        vg = _outcome(
            lambda f=loss, p=params: torch.func.vmap(
                torch.func.grad(f, argnums=1), in_dims=(None, 0)
            )(p, x)
        )
        results.append([*g[0].values(), g[1], v, vg])
    for i, (u, v) in enumerate(zip(*results)):
        if isinstance(u, type) or isinstance(v, type):
            assert u == v, (name, i, u, v)
        else:
            assert torch.equal(u, v), (name, i)


def _t(*shape):
    gen = torch.Generator().manual_seed(sum(shape))
    return torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()


GRADCHECKS = {
    "linear-3d": (lambda x, w, b: sops.linear(x, w, b), lambda: (_t(2, 3, 4), _t(5, 4), _t(5))),
    "linear-4d-nobias": (lambda x, w: sops.linear(x, w), lambda: (_t(2, 1, 3, 4), _t(5, 4))),
    "linear-3d-transposed": (
        lambda x, w, b: sops.linear(x.transpose(0, 1), w, b),
        lambda: (_t(2, 3, 4), _t(5, 4), _t(5)),
    ),
    "conv1d_addmm-3d": (
        lambda x, w, b: sops.conv1d_addmm(x, w, b),
        lambda: (_t(2, 3, 4), _t(4, 5), _t(5)),
    ),
    "elu-inplace": (lambda x: sops.elu(x * 1, 1.3, inplace=True), lambda: (_t(3, 7),)),
    "layer_norm": (
        lambda x, w, b: sops.layer_norm(x, (5,), w, b),
        lambda: (_t(2, 1, 5), _t(5), _t(5)),
    ),
    "group_norm": (
        lambda x, w, b: sops.group_norm(x, 3, w, b),
        lambda: (_t(2, 6, 5), _t(6), _t(6)),
    ),
    "group_norm-lean": (
        lambda x, w, b: sops.group_norm(x, 1, w, b),  # the output-keeping path (_lean)
        lambda: (_t(2, 1, 32), _t(1), _t(1)),
    ),
    "scores_sdm-4d": (
        lambda q, k, v: sops.scores_softmax_dropout_matmul(q, k, v, 0.0),
        lambda: (_t(1, 2, 3, 4), _t(1, 2, 4, 3), _t(1, 2, 3, 2)),
    ),
}


@pytest.mark.parametrize("name", list(GRADCHECKS))
def test_gradcheck_and_gradgradcheck_float64(name):
    fn, inputs = GRADCHECKS[name]
    assert gradcheck(fn, inputs(), check_undefined_grad=True, fast_mode=True)
    if name != "scores_sdm-4d":  # first order only (it says so)
        assert gradgradcheck(fn, inputs(), fast_mode=True)


def test_rms_norm_second_derivatives_are_eagers():
    # keeps y: x rebuilt and bridged (NOTE [RMSNorm's second derivatives through its own node])
    x, w = _t(3, 4, 6), _t(6)
    assert gradgradcheck(lambda a, b: sops.rms_norm(a, (6,), b), (x, w))


PEAK_CASES = {
    "LayerNorm": (lambda: nn.LayerNorm(64), (40, 64)),
    "LayerNorm-4d": (lambda: nn.LayerNorm(16), (2, 3, 5, 16)),
    "RMSNorm": (lambda: nn.RMSNorm(64), (40, 64)),
    "GroupNorm": (lambda: nn.GroupNorm(4, 16), (4, 16, 64)),
    "GroupNorm-odd": (lambda: nn.GroupNorm(3, 9), (2, 9, 7, 5)),
    "ELU-inplace": (lambda: nn.Sequential(nn.Linear(64, 64), nn.ELU(inplace=True)), (40, 64)),
    "Linear-3d": (lambda: nn.Linear(64, 48), (4, 10, 64)),
    "Linear-4d-nobias": (lambda: nn.Linear(16, 8, bias=False), (2, 3, 5, 16)),
}


@pytest.mark.parametrize("grad", ["contiguous", "transposed", "expanded", "residual", "chlast"])
@pytest.mark.parametrize("name", list(PEAK_CASES))
def test_saved_and_peak_never_above_eager(name, grad):
    mk, shape = PEAK_CASES[name]
    torch.manual_seed(0)
    eager = nn.Sequential(mk(), Scale())
    ours = copy.deepcopy(eager)
    slimgrad.convert_(ours)
    _assert_converted(ours)
    if grad == "chlast" and len(shape) != 4:
        pytest.skip("channels_last needs 4 dims")
    out = []
    for mod in (eager, ours):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).requires_grad_()
        g = torch.randn(mod(x).shape, generator=torch.Generator().manual_seed(6))
        if grad == "transposed":
            g = g.transpose(0, 1).contiguous().transpose(0, 1)
        elif grad == "chlast":
            g = g.contiguous(memory_format=torch.channels_last)

        def step(mod=mod, x=x, g=g):
            y = mod(x * 1)
            if grad == "expanded":
                return y.sum()
            if grad == "residual" and y.shape == x.shape:
                return ((y + x) * g).sum()
            return (y * g).sum()

        step().backward()  # first-call caches out of the measured step
        out.append(measure(step, timeline=False))
    me, mo = out
    assert mo.saved_bytes <= me.saved_bytes, (mo.saved_bytes, me.saved_bytes)
    assert mo.peak_bytes <= me.peak_bytes, (mo.peak_bytes, me.peak_bytes)


ELU_KINDS = ["plain", "saved_then", "view", "strided_view", "twice", "after_modify", "hook"]


def _elu_case(fn, kind, n):
    a = torch.randn(n, generator=torch.Generator().manual_seed(n)).requires_grad_()
    w = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    h = a * 1
    if kind == "plain":
        y = fn(h)
    elif kind == "saved_then":  # h saved by a product, then written in place: version error
        s = h * w
        y = fn(h) + s
    elif kind == "view":
        fn(h[n // 4 : n // 2])
        y = h
    elif kind == "strided_view":
        fn(h.view(-1, 10)[:, ::2])
        y = h
    elif kind == "twice":
        y = fn(fn(h))
    elif kind == "after_modify":  # y kept by elu_'s backward, then written: version error
        y = fn(h)
        y.mul_(2)
    else:
        y = fn(h)
        y.register_hook(lambda g: g * 2)
    (y * w).sum().backward(retain_graph=True)
    (y * w).sum().backward()
    return a.grad


@pytest.mark.parametrize("n", [300, 700])
@pytest.mark.parametrize("alpha", [1.0, 0.3, 2.5])
@pytest.mark.parametrize("kind", ELU_KINDS)
def test_elu_inplace_against_eager_elu_(kind, alpha, n):
    e = _outcome(lambda: _elu_case(lambda t: F.elu(t, alpha, inplace=True), kind, n))
    s = _outcome(lambda: _elu_case(lambda t: sops.elu(t, alpha, inplace=True), kind, n))
    if isinstance(e, type) or isinstance(s, type):
        assert e == s
    else:
        assert torch.equal(e, s)


# GroupNorm's C backward against its PyTorch path (the same bits, NOTE in ops/group_norm.py)
GN_SHAPES = [((3, 6, 10), 2), ((2, 15, 7), 5), ((4, 8, 3, 3), 4), ((2, 12, 2), 3)]
GN_SHAPES += [((1, 32, 17), 1), ((2, 64, 3), 32), ((2, 6, 4), 6)]


def _gn_state(shape, g, wk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, c = shape[0], shape[1]
    hw = torch.Size(shape[2:]).numel()
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    w, b = torch.randn(c, generator=gen), torch.randn(c, generator=gen)
    dy = torch.randn(shape, generator=gen)
    if wk == "zero":
        w[::2] = 0
    elif wk == "inf":
        w[0] = float("inf")
    elif wk == "inf_nan_b":  # gamma -inf in one group, beta inf and nan elsewhere
        w[-1] = -float("inf")
        b[0], b[c // 2] = float("inf"), float("nan")
    if wk in ("no_weight", "none"):
        w = None
    if wk in ("no_bias", "none"):
        b = None
    y, mean, rstd = torch.native_group_norm(x, w, b, n, c, hw, g, 1e-5)
    if w is None and b is None:
        idx = torch.empty(0, dtype=torch.int64)
    else:
        idx = GN._fallback_channels(w, b, y.dtype, g)
    xside = x.reshape(n, c, hw).index_select(1, idx) if idx.shape[0] else x.new_empty((n, 0, hw))
    return dy, y, mean, rstd, idx, xside, w, b


MASKS = [[True, True, True], [True, False, False], [False, True, True]]


def _same_values(u, v):
    # the same values, NaN where the other has NaN (a NaN's sign and payload aside)
    return torch.equal(u.isnan(), v.isnan()) and torch.equal(u.nan_to_num(0.0), v.nan_to_num(0.0))


@pytest.mark.parametrize("wk", ["zero", "no_bias", "none", "inf", "inf_nan_b"])
@pytest.mark.parametrize("shape,g", GN_SHAPES)
def test_group_norm_c_backward_is_the_pytorch_paths_bits(shape, g, wk):
    if GN._backend.use_cpu(torch.empty(1), "group_norm") is None:
        pytest.skip("no C compiler: the PyTorch path runs")
    dy, y, mean, rstd, idx, xside, w, b = _gn_state(shape, g, wk)
    for mask in MASKS:
        for dyk in ("contiguous", "transposed", "expanded", "granted"):
            d = {
                "transposed": dy.transpose(0, 1).contiguous().transpose(0, 1),
                "expanded": dy[:1].expand(shape),
            }.get(dyk, dy)
            if dyk == "granted" and not mask[0]:
                continue
            d1, d2 = d.clone(), d.clone()
            args = (y, mean, rstd, idx, xside, w, b, g, mask)
            c = GN._bwd_cpu(d1, *args, out=d1 if dyk == "granted" else None)
            t = GN._bwd_torch(d2, *args, out=d2 if dyk == "granted" else None)
            for i, (u, v) in enumerate(zip(c, t)):
                if mask[i] and (i == 0 or (w, b)[i - 1] is not None):
                    assert _same_values(u, v), (mask, dyk, i)


def test_group_norm_c_backward_bits_independent_of_threads():
    if GN._backend.use_cpu(torch.empty(1), "group_norm") is None:
        pytest.skip("no C compiler: the PyTorch path runs")
    n0 = torch.get_num_threads()
    try:
        for shape, g in [((16, 32, 9), 8), ((7, 12, 64), 3)]:
            dy, *rest = _gn_state(shape, g, "zero")
            res = []
            for t in (1, 2, 3, 8):
                torch.set_num_threads(t)
                for granted in (False, True):
                    d = dy.clone()
                    res.append(GN._bwd_cpu(d, *rest, g, [True] * 3, out=d if granted else None))
            for r in res[1:]:
                assert all(torch.equal(u, v) for u, v in zip(res[0], r)), shape
    finally:
        torch.set_num_threads(n0)


def _gn_run(fn, x, g, w, b, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fn(x, g, w, b, 1e-5)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad, b.grad]


def _gn_inputs(shape, kind):
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    w, b = torch.randn(shape[1], generator=gen), torch.randn(shape[1], generator=gen)
    if kind == "huge":
        x = x * 1e18
    elif kind == "nan_x":
        x.view(-1)[3] = float("nan")
    elif kind == "inf_x":
        x.view(-1)[5] = float("inf")
    elif kind == "nan_dy":
        dy.view(-1)[2] = float("nan")
    elif kind == "nan_w":
        w[1] = float("nan")
    elif kind == "inf_w":
        w[0] = float("inf")
    elif kind == "inf_w2":  # two infinite gammas of opposite signs in one group
        w[1], w[2] = -float("inf"), float("inf")
    elif kind == "inf_b":
        b[1] = float("inf")
    elif kind == "nan_b":
        b[1] = float("nan")
    return x, w, b, dy


GN_KINDS = ["huge", "nan_x", "inf_x", "nan_dy", "nan_w", "inf_w", "inf_w2", "inf_b", "nan_b"]


# NOTE [GroupNorm with a non-finite gamma] (ops/group_norm.py): an inf gamma or an inf/NaN beta
# gave dx another NaN/inf pattern than eager's, NaN for every finite value of a non-finite beta's
# channel ((3, 6, 10) groups 2, w[0] = inf: 65 NaN/25 inf against eager's 59/31; b[1] = inf: 30
# NaN against none)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", GN_KINDS)
@pytest.mark.parametrize("shape,g", GN_SHAPES[:5] + [((5, 12, 64), 3)])
def test_group_norm_nonfinite_pattern_as_eager(shape, g, kind, dtype):
    x, w, b, dy = (t.to(dtype) for t in _gn_inputs(shape, kind))
    ours = _gn_run(sops.group_norm, x, g, w, b, dy)
    eager = _gn_run(F.group_norm, x, g, w, b, dy)
    for i, (u, v) in enumerate(zip(ours, eager)):
        assert torch.equal(u.isnan(), v.isnan()) and torch.equal(u.isposinf(), v.isposinf()), i
        assert torch.equal(u.isneginf(), v.isneginf()), i


# an inf weight entry gave dx another NaN/inf pattern in the C backward than in the PyTorch path:
# (3, 6, 10) groups 2, w[0] = inf: 85 NaN in C, 90 in _bwd_torch (before NOTE [GroupNorm with a
# non-finite gamma])
def test_group_norm_c_backward_inf_weight_as_pytorch_path():
    if GN._backend.use_cpu(torch.empty(1), "group_norm") is None:
        pytest.skip("no C compiler: the PyTorch path runs")
    dy, y, mean, rstd, idx, xside, w, b = _gn_state((3, 6, 10), 2, "inf")
    args = (y, mean, rstd, idx, xside, w, b, 2, [True] * 3)
    c, t = GN._bwd_cpu(dy, *args), GN._bwd_torch(dy.clone(), *args)
    counts = (c[0].isnan().sum().item(), t[0].isnan().sum().item())
    assert torch.equal(c[0].isnan(), t[0].isnan()), counts
    assert torch.equal(c[0].isinf(), t[0].isinf()), counts


# an inf weight entry gave dx another NaN/inf pattern than eager's: (3, 6, 10) groups 2, 65 NaN/25
# inf against eager's 59 NaN/31 inf (before NOTE [GroupNorm with a non-finite gamma])
def test_group_norm_inf_weight_pattern_as_eager():
    x, w, b, dy = _gn_inputs((3, 6, 10), "inf_w")
    ours = _gn_run(sops.group_norm, x, 2, w, b, dy)
    eager = _gn_run(F.group_norm, x, 2, w, b, dy)
    counts = [(t.isnan().sum().item(), t.isinf().sum().item()) for t in (ours[1], eager[1])]
    assert torch.equal(ours[1].isnan(), eager[1].isnan()), counts
    assert torch.equal(ours[1].isinf(), eager[1].isinf()), counts


# was a finding, before round 17 as well: an inf weight entry gave dx another NaN/inf pattern
# than eager's F.layer_norm: (3, 5, 16) 141 NaN/99 inf against eager's 222 NaN/18 inf (NOTE
# [LayerNorm with a non-finite gamma] in slimgrad/_math/norms.py)
def test_layer_norm_inf_weight_pattern_as_eager():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 5, 16, generator=gen) * 3 + 1
    w, b = 1 + 0.5 * torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    w[1] = float("inf")
    g = torch.randn(3, 5, 16, generator=gen)
    grads = []
    for fn in (sops.layer_norm, F.layer_norm):
        xx = x.clone().requires_grad_()
        fn(xx, (16,), w, b).backward(g)
        grads.append(xx.grad)
    counts = [(t.isnan().sum().item(), t.isinf().sum().item()) for t in grads]
    assert torch.equal(grads[0].isnan(), grads[1].isnan()), counts
    assert torch.equal(grads[0].isinf(), grads[1].isinf()), counts


# x (2, 3, 4, 8), weight (8) with every other entry 0, bias (8), the gradient (2, 3, 4, 8): the
# float32 values of a probe's case (global seed 0) that left the error rule
_LN_CASE = (
    "lZEAQOtr9T/fhoHAQIYTv7pELEAU+us/WDJ5v/fNg0AMy48/AQ9qQG6huUCWXwPAfFc9QAij2UBvLTpAZpsuwGDXmEDQ"
    "oQnAKfRkP0gSqT7aVKxAgERgPWAaMT5vAhM/Ius0v7IcGEGMOMVAoLNpQIjRz76+JU9AIFMvvnIekj5oN29AQs/kP8LK"
    "0EA5KY9AQAy4vYHVDMEOGlxApHy9vnuyGkAQK5a+ZI1Lv7yz5j+yalvArP2bP9ZTuT/sEfM/WzkIwP8YwUAuA2jAr3dq"
    "QObF0ECUlFVAyK1fPwhiScBkjoHA2KJ0QKo/GEBEjFfA1BZkwN5tHUAl0fo/PvWiwDXQhcAQq5ZAnoRnQDRDp8DMCm8/"
    "UnkEwJHroUCVxzxA9dfFQELOCEDCAhJAfNZKwBhUp74wlwe/luxeP2C/iMDoGfy/0D4vvvhFJkCwwze/KlfOv3/a9D/x"
    "0S4/htD6v7gMO0Bo2lC/iKWNPq5+HEBjK1Q/xi8RQIXxxD+yFLHAHyBfQOgSWL/aSPU/XIdIv0igwj4EnhlAlmuXv1ax"
    "J8CjlU4/dnFlwBZcJkDIN/w/i2c+QNKE479U+wtA6VepQOZslT+cTjJAZY8RP6Tn0UD7Fe0/aNcCQa41lz8JZqZABW3A"
    "PwX8bUCkv8q+exuvwDoTkkCiTZTALVNcQJS22kATt7lAmglUQHSQ5EDeuyRAYPzBv1QvK8ChEm9ALd0DPynF4D9qMeA/"
    "zKVwwBBPi78M4fdA4BfKvjhFd791WDjAoAFQQCyuGUCuczZA7LTTPw7RTb/GmxtAMslEQM70jr9I5xe/2GdvwMCnej8e"
    "HPo+u6dlP5F+kkBZU7tA6qDov/qDJsCel0w/sGp2QAzhpT8M7Jq/4BEPPrQeLb8iwMjAfA0VQFgdqT7YlWVAfnyPQM41"
    "TkCCt3BAafOOQNwntz8wIfC+oPaaP1Sew0C4t5M+oO8LQKaLncDgI4I+GqR+wC5PCr/gWnHAZT0bQManDMCQ0OQ/hpKO"
    "v2a4i7814so/AAAAAPimoj8AAAAAxuOkPgAAAACiB9c/AAAAAK4EED9Cbma/a7Qzv9D3Yj8DsNe/z2Onvwp7nz8+Ta2/"
    "aH18v3/YOT5q8Gm+snuoP8mpJD7p31i/LwGHP0sseD/y4kq/lMN/vndh0T2un/e+6jHmPyaqWr6NGCY+T32wP6yZZz/G"
    "/jY+3LH8PMydBz6xswC/mIk4PiKZAz+XiUk+5QuXPJD5pL8UELG/E56Yv6rRZr8TwoE+lD4PvlfduL8Nmlu/eOH3v/39"
    "uD934UA/yxqxvv8IQz5x6N2/RD8JQLHboD5Xr0+/QFoNwOKTU78iBsy+7tZ9vwZABb+GoWA/gczKvggJNj9U+2Q/uFpo"
    "v0KP6z5u4kO/Q+7BvVjmdz9ukt+/q6mKPkgUzbweTLa9zDp0PGGMGD9dt9E85KQpPM/LcT6tyr4/mPqtviVsYr2WHh8+"
    "jRDwPrAdLL+E10u+3X42vguZK78qZIw+jXGLPxbzIz9fy7o+kyEWv67Lyj96Up6/TFgHPicBgD8ejHQ+IFrgPTwFF8DN"
    "r+C/slA1P9METL82BDA/Ss0Ev8SOjj/Ymwu/fDmpPqQ6gj+sQVm+8E0RPU6m3r3OvGy+NIxtv7aDm71B8SM/mT7Pvj65"
    "6j9FuG4+EnqQP++kQ0D/oZq/o1yJvkdEPr9rDru/UdapP5RkJL9BiH+/TXnSv4uW3L5Kej87BekLv7hchT/s6wFAny6k"
    "PrIfC78MliK//6E9vp8OhL84SbQ+qhSUv/pPmj6zOOO/2QekvrawH7+FqeM95j/0vvU9dr9Daro/DmXSPgDYQ76iHg0+"
    "BqmzP7kr4L2rnRi+RBgePyLiIb5Bn26/m6xwPTUBPz/PCx4/uqoAvntEQj/SbFO/QK8WPqZqWz/EfZE/YP1bv2CCYL/b"
    "HZC/CyQGP57GC77OStO/Mg4nPuU84D59WsE/ZrKLP0xpQ7+1EgFA0tYbv2UKlTsNleA/puQGvwUlej9ni8U99vxjPkeV"
    "dD9looy/QnsCvapJEj6o7FA/IqzOvl2bGT+llcM8FjeoP3x6Az92Eb+/SOHXv/8YDD+7LOY+NVUgvzweLL4j0jS/PVd/"
    "vy6/gj6g77i/HbyCvw=="
)


def _ln_case():
    v = torch.frombuffer(bytearray(base64.b64decode(_LN_CASE)), dtype=torch.float32)
    x, w, b, g = torch.split(v, [192, 8, 8, 192])
    return x.view(2, 3, 4, 8), w.clone(), b.clone(), g.reshape(2, 3, 4, 8)


# was a finding, before round 17 as well: dgamma outside the error rule with 2 intra-op threads:
# LayerNorm(8) on (2, 3, 4, 8), a weight with zero entries, err 2.066e-06 against bound 1.952e-06
# (1.06x; 1.883e-06 at 4 threads, 2.420e-06 at 1; ours the same at each). Not the reduction
# order: all of it was channel 7 (gamma 0.563, beta -0.986, rebuilt from y), 1.48e-06 from the
# rebuild and the rest from rounding dy * xhat to float32 before the float64 sum; the PyTorch
# path (fallback channels) now forms those products in float64 (exact): 1.589e-06 at 1, 2 and 4
# threads (0.81 of the bound at 2)
def test_layer_norm_zero_weight_grad_within_rule():
    x, w, b, g = _ln_case()

    def run(fn, dt):
        xx, ww, bb = (t.detach().to(dt).clone().requires_grad_() for t in (x, w, b))
        fn(xx, (8,), ww, bb).backward(g.to(dt))
        return ww.grad

    n0 = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ok, err, bound = rule_ok(
            run(sops.layer_norm, torch.float32),
            run(F.layer_norm, torch.float64),
            run(F.layer_norm, torch.float32),
        )
    finally:
        torch.set_num_threads(n0)
    assert ok, (err, bound)


def test_scores_sdm_3d_output_takes_inplace_write():
    q, kt, v = (torch.randn(s, generator=torch.Generator().manual_seed(9)) for s in [(3, 5, 4)] * 3)
    kt = kt.transpose(1, 2).contiguous()
    grads = []
    for fn in (
        lambda a, b, c: sops.scores_softmax_dropout_matmul(a, b, c, 0.0),
        lambda a, b, c: torch.softmax(a @ b, -1) @ c,
    ):
        a, b, c = (t.clone().requires_grad_() for t in (q, kt, v))
        out = fn(a, b, c)
        out.mul_(2)
        (out * _weight(out.shape)).sum().backward()
        grads.append([a.grad, b.grad, c.grad])
    for u, w in zip(*grads):
        assert torch.equal(u, w)


# was a finding (ops/softmax_dropout.py, NOTE [Attention matmuls as bmm], 7d13e41): the 4-D
# product returned as a view of bmm's result made inside the Function, so an in-place write on the
# attention output raised "Output 0 of _ScoresSoftmaxDropoutMatmulFn is a view and is being
# modified inplace" where eager trains (NOTE [Function outputs are not views] in ops/linear.py)
def test_scores_sdm_4d_output_takes_inplace_write():
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(2, 3, 5, 4, generator=gen, requires_grad=True)
    kt = torch.randn(2, 3, 4, 5, generator=gen, requires_grad=True)
    v = torch.randn(2, 3, 5, 4, generator=gen, requires_grad=True)
    out = sops.scores_softmax_dropout_matmul(q, kt, v, 0.0)
    out.mul_(2)
    out.sum().backward()
    qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, kt, v))
    oe = torch.softmax(qe @ ke, -1) @ ve
    oe.mul_(2)
    oe.sum().backward()
    for a, b in ((q, qe), (kt, ke), (v, ve)):
        assert torch.equal(a.grad, b.grad)


def test_scores_sdm_4d_bits_as_eager():
    gen = torch.Generator().manual_seed(11)
    shapes = [(2, 3, 5, 4), (2, 3, 4, 5), (2, 3, 5, 4)]
    base = [torch.randn(s, generator=gen) for s in shapes]
    # a transposed key (the HF layout) and a non-contiguous value
    base[1] = torch.randn(2, 3, 5, 4, generator=gen).transpose(-1, -2)
    base[2] = torch.randn(2, 5, 3, 4, generator=gen).transpose(1, 2)
    res = []
    for fn in (
        lambda a, b, c: sops.scores_softmax_dropout_matmul(a, b, c, 0.0),
        lambda a, b, c: torch.softmax(a @ b, -1) @ c,
    ):
        ins = [t.detach().clone().requires_grad_() for t in base]
        out = fn(*ins)
        (out * _weight(out.shape)).sum().backward()
        res.append([out.detach()] + [t.grad for t in ins])
    for u, w in zip(*res):
        assert torch.equal(u, w)


# (was a finding, issue 30, never more than eager: without bias, relu_ on the converted Linear's
# N-D output peaked above eager's: (4, 10, 64) 48,648 B against 40,968, (2, 3, 5, 64) 36,488
# against 33,416; NOTE [Linear's N-D output without bias] in slimgrad/ops/linear.py)
@pytest.mark.parametrize(
    "bias,shape,post",
    [
        (bias, shape, post)
        for bias in (False, True)
        for shape in [(4, 10, 64), (2, 3, 5, 64)]
        for post in ("relu_", "mul_")
    ],
)
def test_linear_nd_inplace_after_bytes_as_eager(bias, shape, post):
    # the N-D output is a view of the 2-D product (eager's is an _unsafe_view without bias): an
    # in-place write on it costs eager's bytes
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 48, bias=bias))  # convert_ converts children only
    ours = copy.deepcopy(eager)
    slimgrad.convert_(ours)
    _assert_converted(ours)
    out = []
    for mod in (eager, ours):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(12)).requires_grad_()

        def step(mod=mod, x=x):
            y = mod(x * 1)
            return (y.relu_() if post == "relu_" else y.mul_(2.0)).pow(2).sum()

        step().backward()
        out.append(measure(step, timeline=False))
    me, mo = out
    assert (mo.saved_bytes, mo.peak_bytes) == (me.saved_bytes, me.peak_bytes)

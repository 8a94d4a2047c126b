"""A gradient penalty (WGAN-GP / R1: ``autograd.grad(..., create_graph=True)``, then backward)
through a converted critic, one row per converted module type, at a few-element size (<= 512
elements at the op) and above it: every gradient within the error rule of eager's float64 result
(NOTE [Second derivatives] in slimgrad/_autograd.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from slimgrad.testing import assert_within_rule


class _LlamaRMSNorm(nn.Module):
    # transformers' LlamaRMSNorm forward (importing transformers would cost this file ~10 s; the
    # conversion of the real class is tests/test_convert_hf_rms_norm.py's)
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def _hf_converted(mod):
    from slimgrad.nn.rms_norm import HFRMSNorm

    out = HFRMSNorm(mod.weight.shape[0], eps=mod.variance_epsilon, variant="llama")
    out.weight = mod.weight
    return out


# name -> (module factory over the feature size d, converted class name)
MODS = {
    "rms_norm": (lambda d: nn.RMSNorm(d), "RMSNorm"),
    "rms_norm_no_affine": (lambda d: nn.RMSNorm(d, elementwise_affine=False), "RMSNorm"),
    "hf_rms_norm": (lambda d: _LlamaRMSNorm(d), "HFRMSNorm"),
    "layer_norm": (lambda d: nn.LayerNorm(d), "LayerNorm"),
    "group_norm": (lambda d: nn.GroupNorm(4, d), "GroupNorm"),
    "batch_norm": (lambda d: nn.BatchNorm1d(d), "BatchNorm1d"),
    "elu": (lambda d: nn.ELU(), "ELU"),
    "gelu": (lambda d: nn.GELU(), "GELU"),
    "gelu_tanh": (lambda d: nn.GELU("tanh"), "GELU"),
    "silu": (lambda d: nn.SiLU(), "SiLU"),
    "mish": (lambda d: nn.Mish(), "Mish"),
    "linear": (lambda d: nn.Linear(d, d), "Linear"),
}

# (rows, features): 512 elements at the op (the few-elements path) and 1,536 (past it)
SIZES = [(32, 16), (48, 32)]


def _critic(name, d):
    torch.manual_seed(0)
    mod = MODS[name][0](d)
    with torch.no_grad():  # weights away from 1 and 0, so that gamma's role is exercised
        for p in mod.parameters():
            if p.dim() == 1 and name != "linear":
                p.uniform_(0.5, 1.5)
    return nn.Sequential(nn.Linear(d, d), mod, nn.Linear(d, 1))


def _penalty_grads(model, x0):
    x = x0.to(next(model.parameters()).dtype).requires_grad_()
    (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    penalty = ((gx.flatten(1).norm(dim=1) - 1) ** 2).mean()
    inputs = [x, *model.parameters()]
    grads = torch.autograd.grad(penalty, inputs, allow_unused=True, materialize_grads=True)
    return list(grads)


# Past the few-elements path the smooth activations keep y + branch bits + a table, which give f'
# but not f'': differentiating their gradient raises slimgrad's error (NOTE [Second derivatives]).
# Where more than 1/16 of the elements are hard they keep x densely and give eager's f''; which
# happens depends on the float32 bits of eager's forward, so on the CPU's kernels (erf GELU at
# 48x32: x on an AVX2 CPU, y + 520 B on an AVX-512 one): the row reads what the op kept
_SMOOTH = {"gelu", "gelu_tanh", "silu", "mish"}
ROWS = [
    pytest.param(name, shape, 1.0, id=f"{name}-{shape[0]}x{shape[1]}")
    for name in MODS
    for shape in SIZES
]
# inputs 16x wider: most of the op's elements deep in the tails, hard on any CPU: past 1/16 hard
# the op keeps x, and its second derivatives are eager's (the rows above may all refuse)
ROWS += [pytest.param(name, (48, 32), 16.0, id=f"{name}-48x32-wide") for name in sorted(_SMOOTH)]


def _keeps_y(slim, x0) -> bool:
    # the smooth op's node keeps less than x: y (the next Linear's) + side information
    by_node = measure(lambda: slim(x0.float().requires_grad_()).sum(), timeline=False).by_node
    (kept,) = [v for k, v in by_node.items() if k.endswith("FnBackward")]
    return kept < x0.numel() * 4


@pytest.mark.parametrize("name,shape,scale", ROWS)
def test_gradient_penalty_matches_eager(name, shape, scale):
    n, d = shape
    eager = _critic(name, d)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    if name == "hf_rms_norm":
        from slimgrad import _ext

        _ext.load()  # the C++ node where the extension builds (else the Python Function)
        slim[1] = _hf_converted(slim[1])
    x0 = scale * torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # a first call resolves the kernel backend: the second takes the straight path (for the
    # Llama RMSNorm with slimgrad's C++ extension, its C++ node)
    slim(x0.float().requires_grad_())
    assert type(slim[1]).__module__.startswith("slimgrad."), type(slim[1])
    assert type(slim[1]).__name__ == MODS[name][1]
    if scale != 1.0:
        assert not _keeps_y(slim, x0)  # the dense fallback: x kept
    elif name in _SMOOTH and n * d > 512 and _keeps_y(slim, x0):
        with pytest.raises(RuntimeError, match=r"second derivative through this op"):
            _penalty_grads(slim, x0)
        return
    ref64 = _penalty_grads(copy.deepcopy(eager).double(), x0)
    eager32 = _penalty_grads(eager, x0)
    out = _penalty_grads(slim, x0)
    names = ["x"] + [k for k, _ in eager.named_parameters()]
    assert_within_rule(out, ref64, eager32, names=names)


# NOTE [A second-order pass's gradient handed to its node] in slimgrad/ops/layer_norm.py: passes
# over one graph at once, a pass that ends before the node, a pass that raises. One row per node
# whose double bridges to its own output: LayerNorm's and RMSNorm's Python Functions and the HF
# Llama RMSNorm (the C++ node where the extension builds, else the same Python Function); and, for
# passes at once, BatchNorm past the few-elements path, whose bridge hands its gradient to an
# anchor on x.
HANDOFF = ["layer_norm", "rms_norm", "hf_rms_norm"]


def _handoff_critic(name, d=16, n=8):
    from slimgrad import _ext
    from slimgrad.ops.layer_norm import layer_norm
    from slimgrad.ops.rms_norm import hf_rms_norm, rms_norm

    torch.manual_seed(0)
    w = nn.Parameter(torch.rand(d) + 0.5)
    norm = {
        "layer_norm": lambda h: layer_norm(h, (d,), w, None, 1e-5),
        "rms_norm": lambda h: rms_norm(h, (d,), w, 1e-6),
        "hf_rms_norm": lambda h: hf_rms_norm(h, w, 1e-6, "llama"),
        "batch_norm": slimgrad.convert_(nn.Sequential(nn.BatchNorm1d(d)))[0],
    }[name]
    first, last = nn.Linear(d, d), nn.Linear(d, 1)
    if name == "hf_rms_norm":
        _ext.load()
    x = torch.randn(n, d, requires_grad=True)
    norm(first(x))  # resolves the kernel backend: the next call takes the straight path
    y = norm(first(x))
    node = {"hf_rms_norm": "HFRMSNormNode" if _ext.available() else "_HF", "batch_norm": "_Batch"}
    assert node.get(name, "_") in y.grad_fn.name(), y.grad_fn.name()
    (gx,) = torch.autograd.grad(last(torch.tanh(y)).sum(), x, create_graph=True)
    own = list(norm.parameters()) if isinstance(norm, nn.Module) else [w]
    return x, y, gx, [*own, *first.parameters(), *last.parameters()], norm


def _penalty(x, gx, params, s=1.0):
    p = (((gx * s).norm(dim=1) - 1) ** 2).mean()
    return torch.autograd.grad(p, [x, *params], retain_graph=True, allow_unused=True)


def _same_grads(out, ref):
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", [*HANDOFF, "batch_norm"])
def test_two_passes_at_once_over_one_graph(name):
    # both passes' bridges run before either pass's node (a barrier in y's hook, which runs
    # between them): each pass gets its own gradient, as one pass alone
    import threading

    x, y, gx, params, _ = _handoff_critic(name, *((32, 48) if name == "batch_norm" else ()))
    ref = _penalty(x, gx, params)
    barrier = threading.Barrier(2, timeout=30)
    y.register_hook(lambda g: (barrier.wait(), g)[1])
    out = [None, None]

    def run(k):
        out[k] = _penalty(x, gx, params)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in out:
        _same_grads(res, ref)


def _marker_pass(x, y, gx, stop_at_y, raises=False):
    # a create_graph pass whose gradient at the bridge carries s: s lives on only if an entry of
    # the pass outlives it
    import weakref

    s = torch.rand(gx.shape, requires_grad=True)
    alive = weakref.ref(s)
    p = (gx * s).sum()
    if raises:

        def hook(g):
            handle.remove()
            raise RuntimeError("stop")

        handle = y.register_hook(hook)
        with pytest.raises(RuntimeError, match="stop"):
            torch.autograd.grad(p, [x], retain_graph=True, create_graph=True)
    else:
        torch.autograd.grad(p, [y] if stop_at_y else [x], retain_graph=True, create_graph=True)
    del s, p
    return alive


@pytest.mark.parametrize("name", HANDOFF)
def test_a_pass_that_ends_before_the_node_leaves_nothing(name):
    from tests._host_calls import slimgrad_calls

    x, y, gx, params, norm = _handoff_critic(name)
    ref = _penalty(x, gx, params)
    alive = _marker_pass(x, y, gx, stop_at_y=True)  # inputs=[y]: the node never runs
    assert alive() is None  # nothing of that pass is kept (its gradient, its graph)
    _same_grads(_penalty(x, gx, params), ref)
    if name == "hf_rms_norm":
        # a plain step afterwards: the C++ node's backward, no Python call (nothing routes it
        # through Python)
        y = norm(torch.randn(8, 16, requires_grad=True))
        assert "HFRMSNormNode" in y.grad_fn.name()
        loss = (y * torch.randn(8, 16)).sum()  # a contiguous dy: the node's C++ body applies
        assert slimgrad_calls(loss.backward) == 0


@pytest.mark.parametrize("name", HANDOFF)
def test_a_pass_that_raises_leaves_nothing(name):
    x, y, gx, params, _ = _handoff_critic(name)
    ref = _penalty(x, gx, params)
    alive = _marker_pass(
        x, y, gx, stop_at_y=False, raises=True
    )  # after the bridge, before the node
    assert alive() is None
    _same_grads(_penalty(x, gx, params), ref)

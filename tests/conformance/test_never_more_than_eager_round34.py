"""Issue 30 class 7, round 34: an activation on a leaf that requires grad (the model's input, a
parameter), or on a view of one, saves no more, and peaks no higher, than eager.

Eager's SiLU, GELU, Mish, Hardswish, Hardsigmoid, LeakyReLU and ELU keep x; on such a leaf x is
held by its gradient accumulator for as long as the graph lives, so eager's kept x costs no byte,
while slimgrad's y + side information (branch bits, a sparse table; Hardsigmoid's bits and its
backward's stand-in) cost theirs: SiLU -> Linear on a 40x48 leaf saved 8,200 B against eager's
7,680 before. Now each keeps x there, with eager's y and backward (NOTE [An input the graph
holds] in slimgrad/ops/_output_act.py); a tensor that requires no grad (one made inside a fused
node) is not such a leaf, so GPT-2's one-node MLP and the per-op path still decide alike.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import slimgrad
from slimgrad.memory import measure

_ACTS = {
    "silu": nn.SiLU,
    "gelu_tanh": lambda: nn.GELU("tanh"),
    "mish": nn.Mish,
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "leaky_relu_neg": lambda: nn.LeakyReLU(-0.1),
    "elu": nn.ELU,
    "elu_neg": lambda: nn.ELU(-0.5),
}

# x: the leaf itself, a view of it, its transpose, a slice of it (each the activation's input)
_VIEWS = {
    "leaf": ((40, 48), lambda x: x),
    "view": ((40 * 48,), lambda x: x.view(40, 48)),
    "t": ((48, 40), lambda x: x.t()),
    "slice": ((40, 60), lambda x: x[:, :48]),
}


def _bytes_and_grads(eager, slim, x, step):
    res, grads = [], []
    for m in (eager, slim):
        for _ in range(2):  # first-use caches (tables, kernels) outside the measured step
            step(m).backward()
        r = measure(lambda m=m: step(m), module=m, timeline=False)
        res.append((r.saved_bytes, r.peak_bytes))
        x.grad = None
        m.zero_grad(set_to_none=True)
        step(m).backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
        x.grad = None
    return res, grads


@pytest.mark.parametrize(
    "act,view,tail",
    [(a, "leaf", "linear") for a in _ACTS]
    + [
        ("silu", "view", "linear"),
        ("mish", "t", "linear"),
        ("hardswish", "slice", "linear"),
        ("elu_neg", "t", "linear"),
        ("hardsigmoid", "leaf", "sum"),
        ("hardsigmoid", "slice", "sum"),
    ],
)
def test_activation_on_a_leaf_keeps_the_leaf(act, view, tail):
    torch.manual_seed(0)
    rest = [nn.Linear(48, 16)] if tail == "linear" else []
    eager = nn.Sequential(_ACTS[act](), *rest)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    shape, as_input = _VIEWS[view]
    x = torch.randn(shape, requires_grad=True)
    res, grads = _bytes_and_grads(eager, slim, x, lambda m: m(as_input(x)).sum())
    assert res[1] == res[0], res  # eager's saved and peak bytes, exactly
    for ge, gs in zip(*grads, strict=True):
        assert torch.equal(gs, ge)  # eager's formula on the kept x: eager's bits


def _sac_nonpointwise(ctx, op, *args, **kwargs):
    if torch.Tag.pointwise in op.tags:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("scheme", ["plain", "sac", "reentrant"])
def test_silu_conv_on_a_leaf_under_checkpointing(scheme):
    # a checkpointed region's input is such a leaf too (the reentrant recompute's detached copy)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1))
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(2, 8, 9, 9, requires_grad=True)

    def step(m):
        if scheme == "plain":
            y = m(x)
        elif scheme == "reentrant":
            y = checkpoint(m, x, use_reentrant=True)
        else:
            ctx = functools.partial(create_selective_checkpoint_contexts, _sac_nonpointwise)
            y = checkpoint(m, x, use_reentrant=False, context_fn=ctx)
        return y.pow(2).sum()

    res, grads = _bytes_and_grads(eager, slim, x, step)
    assert res[1] == res[0], res
    for ge, gs in zip(*grads, strict=True):
        torch.testing.assert_close(gs, ge)


@pytest.mark.parametrize("op", ["silu", "mish", "gelu"])
@pytest.mark.parametrize("shape", [(40, 48), (3, 0)])
def test_second_derivatives_on_a_leaf_are_eagers(op, shape):
    # the kept leaf gives eager's second derivatives (before: y and bits kept, so a slimgrad
    # error for float32, and for an empty float64 leaf, where neither y nor bits exist)
    dtype = torch.float32 if shape[1] else torch.float64
    fns = {
        "silu": (slimgrad.ops.silu, torch.nn.functional.silu),
        "mish": (slimgrad.ops.mish, torch.nn.functional.mish),
        "gelu": (slimgrad.ops.gelu, torch.nn.functional.gelu),
    }[op]
    gen = torch.Generator().manual_seed(1)
    x0, cot, v = (torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3))
    out = []
    for fn in fns:
        x = x0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(x), x, cot, create_graph=True)
        (g2,) = torch.autograd.grad((g * v).sum(), x)
        out.append((g.detach(), g2))
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grads", ["x", "weights"])
def test_gpt2_mlp_node_decides_as_the_per_op_path_on_a_leaf(grads):
    # guard: inside the node c_fc's output requires no grad (grad mode off) and is no leaf of the
    # graph; the node keeps GELU's y and bits as the per-op path does on c_fc's output, whether
    # the MLP's input is a leaf that requires grad or not: the same bits
    from slimgrad.ops.dropout import dropout
    from slimgrad.ops.gelu import gelu
    from slimgrad.ops.gpt2_mlp import gpt2_mlp
    from slimgrad.ops.linear import conv1d_addmm

    def per_op(x, w1, b1, w2, b2, approximate, p, training):
        h = gelu(conv1d_addmm(x, w1, b1), approximate)
        return dropout(conv1d_addmm(h, w2, b2), p, training)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 12, generator=g).requires_grad_(grads == "x")
    w1 = (torch.randn(12, 48, generator=g) / 12**0.5).requires_grad_()
    b1 = torch.randn(48, generator=g).requires_grad_()
    w2 = (torch.randn(48, 12, generator=g) / 48**0.5).requires_grad_()
    b2 = torch.randn(12, generator=g).requires_grad_()
    args = (x, w1, b1, w2, b2)
    inputs = [x, w1, w2] if grads == "x" else [w1, b1, w2, b2]
    dy = torch.randn(2, 40, 12, generator=g)
    outs = []
    for fn in (gpt2_mlp, per_op):
        torch.manual_seed(1)
        y = fn(*args, "tanh", 0.0, True)
        outs.append((y.detach(), torch.autograd.grad(y, inputs, dy)))
    (y, gs), (y_p, gs_p) = outs
    assert torch.equal(y, y_p)
    for a, b in zip(gs, gs_p, strict=True):
        assert torch.equal(a, b)

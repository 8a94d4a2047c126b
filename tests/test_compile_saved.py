"""torch.compile keeps what a converted model keeps (issue 32; NOTE [slimgrad ops under
torch.compile] in ``slimgrad/_compile.py``).

A tiny converted HF Llama compiled with ``aot_eager_decomp_partition`` (inductor's decompositions
and its min-cut partitioner, without inductor's C++ builds: the same choice of saved values,
minutes faster) keeps, after forward, at most 1.05x the bytes the uncompiled converted model keeps
(no graph break comes from slimgrad: tests/test_compile_graph_breaks.py; GPT-2:
tests/test_compile_gpt2_small_kept.py). Two compiled SGD steps of converted GPT-2 and Llama (one
layer, dropout off) meet the error rule: their losses and gradients against float64, with eager
(uncompiled) as the baseline.

Kept bytes: the unique storages the autograd graph holds at the end of forward, walked from the
loss (``slimgrad.memory``'s walk: a compiled region is one ``CompiledFunctionBackward`` node whose
saved tensors are what the partitioner chose), parameters excluded. Exact, not an allocator
estimate.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch

import slimgrad
from slimgrad.memory import _storage, _walk_savers
from slimgrad.testing import assert_within_rule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import _hf_families as H  # noqa: E402

pytest.importorskip("transformers")

BACKEND = "aot_eager_decomp_partition"  # inductor's partitioner and decompositions, no codegen


def _family(name: str, dropout: bool, layers: int = 2) -> H.Family:
    fam = H.FAMILIES[name]
    over = {**fam.overrides, ("n_layer" if name == "gpt2" else "num_hidden_layers"): layers}
    if not dropout:
        over.update({k: 0.0 for k in fam.overrides if "drop" in k})
    return dataclasses.replace(fam, overrides=over)


def _kept_bytes(model: torch.nn.Module, loss: torch.Tensor) -> int:
    params = {_storage(p)._cdata for p in model.parameters()}
    found = _walk_savers([loss.grad_fn])
    return sum(_storage(t).nbytes() for key, (t, _) in found.items() if key not in params)


def _forward(model, batch, compiled: bool):
    fwd = torch.compile(model, backend=BACKEND) if compiled else model
    torch.manual_seed(0)
    fwd(**batch).loss.backward()  # the first step compiles backward too
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    return fwd(**batch).loss


# one layer: the layers are converted alike, and the kept ratio is a per-layer one plus the
# embedding and loss ends (a recompute tag dropped under compile: 2.09x here)
@pytest.mark.slow  # compiles
def test_compiled_converted_keeps_what_uncompiled_keeps():
    fam = _family("llama", dropout=True, layers=1)
    conv = H.build(fam)
    batch = H.inputs(fam, conv, labels=True)
    slimgrad.convert_(conv)
    kept = _kept_bytes(conv, _forward(conv, batch, compiled=False))
    torch._dynamo.reset()
    try:
        kept_compiled = _kept_bytes(conv, _forward(conv, batch, compiled=True))
    finally:
        torch._dynamo.reset()
    assert kept_compiled <= 1.05 * kept, (kept_compiled, kept, kept_compiled / kept)


def _sgd_steps(model, batch, n: int, backend: str | None = None) -> list:
    # each step's loss and gradients; SGD changes the parameters in place between steps
    fwd = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = fwd(**batch).loss
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        opt.step()
    return out


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_converted_train_steps_within_rule(name):
    # dropout off: the float64 reference cannot draw the same masks; one layer: each op kind once;
    # the second step runs the compiled model on parameters the first step's update changed
    fam = _family(name, dropout=False, layers=1)
    model = H.build(fam)
    batch = H.inputs(fam, model, labels=True)
    ref = _sgd_steps(copy.deepcopy(model).double(), batch, 2)
    eager = _sgd_steps(copy.deepcopy(model), batch, 2)
    slimgrad.convert_(model)
    assert any(type(m).__module__.startswith("slimgrad.") for m in model.modules())
    torch._dynamo.reset()
    try:
        got = _sgd_steps(model, batch, 2, BACKEND)
    finally:
        torch._dynamo.reset()
    names = ["loss"] + [n for n, p in model.named_parameters() if p.requires_grad]
    assert_within_rule(got, ref, eager, names=[f"step{s}.{n}" for s in (0, 1) for n in names])


# Op level: what the compiled graph keeps is the op's Memory line, byte for byte, and the op
# computes what it computes uncompiled (the same dropout draws: the attention's mask is drawn
# inside its custom op, from the global generator, at run time).


def _op_step(fn, inputs, compiled: bool):
    f = torch.compile(fn, backend=BACKEND, fullgraph=True) if compiled else fn
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    torch.manual_seed(0)
    out = f(*leaves)
    found = _walk_savers([out.grad_fn])
    keep = {_storage(t)._cdata for t in leaves}
    kept = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in keep)
    kept_inputs = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k in keep)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in leaves], kept, kept_inputs


def test_attention_keeps_q_k_v_and_bits_under_compile():
    from slimgrad.ops import scores_softmax_dropout_matmul

    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 37, 8  # odd, prime sizes
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))

    def fn(q, k, v):
        return scores_softmax_dropout_matmul(q, k.transpose(-2, -1), v, p=0.2, causal=True)

    torch._dynamo.reset()
    try:
        out, grads, kept, kept_inputs = _op_step(fn, (q, k, v), compiled=True)
    finally:
        torch._dynamo.reset()
    ref_out, ref_grads, _, _ = _op_step(fn, (q, k, v), compiled=False)
    # Memory line: q, k_t, v (the inputs, by reference) and 1 bit per score; nothing T x T
    assert kept == (b * h * t * t + 7) // 8
    assert kept_inputs == 3 * q.numel() * 4
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_gated_mlp_keeps_x_g_u_under_compile():
    from slimgrad.ops import gated_mlp

    g = torch.Generator().manual_seed(0)
    n, d, i = 13, 16, 40
    x = torch.randn(n, d, generator=g)
    wg, wu = torch.randn(i, d, generator=g), torch.randn(i, d, generator=g)
    wd = torch.randn(d, i, generator=g)

    def fn(x, wg, wu, wd):
        return gated_mlp(x, wg, wu, wd)

    torch._dynamo.reset()
    try:
        out, grads, kept, kept_inputs = _op_step(fn, (x, wg, wu, wd), compiled=True)
    finally:
        torch._dynamo.reset()
    ref_out, ref_grads, _, _ = _op_step(fn, (x, wg, wu, wd), compiled=False)
    # Memory line: x (the input, by reference) + g + u; act(g) * u is recomputed, not kept
    assert kept == 2 * n * i * 4
    torch.testing.assert_close(out, ref_out)
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r)


@pytest.mark.slow  # inductor's C++ build: 1-3 min on two loaded CPU cores
def test_fused_loss_keeps_no_logits_under_inductor():
    # inductor (not aot_eager_decomp_partition) merged the backward's recompute of the chunk x V
    # logits with the forward's and kept them (tiny HF Llama: 262,144 of 962,216 B)
    from slimgrad.ops import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, d, v = 61, 16, 97
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    target = torch.randint(0, v, (n,), generator=g)

    def fn(h, w):
        return linear_cross_entropy(h, w, target)

    f = torch.compile(fn, backend="inductor", fullgraph=True)
    torch._dynamo.reset()
    try:
        kept = []
        for step in (f, fn):
            leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
            loss = step(*leaves)
            found = _walk_savers([loss.grad_fn])
            own = {_storage(t)._cdata for t in leaves}
            kept.append(sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in own))
            loss.backward()
    finally:
        torch._dynamo.reset()
    # compiled: 801 B, uncompiled 732 (lse, the valid mask and scalars); the logits: 23,668
    assert kept[0] < n * v * 4, kept

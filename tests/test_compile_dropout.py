"""Dropout under torch.compile on CPU: traced torch ops, the packed mask kept, compiled eager's
masks (NOTE [Dropout traced under torch.compile] in ``slimgrad/ops/dropout.py``; the attention's
draw: NOTE [The attention's dropout draw under torch.compile] in ``ops/softmax_dropout.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import _storage, _walk_savers
from slimgrad.ops import dropout

pytest.importorskip("torch._dynamo")


def _graphs_backend(graphs: list):
    # AOTAutograd with inductor's decompositions and min-cut partitioner (what inductor is given),
    # recording the forward and backward graphs and running them as they are
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def record(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    return aot_autograd(
        fw_compiler=record,
        bw_compiler=record,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )


def _kept(y: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    found = _walk_savers([y.grad_fn])
    return [t for k, (t, _) in found.items() if _storage(t)._cdata != _storage(x)._cdata]


@pytest.mark.parametrize("shape", [(37, 41), (2, 64, 64)])
@pytest.mark.parametrize("inplace", [False, True])
def test_compiled_cpu_dropout_is_traced_and_keeps_the_packed_mask(shape, inplace):
    # plain aten ops, compiled eager's draw among them (before: slimgrad::dropout_noise, eager's
    # bernoulli_ in a custom op), and what the compiled region keeps is ceil(n / 8) B
    graphs: list = []
    torch._dynamo.reset()
    try:
        f = torch.compile(
            lambda x: dropout(x * 1, 0.3, inplace=inplace) * 2,
            backend=_graphs_backend(graphs),
            fullgraph=True,
        )
        x = torch.randn(shape, requires_grad=True)
        y = f(x)
        kept = _kept(y, x)
        y.sum().backward()
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2  # forward and backward
    called = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert [c for c in called if c.startswith("slimgrad.")] == []
    draw = "aten.bernoulli.p" if inplace else "aten.rand.default"
    assert any(c.endswith(draw) for c in called), sorted(called)
    n = x.numel()
    assert [(t.dtype, t.numel()) for t in kept] == [(torch.uint8, (n + 7) // 8)]


@pytest.mark.parametrize("inplace", [False, True])
def test_inductor_compiled_cpu_dropout_draws_compiled_eagers_mask(inplace):
    # the compiled output and gradient equal torch.compile(F.dropout)'s at the same seed, bit for
    # bit (inductor's RNG out of place: not the uncompiled F.dropout's mask), and the backward mask
    # is the forward's
    x0 = torch.randn(5, 67)
    out = []
    for fn in (dropout, F.dropout):
        torch._dynamo.reset()
        try:
            f = torch.compile(
                lambda x, fn=fn: fn(x * 1, 0.2, inplace=inplace) * 2,
                backend="inductor",
                fullgraph=True,
            )
            x = x0.clone().requires_grad_()
            torch.manual_seed(7)
            y = f(x)
            y.sum().backward()
        finally:
            torch._dynamo.reset()
        out.append((y, x.grad))
    (y, dx), (ye, dxe) = out
    assert torch.equal(y, ye)
    assert torch.equal(dx, dxe)
    assert not torch.equal(y, x0 * 2)  # something was dropped


def test_inductor_compiled_attention_draws_compiled_eagers_mask():
    # the scores op's dropout draw is compiled eager's (softmax, F.dropout, @ v): with v the
    # identity, the output is the dropped P itself, so the zeros are the dropped entries; kept q,
    # k_t, v and the packed bits as before
    from slimgrad.ops.softmax_dropout import scores_softmax_dropout_matmul

    b, h, t = 2, 3, 29
    q0 = torch.randn(b, h, t, 8)
    k0 = torch.randn(b, h, 8, t)
    v0 = torch.eye(t).expand(b, h, t, t).contiguous()
    drop = torch.ones(t, t, dtype=torch.bool).triu_(1)

    def ref(q, k_t, v):
        s = torch.matmul(q, k_t).masked_fill(drop, float("-inf"))
        return torch.matmul(F.dropout(torch.softmax(s, -1), 0.25), v)

    def conv(q, k_t, v):
        return scores_softmax_dropout_matmul(q, k_t, v, 0.25, causal=True)

    outs = []
    for fn in (conv, ref):
        torch._dynamo.reset()
        try:
            f = torch.compile(fn, backend="inductor", fullgraph=True)
            q = q0.clone().requires_grad_()
            torch.manual_seed(3)
            y = f(q, k0, v0)
            y.sum().backward()
        finally:
            torch._dynamo.reset()
        outs.append((y.detach(), q.grad))
    (y, dq), (ye, dqe) = outs
    assert torch.equal(y == 0, ye == 0)
    assert (ye[..., ~drop] == 0).any()  # dropped entries below the diagonal
    torch.testing.assert_close(y, ye)
    torch.testing.assert_close(dq, dqe)

"""Dropout under torch.compile on CPU: traced torch ops, the packed mask kept, eager's masks
(NOTE [Dropout traced under torch.compile] in ``slimgrad/ops/dropout.py``)."""

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
    # before: the graphs called slimgrad::dropout_fwd and slimgrad::dropout_apply_mask (opaque to
    # inductor); now plain aten ops, and what the compiled region keeps is still ceil(n / 8) B;
    # output and gradient are F.dropout's at the same seed, bit for bit (inductor: below)
    graphs: list = []
    torch._dynamo.reset()
    try:
        f = torch.compile(
            lambda x: dropout(x * 1, 0.3, inplace=inplace) * 2,
            backend=_graphs_backend(graphs),
            fullgraph=True,
        )
        x0 = torch.randn(shape)
        x = x0.clone().requires_grad_()
        torch.manual_seed(7)
        y = f(x)
        kept = _kept(y, x)
        y.sum().backward()
    finally:
        torch._dynamo.reset()
    xe = x0.clone().requires_grad_()
    torch.manual_seed(7)
    ye = F.dropout(xe * 1, 0.3) * 2
    ye.sum().backward()
    assert torch.equal(y, ye)
    assert torch.equal(x.grad, xe.grad)
    assert len(graphs) == 2  # forward and backward
    called = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    # the draw alone stays an op of x (so that it runs where x is ready)
    assert [c for c in called if c.startswith("slimgrad.")] == ["slimgrad.dropout_noise.default"]
    n = x.numel()
    assert [(t.dtype, t.numel()) for t in kept] == [(torch.uint8, (n + 7) // 8)]


def test_inductor_compiled_cpu_dropout_draws_eagers_mask():
    # inductor runs bernoulli_ on CPU as eager's op: the compiled output and gradient equal
    # F.dropout's at the same seed, bit for bit, and the backward mask is the forward's (the
    # in-place form draws the same: the traced rows above)
    inplace = False
    torch._dynamo.reset()
    try:
        f = torch.compile(
            lambda x: dropout(x * 1, 0.2, inplace=inplace) * 2, backend="inductor", fullgraph=True
        )
        x0 = torch.randn(5, 67)
        x = x0.clone().requires_grad_()
        torch.manual_seed(7)
        y = f(x)
        y.sum().backward()
    finally:
        torch._dynamo.reset()
    xe = x0.clone().requires_grad_()
    torch.manual_seed(7)
    ye = F.dropout(xe * 1, 0.2) * 2
    ye.sum().backward()
    assert torch.equal(y, ye)
    assert torch.equal(x.grad, xe.grad)

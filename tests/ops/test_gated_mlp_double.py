"""Second derivatives through the gated MLP (issue 30: they raised a slimgrad error where eager
runs): NOTE [The gated MLP's second derivatives] in slimgrad/ops/gated_mlp.py. First derivatives
under ``create_graph=True`` are eager's bits, second ones eager's formulas (autograd sums the
paths in another order: within 2 ulp of the largest element, as GPT-2's MLP), for every subset of
frozen projections, biases, the fused (Phi-3) form, float32 and bf16 autocast, and
``torch.autograd.functional``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import slimgrad
from slimgrad.ops.gated_mlp import _fwd_torch, gated_mlp, gated_mlp_fused

D, INTER, N = 12, 20, 7

_FROZEN = [(), ("wg", "wu"), ("wd",), ("wg", "wu", "wd"), ("x", "wg", "wu")]


def _params(bias: bool, fused: bool, frozen: tuple):
    g = torch.Generator().manual_seed(0)

    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.3)

    ps = {"wg": p(2 * INTER if fused else INTER, D), "wd": p(D, INTER)}
    ps["wu"] = None if fused else p(INTER, D)
    ps["bg"] = p(2 * INTER if fused else INTER) if bias else None
    ps["bu"] = p(INTER) if bias and not fused else None
    ps["bd"] = p(D) if bias else None
    for k in frozen:
        if ps.get(k) is not None:
            ps[k].requires_grad_(False)
    return ps


def _call(slim: bool, x, ps, fused: bool):
    if slim:
        if fused:
            return gated_mlp_fused(x, ps["wg"], ps["wd"], ps["bg"], ps["bd"], "silu")
        return gated_mlp(x, ps["wg"], ps["wu"], ps["wd"], ps["bg"], ps["bu"], ps["bd"], "silu")
    args = (x, ps["wg"], ps["bg"], ps["wu"], ps["bu"], ps["wd"], ps["bd"])
    return _fwd_torch(*args, "silu", fused)


def _penalty(slim, ps, fused, frozen, dtype):
    x = torch.randn(2, N, D, generator=torch.Generator().manual_seed(1))
    if dtype is torch.float64:  # the reference: eager in float64
        x = x.double()
        ps = {
            k: None if v is None else v.detach().double().requires_grad_(v.requires_grad)
            for k, v in ps.items()
        }
    x = x.requires_grad_("x" not in frozen) * 1  # a step tensor (non-leaf) where it needs grad
    leaves = [x] if x.requires_grad else []
    leaves += [t for t in ps.values() if t is not None and t.requires_grad]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is torch.bfloat16):
        y = _call(slim, x, ps, fused).to(x.dtype)
    first = torch.autograd.grad(y.square().sum(), leaves, create_graph=True)
    pen = sum(g.square().sum() for g in first)
    second = torch.autograd.grad(pen, leaves)
    return [g.detach() for g in first], second


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("frozen", _FROZEN)
def test_double_backward_is_eagers(frozen, bias, fused, dtype):
    ps = _params(bias, fused, frozen)
    (first, second), (first_e, second_e) = (
        _penalty(s, ps, fused, frozen, dtype) for s in (True, False)
    )
    for a, e in zip(first, first_e, strict=True):
        assert torch.equal(a, e)
    # autograd sums the second-order paths in another order than eager's graph does: measured
    # at most 1.65 ulp of the largest element (up to 2.1x the error rule's bound), pinned at 2
    for a, e in zip(second, second_e, strict=True):
        assert (a - e).abs().max() <= 2 * torch.finfo(dtype).eps * e.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_functional_hvp(dtype):
    ps = _params(False, False, ())

    def f(slim):
        def fn(x):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
                return _call(slim, x, ps, False).float().square().sum()

        return fn

    x0 = torch.randn(1, 3, D, generator=torch.Generator().manual_seed(2))
    v = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    (o, r), (o_e, r_e) = (torch.autograd.functional.hvp(f(s), x0, v) for s in (True, False))
    assert torch.equal(o, o_e)
    tol = 2 * torch.finfo(dtype).eps * r_e.abs().max()
    assert (r - r_e).abs().max() <= (tol if dtype is not torch.float32 else 1e-5 * r_e.abs().max())


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("frozen", [None, "gate_proj", "down_proj"])
def test_converted_llama_mlp_double_backward(frozen, tokens):
    # the converted module on both of its paths (few tokens: the children; many: the op)
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=1, num_hidden_layers=1,
        head_dim=2,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = torch.nn.Sequential(LlamaMLP(cfg))
    if frozen is not None:
        getattr(eager[0], frozen).weight.requires_grad_(False)
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(4)).requires_grad_()

    def run(m):
        params = [p for p in m.parameters() if p.requires_grad]
        (gx,) = torch.autograd.grad(F.softplus(m(x)).sum(), x, create_graph=True)
        return gx.detach(), torch.autograd.grad(gx.square().sum(), [x, *params])

    (gx, second), (gx_e, second_e) = run(conv), run(eager)
    assert torch.equal(gx, gx_e)
    for a, e in zip(second, second_e, strict=True):
        assert_close(a, e)

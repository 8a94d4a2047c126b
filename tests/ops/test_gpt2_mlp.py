"""HF GPT-2's MLP as one autograd node (ops/gpt2_mlp.py, nn/gpt2_mlp.py; NOTE [One node for
GPT-2's MLP]): the per-op converted path's loss, gradients and bytes, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
import slimgrad.nn.gpt2_mlp as ngm
from slimgrad import memory
from slimgrad.ops.gpt2_mlp import block_ok, gpt2_mlp
from tests._counting import count_calls
from tests.ops._gpt2_helpers import assert_same_step, gpt2_model, gpt2_step, measure_step

transformers = pytest.importorskip("transformers")


def _model(act="gelu_new", layers=2, pdrop=0.1, width=32):
    return gpt2_model(layers, pdrop, width, activation_function=act)


@pytest.fixture
def count(monkeypatch):
    # how many calls took the one-node path
    # the MLP's node alone, or with GPT-2's ln_2 folded in (NOTE [GPT-2's block with its
    # LayerNorms folded])
    n = count_calls(monkeypatch, ngm, "_GPT2_MLP_APPLY")
    real = ngm._GPT2_LN_MLP_APPLY

    def counting(*a):
        n[0] += 1
        return real(*a)

    monkeypatch.setattr(ngm, "_GPT2_LN_MLP_APPLY", counting)
    return n


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("frozen", [None, "c_fc", "c_proj_bias", "wte"])
def test_bits_as_per_op(act, train, frozen, count, monkeypatch):
    model = _model(act)
    model.train(train)
    if frozen == "wte":  # the MLP's input needs grad through the blocks still
        model.transformer.wte.weight.requires_grad_(False)
    elif frozen is not None:
        for blk in model.transformer.h:
            p = blk.mlp.c_fc.weight if frozen == "c_fc" else blk.mlp.c_proj.bias
            p.requires_grad_(False)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    assert type(conv.transformer.h[0].mlp) is ngm.GPT2MLP
    ids = torch.randint(0, 97, (2, 24))
    loss, grads = gpt2_step(conv, ids)
    assert count[0] == 2  # both blocks ran the node
    monkeypatch.setattr(ngm, "block_ok", lambda *a: False)  # the per-op path
    assert_same_step((loss, grads), gpt2_step(conv, ids))
    if not train:  # without dropout: eager's loss within the rule, the same state_dict
        torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss)
    assert conv.state_dict().keys() == model.state_dict().keys()


def _args(rows=40, d=12, hidden=48, grads=(True, True, True, True, True)):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, rows, d, generator=g)
    w1 = torch.randn(d, hidden, generator=g) / d**0.5
    b1 = torch.randn(hidden, generator=g)
    w2 = torch.randn(hidden, d, generator=g) / hidden**0.5
    b2 = torch.randn(d, generator=g)
    return [t.requires_grad_(r) for t, r in zip((x, w1, b1, w2, b2), grads, strict=True)]


def _per_op(x, w1, b1, w2, b2, approximate, p, training):
    from slimgrad.ops.dropout import dropout
    from slimgrad.ops.gelu import gelu
    from slimgrad.ops.linear import conv1d_addmm

    h = gelu(conv1d_addmm(x, w1, b1), approximate)
    return dropout(conv1d_addmm(h, w2, b2), p, training)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("subset", [None, "x", "weights"])
def test_functional_bits_and_subsets(approximate, p, subset):
    args = _args()
    dy = torch.randn(2, 40, 12, generator=torch.Generator().manual_seed(9))
    outs = []
    for fn in (gpt2_mlp, _per_op):
        torch.manual_seed(1)
        y = fn(*args, approximate, p, True)
        inputs = {None: args, "x": args[:1], "weights": [args[1], args[3]]}[subset]
        outs.append((y.detach(), torch.autograd.grad(y, inputs, dy)))
    (y, g), (y_p, g_p) = outs
    assert torch.equal(y, y_p)
    for a, b in zip(g, g_p, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("width, tokens", [(32, 24), (64, 16)])
def test_memory_as_per_op_and_below_eager(width, tokens, monkeypatch):
    # NOTE [One node for GPT-2's MLP]: the same saved bytes; the peak at most y's bytes (4 B x
    # tokens x 4 width) above the per-op path's, where c_fc's backward is the step's peak (2x24
    # tokens at width 32: +9,344 B); equal where it is not (the host-overhead model's shape)
    model = _model(layers=2) if width == 32 else _model(layers=2, width=width)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    ids = torch.randint(0, 97, (2 if width == 32 else 1, tokens))

    measure_step(conv, ids)  # first-use caches
    block = measure_step(conv, ids)
    monkeypatch.setattr(ngm, "block_ok", lambda *a: False)
    per_op, eager = measure_step(conv, ids), measure_step(model, ids)
    assert block.saved_bytes == per_op.saved_bytes < eager.saved_bytes
    y_bytes = 4 * ids.numel() * 4 * width
    assert per_op.peak_bytes <= block.peak_bytes <= per_op.peak_bytes + y_bytes
    if width == 64:
        assert block.peak_bytes == per_op.peak_bytes
    assert block.peak_bytes < eager.peak_bytes


def test_per_op_path_where_the_node_does_not_apply(count):
    conv = _model(layers=1)
    slimgrad.convert_(conv)
    mlp = conv.transformer.h[0].mlp
    x = torch.randn(2, 24, 32, requires_grad=True)
    mlp(x)
    assert count[0] == 1
    with torch.no_grad():
        mlp(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mlp(x)
    mlp(x.detach())  # nothing needs a gradient: no node... unless the weights do
    w = [t.double() for t in (mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias)]
    assert not block_ok(x.double(), *w)  # float64: the per-op ops (eager's 2nd derivatives)
    h = mlp.act.register_forward_hook(lambda m, i, o: None)
    mlp(x)
    h.remove()
    assert count[0] == 2  # only the call on x.detach() (the weights need grads) ran the node
    mlp.act.keep_y = False  # as convert_ decides for a frozen c_proj: eager's GELU, per op
    mlp(x)
    assert count[0] == 2


def test_frozen_c_proj_keeps_eager_gelu():
    # NOTE [Keep y only where its consumer keeps it]: the node's module is a declared call site
    model = _model(layers=1)
    model.transformer.h[0].mlp.c_proj.weight.requires_grad_(False)
    slimgrad.convert_(model)
    mlp = model.transformer.h[0].mlp
    assert type(mlp) is ngm.GPT2MLP and mlp.act.keep_y is False


def test_handler_refuses_other_forwards():
    from slimgrad.convert_handlers.hf import gpt2_mlp_from_hf

    model = _model(layers=1)
    mlp = model.transformer.h[0].mlp

    class Mine(type(mlp)):
        def forward(self, x):
            return self.c_proj(self.act(self.c_fc(x)))

    other = copy.deepcopy(mlp)
    other.__class__ = Mine
    with pytest.raises(NotImplementedError, match="not transformers' GPT2MLP.forward"):
        gpt2_mlp_from_hf(other)
    patched = copy.deepcopy(mlp)
    patched.forward = lambda x: x
    with pytest.raises(NotImplementedError, match="patched forward"):
        gpt2_mlp_from_hf(patched)
    relu = copy.deepcopy(mlp)
    relu.act = torch.nn.ReLU()
    with pytest.raises(NotImplementedError, match="not a GELU"):
        gpt2_mlp_from_hf(relu)


def test_double_backward_refused():
    args = _args()
    y = gpt2_mlp(*args, "tanh", 0.1, True)
    (gx,) = torch.autograd.grad(y.square().sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.ops.gpt2_mlp"):
        gx.sum().backward()


def test_checkpoint_and_saved_tensor_hooks(count):
    conv = _model(layers=1)
    slimgrad.convert_(conv)
    mlp = conv.transformer.h[0].mlp
    x = torch.randn(2, 24, 32, requires_grad=True)
    dy = torch.randn(2, 24, 32)
    torch.manual_seed(2)
    ref = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], dy)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    torch.manual_seed(2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mlp(x)
    assert packed  # what the node keeps goes through save_for_backward
    got = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    torch.manual_seed(2)
    y = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
    ck = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    assert count[0] == 4  # the checkpoint's recompute too
    # the checkpoint's recompute gives the lean bits; under hooks that pack each tensor the GELU
    # keeps x as eager does (NOTE [Under hooks that pack each tensor]): eager's GELU gradient
    for a, b, c in zip(ref, got, ck, strict=True):
        assert torch.equal(a, c)
        torch.testing.assert_close(b, a)


def test_verify_passes():
    model = _model(layers=1)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    ids = torch.randint(0, 97, (2, 24))
    rep = slimgrad.verify(model, conv, {"input_ids": ids, "labels": ids})
    assert rep.ok, rep


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_keep_set(dtype, count, monkeypatch):
    # NOTE [GPT-2's MLP under autocast]: the autocast node keeps x's cast (2 B/elt of x), h
    # (2 B/elt of h) and dropout's bits: 41,472 B per layer at 2x32 tokens, 64 wide; the per-op
    # path (before the node) kept y too: 74,240 B (c_fc 8,192, act 32,768, c_proj 32,768,
    # dropout 512)
    model = _model(layers=3, width=64)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    ids = torch.randint(0, 97, (2, 32))
    ac = count_calls(monkeypatch, ngm, "autocast_apply")

    def meas(m):
        def fwd():
            with torch.autocast("cpu", dtype=dtype):
                return m(input_ids=ids, labels=ids).loss

        torch.manual_seed(5)
        r = memory.measure(fwd, module=m)
        for p in m.parameters():
            p.grad = None
        return r

    meas(conv)  # first-use caches
    ours, eager = meas(conv), meas(model)
    assert count[0] == 0 and ac[0] == 6  # the autocast node, 3 layers x 2 measured steps
    n, d, i = ids.numel(), 64, 256
    for layer in range(3):
        kept = {k: v for k, v in ours.by_module.items() if f"h.{layer}.mlp" in k}
        assert kept == {f"transformer.h.{layer}.mlp": 2 * n * d + 2 * n * i + n * d // 8}
    assert ours.peak_bytes < eager.peak_bytes
    assert ours.saved_bytes < eager.saved_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("std", [0.577, 1.0])
def test_half_gelu_keeps_x_at_gpt2_like_inputs(dtype, std):
    # NOTE [GPT-2's MLP under autocast]: past HALF_DENSE_MAX the half-type table path runs, but
    # about 9% of N(0, std) elements lie within the 16-bit window (0.15) of x*, more than the 1/16
    # of the dense fallback: x is kept densely (2 B/elt), no y, bits or table
    from slimgrad.ops.gelu import gelu

    n = 2 * 131072
    h = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * std).to(dtype)
    h.requires_grad_()
    r = memory.measure(lambda: gelu(h * 1, "tanh").float().sum())
    kept = sorted(s.nbytes for s in r.saved if s.nbytes)
    assert kept[-1] == 2 * n  # x (the product h * 1), densely
    assert sum(kept[:-1]) < 64  # the scalar's bytes, no y, bits or table
    hard = ((h.detach().float() + 0.75246).abs() < 0.15).float().mean().item()
    assert 1 / 16 < hard < 0.1


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_lossy_hooks_around_checkpoint(act):
    # issue 30: the MLP block node checkpointed (non-reentrant) inside user hooks that pack in
    # bfloat16; the GELU's hard-element table differs between the forward and the recompute (h
    # scaled to N(0, 1)-like values): CheckpointError before (NOTE [Side tables under
    # torch.utils.checkpoint] in ops/_output_act.py); eager's gradient class under the same hooks
    import torch.utils.checkpoint as cp
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    from slimgrad.testing import assert_within_rule

    def pack(t):
        return t.dtype, t.to(torch.bfloat16) if t.is_floating_point() else t

    torch.manual_seed(0)
    eager = GPT2MLP(
        256, transformers.GPT2Config(n_embd=64, resid_pdrop=0.0, activation_function=act)
    )
    with torch.no_grad():
        eager.c_fc.weight.mul_(6.0)
    lean = slimgrad.convert_(torch.nn.Sequential(copy.deepcopy(eager)))[0]
    assert type(lean) is ngm.GPT2MLP
    x, w = torch.randn(4, 37, 64), torch.randn(4, 37, 64)

    def grads(m, xin):
        xx = xin.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[1].to(p[0])):
            y = cp.checkpoint(m, xx, use_reentrant=False)
        (y * w.to(y.dtype)).sum().backward()
        return [xx.grad] + [p.grad for p in m.parameters()]

    ref = grads(copy.deepcopy(eager).double(), x.double())
    assert_within_rule(grads(lean, x), ref, grads(eager, x))

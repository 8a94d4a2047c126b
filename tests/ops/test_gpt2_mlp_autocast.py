"""GPT-2's MLP under autocast as one node (NOTE [GPT-2's MLP under autocast] in
ops/gpt2_mlp.py): eager autocast's loss and gradients bit for bit (erf form; the tanh form: the
per-op converted path's, which runs F.gelu's tanh form where HF's gelu_new runs its own formula),
x's cast + h + dropout's bits kept, saved and peak bytes below eager's at every swept shape."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import slimgrad
import slimgrad.nn.gpt2_mlp as ngm
from slimgrad import memory
from tests._counting import count_calls

transformers = pytest.importorskip("transformers")

_DTYPES = [torch.bfloat16, torch.float16]


def _mlp(width=32, inter=128, act="gelu", pdrop=0.1):
    # HF's GPT2MLP inside a holder (convert_ converts children, not the root)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=width, n_head=1, activation_function=act, resid_pdrop=pdrop,
        n_inner=inter,
    )  # fmt: skip
    torch.manual_seed(0)
    return torch.nn.Sequential(transformers.models.gpt2.modeling_gpt2.GPT2MLP(inter, cfg))


def _pair(**kw):
    eager = _mlp(**kw)
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    assert type(conv[0]) is ngm.GPT2MLP
    return eager, conv


def _x(tokens, width, batch=1, std=1.0):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, tokens, width, generator=g) * std).requires_grad_()


def _run(m, x, dtype, inputs=None):
    torch.manual_seed(5)  # the dropout masks
    with torch.autocast("cpu", dtype=dtype):
        y = m(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(y.dtype)
    inputs = [x, *m.parameters()] if inputs is None else inputs(m, x)
    return y.detach(), torch.autograd.grad(y, inputs, dy)


def _per_op(monkeypatch):
    monkeypatch.setattr(ngm, "autocast_ok", lambda *a: False)


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("pdrop, train", [(0.1, True), (0.0, True), (0.1, False)])
@pytest.mark.parametrize("shape", [(1, 1, 8, 32), (2, 24, 32, 128), (4, 256, 64, 256)])
def test_bits_as_eager_autocast(dtype, pdrop, train, shape, monkeypatch):
    # erf GELU (HF 'gelu' is F.gelu): the node's y and gradients are eager autocast's. At 4x256
    # tokens (262,144 elements of h, past HALF_DENSE_MAX) the per-op path's GELU kept y + bits +
    # table, whose gradient is not eager's bits (this test failed there before the node)
    b, t, d, i = shape
    eager, conv = _pair(width=d, inter=i, pdrop=pdrop)
    eager.train(train)
    conv.train(train)
    x = _x(t, d, b)
    n = count_calls(monkeypatch, ngm, "autocast_apply")
    y, g = _run(conv, x, dtype)
    assert n[0] == 1
    y_e, g_e = _run(eager, x, dtype)
    assert torch.equal(y, y_e)
    for a, e in zip(g, g_e, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
@pytest.mark.parametrize("frozen", [None, "c_fc.weight", "c_fc.bias", "c_proj.bias", "x", "x+c_fc"])
def test_bits_as_per_op_and_subsets(dtype, act, frozen, monkeypatch):
    # the per-op converted path's bits (at 24 tokens its GELU keeps h densely: eager's formula
    # on h) with each subset of gradients asked for
    _, conv = _pair(act=act)
    x = _x(24, 32, 2)
    if frozen in ("x", "x+c_fc"):
        x.requires_grad_(False)
    for name, p in conv.named_parameters():
        if frozen is not None and name.endswith(frozen.replace("x+", "")):
            p.requires_grad_(False)

    def inputs(m, x):
        return [t for t in (x, *m.parameters()) if t.requires_grad]

    n = count_calls(monkeypatch, ngm, "autocast_apply")
    y, g = _run(conv, x, dtype, inputs)
    assert n[0] == 1
    _per_op(monkeypatch)
    y_p, g_p = _run(conv, x, dtype, inputs)
    assert torch.equal(y, y_p)
    for a, e in zip(g, g_p, strict=True):
        assert torch.equal(a, e)


def _meas(m, x, dtype):
    def fwd():
        with torch.autocast("cpu", dtype=dtype):
            return m(x).float().square().sum()

    torch.manual_seed(5)
    r = memory.measure(fwd, module=m)
    for p in m.parameters():
        p.grad = None
    x.grad = None
    return r


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("tokens, width, inter", [(1, 8, 32), (24, 32, 128), (263, 64, 256)])
def test_keeps_x_cast_h_and_bits(dtype, tokens, width, inter, monkeypatch):
    # 2 B/elt of x (its cast, c_fc's input) + 2 B/elt of h + 1/8 B/elt of the output (dropout's
    # bits); the per-op path kept y too (2 B/elt of h more) and, past HALF_DENSE_MAX on
    # inputs with fewer than 1/16 hard elements, y + bits + table instead of h
    eager, conv = _pair(width=width, inter=inter)
    x = _x(tokens, width)
    _meas(conv, x, dtype)  # first-use caches
    ours, eager_r = _meas(conv, x, dtype), _meas(eager, x, dtype)
    n = tokens
    assert ours.by_module == {
        "": 4 * n * width,
        "0": 2 * n * width + 2 * n * inter + -(-n * width // 8),
    }
    _per_op(monkeypatch)
    per_op = _meas(conv, x, dtype)
    assert ours.saved_bytes == per_op.saved_bytes - 2 * n * inter
    assert ours.peak_bytes <= per_op.peak_bytes
    assert ours.saved_bytes < eager_r.saved_bytes and ours.peak_bytes < eager_r.peak_bytes


_SWEEP = list(
    itertools.product(
        _DTYPES,
        ["gelu", "gelu_new"],
        [(3, 1), (4, 16), (5, 7), (16, 64), (64, 256)],
        [1, 2, 7, 64],
        [0.0, 0.1],
    )
)


@pytest.mark.parametrize("dtype, act, wi, tokens, pdrop", _SWEEP[::3])
def test_never_above_eager_or_per_op(dtype, act, wi, tokens, pdrop, monkeypatch):
    # tiny to small shapes (at most 16,384 elements of h: the per-op GELU keeps h densely there,
    # a CPU half-type rule): saved and peak strictly below eager autocast's, peak at most the
    # per-op path's (tracker bytes)
    width, inter = wi
    eager, conv = _pair(width=width, inter=inter, act=act, pdrop=pdrop)
    x = _x(tokens, width)
    _meas(conv, x, dtype)
    ours, eager_r = _meas(conv, x, dtype), _meas(eager, x, dtype)
    _per_op(monkeypatch)
    per_op = _meas(conv, x, dtype)
    assert ours.saved_bytes < per_op.saved_bytes
    assert ours.saved_bytes < eager_r.saved_bytes
    assert ours.peak_bytes < eager_r.peak_bytes
    assert ours.peak_bytes <= per_op.peak_bytes


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("pdrop", [0.0, 0.1])
@pytest.mark.parametrize("loss", ["linear", "square"])
def test_double_backward(dtype, pdrop, loss):
    # create_graph=True: first derivatives eager autocast's bits; second derivatives eager's
    # formulas on the same operands, bit for bit where the penalty's dy is a constant (linear
    # loss); where dy depends on the node's output, autograd sums the paths through h in another
    # order (the node recomputes h for its graph): within 2 ulp of the largest element (measured:
    # at most 1.5 ulp, bf16 and fp16)
    eager, conv = _pair(pdrop=pdrop)
    x = _x(24, 32, 2)

    def penalty(m):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=dtype):
            y = m(x).float()
        out = y.sum() if loss == "linear" else y.square().sum()
        gx, gw = torch.autograd.grad(out, [x, m[0].c_fc.weight], create_graph=True)
        params = [x, *m.parameters()][:4]  # c_proj's bias has no second derivative
        second = torch.autograd.grad(gx.square().sum() + gw.square().sum(), params)
        return [gx.detach(), gw.detach()], second

    (first, second), (first_e, second_e) = penalty(conv), penalty(eager)
    for a, e in zip(first, first_e, strict=True):
        assert torch.equal(a, e)
    ulp = torch.finfo(dtype).eps
    for a, e in zip(second, second_e, strict=True):
        if loss == "linear":
            assert torch.equal(a, e)
        else:
            assert (a - e).abs().max() <= 2 * ulp * e.abs().max()


def test_double_backward_refused_without_x_cast():
    # c_fc's weight frozen: x's cast is not kept, h has no history in the node: first
    # derivatives, then the second-derivative error
    _, conv = _pair()
    conv[0].c_fc.weight.requires_grad_(False)
    x = _x(24, 32, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
    (gx,) = torch.autograd.grad(y.float().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.ops.gpt2_mlp"):
        gx.sum().backward()


@pytest.mark.parametrize("dtype", _DTYPES)
def test_checkpoint_and_saved_tensor_hooks(dtype):
    _, conv = _pair()
    x = _x(24, 32, 2)
    ref = _run(conv, x, dtype)[1]
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _run(conv, x, dtype)[1]
    assert any(t.shape == (2, 24, 128) for t in packed)  # h goes through save_for_backward

    def ck(m, x):
        return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)

    class Ck(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return ck(self.m, x)

    ck_g = _run(Ck(conv), x, dtype)[1]
    for a, b, c in zip(ref, got, ck_g, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_not_taken_where_per_op_applies(monkeypatch):
    # compiled, no_grad, float64 weights, autocast off: not the autocast node
    _, conv = _pair()
    x = _x(24, 32, 2)
    n = count_calls(monkeypatch, ngm, "autocast_apply")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        conv(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x.detach())  # the weights still need grads: the node
    assert n[0] == 1
    conv.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x.double())
    assert n[0] == 1


@pytest.mark.parametrize("cache", [True, False])
def test_weights_used_twice_in_one_region(cache):
    # NOTE [Autocast weight casts]: one cast token per weight per region (autocast's cache), or
    # one per use without the cache: each weight's two gradients summed as eager sums them
    eager, conv = _pair()
    x = _x(24, 32, 2)

    def run(m):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            y = m(m(x).float())
        return torch.autograd.grad(y.float().square().sum(), [x, *m.parameters()])

    for a, e in zip(run(conv), run(eager), strict=True):
        assert torch.equal(a, e)

"""Second derivatives through the lean MLP ops (gated MLP, GPT-2's MLP node) are refused in
GUIDE form naming the op and the switch that leaves the MLPs to torch, never silently wrong
(NOTE [The lean MLP ops refuse second derivatives] in slimgrad/ops/gated_mlp.py)."""

import copy

import pytest
import torch

import slimgrad

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

_MSG = (
    r"slimgrad\.ops\.{op}: a second derivative through this op was requested .*expected first "
    r"derivatives only, got a double backward\. .*the lean MLP op does not support second "
    r"derivatives; convert with ConvertConfig\(activations=False\)"
)


def _llama(frozen, bias):
    cfg = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=40,
        num_attention_heads=1,
        num_hidden_layers=1,
        head_dim=2,
        mlp_bias=bias,
    )
    torch.manual_seed(0)
    m = torch.nn.Sequential(LlamaMLP(cfg))
    for n in frozen:
        for p in getattr(m[0], n).parameters():
            p.requires_grad_(False)
    return m


def _gpt2(frozen):
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=1, activation_function="gelu_new", resid_pdrop=0.0, n_inner=64
    )
    torch.manual_seed(0)
    m = torch.nn.Sequential(GPT2MLP(64, cfg))
    for n in frozen:
        getattr(m[0], n).weight.requires_grad_(False)
    return m


def _double(m, x0, autocast):
    x = x0.clone().requires_grad_()
    leaves = [x] + [p for p in m.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = m(x)
    first = torch.autograd.grad(y.float().square().sum(), leaves, create_graph=True)
    pen = sum(g.float().square().sum() for g in first)
    return torch.autograd.grad(pen, leaves, allow_unused=True)


def _check(e, op, autocast):
    c = copy.deepcopy(e)
    slimgrad.convert_(c)
    assert type(c[0]) is not type(e[0]), "the MLP was not converted: the test checks nothing"
    x0 = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    ref = _double(e, x0, autocast)
    try:
        got = _double(c, x0, autocast)
    except RuntimeError as ex:
        assert __import__("re").search(_MSG.format(op=op), str(ex), flags=__import__("re").S), ex
    else:  # where the op has eager's second derivatives (GPT-2 under autocast, c_fc trained)
        for a, b in zip(got, ref, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0.05, atol=1e-2 * b.abs().max().item())
    # the fix the message names: the MLP stays torch's and the double backward is eager's
    o = copy.deepcopy(e)
    slimgrad.convert_(o, slimgrad.ConvertConfig(activations=False))
    assert type(o[0]) is type(e[0])
    for a, b in zip(_double(o, x0, autocast), ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize(
    "frozen,bias",
    [((), False), (("gate_proj", "up_proj"), True), (("down_proj",), False)],
)
def test_gated_mlp_double_backward_refused(frozen, bias, autocast):
    _check(_llama(frozen, bias), "gated_mlp", autocast)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("frozen", [(), ("c_fc",), ("c_fc", "c_proj")])
def test_gpt2_mlp_double_backward_refused_or_eager(frozen, autocast):
    _check(_gpt2(frozen), "gpt2_mlp", autocast)

"""Converted modules and ops on the meta device run as eager's do (NOTE [Meta tensors take eager's
op] in slimgrad/_autograd.py): deferred init, shape inference and accelerate's
``init_empty_weights`` models call a model whose tensors have shapes but no values. Each row builds
the same model twice on meta, converts one, runs forward and backward on a meta input, and
compares the output's and every gradient's shape, strides, dtype and device with eager's. Sizes
are above the few-element paths (the smooth activations keep x densely up to 512 elements), where
the side tables whose sizes depend on the data are built.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad import ops


def _layout(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device.type)


def _run(model, x, train, autocast):
    model.train(train)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        y = model(x)
    out = _layout(y)
    y.backward(torch.empty_like(y))
    return out, [_layout(x.grad)] + [_layout(p.grad) for p in model.parameters()]


def _seq(*mods):
    return lambda: nn.Sequential(*[m() for m in mods])


W = 64  # (16, 8) -> (16, 64): 1024 elements after the first Linear
_lin, _lin2 = (lambda: nn.Linear(8, W)), (lambda: nn.Linear(W, 8))
_c1, _c2 = (lambda: nn.Conv2d(3, 8, 3)), (lambda: nn.Conv2d(8, 4, 3))
X2, X4 = (16, 8), (2, 3, 17, 17)

# name: (model builder, input shape, under CPU autocast, ConvertConfig)
CASES = {
    "LayerNorm": (_seq(_lin, lambda: nn.LayerNorm(W), _lin2), X2, False, None),
    "RMSNorm": (_seq(_lin, lambda: nn.RMSNorm(W), _lin2), X2, False, None),
    "GroupNorm": (_seq(_c1, lambda: nn.GroupNorm(2, 8), _c2), X4, False, None),
    "GELU": (_seq(_lin, nn.GELU, _lin2), X2, False, None),
    "SiLU": (_seq(_lin, nn.SiLU, _lin2), X2, False, None),
    "Mish": (_seq(_lin, nn.Mish, _lin2), X2, False, None),
    "ELU": (_seq(_lin, nn.ELU, _lin2), X2, False, None),
    "Hardswish": (_seq(_lin, nn.Hardswish, _lin2), X2, False, None),
    "ReLU": (_seq(_lin, nn.ReLU, _lin2), X2, False, None),
    "Dropout": (_seq(_lin, lambda: nn.Dropout(0.1), _lin2), X2, False, None),
    "BatchNorm2d+ReLU": (_seq(_c1, lambda: nn.BatchNorm2d(8), nn.ReLU, _c2), X4, False, None),
    "BatchNorm2d+SiLU": (_seq(_c1, lambda: nn.BatchNorm2d(8), nn.SiLU, _c2), X4, False, None),
    "InPlaceABN": (
        _seq(_c1, lambda: nn.BatchNorm2d(8), nn.ReLU, _c2),
        X4,
        False,
        slimgrad.ConvertConfig(inplace_abn=True),
    ),
    "RecomputeABN": (  # a ResNet stem: conv, BN, ReLU, max-pool
        _seq(
            lambda: nn.Conv2d(3, 8, 7, 2, 3),
            lambda: nn.BatchNorm2d(8),
            nn.ReLU,
            lambda: nn.MaxPool2d(3, 2, 1),
            _c2,
        ),
        (2, 3, 33, 33),
        False,
        slimgrad.ConvertConfig(inplace_abn=True),
    ),
    "Linear (autocast)": (_seq(_lin, nn.ReLU, _lin2), X2, True, None),
    "Conv2d (autocast)": (_seq(_c1, nn.ReLU, _c2), X4, True, None),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_converted_module_on_meta_runs_as_eager(name, train):
    make, shape, autocast, config = CASES[name]
    with torch.device("meta"):
        eager, conv = make(), make()
    slimgrad.convert_(conv, config)
    assert any(type(m).__module__.startswith("slimgrad") for m in conv.modules())
    x_e = torch.empty(shape, device="meta", requires_grad=True)
    x_s = torch.empty(shape, device="meta", requires_grad=True)
    assert _run(conv, x_s, train, autocast) == _run(eager, x_e, train, autocast)


def _hf_models():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    llama = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    llama._attn_implementation = "eager"
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=97)
    return {
        "LlamaForCausalLM+labels": lambda: transformers.LlamaForCausalLM(llama),
        "GPT2MLP": lambda: GPT2MLP(128, gpt2),
        "LlamaMLP (autocast)": lambda: LlamaMLP(llama),
    }


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", ["LlamaForCausalLM+labels", "GPT2MLP", "LlamaMLP (autocast)"])
def test_converted_hf_module_on_meta_runs_as_eager(name, train):
    make = _hf_models()[name]
    with torch.device("meta"):
        eager, conv = make(), make()
    slimgrad.convert_(conv)
    res = []
    for m in (eager, conv):
        m.train(train)
        if name.startswith("LlamaForCausalLM"):  # the fused loss's model: HF's forward on meta
            ids = torch.zeros(2, 9, dtype=torch.long, device="meta")
            y = m(input_ids=ids, labels=ids).loss
        else:
            x = torch.empty(2, 33, 32, device="meta", requires_grad=True)
            ctx = torch.autocast("cpu", dtype=torch.bfloat16)
            with ctx if "autocast" in name else contextlib.nullcontext():
                y = m(x)
        out = _layout(y)
        y.backward(torch.empty_like(y))
        res.append((out, [_layout(p.grad) for p in m.parameters()]))
    assert res[0] == res[1]


def _r(*shape):
    return torch.empty(shape, device="meta", requires_grad=True)


def _eager_gated(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


# the public ops on meta tensors that are not Parameters (their general paths), against eager's
OPS = {
    "matmul": (ops.matmul, torch.matmul, lambda: (_r(4, 16, 32), _r(32, 8))),
    "gated_mlp": (ops.gated_mlp, _eager_gated, lambda: (_r(4, 33, 16), _r(32, 16), _r(32, 16),
                                                        _r(16, 32))),
    "softmax_dropout_matmul": (
        lambda s, v: ops.softmax_dropout_matmul(s, v, 0.0),
        lambda s, v: torch.matmul(F.softmax(s, -1), v),
        lambda: (_r(2, 2, 33, 33), _r(2, 2, 33, 8)),
    ),
    "causal_lm_loss (bfloat16)": (
        ops.causal_lm_loss,
        lambda h, w, lab: F.cross_entropy(
            F.linear(h, w).float().flatten(0, 1), F.pad(lab, (0, 1), value=-100)[:, 1:].flatten()
        ),
        lambda: (
            _r(2, 9, 16).to(torch.bfloat16).detach().requires_grad_(),
            _r(40, 16).to(torch.bfloat16).detach().requires_grad_(),
            torch.zeros(2, 9, dtype=torch.long, device="meta"),
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPS))
def test_op_on_meta_runs_as_eager(name):
    slim, eager, make = OPS[name]
    res = []
    for fn in (eager, slim):
        args = make()
        y = fn(*args)
        out = _layout(y)
        y.backward(torch.empty_like(y))
        res.append((out, [_layout(a.grad) for a in args if a.requires_grad]))
    assert res[0] == res[1]

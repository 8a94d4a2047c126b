"""Converted models under ``torch.inference_mode()`` run as eager does, with eager's bits.

Parameters made inside inference mode are inference tensors: they have no version counter, so a
converted op that read one (the autocast Linear's master weight, InPlaceABN's per-parameter-version
channel search) raised "Inference tensors do not track version counter" where eager runs (issue 30).
Each row builds the model inside or outside inference mode, converts a copy, and runs both under
inference mode (with autocast on or off, and under a nested ``torch.no_grad()``): the converted
output must be eager's bit for bit (for InPlaceABN, which computes leaky_relu by design, the
converted model's own output in grad mode on ordinary tensors).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.ops.linear import linear

_seed = torch.default_generator.manual_seed


def _build(make, inside: bool):
    _seed(0)
    if inside:
        with torch.inference_mode():
            return make()
    return make()


def _run(model, x, autocast: bool, nested_no_grad: bool):
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        _seed(1)
        if nested_no_grad:
            with torch.no_grad():
                return model(x.clone())
        return model(x.clone())


def _mlp():
    return nn.Sequential(
        nn.Linear(8, 12), nn.GELU(), nn.LayerNorm(12), nn.Linear(12, 6, bias=False)
    )


def _llama_mlp():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2
    )
    return nn.Sequential(llama.LlamaRMSNorm(8), llama.LlamaMLP(cfg))


def test_linear_on_a_weight_made_in_inference_mode_under_autocast():
    # the reported case: F.linear runs, ops.linear raised
    with torch.inference_mode():
        x = torch.randn(4, 8)
        w = torch.randn(16, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, ref = linear(x, w), torch.nn.functional.linear(x, w)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(y, ref)


@pytest.mark.parametrize(
    "make,shape",
    [(_mlp, (2, 3, 8)), (_llama_mlp, (2, 5, 8))],
    ids=["linear_gelu_layernorm", "llama_rmsnorm_gated_mlp"],
)
@pytest.mark.parametrize("inside", [True, False], ids=["params_in_inference", "params_outside"])
@pytest.mark.parametrize("autocast,nested", [(True, False), (True, True), (False, False)])
def test_converted_model_in_inference_mode_gives_eagers_bits(make, shape, inside, autocast, nested):
    model = _build(make, inside)
    with torch.inference_mode(inside):  # a copy made in inference mode is an inference tensor
        conv = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(shape)
    y_eager = _run(model, x, autocast, nested)
    y_conv = _run(conv, x, autocast, nested)
    assert y_conv.dtype == y_eager.dtype
    assert torch.equal(y_conv, y_eager)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_inplace_abn_on_parameters_made_in_inference_mode(training):
    def make():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))

    cfg = slimgrad.ConvertConfig(inplace_abn=True)
    x = torch.randn(2, 3, 7, 7)
    # the reference: the same conversion of the same model on ordinary tensors, in grad mode
    ref = slimgrad.convert_(_build(make, False), cfg).train(training)
    _seed(1)
    y_ref = ref(x.clone()).detach()
    model = _build(make, True)
    with torch.inference_mode():
        conv = slimgrad.convert_(model, cfg).train(training)
    assert any(type(m).__name__ == "InPlaceABN" for m in conv.modules())
    y = _run(conv, x, autocast=False, nested_no_grad=False)
    assert torch.equal(y, y_ref)
    bufs = dict(conv.named_buffers())
    for name, b in ref.named_buffers():  # train: the running statistics moved as in grad mode
        assert torch.equal(bufs[name], b), name

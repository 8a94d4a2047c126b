"""Conformance and savings: timm vision models through ``slimgrad.convert_``.

timm's fused norm + act layers in conv stacks (every option: drop, no act, in-place act, momentum
None; contiguous and channels_last; train and eval), then tiny variants of the six models of issue
18 (see MODELS): the report converts timm's layers (no timm norm left as-is), ``slimgrad.verify``
passes (outputs, loss and every parameter gradient by the error rule against float64, inputs
unchanged, running statistics), the exact tracker's peak is not above eager's and it saves less;
channels_last (train and eval) and autocast bfloat16 rows too. Skipped without timm
(tests/conformance/_timm_shim.py imports it).

Run time: the suite runs with one intra-op thread (as each xdist worker does, tests/conftest.py),
also in a single-process run. At these tiny shapes a second thread buys nothing, and on a loaded
box it costs the most: verify's float64 reference runs a grouped or depthwise convolution as one
small convolution per group (aten's slow path has no float64 grouped kernel), each one an OpenMP
parallel region that waits for a descheduled thread. Measured on the 2-core box under a load
average of ~18: verify of mobilenetv3_small_050 took 167 s with 2 threads, 15.5 s with 1. Each
model is built and converted once; every test gets its own deep copies.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import timm as timm_handlers
from slimgrad.memory import measure
from tests._threads import one_thread
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # see the module docstring (Run time); the thread count is restored for the next module
    with one_thread():
        yield


def _bn_act(act, **kw):
    return timm.layers.BatchNormAct2d(6, act_layer=act, **kw)


# timm's fused norm + act layers, each in a conv stack: (name, layer factory)
NORM_ACTS = [
    ("bn_silu_inplace", lambda: _bn_act(nn.SiLU)),
    ("bn_relu", lambda: _bn_act(nn.ReLU, inplace=False)),
    ("bn_gelu", lambda: _bn_act(nn.GELU)),
    ("bn_hardswish", lambda: _bn_act(nn.Hardswish)),
    ("bn_no_act", lambda: _bn_act(nn.ReLU, apply_act=False)),
    ("bn_drop_silu", lambda: _bn_act(nn.SiLU, drop_layer=lambda: nn.Dropout(0.2))),
    ("bn_momentum_none", lambda: _bn_act(nn.SiLU, momentum=None)),
    ("gn_silu", lambda: timm.layers.GroupNormAct(6, 3, act_layer=nn.SiLU, inplace=False)),
    ("ln_act_gelu", lambda: timm.layers.LayerNormAct(9, act_layer=nn.GELU)),
    ("ln2d_gelu", lambda: timm.layers.LayerNormAct2d(6, act_layer=nn.GELU)),
]


def _stack(layer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), layer, nn.Conv2d(6, 4, 3))
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)) and m.weight is not None:
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model


@pytest.mark.parametrize("name, make", NORM_ACTS, ids=[n for n, _ in NORM_ACTS])
def test_timm_norm_act_layers(name, make):
    model = _stack(make())
    slim = slimgrad.convert_(copy.deepcopy(model))
    assert type(slim[1]).__module__ == timm_handlers.__name__, slimgrad.report(slim)
    assert list(slim.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 3, 7, 9)
    for inp in (x, x.to(memory_format=torch.channels_last)):
        res = slimgrad.verify(model, slim, inp)
        assert res.ok, str(res)
    if name in ("bn_silu_inplace", "bn_relu", "bn_gelu"):  # BN + act keeps the BN output only

        def step(m):
            return lambda: m(x).square().mean()

        me, ms = measure(step(model)), measure(step(slim))
        act_bytes = 3 * 6 * 7 * 9 * 4  # one activation-sized float32 tensor
        assert me.saved_bytes - ms.saved_bytes >= 0.95 * act_bytes, (ms.saved_bytes, me.saved_bytes)
        assert ms.peak_bytes <= me.peak_bytes


def test_timm_norm_act_fast_norm_inplace_act_and_own_forward_are_skipped():
    ln = timm.layers.LayerNormAct(6)
    ln._fast_norm = True
    # slimgrad's GroupNorm keeps its output, which an in-place act would overwrite
    gn = timm.layers.GroupNormAct(6, 3, act_layer=nn.SiLU)  # timm's default: inplace=True

    class MyBNAct(timm.layers.BatchNormAct2d):
        def forward(self, x):
            return super().forward(x) * 2

    # (its act not in place: a write there would come first in the norm's reasons, as the source
    # reading takes F.batch_norm as maybe returning its input)
    model = nn.Sequential(ln, MyBNAct(6, inplace=False), gn)
    slimgrad.convert_(model)
    why = {n: r for n, _, r in slimgrad.report(model).skipped}
    assert "fast norm is on" in why["0"] and "MyBNAct overrides forward" in why["1"]
    assert "its act (SiLU) writes in place over the norm's output" in why["2"]
    assert model[0] is ln and type(model[1]) is MyBNAct and model[2] is gn


def test_convert_leaves_timm_buffers_alone():
    # timm's BatchNormAct2d.forward runs ``self.num_batches_tracked.add_(1)``: convert_'s fx traces
    # must record it, not run it (verify would then fail on that buffer)
    model = _stack(_bn_act(nn.SiLU))
    slimgrad.convert_(model)
    assert int(model[1].num_batches_tracked) == 0


# The six models of issue 18 as tiny variants: fewer blocks (and narrower where timm takes the
# option: ResNet's bottleneck width, ConvNeXt's dims, RegNet's depth) with the same layer types,
# else the smallest timm model of the same family built from the same layers (test_efficientnet for
# efficientnet_b0, regnety_002 for regnety_016, mobilenetv3_small_050 for mobilenetv3_large_100).
# name: (create_model kwargs, batch x image HxW, classes that must all be converted)
MODELS = {
    "resnet50": (
        dict(layers=(1, 1, 1, 1), base_width=16),
        (4, 32, 32),
        ("BatchNorm2d", "ReLU", "Conv2d"),
    ),
    "test_efficientnet": ({}, (4, 33, 35), ("BatchNormAct2d", "SiLU", "Sigmoid")),
    "vit_small_patch16_224": (dict(depth=2, img_size=32), (4, 32, 32), ("LayerNorm", "GELU")),
    "regnety_002": (dict(depth=7), (4, 32, 32), ("BatchNormAct2d", "ReLU", "Sigmoid")),
    "convnext_tiny": (
        dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)),
        (4, 35, 33),
        ("LayerNorm", "LayerNorm2d"),
    ),
    "mobilenetv3_small_050": ({}, (4, 32, 32), ("BatchNormAct2d", "Hardswish", "Hardsigmoid")),
}


@functools.cache
def _built(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **MODELS[name][0])
    for m in model.modules():  # non-trivial affine parameters
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)) and m.weight is not None:
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model, slimgrad.convert_(copy.deepcopy(model))


def _pair(name):
    # fresh copies of the model and its conversion (verify's train steps update running stats)
    _, shape, kinds = MODELS[name]
    model, slim = _built(name)
    return copy.deepcopy(model), copy.deepcopy(slim), shape, kinds


@pytest.mark.parametrize("name", list(MODELS))
def test_timm_model_converts_verifies_and_saves(name):
    model, slim, shape, kinds = _pair(name)
    rep = slimgrad.report(_built(name)[1])  # convert_'s report is kept for the model it converted
    converted = {k for _, k, _ in rep.converted}
    assert set(kinds) <= converted, rep
    assert not any(k in kinds for _, k, _ in rep.skipped), rep
    timm_norms = [
        type(m).__name__ for m in slim.modules() if "timm.layers.norm" in type(m).__module__
    ]
    assert not timm_norms, timm_norms
    x = torch.randn(shape[0], 3, *shape[1:])
    res = slimgrad.verify(model, slim, x, modes=("train",))
    assert res.ok, str(res)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    assert ms.peak_bytes <= me.peak_bytes, (ms.peak_bytes, me.peak_bytes)
    assert ms.saved_bytes < me.saved_bytes, (ms.saved_bytes, me.saved_bytes)


@pytest.mark.parametrize("name", ["mobilenetv3_small_050"])  # LayerNorm2d: test_convert_subclass
def test_timm_model_channels_last_train_and_eval(name):
    model, slim, shape, _ = _pair(name)
    x = torch.randn(shape[0], 3, *shape[1:]).to(memory_format=torch.channels_last)
    res = slimgrad.verify(model, slim, x)
    assert res.ok, str(res)


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "test_efficientnet"])
def test_timm_model_autocast_bf16(name):
    model, slim, shape, _ = _pair(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = slimgrad.verify(model, slim, torch.randn(shape[0], 3, *shape[1:]), modes=("train",))
    assert res.ok, str(res)

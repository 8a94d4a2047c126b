"""Conformance and savings: timm's CNN blocks with squeeze-excite, DropPath and Hardswish.

Tiny stacks of the blocks that efficientnet_b0, mobilenetv3_large_100 and regnety_016 are built
from (timm's ``InvertedResidual``/``DepthwiseSeparableConv`` with their ``SqueezeExcite``, RegNet's
``Bottleneck`` with ``SEModule``), with stochastic depth on: ``convert_`` converts every SE block,
DropPath and BatchNorm -> Hardswish, ``slimgrad.verify`` passes (outputs, loss and every gradient
by the error rule against float64, the same DropPath draws on every side, train and eval), on
odd image sizes, channels_last and autocast bfloat16, and the exact tracker's peak and saved bytes
are below eager's. Skipped without timm (tests/conformance/_timm_shim.py imports it).
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


def _effnet():
    eb = timm.models._efficientnet_blocks
    se = partial(eb.SqueezeExcite, rd_ratio=0.25)
    return [
        eb.DepthwiseSeparableConv(8, 8, act_layer=nn.SiLU, se_layer=se, drop_path_rate=0.3),
        eb.InvertedResidual(8, 8, exp_ratio=3, act_layer=nn.SiLU, se_layer=se, drop_path_rate=0.3),
    ]


def _mobilenetv3():
    eb = timm.models._efficientnet_blocks
    se = partial(
        eb.SqueezeExcite, gate_layer="hard_sigmoid", force_act_layer=nn.ReLU, rd_round_fn=round
    )
    return [
        eb.InvertedResidual(8, 8, exp_ratio=3, act_layer=nn.Hardswish, se_layer=se),
        eb.InvertedResidual(
            8, 8, dw_kernel_size=5, exp_ratio=2, act_layer=nn.ReLU, se_layer=se, drop_path_rate=0.3
        ),
    ]


def _regnety():
    b = timm.models.regnet.Bottleneck
    return [b(8, 8, group_size=4, se_ratio=0.25, drop_path_rate=0.3), b(8, 16, group_size=4)]


# name: (blocks, classes convert_ must convert, input H x W)
BLOCKS = {
    "efficientnet": (_effnet, {"SqueezeExcite", "DropPath", "SiLU"}, (11, 9)),
    "mobilenetv3": (_mobilenetv3, {"SqueezeExcite", "DropPath", "Hardswish"}, (9, 13)),
    "regnety": (_regnety, {"SEModule", "DropPath", "ReLU"}, (10, 7)),
}


def _pair(name, channels_last=False):
    make, kinds, hw = BLOCKS[name]
    torch.manual_seed(0)
    stem = [nn.Conv2d(3, 8, 3), timm.layers.BatchNormAct2d(8, act_layer=nn.ReLU)]
    model = nn.Sequential(*stem, *make(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    if isinstance(model[-4], timm.models.regnet.Bottleneck):
        model[-1] = nn.Linear(16, 5)
    for m in model.modules():  # non-trivial affine parameters
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    slim = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(3, 3, *hw)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return model, slim, x, kinds


@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_convert_verify_and_save(name):
    model, slim, x, kinds = _pair(name)
    rep = slimgrad.report(slim)
    assert kinds <= {k for _, k, _ in rep.converted}, rep
    assert not any(k in kinds for _, k, _ in rep.skipped), rep
    assert not [m for m in slim.modules() if type(m).__module__.startswith("timm.layers.squeeze")]
    res = slimgrad.verify(model, slim, x)
    assert res.ok, str(res)

    def step(m):
        def run():
            torch.manual_seed(1)  # the same DropPath draws on both sides
            return m(x).square().mean()

        return run

    me, ms = measure(step(model), timeline=False), measure(step(slim), timeline=False)
    assert ms.peak_bytes < me.peak_bytes, (ms.peak_bytes, me.peak_bytes)
    assert ms.saved_bytes < 0.7 * me.saved_bytes, (ms.saved_bytes, me.saved_bytes)


@pytest.mark.parametrize("name", ["regnety"])  # mobilenetv3_small_050: test_timm.py
def test_blocks_channels_last(name):
    model, slim, x, _ = _pair(name, channels_last=True)
    res = slimgrad.verify(model, slim, x)
    assert res.ok, str(res)


@pytest.mark.parametrize("name", ["mobilenetv3"])  # test_efficientnet: test_timm.py
def test_blocks_autocast_bf16(name):
    model, slim, x, _ = _pair(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = slimgrad.verify(model, slim, x, modes=("train",))
    assert res.ok, str(res)


def test_frozen_batch_norm_left_as_is_with_the_reason():
    # timm's freeze_batch_norm_2d makes torchvision FrozenBatchNorm2d and timm
    # FrozenBatchNormAct2d: x * scale + shift from buffers, for which eager keeps only the
    # per-channel scale, so convert_ leaves them (the act inside still converts) and says why;
    # the converted model computes eager's bits
    layers = timm.layers
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 1),
        layers.BatchNormAct2d(8, act_layer=nn.ReLU),
    )
    model = layers.freeze_batch_norm_2d(model).train()
    kinds = [type(model[i]).__name__ for i in (1, 4)]
    assert kinds == ["FrozenBatchNorm2d", "FrozenBatchNormAct2d"]
    lean = slimgrad.convert_(copy.deepcopy(model))
    rep = slimgrad.report(lean)
    assert [type(lean[i]).__name__ for i in (1, 4)] == kinds
    skipped = {name: why for name, _, why in rep.skipped}
    assert set(skipped) == {"1", "4"}
    assert all("nothing to save" in why for why in skipped.values())
    assert any(name == "4.act" for name, *_ in rep.converted)

    # eager keeps no full-size tensor for a frozen BatchNorm
    saved = []
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        model[1](x * 1.0)
    assert max(saved, default=0) <= 8

    x = torch.randn(2, 3, 9, 9)
    outs = []
    for m in (model, lean):
        y = m(x)
        y.square().sum().backward()
        outs.append([y] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)

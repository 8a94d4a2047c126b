"""MobileNetV2-style inverted residuals (no squeeze-excite) keep their measured bytes: a stem
Conv-BN-ReLU6 and three torchvision-layout blocks (1x1 expand, BN, ReLU6, 3x3 depthwise, BN, ReLU6,
1x1 project, BN; expansion 6, stride 2), pooling and a Linear head, on 8x3x112x112. Saved bytes
under the exact tracker, measured at f41e593 (the probe of session 19): slimgrad 26,603,328,
eager 60,723,008 (0.438x); peak 32,254,656 against eager's 61,281,392."""

from __future__ import annotations

import copy

import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure

SAVED = {"eager": 60_723_008, "slimgrad": 26_603_328}


def _block(cin: int, cout: int, t: int, stride: int) -> nn.Sequential:
    hid = cin * t
    return nn.Sequential(
        nn.Conv2d(cin, hid, 1, bias=False),
        nn.BatchNorm2d(hid),
        nn.ReLU6(inplace=True),
        nn.Conv2d(hid, hid, 3, stride, 1, groups=hid, bias=False),
        nn.BatchNorm2d(hid),
        nn.ReLU6(inplace=True),
        nn.Conv2d(hid, cout, 1, bias=False),
        nn.BatchNorm2d(cout),
    )


def test_mobilenetv2_style_saved_bytes_pinned():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1),
        nn.BatchNorm2d(16),
        nn.ReLU6(True),
        _block(16, 24, 6, 2),
        _block(24, 32, 6, 2),
        _block(32, 64, 6, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    x = torch.randn(8, 3, 112, 112)
    slim = slimgrad.convert_(copy.deepcopy(model))
    got = {}
    for name, mod in (("eager", model), ("slimgrad", slim)):
        got[name] = measure(lambda mod=mod: mod(x).sum(), module=mod)
    assert {k: m.saved_bytes for k, m in got.items()} == SAVED
    assert got["slimgrad"].peak_bytes < got["eager"].peak_bytes

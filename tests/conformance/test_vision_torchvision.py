"""torchvision's ConvNeXt: its ``LayerNorm2d`` (permute, ``F.layer_norm``, permute back) converts
like timm's (``convert_handlers.cnn.convert_tv_layer_norm2d``), exactly, and keeps less.

A tiny ConvNeXt (two stages of one block, 8 and 16 channels) on an odd image size: no torchvision
LayerNorm2d is left, the converted norms' outputs are bit for bit torchvision's (train, eval,
channels_last), ``slimgrad.verify`` passes, and the exact tracker's saved bytes drop by at least
the norms' inputs. A subclass with its own forward stays as it is, with the reason in the report.
torchvision is imported through tests/conformance/_timm_shim.py (skipped without it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests._threads import one_thread
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _tiny_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    model = ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=5)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model


def _tv_ln2d(model):
    return [n for n, m in model.named_modules() if type(m).__name__ == "LayerNorm2d"
            and type(m).__module__.startswith("torchvision")]  # fmt: skip


def test_torchvision_layer_norm2d_converts_exactly_and_saves():
    model = _tiny_convnext()
    assert _tv_ln2d(model)
    slim = slimgrad.convert_(copy.deepcopy(model))
    assert not _tv_ln2d(slim), slimgrad.report(slim)
    assert list(slim.state_dict()) == list(model.state_dict())
    x = torch.randn(2, 3, 19, 21)
    for inp in (x, x.to(memory_format=torch.channels_last)):
        for n, m in model.named_modules():
            if type(m).__name__ == "LayerNorm2d":
                h = torch.randn(2, m.normalized_shape[0], 5, 3, requires_grad=True)
                for mode in (True, False):
                    m.train(mode)
                    s = slim.get_submodule(n).train(mode)
                    torch.testing.assert_close(s(h), m(h), rtol=0, atol=0)
        res = slimgrad.verify(model, slim, inp)
        assert res.ok, str(res)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    assert ms.saved_bytes < me.saved_bytes and ms.peak_bytes <= me.peak_bytes


def test_torchvision_layer_norm2d_subclass_with_own_forward_is_left():
    from torchvision.models.convnext import LayerNorm2d

    class Scaled(LayerNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Conv2d(3, 4, 1), Scaled(4))
    slimgrad.convert_(model)
    assert type(model[1]) is Scaled
    why = {n: r for n, _, r in slimgrad.report(model).skipped}
    assert "Scaled overrides forward" in why["1"], why

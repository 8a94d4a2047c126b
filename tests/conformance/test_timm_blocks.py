"""Conformance and savings of timm's blocks (convert_handlers.timm_blocks) in whole models.

Tiny siblings of issue 18's vit_small_patch16_224 and convnext_tiny (fewer blocks, small images):
every Attention / ConvNeXtBlock converts, and the blocks save exactly v per attention (ViT) and
fc2's output per block (ConvNeXt) over the same converted model with its blocks on timm's forward,
with a peak not above eager's. tests/conformance/test_timm.py verifies the same models (float32
train, channels_last, autocast bfloat16); tests/test_convert_timm_blocks.py each path of the
blocks.
Skipped without timm (tests/conformance/_timm_shim.py imports it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import timm_blocks
from slimgrad.memory import measure
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")

# name: (create_model kwargs, batch x H x W, block class, bytes the blocks no longer keep)
MODELS = {
    # 2 blocks, 4 patches + cls token, 384 channels: v per attention
    "vit_small_patch16_224": (
        dict(depth=2, img_size=32),
        (2, 32, 32),
        timm_blocks.Attention,
        2 * 2 * 5 * 384 * 4,
    ),
    # one block per stage at 8x8, 4x4, 2x2, 1x1: fc2's output per block
    "convnext_tiny": (
        dict(depths=(1, 1, 1, 1)),
        (2, 35, 33),
        timm_blocks.ConvNeXtBlock,
        2 * 4 * (96 * 64 + 192 * 16 + 384 * 4 + 768 * 1),
    ),
}


def _pair(name):
    kwargs, shape, cls, saved = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs)
    for n, p in model.named_parameters():
        if n.endswith("gamma"):
            nn.init.uniform_(p, -1.0, 1.0)
    slim = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(shape[0], 3, *shape[1:])
    return model, slim, x, cls, saved


def _on_timms_forward(slim, cls):
    # the converted model with every block on timm's forward (a no-op hook on a child that the
    # fast path does not call), the layers still converted
    ref = copy.deepcopy(slim)
    for m in ref.modules():
        if type(m) is cls:
            child = m.q_norm if cls is timm_blocks.Attention else m.mlp.norm
            child.register_forward_hook(lambda *a: None)
    return ref


@pytest.mark.parametrize("name", list(MODELS))
def test_blocks_convert_and_save_exactly(name):
    model, slim, x, cls, saved = _pair(name)
    blocks = [m for m in slim.modules() if type(m) is cls]
    assert blocks and all(type(m) is not cls for m in model.modules())
    assert not any(cls.__name__ == k for _, k, _ in slimgrad.report(slim).skipped)
    ref = _on_timms_forward(slim, cls)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    mr = measure(lambda: ref(x).square().mean(), timeline=False)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    assert mr.saved_bytes - ms.saved_bytes == saved
    # at these sizes the peak falls in backward, on the parameters' gradients
    assert ms.peak_bytes <= me.peak_bytes and mr.peak_bytes <= me.peak_bytes

"""slimgrad.nn.squeeze_excite: timm's and torchvision's squeeze-excite blocks, by instance.

Each block sits after conv -> BatchNorm -> act and before a conv. The reference is the same model
converted with the block left as it is (``filter_fn``), so everything else runs the same slimgrad
ops: outputs and every gradient must agree bit for bit, and the converted block must save less.
Skipped without timm (tests/conformance/_timm_shim.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from slimgrad.nn import squeeze_excite as sse
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")

C = 8


def _blocks():
    import torchvision

    eb = timm.models._efficientnet_blocks
    inplace_gate = timm.layers.SEModule(C, rd_ratio=0.5)
    inplace_gate.gate = timm.layers.activations.Sigmoid(inplace=True)
    return {
        "timm_se": (lambda: timm.layers.SEModule(C, rd_ratio=0.5), sse.SEModule),
        "timm_se_maxpool_hardsigmoid": (
            lambda: timm.layers.SEModule(
                C, rd_ratio=0.5, add_maxpool=True, gate_layer="hard_sigmoid"
            ),
            sse.SEModule,
        ),
        "timm_se_inplace_gate": (lambda: copy.deepcopy(inplace_gate), sse.SEModule),
        "timm_effective_se": (lambda: timm.layers.EffectiveSEModule(C), sse.EffectiveSEModule),
        "effnet_se": (lambda: eb.SqueezeExcite(C, act_layer=nn.SiLU), sse.SqueezeExciteBlock),
        "mbv3_se": (lambda: eb.SqueezeExcite(C, gate_layer=nn.Hardsigmoid), sse.SqueezeExciteBlock),
        "torchvision_se": (
            lambda: torchvision.ops.SqueezeExcitation(C, C // 2),
            sse.SqueezeExcitation,
        ),
    }


NAMES = [
    "timm_se",
    "timm_se_maxpool_hardsigmoid",
    "timm_se_inplace_gate",
    "timm_effective_se",
    "effnet_se",
    "mbv3_se",
    "torchvision_se",
]


def _model(block, act=nn.ReLU):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), act(), block, nn.Conv2d(C, 4, 1))
    nn.init.uniform_(m[1].weight, 0.5, 1.5)
    nn.init.uniform_(m[1].bias, -0.2, 0.2)
    return m


def _run(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    model.zero_grad(set_to_none=True)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), [p.grad for p in model.parameters()] + [x.grad]


def _pair(name, act=nn.ReLU):
    make, cls = _blocks()[name]
    eager = _model(make(), act)
    ref = slimgrad.convert_(copy.deepcopy(eager), filter_fn=lambda m, n: n != "3")
    slim = slimgrad.convert_(copy.deepcopy(eager))
    assert type(slim[3]) is cls, slimgrad.report(slim)
    assert type(ref[3]) is type(eager[3])
    assert list(slim.state_dict()) == list(eager.state_dict())
    return eager, ref, slim


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_block_is_eagers_bit_for_bit(name, layout):
    eager, ref, slim = _pair(name, nn.SiLU if name == "effnet_se" else nn.ReLU)
    x = torch.randn(2, 3, 11, 9)
    if layout == "channels_last":  # as channels_last is used: the model and its input
        x = x.to(memory_format=torch.channels_last)
        for m in (ref, slim):
            m.to(memory_format=torch.channels_last)
    yr, gr = _run(ref, x)
    ys, gs = _run(slim, x)
    _same(ys, yr)
    for a, b in zip(gs, gr, strict=True):
        _same(a, b)
    ref.eval(), slim.eval()
    _same(_run(slim, x)[0], _run(ref, x)[0])


@pytest.mark.parametrize("name", ["timm_se", "mbv3_se", "torchvision_se"])
def test_block_saves_the_input_and_output_copies(name):
    _, ref, slim = _pair(name)
    x = torch.randn(2, 3, 12, 12)

    def step(m):
        return lambda: m(x).square().sum()

    full = 2 * C * 10 * 10 * 4
    mr, ms = measure(step(ref)), measure(step(slim))
    assert mr.saved_bytes - ms.saved_bytes >= 2 * full - 64 * C  # x and y, minus gate-sized bits
    assert ms.peak_bytes < mr.peak_bytes


def test_hooks_fire_on_the_converted_block():
    eager, _, slim = _pair("timm_se")
    seen = []
    slim[3].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    slim[3].gate.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    slim(torch.randn(2, 3, 7, 7))
    assert seen == [(2, C, 1, 1), (2, C, 5, 5)]


def test_own_forward_or_instance_forward_is_left_as_is():
    class MySE(timm.layers.SEModule):
        def forward(self, x):
            return super().forward(x) * 2

    m = _model(MySE(C, rd_ratio=0.5))
    slimgrad.convert_(m)
    assert type(m[3]) is MySE
    with pytest.raises(TypeError, match="slimgrad.nn.SEModule.from_torch"):
        sse.SEModule.from_torch(MySE(C))
    se = timm.layers.SEModule(C)
    se.forward = lambda x: x
    with pytest.raises(TypeError, match="instance attribute 'forward'"):
        sse.SEModule.from_torch(se)

"""Conformance and savings: timm vision models through ``slimgrad.convert_``.

Tiny variants of the six models of issue 18 (``timm.create_model(name, pretrained=False)`` with
fewer blocks where timm takes it, at 32x32 or odd image sizes): the report converts timm's layers
(no LayerNorm/BatchNormAct2d/Hardswish left as-is), ``slimgrad.verify`` passes (outputs, loss and
every parameter gradient by the GUIDE.md rule against float64, inputs unchanged, train and eval,
running statistics), the exact tracker's peak is not above eager's, and channels_last inputs and
autocast bfloat16 agree too. Skipped without timm (tests/conformance/_timm_shim.py imports it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import inplace_guard
from slimgrad.convert_handlers import timm as timm_handlers
from slimgrad.memory import measure
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


@pytest.fixture(autouse=True)
def _guard_traces_buffers_symbolically(monkeypatch):
    # convert_'s in-place guard fx-traces modules; timm's BatchNormAct2d.forward runs
    # ``self.num_batches_tracked.add_(1)``, and fx hands buffers to the trace as real tensors, so
    # the trace itself bumped the counter (verify then fails on that buffer). The fix belongs in
    # convert_handlers/inplace_guard.py (``proxy_buffer_attributes = True`` on its tracer); until it
    # lands there, these tests apply it (test_convert_leaves_timm_buffers_alone shows the bug).
    if not getattr(inplace_guard._LeafTracer, "proxy_buffer_attributes", False):
        monkeypatch.setattr(
            inplace_guard._LeafTracer, "proxy_buffer_attributes", True, raising=False
        )


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

    model = nn.Sequential(ln, MyBNAct(6), gn)
    slimgrad.convert_(model)
    why = {n: r for n, _, r in slimgrad.report(model).skipped}
    assert "fast norm is on" in why["0"] and "MyBNAct overrides forward" in why["1"]
    assert "its act (SiLU) writes in place over the norm's output" in why["2"]
    assert model[0] is ln and type(model[1]) is MyBNAct and model[2] is gn


@pytest.mark.xfail(strict=True, reason="inplace_guard's fx trace runs buffer updates (lead's fix)")
def test_convert_leaves_timm_buffers_alone(monkeypatch):
    monkeypatch.undo()  # without the fixture's tracer setting
    model = _stack(_bn_act(nn.SiLU))
    slimgrad.convert_(model)
    assert int(model[1].num_batches_tracked) == 0

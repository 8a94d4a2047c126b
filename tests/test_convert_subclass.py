"""convert_ converts a subclass of a table class by what it computes (NOTE [Subclasses convert by
what they compute] in slimgrad/convert.py): converted when its forward and state are its parent's,
skipped with the reason otherwise; timm's own layers by their handlers (convert_handlers/timm.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
import slimgrad.nn as snn
from slimgrad.convert_handlers.timm import LayerNorm2d
from tests.conformance._timm_shim import timm


class RenamedGELU(nn.GELU):
    pass


class TaggedLayerNorm(nn.LayerNorm):
    def __init__(self, n):
        super().__init__(n, eps=1e-6)
        self.tag = "block0"  # read by nothing in forward

    def extra_repr(self):
        return f"tag={self.tag}"


class RenamedBN(nn.BatchNorm2d):
    pass


class DoubledGELU(nn.GELU):
    def forward(self, x):
        return 2 * super().forward(x)


class OwnConv(nn.Conv2d):
    def _conv_forward(self, x, w, b):  # called by nn.Conv2d.forward
        return super()._conv_forward(x, w * 0.5, b)


class CalledGELU(nn.GELU):
    def __call__(self, x):
        return super().__call__(x) + 1


class ScaledLayerNorm(nn.LayerNorm):
    def __init__(self, n):
        super().__init__(n)
        self.scale = nn.Parameter(torch.ones(()))  # forward does not read it; state_dict does


class FreezableReLU(nn.ReLU):
    def freeze(self):
        return self


class OldStateBN(nn.BatchNorm2d):
    _version = 1  # nn.BatchNorm2d's is 2: its _load_from_state_dict reads it


class Net(nn.Module):
    def __init__(self, act, norm):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = RenamedBN(6)
        self.fc = nn.Linear(6, 6)
        self.norm = norm
        self.act = act

    def forward(self, x):
        h = self.bn(self.conv(x)).mean((2, 3))
        return self.act(self.norm(self.fc(h)))


def _run(model, x):
    torch.manual_seed(0)
    out = model(x)
    out.square().sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _skipped(rep):
    return {n: r for n, _, r in rep.skipped}


def test_renamed_and_tagged_subclasses_convert_and_match_eager():
    model = Net(RenamedGELU(), TaggedLayerNorm(6))
    slim = slimgrad.convert_(copy.deepcopy(model))
    rep = slimgrad.report(slim)
    conv = {n: (a, b) for n, a, b in rep.converted}
    assert conv["act"] == ("RenamedGELU", "GELU")
    assert conv["norm"] == ("TaggedLayerNorm", "LayerNorm")
    assert conv["bn"] == ("RenamedBN", "BatchNorm2d")
    assert isinstance(slim.bn, snn.BatchNorm2d) and slim.norm.tag == "block0"
    assert slim.norm.eps == 1e-6 and slim.norm.weight is not model.norm.weight
    assert list(slim.state_dict()) == list(model.state_dict())
    x = torch.randn(4, 3, 5, 7)
    (o1, g1), (o2, g2) = _run(model, x), _run(slim, x)
    torch.testing.assert_close(o2, o1)
    torch.testing.assert_close(g2, g1)
    torch.testing.assert_close(slim.bn.running_var, model.bn.running_var)
    assert slimgrad.verify(model, slim, x).ok


def test_parent_view_leaves_the_original_alone():
    m = RenamedBN(4)
    params = dict(m.named_parameters())
    slimgrad.convert_(wrapper := nn.Sequential(m))
    assert type(m) is RenamedBN and isinstance(wrapper[0], snn.BatchNorm2d)
    assert dict(m.named_parameters()) == params
    assert wrapper[0].weight is m.weight and wrapper[0].running_mean is m.running_mean


@pytest.mark.parametrize(
    "module, reason",
    [
        (DoubledGELU(), r"DoubledGELU overrides forward; expected torch\.nn\..*GELU\.forward"),
        (OwnConv(3, 3, 1), r"OwnConv overrides _conv_forward, which .*Conv2d's forward may call"),
        (CalledGELU(), r"CalledGELU overrides __call__"),
        (ScaledLayerNorm(6), r"has parameters \['bias', 'scale', 'weight'\] and its .*LayerNorm"),
        (FreezableReLU(), r"FreezableReLU adds method freeze"),
        (OldStateBN(6), r"OldStateBN sets class attribute _version; expected .*BatchNorm2d's"),
    ],
    ids=["forward", "helper", "call", "extra_param", "new_method", "class_attr"],
)
def test_subclasses_that_may_compute_otherwise_are_skipped(module, reason):
    model = (
        nn.Sequential(nn.Linear(3, 6), module)
        if not isinstance(module, nn.Conv2d)
        else (nn.Sequential(module))
    )
    before = type(model[-1])
    slimgrad.convert_(model)
    assert type(model[-1]) is before
    why = _skipped(slimgrad.report(model))[str(len(model) - 1)]
    assert __import__("re").search(reason, why), why


@pytest.mark.parametrize("cls", [nn.GELU, RenamedGELU])
def test_forward_replaced_on_the_instance_is_skipped(cls):
    act = cls()
    act.forward = lambda x: torch.tanh(x)  # a hook-like attribute: what nn.Module calls
    model = nn.Sequential(nn.Linear(3, 3), act)
    x = torch.randn(2, 3)
    want = model(x)
    slimgrad.convert_(model)
    assert model[1] is act
    assert "forward is replaced on the instance" in _skipped(slimgrad.report(model))["1"]
    torch.testing.assert_close(model(x), want)


def test_skipped_subclass_children_are_still_visited():
    class Block(nn.LayerNorm):  # overrides forward, holds a child
        def __init__(self):
            super().__init__(4)
            self.act = nn.GELU()

        def forward(self, x):
            return self.act(super().forward(x))

    model = nn.Sequential(Block())
    slimgrad.convert_(model)
    assert type(model[0]) is Block and isinstance(model[0].act, snn.GELU)


needs_timm = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


@needs_timm
def test_timm_layers_convert_and_match_eager():
    from timm.layers import GELU as TimmGELU
    from timm.layers import LayerNorm as TimmLN
    from timm.layers import LayerNorm2d as TimmLN2d

    class SubLN(TimmLN):  # a subclass of a timm class: timm's LayerNorm is its parent
        pass

    model = nn.Sequential(
        nn.Conv2d(3, 5, 3), TimmLN2d(5), nn.Flatten(2), TimmLN(42), TimmGELU(), SubLN(42)
    )
    for m in model:
        if getattr(m, "weight", None) is not None and m.weight.dim() == 1:
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    slim = slimgrad.convert_(copy.deepcopy(model))
    kinds = [type(m) for m in slim]
    assert kinds[1] is LayerNorm2d and kinds[3] is snn.LayerNorm and kinds[5] is snn.LayerNorm
    assert isinstance(slim[4], snn.GELU) and slim[4].approximate == "none"
    for x in (
        torch.randn(2, 3, 9, 8),
        torch.randn(2, 3, 9, 8).to(memory_format=torch.channels_last),
    ):
        o1, o2 = model(x), slim(x)
        torch.testing.assert_close(o2, o1)
        assert o2.stride() == o1.stride()
        rep = slimgrad.verify(model, slim, x)  # every gradient by the error rule
        assert rep.ok, str(rep)


@needs_timm
def test_timm_fast_norm_and_inplace_sigmoid_are_skipped():
    from timm.layers import LayerNorm as TimmLN
    from timm.layers.activations import Sigmoid as TimmSigmoid

    ln = TimmLN(4)
    ln._fast_norm = True
    # (the LayerNorm last: before the in-place Sigmoid, the in-place guard's reason comes first)
    model = nn.Sequential(TimmSigmoid(inplace=True), TimmSigmoid(), ln)
    slimgrad.convert_(model)
    why = _skipped(slimgrad.report(model))
    assert "fast norm is on" in why["2"] and "inplace=True" in why["0"]
    assert isinstance(model[1], snn.Sigmoid) and model[2] is ln

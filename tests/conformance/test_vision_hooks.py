"""Hooks registered before ``convert_`` stay the user's: their handles still remove them.

``convert_`` hands a replaced module's hook dicts themselves to its replacement (the table pass:
``slimgrad.convert._carry_hooks``), so a ``RemovableHandle`` taken before the conversion still
removes the hook from the converted model. The passes that swap modules next to a BatchNorm
(``convert_handlers.cnn.bn_act_pattern``: the activation after a BatchNorm, timm's
``BatchNormAct2d.act``; ``convert_handlers.abn.inplace_abn_pattern``: the max-pool after the stem's
ReLU) must do the same: a copy of the dicts keeps a removed hook firing in the converted model,
which then computes what the original no longer computes. Skipped parts need timm
(tests/conformance/_timm_shim.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from tests._threads import one_thread
from tests.conformance._timm_shim import timm


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _hook_all_then_remove(model, kinds):
    # a forward hook that doubles the output and a pre-hook that shifts the input on every module
    # of the given kinds; returns the handles and the call log
    calls, handles = [], []
    for m in model.modules():
        if isinstance(m, kinds):
            handles.append(m.register_forward_hook(lambda mod, i, o: calls.append(1) or o * 2))
            handles.append(m.register_forward_pre_hook(lambda mod, i: (i[0] + 1,)))
    return handles, calls


def _check(model, kinds, x, config=None):
    ref = copy.deepcopy(model)
    handles, calls = _hook_all_then_remove(model, kinds)
    assert handles
    slimgrad.convert_(model, config)
    for h in handles:
        h.remove()
    for mode in (True, False):
        model.train(mode), ref.train(mode)
        torch.manual_seed(0)
        out = model(x)
        torch.manual_seed(0)
        expected = ref(x)
        assert not calls, f"a removed hook fired {len(calls)} times"
        if config is None:  # the default conversion is exact
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    return model


def test_removed_hooks_on_the_act_after_a_batchnorm_stay_removed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1))
    model = model.append(nn.BatchNorm2d(4)).append(nn.SiLU()).append(nn.BatchNorm2d(4))
    model = model.append(nn.GELU())
    _check(model, (nn.ReLU, nn.SiLU, nn.GELU), torch.randn(2, 3, 7, 9))
    assert "AfterNorm" in type(model[2]).__name__, slimgrad.report(model)


@pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")
def test_removed_hooks_on_timm_batchnormact_act_stay_removed():
    torch.manual_seed(0)
    bn_act = timm.layers.BatchNormAct2d(4, act_layer=nn.ReLU)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), bn_act, nn.Conv2d(4, 2, 1))
    _check(model, (nn.ReLU, timm.layers.BatchNormAct2d), torch.randn(2, 3, 7, 9))
    assert "AfterNorm" in type(model[1].act).__name__, slimgrad.report(model)


class _Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(self.relu(self.bn(self.conv(x))))


def test_removed_hooks_on_the_stem_pool_stay_removed_with_inplace_abn():
    torch.manual_seed(0)
    model = _Stem()
    config = slimgrad.ConvertConfig(inplace_abn=True)
    _check(model, (nn.MaxPool2d,), torch.randn(2, 3, 9, 9), config)
    assert type(model.pool).__name__ == "MaxPool2dRecompute", slimgrad.report(model)


@pytest.mark.skipif(timm is None, reason="timm (tests/conformance/_timm_shim.py) not installed")
def test_inplace_hook_after_convert_on_timm_layer_norm2d():
    # NOTE [Forward hooks on an output-saving module] (slimgrad/nn/_hooks.py): timm's LayerNorm2d
    # converts to a LayerNorm that keeps its output; a hook added after convert_ that edits that
    # output in place makes it run eager's F.layer_norm (before: autograd's in-place error)
    from timm.layers import LayerNorm2d

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3), LayerNorm2d(8), nn.Conv2d(8, 4, 1))
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv[1]).__module__.startswith("slimgrad."), type(conv[1])

    def steer(mod, args, out):
        out.mul_(1.5)  # in place, returns None

    for m in (eager, conv):
        m[1].register_forward_hook(steer)
    x = torch.randn(2, 3, 9, 11)
    grads = []
    for m in (eager, conv):
        xi = x.clone().requires_grad_()
        y = m(xi)
        grads.append((y, *torch.autograd.grad(y.square().sum(), [xi, *m.parameters()])))
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

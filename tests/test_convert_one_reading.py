"""convert_ reads each module's structure once (NOTE [One reading of the structure per convert_]
in slimgrad/convert_handlers/inplace_guard.py).

The in-place guard traces every forward it reads with torch.fx before anything is swapped (once
in train mode, once in eval, or once for both: NOTE [One trace serves both modes]); the
BatchNorm + ReLU pattern and the reading of the converted model (``state_consumers_``: which
outputs are the model's output, which consumers keep y) read those traces, mapped through the
swaps, instead of tracing again. The flags that reading sets must be the ones a fresh reading of
the converted model sets (``state_consumers_`` called without the traces, as before), on HF,
timm, torchvision and plain-torch models.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import abn as _abn
from tests._readings import count_traces, read_afresh
from tests._threads import one_thread_each_test  # noqa: F401 (an autouse fixture)
from tests.conformance import _hf_families as H
from tests.conformance._timm_shim import timm


class _Residual(nn.Module):
    # a norm whose output is written in place, one that is the model's output, a GELU kept after
    def __init__(self):
        super().__init__()
        self.a, self.n1, self.act, self.fc = (
            nn.Linear(8, 8),
            nn.LayerNorm(8),
            nn.GELU(),
            nn.Linear(8, 8),
        )
        self.n2, self.drop = nn.LayerNorm(8), nn.Dropout(0.2)

    def forward(self, x):
        h = self.n1(self.a(x))
        h += x
        y = self.fc(self.act(h))
        return self.n2(self.drop(self.act(y)))


def _plain():
    return nn.Sequential(_Residual(), nn.Sequential(nn.Linear(8, 8), nn.SiLU()), _Residual())


def _hf(name):
    return lambda: H.build(H.FAMILIES[name])


def _timm(name, **kw):
    def build():
        if timm is None:
            pytest.skip("timm is not installed")
        return timm.create_model(name, pretrained=False, **kw)

    return build


def _torchvision():
    if timm is None:
        pytest.skip("torchvision is not installed")
    import torchvision

    return torchvision.models.resnet18()


MODELS = {
    "gpt2": _hf("gpt2"),
    "llama": _hf("llama"),
    "bert": _hf("bert"),
    "t5": _hf("t5"),
    "deberta_v2": _hf("deberta_v2"),
    "mixtral": _hf("mixtral"),
    "timm_resnet18": _timm("resnet18"),
    "vit_tiny": _timm("vit_tiny_patch16_224", depth=2),  # the blocks are alike: two say it
    # timm's tiny EfficientNet: efficientnet_b0's block types (depthwise-separable, inverted
    # residual with squeeze-excite, BatchNormAct2d) at one block per stage
    "efficientnet_b0": _timm("test_efficientnet"),
    "convnext_atto": _timm("convnext_atto", depths=(1, 1, 1, 1)),
    "torchvision_resnet18": _torchvision,
    "plain": _plain,
}


# rows whose convert_ must trace each forward at most once per mode (train, eval)
ONCE_PER_MODE = {"timm_resnet18", "convnext_atto", "plain"}
# rows with replacements that have children (timm's Attention, ConvNeXtBlock, norm + act and
# squeeze-excite blocks, GPT-2's and Llama's MLPs): they are read from the structure their class
# states (NOTE [A replacement states its structure]); every forward is traced once per mode,
# before the swaps (before: 24 of vit_tiny's 100 traces were of replacements, 65 of
# efficientnet_b0's 231, 4 on GPT-2, 2 on Llama)
SWAPS_UNTRACED = {"vit_tiny", "efficientnet_b0", "gpt2", "llama", "convnext_ls"}


def _check_traces(name, model, seen, before):
    if name in ONCE_PER_MODE:
        assert seen and max(seen.values()) <= 2, max(seen.values())
    if name in SWAPS_UNTRACED:
        made = {id(m) for m in model.modules()} - before
        assert made, "the row converts no module with children"
        assert not made & set(seen)
        assert max(seen.values(), default=0) <= 2


@pytest.mark.parametrize("name", list(MODELS))
def test_flags_are_a_fresh_readings(name, monkeypatch):
    # one convert_ per model for the three checks of the module docstring's NOTE: the traces it
    # made (counted before the fresh reading), then the flags against a fresh reading
    torch.manual_seed(0)
    model = MODELS[name]()
    before = {id(m) for m in model.modules()}
    _keep = list(model.modules())  # the originals stay alive: their ids stay unique
    seen = count_traces(monkeypatch)
    slimgrad.convert_(model)
    _check_traces(name, model, collections.Counter(seen), before)
    read_afresh(model)


def test_inplace_abn_reads_the_guards_traces(monkeypatch):
    # torchvision's ResNet: every parent of a BatchNorm is a plain-torch module the guard traced
    model = _torchvision()
    calls = []
    trace = _abn._trace
    monkeypatch.setattr(_abn, "_trace", lambda p: calls.append(p) or trace(p))
    slimgrad.convert_(model, slimgrad.ConvertConfig(inplace_abn=True))
    assert calls == []
    kinds = collections.Counter(t for _, _, t in slimgrad.report(model).converted)
    assert kinds["InPlaceABN"] + kinds["RecomputeABN"] == 9  # each block's bn1, the stem's bn1


def test_item_assignment_leaves_inplace_abn_its_own_trace(monkeypatch):
    # a plain tracer cannot trace ``h[...] = v`` (the guard's can): the pattern traces for itself
    # and reports what it reported before
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()

        def forward(self, x):
            h = self.relu(self.bn(self.conv(x)))
            h[:, 0] = 0.0
            return h

    model = nn.Sequential(Block())
    calls = []
    trace = _abn._trace
    monkeypatch.setattr(_abn, "_trace", lambda p: calls.append(p) or trace(p))
    slimgrad.convert_(model, slimgrad.ConvertConfig(inplace_abn=True))
    assert calls == [model[0]]
    assert any("not traceable" in r for _, _, r in slimgrad.report(model).skipped)


def test_no_module_the_swaps_made_is_traced(monkeypatch):
    # ConvNeXt's blocks with their Linear MLP (the other rows of SWAPS_UNTRACED are models of
    # test_flags_are_a_fresh_readings, checked there)
    model = _timm_kw("convnext_atto", conv_mlp=False, depths=(1, 1, 1, 1))()
    before = {id(m) for m in model.modules()}
    _keep = list(model.modules())  # the originals stay alive: their ids stay unique
    seen = count_traces(monkeypatch)
    slimgrad.convert_(model)
    _check_traces("convnext_ls", model, seen, before)


def _timm_kw(name, **kw):
    def build():
        if timm is None:
            pytest.skip("timm is not installed")
        return timm.create_model(name, pretrained=False, **kw)

    return build

"""The structure a replacement's class states (NOTE [A replacement states its structure] in
slimgrad/convert_handlers/inplace_guard.py) is at least what a reading of the module it replaced
finds.

The reading of the converted model asks which modules' outputs may be a module's output; for a
replacement with children it takes the answer from ``_slimgrad_output_statement`` instead of
tracing it. For every class that states one, on the rows below (each such class is on a row), the
statement's answer holds every module (by its name in the block) and the pass-through that the
guard's own reading of the original module finds, in train and in eval mode.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import inplace_guard as _guard
from slimgrad.nn import _output_act
from tests._threads import one_thread
from tests.conformance import _hf_families as H
from tests.conformance._timm_shim import timm


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _need_timm():
    if timm is None:
        pytest.skip("timm is not installed")


def _timm(name, **kw):
    def build():
        _need_timm()
        return timm.create_model(name, pretrained=False, **kw)

    return build


def _timm_layer(make):
    # a conv, the block, a conv: the block's replacement has a parent that reads it
    def build():
        _need_timm()
        return nn.Sequential(nn.Conv2d(3, 16, 1), make(timm.layers), nn.Conv2d(16, 4, 1))

    return build


def _torchvision_se():
    _need_timm()  # (torchvision comes with timm here)
    from torchvision.ops.misc import SqueezeExcitation

    return nn.Sequential(nn.Conv2d(3, 16, 1), SqueezeExcitation(16, 4), nn.Conv2d(16, 4, 1))


ROWS = {
    "vit_tiny": _timm("vit_tiny_patch16_224", depth=2),  # the blocks are alike: two say it
    "convnext_ls": _timm("convnext_atto", conv_mlp=False, depths=(1, 1, 1, 1)),
    # timm's tiny EfficientNet: efficientnet_b0's block types (depthwise-separable, inverted
    # residual with squeeze-excite, BatchNormAct2d) at one block per stage
    "efficientnet_b0": _timm("test_efficientnet"),
    "gpt2": lambda: H.build(H.FAMILIES["gpt2"]),
    "llama": lambda: H.build(H.FAMILIES["llama"]),
    "se": _timm_layer(lambda L: L.SEModule(16)),
    "effective_se": _timm_layer(lambda L: L.EffectiveSEModule(16)),
    "torchvision_se": _torchvision_se,
    "group_norm_act": _timm_layer(lambda L: L.GroupNormAct(16, 4, inplace=False)),
    "layer_norm_act2d": _timm_layer(lambda L: L.LayerNormAct2d(16, inplace=False)),
    "layer_norm_act": lambda: (
        nn.Sequential(
            nn.Linear(8, 16), timm.layers.LayerNormAct(16, inplace=False), nn.Linear(16, 4)
        )
        if timm is not None
        else pytest.skip("timm is not installed")
    ),
}


def _stating_classes():
    found = set()
    for pkg in ("slimgrad.nn", "slimgrad.convert_handlers"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            sub = importlib.import_module(f"{pkg}.{info.name}")
            for obj in vars(sub).values():
                if (
                    inspect.isclass(obj)
                    and obj.__module__ == sub.__name__
                    and "_slimgrad_output_statement" in vars(obj)
                ):
                    found.add(obj)
    return found


def _kinds():
    return (
        slimgrad.nn.SiLU,
        slimgrad.nn.GELU,
        slimgrad.nn.Mish,
        slimgrad.nn.ELU,
        slimgrad.nn.Hardswish,
        *_output_act._output_kinds(),
        *_output_act._copy_kinds(),
    )


def _names(block, ends):
    where = {id(m): n for n, m in block.named_modules(remove_duplicate=False)}
    return {where.get(id(m), "<outside>") for m in ends}


# the stating classes (where the statement is written) each row converts
STATES = {
    "vit_tiny": {"Attention"},
    "convnext_ls": {"ConvNeXtBlock"},
    "efficientnet_b0": {"_NormAct", "SqueezeExciteBlock"},
    "gpt2": {"GPT2MLP"},
    "llama": {"GatedMLP"},
    "se": {"SEModule"},
    "effective_se": {"EffectiveSEModule"},
    "torchvision_se": {"SqueezeExcitation"},
    "group_norm_act": {"_NormAct"},
    "layer_norm_act2d": {"_NormAct"},
    "layer_norm_act": {"_NormAct"},
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("row", list(ROWS))
def test_a_statement_holds_what_the_original_is_read_to_hold(row, mode):
    torch.manual_seed(0)
    model = ROWS[row]()
    model.train(mode == "train")
    original = copy.deepcopy(model)
    slimgrad.convert_(model)
    kinds = _kinds()
    met = set()
    for name, new in model.named_modules():
        stated = getattr(type(new), "_slimgrad_output_statement", None)
        if stated is None:
            continue
        old = original.get_submodule(name)
        assert _guard._Guard(outputs=kinds)._stated(new) is not None, name  # it applies
        # what the reading of the converted model takes (a norm + act that is itself a norm is
        # its own output; any other stating replacement: its statement)
        got = _guard._Guard(outputs=kinds).info(new)
        read = _guard._Guard(outputs=kinds).info(old)
        assert _names(old, read.ends) <= _names(new, got.ends), name
        assert got.passes or not read.passes, name
        met.update(
            c.__qualname__ for c in type(new).__mro__ if "_slimgrad_output_statement" in vars(c)
        )
    assert met == STATES[row]


def test_every_stating_class_is_on_a_row():
    assert {c.__qualname__ for c in _stating_classes()} == set().union(*STATES.values())

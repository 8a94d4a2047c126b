"""torch.jit.script of a converted model fails with slimgrad's error naming module and fix."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import slimgrad
import slimgrad.nn as snn


def _slimgrad_module_classes():
    out = []
    for info in pkgutil.iter_modules(snn.__path__):
        mod = importlib.import_module(f"slimgrad.nn.{info.name}")
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, nn.Module)
                and obj.__module__ == mod.__name__
                and not name.startswith("_")
            ):
                out.append(obj)
    return out


@pytest.mark.parametrize("cls", _slimgrad_module_classes(), ids=lambda c: c.__name__)
def test_every_slimgrad_module_refuses_script(cls):
    assert hasattr(cls, "__prepare_scriptable__"), (
        f"{cls.__module__}.{cls.__name__} lacks NoScript (script would fail inside slimgrad)"
    )


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 2),
        nn.GELU(),
    )


def test_script_of_converted_model_names_module_and_fix():
    m = _cnn()
    torch.jit.script(_cnn())  # the unconverted model scripts
    slimgrad.convert_(m)
    with pytest.raises(RuntimeError, match=r"slimgrad\.nn\.\w+: torch\.jit\.script cannot") as e:
        torch.jit.script(m)
    assert "before slimgrad.convert_" in str(e.value)


def test_script_of_nested_converted_module():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.SiLU())

        def forward(self, x):
            return self.body(x) + 1

    m = Net()
    slimgrad.convert_(m)
    converted = [type(x).__module__ for x in m.modules()]
    assert any(c.startswith("slimgrad.") for c in converted)
    # the first slimgrad module scripting meets (the Linear, converted since nn.Linear converts)
    with pytest.raises(RuntimeError, match=r"slimgrad\.nn\.(Linear|SiLU): torch\.jit\.script"):
        torch.jit.script(m)

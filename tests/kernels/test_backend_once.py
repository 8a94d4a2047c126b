"""The kernel backend is decided once (NOTE [Kernel backend choice], "Decided once"): no environment
read per op call, and set_backend / refresh still switch a model converted before."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.kernels import _backend as B
from slimgrad.kernels import _cpu

ln_mod = importlib.import_module("slimgrad.ops.layer_norm")


class _CountingEnviron(dict):
    """os.environ stand-in that counts reads per key."""

    def __init__(self, env):
        super().__init__(env)
        self.reads: dict[str, int] = {}

    def _seen(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1

    def get(self, key, default=None):
        self._seen(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._seen(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._seen(key)
        return super().__contains__(key)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with B.set_backend(None):
        yield


def _model() -> nn.Module:
    torch.manual_seed(0)
    # the LayerNorm's output is kept by the next Linear: a LayerNorm whose output nobody keeps
    # runs eager's op (NOTE [A LayerNorm whose output nobody keeps runs eager's op])
    m = nn.Sequential(
        nn.Linear(8, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(16, 4),
    )
    return slimgrad.convert_(m)


def _step(m: nn.Module) -> None:
    x = torch.randn(3, 5, 8, requires_grad=True)
    m(x).sum().backward()


def test_no_environment_read_per_call(monkeypatch):
    m = _model()
    _step(m)  # resolves the backend, builds the C kernels
    env = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", env)
    for _ in range(3):
        _step(m)
    assert env.reads.get(B.ENV_VAR, 0) == 0, env.reads
    assert env.reads.get("TRITON_INTERPRET", 0) == 0, env.reads


def test_environment_read_once_then_again_after_refresh(monkeypatch):
    assert B.get_backend() == "auto"
    monkeypatch.setenv(B.ENV_VAR, "torch")
    assert B.get_backend() == "auto"  # read once: a change in between is not seen
    B.refresh()
    assert B.get_backend() == "torch"
    monkeypatch.setenv(B.ENV_VAR, "auto")
    with B.set_backend(None):  # set_backend also reads it again
        assert B.get_backend() == "auto"


def _count_torch_bwd(monkeypatch) -> list:
    calls = []
    real = ln_mod._bwd_torch

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ln_mod, "_bwd_torch", counted)
    return calls


def test_set_backend_switches_a_converted_model(monkeypatch):
    if not _cpu.available("layer_norm"):
        pytest.skip(f"C kernels unavailable: {_cpu.last_error('layer_norm')}")
    m = _model()
    calls = _count_torch_bwd(monkeypatch)
    _step(m)
    assert calls == []  # auto: the C backward
    with B.set_backend("torch"):
        _step(m)
        assert len(calls) == 1  # the same model, now the PyTorch backward
    _step(m)
    assert len(calls) == 1  # restored: C again
    monkeypatch.setenv(B.ENV_VAR, "torch")
    B.refresh()
    _step(m)
    assert len(calls) == 2  # $SLIMGRAD_BACKEND=torch, read again after refresh()


def test_bad_environment_value_keeps_raising(monkeypatch):
    monkeypatch.setenv(B.ENV_VAR, "fast")
    B.refresh()
    for _ in range(2):  # a bad value is not cached as a choice
        with pytest.raises(ValueError, match=r"\$SLIMGRAD_BACKEND"):
            B.get_backend()

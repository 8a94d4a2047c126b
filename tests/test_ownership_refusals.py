"""Forward writes a hook or a mode refuses are counted and reported, and a watcher that states it
keeps no tensor gets the unwatched step (NOTE [Forward writes a watcher refuses] in
slimgrad/ownership.py).

The block is torchvision's BasicBlock shape (conv, BatchNorm, in-place ReLU, conv, BatchNorm,
residual, in-place ReLU), converted: unwatched, the ReLU after each block's first BatchNorm skips
the write over its input by ownership (reuse_count("forward")). A plain dispatch mode that counts
storages, or a forward hook, could keep that input: the write is refused, ``refused_writes`` and
``measure(...).writes_refused`` name the watcher, and the step keeps more. Stated with
``keeps_no_tensor``, the same watcher gets the unwatched grants, bytes and bits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import slimgrad
from slimgrad import ownership
from slimgrad.memory import measure
from tests._ownership_helpers import BasicBlock, reuse_on  # noqa: F401 (reuse_on: autouse fixture)


def _model():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 1), BasicBlock(8), BasicBlock(8))
    return slimgrad.convert_(copy.deepcopy(eager)).train()


X = torch.randn(2, 3, 9, 7, generator=torch.Generator().manual_seed(1))


class _CountStorages(TorchDispatchMode):
    # a plain mode: counts the storages its ops read, keeps ints only, states nothing
    def __init__(self) -> None:
        super().__init__()
        self.ptrs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.layout == torch.strided:
                self.ptrs.add(a.data_ptr())
        return func(*args, **kwargs)


def _step(model):
    for p in model.parameters():
        p.grad = None
    ownership.reset_reuse_count()
    out = model(X)
    out.square().sum().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters()]


def _measured(model, mode=None):
    for p in model.parameters():
        p.grad = None
    ownership.reset_reuse_count()
    if mode is None:
        m = measure(lambda: model(X).square().sum())
    else:
        with mode:
            m = measure(lambda: model(X).square().sum())
    return m, ownership.reuse_count("forward")


def test_a_plain_dispatch_mode_refuses_the_write_and_measure_says_so():
    model = _model()
    ref = _step(model)
    granted = ownership.reuse_count("forward")
    assert granted == 2  # the ReLU after bn1 of each block
    m0, g0 = _measured(model)
    assert (g0, m0.writes_refused) == (2, {})

    before = ownership.refused_writes()
    mode = _CountStorages()
    with mode:
        got = _step(model)
    assert ownership.reuse_count("forward") == 0
    assert mode.ptrs  # it watched
    after = ownership.refused_writes()
    assert (
        after.get("TorchDispatchMode _CountStorages", 0)
        - before.get("TorchDispatchMode _CountStorages", 0)
        == 2
    )
    # refused: the ReLU runs eager's in-place op and its BatchNorm keeps x (aten's backward), so
    # the output has the same bits and the gradients agree to rounding
    torch.testing.assert_close(ref[0], got[0], rtol=0, atol=0)
    for a, b in zip(ref[1:], got[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    m1, g1 = _measured(model, _CountStorages())
    assert g1 == 0
    assert m1.writes_refused == {"TorchDispatchMode _CountStorages": 2}
    assert m1.peak_bytes > m0.peak_bytes  # what the refusal costs
    assert "TorchDispatchMode _CountStorages could keep the input" in m1.summary()


def test_a_mode_that_states_it_keeps_no_tensor_gets_the_unwatched_step():
    model = _model()
    ref = _step(model)
    m0, _ = _measured(model)
    mode = ownership.keeps_no_tensor(_CountStorages())  # this instance only
    with mode:
        got = _step(model)
    assert ownership.reuse_count("forward") == 2
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    m1, g1 = _measured(model, mode)
    assert (g1, m1.writes_refused) == (2, {})
    assert (m1.saved_bytes, m1.peak_bytes) == (m0.saved_bytes, m0.peak_bytes)
    # another instance of the class has not stated it
    _, g2 = _measured(model, _CountStorages())
    assert g2 == 0


def test_a_forward_hook_is_named_and_a_stated_one_is_granted():
    model = _model()
    ref = _step(model)
    seen = []

    def hook(mod, args, out):
        seen.append(out.shape)  # keeps a shape, no tensor

    h = model[1].bn1.register_forward_hook(hook)
    try:
        m1, g1 = _measured(model)
        assert g1 == 1  # the second block's ReLU still granted
        assert m1.writes_refused == {f"a forward hook on {type(model[1].bn1).__name__}": 1}
        ownership.keeps_no_tensor(hook)
        got = _step(model)
        assert ownership.reuse_count("forward") == 2
        m2, g2 = _measured(model)
        assert (g2, m2.writes_refused) == (2, {})
    finally:
        h.remove()
    assert seen
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_keeps_no_tensor_rejects_what_cannot_carry_the_statement():
    with pytest.raises(TypeError, match=r"keeps_no_tensor: expected a function.*got int"):
        ownership.keeps_no_tensor(3)

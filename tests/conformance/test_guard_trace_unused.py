"""Conformance: an object a convert_ trace can neither copy nor put back (a generator, a
``ThreadPoolExecutor``'s ``SimpleQueue``, a ``memoryview``) refuses only a trace whose forward
uses it (NOTE [A trace leaves the model as it was] in slimgrad/convert_handlers/inplace_guard.py).

Before the fix any such object anywhere in the module tree refused every trace, so a
resnet-like convnet that merely held one lost the BatchNorm + ReLU and ownership patterns: more
bytes saved for backward than the same model without it. Each row converts the convnet with the
object held and unused and compares saved and peak bytes (slimgrad's tracker, exact) with the
convnet without it. A forward that does use such an object still refuses: nothing is run on the
object, it is the same object afterwards, and the first real step matches an unconverted twin.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import memory
from slimgrad.convert_handlers.inplace_guard import untouched
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _gen():
    yield 0
    yield 1


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(_Block(8), _Block(8))
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


def _measure(m: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    r = memory.measure(lambda: m(x).square().mean(), module=m)
    return r.saved_bytes, r.peak_bytes


_OBJECTS = {
    "executor": cf.ThreadPoolExecutor,
    "generator": _gen,
    "memoryview": lambda: memoryview(bytearray(16)),
}


@pytest.mark.parametrize(
    "kind, where", [("executor", "root"), ("generator", "block"), ("memoryview", "root")]
)
def test_an_unused_object_keeps_the_saving(kind, where):
    x = torch.randn(2, 3, 9, 9)
    torch.manual_seed(0)
    plain = _Net()
    slimgrad.convert_(plain)
    want = _measure(plain, x)
    torch.manual_seed(0)
    m = _Net()
    obj = _OBJECTS[kind]()
    holder = m.layer1[1] if where == "block" else m
    holder.extra = obj
    slimgrad.convert_(m)
    assert _measure(m, x) == want
    assert holder.__dict__["extra"] is obj
    assert [type(d) for d in m.modules()] == [type(d) for d in plain.modules()]
    if kind == "generator":
        assert next(obj) == 0  # not run by the trace
    elif kind == "executor":
        obj.shutdown()


class _Uses(_Net):
    # a forward that uses what it holds
    def __init__(self, kind: str, catch: bool = False):
        super().__init__()
        self.kind, self.catch = kind, catch
        self.extra = _OBJECTS[kind]()
        self.seen: list = []

    def forward(self, x):
        try:
            if self.kind == "generator":
                self.seen.append(next(self.extra))
            elif self.kind == "executor":
                self.seen.append(self.extra.submit(int, 1).result())
            else:
                self.seen.append(len(self.extra))
        except Exception:
            if not self.catch:
                raise
        return super().forward(x)


@pytest.mark.parametrize("kind", list(_OBJECTS))
def test_a_used_object_refuses_and_is_left_as_it_was(kind):
    torch.manual_seed(0)
    m = _Uses(kind)
    torch.manual_seed(0)
    ref = _Uses(kind)
    obj = m.extra
    slimgrad.convert_(m)
    assert m.extra is obj and m.seen == []
    x = torch.randn(2, 3, 9, 9)
    y, yr = m(x), ref(x)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    assert m.seen == ref.seen == [{"generator": 0, "executor": 1, "memoryview": 16}[kind]]
    if kind == "executor":
        m.extra.shutdown()
        ref.extra.shutdown()


def test_a_use_the_forward_catches_still_refuses():
    # the forward swallows the stand-in's exception: the trace is refused all the same
    m = _Uses("generator", catch=True).eval()  # (eval: no running statistics written)
    gen = m.extra
    with pytest.raises(RuntimeError, match="got one that uses generator"):
        with untouched(m):
            m(torch.randn(1, 3, 5, 5))
    assert m.extra is gen and next(gen) == 0

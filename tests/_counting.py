"""Counters shared by the tests: the calls that reach one attribute of a module (a test seam, e.g.
a node's ``apply``), and the ATen ops a block of code runs."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Wrap ``owner.<name>`` for the test; the returned one-element list counts its calls."""
    n = [0]
    real = getattr(owner, name)

    def counting(*a):
        n[0] += 1
        return real(*a)

    monkeypatch.setattr(owner, name, counting)
    return n


class OpCounts(TorchDispatchMode):
    """``with OpCounts() as ops:``: ``ops.count`` counts the ATen ops run inside, by overload packet
    (``"aten.any"``); a plain dispatch mode (a slimgrad custom op counts as one op)."""

    # stores no result: ops keep their own paths under it (NOTE [The fused loss under a mode
    # that stores results] in slimgrad/ops/linear_cross_entropy.py)
    _slimgrad_reads_ops = True

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

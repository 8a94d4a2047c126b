"""What the tracker reads of each tensor under ``estimate``'s fake tensors costs no dispatch.

The tracker asks every tensor of every op where its storage is (``slimgrad.memory._storage``),
and the estimate's dispatch asks whether an op's tensors are index tensors with known values
(``_known_values``, NOTE [Index tensors keep their values under fake tensors]). A fake tensor's
``is_meta`` is answered through a Python dispatch of ``prim.device`` (about 60 us under the
estimate's modes, once per tensor per op); the answers here are the ones ``is_meta`` and the
flattened arguments give, without it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad import memory
from slimgrad.memory import fake_tensors


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_fake_tensors_storage_is_read_without_a_dispatch():
    with fake_tensors():
        t = torch.randn(3, 4)
        meta = torch.empty(3, device="meta")  # a fake tensor whose fake device is meta
        with _Ops() as seen:
            st = memory._storage(t)
            none = memory._storage(meta)
        assert seen.ops == []
        assert st is not None and st.nbytes() == 48 and not t.is_meta
        assert none is None and meta.is_meta
    assert memory._storage(torch.empty(2, device="meta")) is None
    assert memory._storage(torch.zeros(2)).nbytes() == 8
    assert memory._storage(torch.zeros(2).to_sparse()) is None
    assert memory._storage(3) is None


def test_known_values_answers_as_the_flattened_arguments_do():
    idx = torch.arange(4)
    aten = torch.ops.aten
    with fake_tensors():
        x = torch.randn(4)
        # a fake (or floating) tensor anywhere in the arguments: not run on real values
        assert memory._known_values(aten.add.Tensor, (x, idx), {}) is None
        assert memory._known_values(aten.cat.default, ([idx, x],), {}) is None
        assert memory._known_values(aten.index.Tensor, (idx, [x]), {}) is None
        # index tensors only: run on them, the real result
        out = memory._known_values(aten.add.Tensor, (idx, idx), {})
        assert type(out) is torch.Tensor and out.tolist() == [0, 2, 4, 6]
        cat = memory._known_values(aten.cat.default, ([idx, idx],), {"dim": 0})
        assert type(cat) is torch.Tensor and cat.tolist() == [0, 1, 2, 3] * 2

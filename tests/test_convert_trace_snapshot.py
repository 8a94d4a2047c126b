"""A trace finds and puts back every generator the module tree holds, in the one walk of the
module attributes it makes for the rest of the snapshot (NOTE [A trace leaves the model as it
was] in slimgrad/convert_handlers/inplace_guard.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from slimgrad.convert_handlers import inplace_guard as _guard


class _Draws(nn.Module):
    def __init__(self, which):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.which = which
        self.py, self.gen = random.Random(0), torch.Generator().manual_seed(0)
        self.np = np.random.default_rng(0)
        self.inner = nn.Sequential(nn.Linear(4, 4))
        self.inner[0].gen = torch.Generator().manual_seed(1)  # a generator below the root

    def forward(self, x):
        if self.which == "py":
            self.py.random()
        elif self.which == "torch":
            torch.rand([], generator=self.gen)
        elif self.which == "numpy":
            self.np.random()
        elif self.which == "inner":
            torch.rand([], generator=self.inner[0].gen)
        return self.fc(x)


def _states(m):
    return (
        m.py.getstate(),
        m.gen.get_state(),
        m.np.bit_generator.state,
        m.inner[0].gen.get_state(),
        torch.random.get_rng_state(),
    )


def _same(a, b):
    return _guard._same(list(a), list(b))


@pytest.mark.parametrize("which", ["py", "torch", "numpy", "inner", None])
def test_a_draw_is_seen_and_put_back(which):
    m = _Draws(which)
    before = _states(m)
    graph, drew, _kept = _guard._trace(m)
    assert drew is (which is not None)
    assert _same(_states(m), before)
    assert any(n.op == "call_module" for n in graph.nodes)

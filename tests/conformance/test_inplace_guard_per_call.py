"""Conformance: the in-place guard's torch.fx trace is trusted only where it does not depend on
the call (NOTE [In-place writers after output-saving modules] in
slimgrad/convert_handlers/inplace_guard.py).

torch.fx runs forward once, so a branch on ``self.training`` or on a random draw is fixed at trace
time: a write after a norm that the trace did not take (a LayerDrop-style random skip, a
training-only in-place write, the model converted in eval mode) was missed, the norm converted, and
the write then raised autograd's in-place error where eager trains. Each row converts at several
seeds and in both modes, checks the norm is kept, then trains and compares with eager.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import kept_reason
from tests._threads import one_thread
from tests.conformance.test_round3_adversarial import _assert_rule, _grads, _loss, _r


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _Base(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 8)
        self.p = p


class _TrainingWrite(_Base):
    # a write over the norm's output in training only
    def forward(self, x):
        h = self.norm(self.fc1(x))
        if self.training:
            h.mul_(0.5)
        return self.fc2(h)


class _RandomAct(_Base):
    # an in-place activation applied on a random draw (Python's random module)
    def forward(self, x):
        h = self.norm(self.fc1(x))
        if random.random() < self.p:
            h = self.act(h)
        return self.fc2(h)


class _LayerDrop(nn.Module):
    # LayerDrop over a ModuleList whose second layer writes its input in place
    def __init__(self, p=0.5):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.LayerNorm(8), nn.ReLU(inplace=True)])
        self.fc2 = nn.Linear(8, 8)
        self.p = p

    def forward(self, x):
        h = self.fc1(x)
        for layer in self.layers:
            if self.training and torch.rand([]).item() < self.p:
                continue
            h = layer(h)
        return self.fc2(h)


class _EvalWrite(_Base):
    # a write in eval mode only (converted in train mode)
    def forward(self, x):
        h = self.norm(self.fc1(x))
        if not self.training:
            h.add_(1.0)
        return self.fc2(h)


CASES = {
    "training_only_write": (_TrainingWrite, "norm"),
    "random_inplace_act": (_RandomAct, "norm"),
    "layerdrop_skip": (_LayerDrop, "layers.0"),
    "eval_only_write": (_EvalWrite, "norm"),
}


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", list(CASES))
def test_a_write_the_trace_did_not_take_keeps_the_norm(case, seed, train):
    cls, norm = CASES[case]
    random.seed(seed)
    torch.manual_seed(seed)
    m = cls().train(train)
    state = (random.getstate(), torch.random.get_rng_state())
    m = slimgrad.convert_(m)
    assert type(m.get_submodule(norm)) is nn.LayerNorm, slimgrad.report(m)
    assert kept_reason(m.get_submodule(norm)) is not None
    assert m.training is train
    # the traces left the caller's random streams as they were
    assert random.getstate() == state[0] and torch.equal(torch.random.get_rng_state(), state[1])


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", list(CASES))
def test_trains_as_eager_whatever_fell_at_convert_time(case, seed, mode):
    cls, _ = CASES[case]

    def build():
        m = cls().train(mode == "train")
        random.seed(seed)  # what the trace at convert_ time draws
        torch.manual_seed(seed)
        return m

    def step(m, dt):
        m.train(mode != "train")  # the other mode than at convert_ time
        random.seed(100 + seed)  # the same draws on each side
        torch.manual_seed(100 + seed)
        x = _r(4, 8, dt=dt, rg=True)
        loss = torch.zeros((), dtype=dt)
        for _ in range(3):
            loss = loss + _loss(m(x * 1.5))
        return _grads(m, loss, [x])

    _assert_rule(build, step)


class _Plain(_Base):
    # no write at all, a branch on the mode: the norm converts (the source reading sees no write)
    def forward(self, x):
        h = self.norm(self.fc1(x))
        if self.training:
            h = h * 0.5
        return self.fc2(h)


def test_a_mode_branch_without_a_write_still_converts():
    m = slimgrad.convert_(_Plain())
    assert type(m.norm).__module__.startswith("slimgrad."), slimgrad.report(m)

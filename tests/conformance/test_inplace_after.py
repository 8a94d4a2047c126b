"""Conformance: an in-place write after a module whose slimgrad version keeps its output.

Adversarial F2 (issue 13): LayerNorm/RMSNorm/GroupNorm/LlamaRMSNorm and GELU/SiLU/Mish/LeakyReLU/
ELU/Hardtanh/ReLU6 keep their output for backward once converted (eager keeps their input); an
in-place writer of that output (ReLU(inplace=True), Dropout(inplace=True), ``h.relu_()``,
``h += r``, ..., also through slices and transposes) made the converted backward raise where
eager trains.
``convert_`` must leave such modules unconverted and say why (NOTE [In-place writers after
output-saving modules] in ``convert_handlers/inplace_guard.py``), and keep converting the others.
Every row: converted vs eager vs a float64 copy by the error rule (outputs, every gradient), same
seed for dropout, train and eval.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import slimgrad
from slimgrad.testing import assert_within_rule
from tests._threads import one_thread

WRITERS = {
    "ReLU": lambda: nn.ReLU(inplace=True),
    "ReLU6": lambda: nn.ReLU6(inplace=True),
    "LeakyReLU": lambda: nn.LeakyReLU(0.1, inplace=True),
    "ELU": lambda: nn.ELU(inplace=True),
    "Hardtanh": lambda: nn.Hardtanh(inplace=True),
    "SiLU": lambda: nn.SiLU(inplace=True),
    "Mish": lambda: nn.Mish(inplace=True),
    "Dropout": lambda: nn.Dropout(0.3, inplace=True),
}
# (module, input shape); the (/tmp/adv/inplace_grid.py) grid: norms, BatchNorm and no norm at all
NORMS = {
    "LayerNorm": (lambda: nn.LayerNorm(8), (6, 8)),
    "RMSNorm": (lambda: nn.RMSNorm(8), (6, 8)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 8), (6, 8, 5)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(8), (6, 8)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(8), (3, 8, 4, 4)),
    "Identity": (lambda: nn.Identity(), (6, 8)),
}
SAVERS = {
    "LlamaRMSNorm": lambda: LlamaRMSNorm(8),
    "GELU": lambda: nn.GELU(),
    "GELUtanh": lambda: nn.GELU("tanh"),
    "SiLU": lambda: nn.SiLU(),
    "Mish": lambda: nn.Mish(),
    "LeakyReLU": lambda: nn.LeakyReLU(0.2),
    "ELU": lambda: nn.ELU(),
    "Hardtanh": lambda: nn.Hardtanh(-0.5, 0.5),
    "ReLU6": lambda: nn.ReLU6(),
    "LayerNorm": lambda: nn.LayerNorm(8),
}
MODES = ["plain", "view", "reuse", "transposed"]


class Grid(nn.Module):
    # /tmp/adv/inplace_grid.py's model: Linear -> norm -> act (inplace) used four ways -> Linear
    # (channels first is fixed at construction, not read from x.dim(), so that torch.fx traces it)
    def __init__(self, norm, act, mode, channels_first=False):
        super().__init__()
        self.pre, self.norm, self.act, self.mode = nn.Linear(8, 8), norm, act, mode
        self.post, self.channels_first = nn.Linear(8, 8), channels_first

    def forward(self, x):
        cf = self.channels_first
        h = self.pre(x.transpose(1, -1)).transpose(1, -1) if cf else self.pre(x)
        h = self.norm(h)
        if self.mode == "plain":
            h = self.act(h)
        elif self.mode == "view":
            self.act(h[:, :4])
        elif self.mode == "reuse":
            h = self.act(h) + h
        elif self.mode == "transposed":
            h = self.act(h.transpose(0, 1)).transpose(0, 1)
        h = h.transpose(1, -1) if cf else h
        return self.post(h)


class Functional(nn.Module):
    # in-place writes in a plain-torch forward, no writer module
    def __init__(self, saver, how):
        super().__init__()
        self.pre, self.saver, self.how, self.post = nn.Linear(8, 8), saver, how, nn.Linear(8, 8)

    def forward(self, x):
        r = self.pre(x)
        h = self.saver(r)
        if self.how == "relu_":
            h.relu_()
        elif self.how == "F.relu(inplace)":
            h = F.relu(h, inplace=True)
        elif self.how == "F.leaky_relu(positional)":
            F.leaky_relu(h, 0.1, True)
        elif self.how == "iadd":
            h += r
        elif self.how == "slice.mul_":
            h[:, 1:5].mul_(2)
        elif self.how == "t().clamp_":
            h.t().clamp_(min=-0.1)
        elif self.how == "flatten.dropout_":
            F.dropout(torch.flatten(h, 1), 0.3, True, True)
        elif self.how == "narrow.add_":
            h.narrow(1, 2, 3).add_(1)
        elif self.how == "setitem":
            h[:, 0] = 0.0
        return self.post(h)


class Untraceable(nn.Module):
    # data-dependent control flow: torch.fx cannot trace it
    def __init__(self, act):
        super().__init__()
        self.pre, self.norm, self.act, self.post = (
            nn.Linear(8, 8),
            nn.LayerNorm(8),
            act,
            nn.Linear(8, 8),
        )

    def forward(self, x):
        h = self.norm(self.pre(x))
        if h.sum() > -1e9:
            h = self.act(h)
        return self.post(h)


@pytest.fixture(autouse=True)
def _one_thread():
    # hundreds of tiny models: thread start-up, not arithmetic, would dominate
    with one_thread():
        yield


def _check(model, x, train):
    model.train(train)
    conv = slimgrad.convert_(copy.deepcopy(model))
    ref = copy.deepcopy(model).double()
    outs = []
    for m, xx in ((conv, x), (model, x), (ref, x.double())):
        xx = xx.clone().requires_grad_()
        torch.manual_seed(7)
        y = m(xx)
        y.square().sum().backward()
        outs.append([y, xx.grad, *(p.grad for p in m.parameters())])
    assert_within_rule(outs[0], outs[2], outs[1])
    return slimgrad.report(conv)


def _skipped(rep):
    return {n: r for n, _, r in rep.skipped}


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("norm", list(NORMS))
def test_grid_norm_then_inplace_writer(norm, train):
    mk, shape = NORMS[norm]
    for writer, mw in WRITERS.items():
        if not train and writer != "Dropout" and not norm.startswith("BatchNorm"):
            # eval runs train's code path here (the same coverage arcs of slimgrad's source and
            # this file, every mode): only a Dropout writer and a BatchNorm read the mode
            continue
        for mode in MODES:
            torch.manual_seed(0)
            model, x = Grid(mk(), mw(), mode, len(shape) > 2), torch.randn(*shape)
            rep = _check(model, x, train)
            if norm in ("LayerNorm", "RMSNorm", "GroupNorm"):
                reason = _skipped(rep).get("norm", "")
                assert "in-place write follows it (act: " in reason, (writer, mode)


@pytest.mark.parametrize("saver", list(SAVERS))
def test_output_savers_then_writer_module(saver):
    for writer, mode in (("ReLU", "plain"), ("LeakyReLU", "view"), ("Dropout", "transposed")):
        for train in (True, False):
            torch.manual_seed(0)
            rep = _check(Grid(SAVERS[saver](), WRITERS[writer](), mode), torch.randn(6, 8), train)
            assert "in-place write follows it (act: " in _skipped(rep)["norm"], (writer, mode)


HOWS = [
    "relu_",
    "F.relu(inplace)",
    "F.leaky_relu(positional)",
    "iadd",
    "slice.mul_",
    "t().clamp_",
    "flatten.dropout_",
    "narrow.add_",
    "setitem",
]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("saver", ["LayerNorm", "GELU", "LlamaRMSNorm"])
def test_inplace_writes_in_a_plain_torch_forward(saver, how):
    for train in (True, False):
        torch.manual_seed(0)
        rep = _check(Functional(SAVERS[saver](), how), torch.randn(6, 8), train)
        assert "in-place write follows" in _skipped(rep)["saver"]


def test_sequential_nested_and_through_view_modules():
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    seq = nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
        nn.Identity(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)),
        nn.GELU(),
        nn.Linear(8, 8),
        nn.SiLU(),
        nn.Dropout(0.2, inplace=True),
        nn.Linear(8, 8),
    )
    for train in (True, False):
        rep = _check(seq, x, train)
        skipped = _skipped(rep)
        assert "in-place write follows" in skipped["1.1"]  # LayerNorm -> ... -> ReLU(inplace)
        assert "in-place write follows" in skipped["8"]  # SiLU -> Dropout(inplace)
        assert "6" not in skipped  # GELU -> Linear: fresh tensor, stays converted


def test_writer_inside_a_child_module_and_saver_at_a_childs_end():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.lin(x)).transpose(0, 1)

    class Writes(nn.Module):
        def forward(self, x):
            return x.clamp_(min=0)

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.writes, self.post = Block(), Writes(), nn.Linear(6, 6)

        def forward(self, x):
            return self.post(self.writes(self.block(x)[:, :]).transpose(0, 1).T)

    torch.manual_seed(0)
    for train in (True, False):
        rep = _check(Parent(), torch.randn(6, 8), train)
        assert "in-place write follows" in _skipped(rep)["block.norm"]


def test_untraceable_parent_keeps_savers_only_with_an_inplace_child():
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    rep = _check(Untraceable(nn.ReLU(inplace=True)), x, True)
    want = "in-place write follows it (act: ReLU, which writes its input in place (inplace=True))"
    assert want in _skipped(rep)["norm"]
    rep = _check(Untraceable(nn.ReLU()), x, True)
    assert "norm" in {n for n, _, _ in rep.converted}


class UntraceableWriter(nn.Module):
    # torch.fx cannot trace it (data-dependent branch) and its own code writes a saver's output
    # in place: the forward's source is read (NOTE [In-place writes in HF forwards])
    def __init__(self, saver, how):
        super().__init__()
        self.pre, self.saver, self.post = nn.Linear(8, 8), saver, nn.Linear(8, 8)
        # a number setting: the source reading follows only the branch it selects
        self.how = ["iadd", "method", "slice", "fresh"].index(how)

    def forward(self, x):
        h = self.saver(self.pre(x))
        if h.sum() > -1e9:
            if self.how == 0:
                h += x
            elif self.how == 1:
                h.mul_(2.0)
            elif self.how == 2:
                h[:, :2] = 0.0
            else:  # a fresh tensor is written: the saver keeps converting
                h = h * 1.0
                h += x
        return self.post(h)


@pytest.mark.parametrize("how", ["iadd", "method", "slice", "fresh"])
@pytest.mark.parametrize("saver", ["GELU", "SiLU", "LayerNorm", "ELU"])
def test_untraceable_parent_writing_in_its_own_code(saver, how):
    torch.manual_seed(0)
    for train in (True, False):
        rep = _check(UntraceableWriter(SAVERS[saver](), how), torch.randn(6, 8), train)
        if how == "fresh":
            assert "saver" in {n for n, _, _ in rep.converted}
        else:
            assert "in-place write follows it" in _skipped(rep)["saver"], how


def test_no_writer_keeps_the_saving():
    # out-of-place acts after the savers, and a writer after a fresh tensor: all converted
    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(), nn.GELU(), nn.Linear(8, 8), nn.ReLU(True)
    )
    rep = _check(seq, torch.randn(6, 8), True)
    assert {"1", "2", "3"} <= {n for n, _, _ in rep.converted}
    for train in (True, False):
        rep = _check(Grid(nn.LayerNorm(8), nn.ReLU(), "plain"), torch.randn(6, 8), train)
        assert "norm" in {n for n, _, _ in rep.converted}


class _CountingBlock(nn.Module):
    # updates its own buffer in forward (as timm's BatchNormAct2d does with num_batches_tracked)
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.norm = nn.LayerNorm(8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        self.calls.add_(1)
        return self.act(self.norm(x))


def test_convert_traces_without_running_buffer_updates():
    # the in-place guard and the ABN pass trace forwards with torch.fx: a buffer update in a
    # traced forward must be recorded in the graph, not run on the model's real buffer
    model = nn.Sequential(nn.Linear(8, 8), _CountingBlock(), nn.BatchNorm1d(8), nn.ReLU())
    slimgrad.convert_(model, slimgrad.ConvertConfig(inplace_abn=True))
    assert int(model[1].calls) == 0
    rep = str(slimgrad.report(model))
    assert "norm" in rep  # the block was analysed: its LayerNorm is reported (kept: ReLU writes)


class _MyGELU(nn.GELU):  # converts under the subclass rule, so the guard must see it too
    pass


@pytest.mark.parametrize("saver", [_MyGELU, nn.Hardswish])
def test_subclass_and_hardswish_savers_then_writer_stay_eager(saver):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.act = saver()

        def forward(self, x):
            h = self.act(self.lin(x))
            h.add_(1.0)  # in-place write over the saver's output
            return h

    model = nn.Sequential(Block())
    ref = copy.deepcopy(model)
    slimgrad.convert_(model)
    assert type(model[0].act) is saver, slimgrad.report(model)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # eager's behaviour: no in-place error
    ref(x).sum().backward()
    torch.testing.assert_close(model[0].lin.weight.grad, ref[0].lin.weight.grad)

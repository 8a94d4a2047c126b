"""convert_ as analyse -> decide -> apply -> record (the stages in slimgrad/convert.py's docstring).

``decide`` and the neighbour patterns (``decide_patterns``) build every replacement and reason
without touching the model; ``apply`` swaps and patches; the report's rows come from the
decisions; each module's facts are read once per ``convert_``, HF attention analysed once, and
the in-place guard reads the model before anything is swapped.
"""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad import convert as cv


class _OwnForward(nn.GELU):
    def forward(self, x):
        return super().forward(x) * 2


def _model() -> nn.Module:
    shared = nn.GELU()
    return nn.Sequential(
        nn.Linear(8, 8),
        shared,
        nn.Sequential(nn.LayerNorm(8), shared, nn.Dropout(0.1)),
        _OwnForward(),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
    )


def _tree(model: nn.Module) -> list[tuple[str, int]]:
    return [(n, id(m)) for n, m in model.named_modules(remove_duplicate=False)]


def _decided(model, allowed=lambda m, n: True):
    facts = cv.analyse(model, (("cpu", None),))
    facts.read_modules()
    return facts, cv.decide(model, slimgrad.ConvertConfig(), allowed, facts)


def test_decide_builds_every_replacement_and_swaps_nothing():
    model = _model()
    before = _tree(model)
    _, decisions = _decided(model, allowed=lambda m, n: n != "4.0")
    assert _tree(model) == before  # no module of the model was swapped
    rows = {d.name: (d.new is not None, d.reason, d.repeat) for d in decisions}
    assert rows["0"] == (True, None, False)
    assert rows["1"] == (True, None, False) and rows["2.1"][2]  # one replacement, held twice
    assert rows["3"][0] is False and "overrides forward" in rows["3"][1]
    assert rows["4.0"] == (False, "filter_fn returned False", False)
    assert rows["4.1"] == (True, None, False)
    by_name = {d.name: d for d in decisions}
    assert by_name["2.1"].new is by_name["1"].new


def test_apply_and_record_give_what_convert_gives():
    model, ref = _model(), _model()
    ref.load_state_dict(model.state_dict())
    slimgrad.convert_(ref)
    _, decisions = _decided(model)
    cv.apply(decisions)
    rep = slimgrad.ConvertReport()
    cv.record(decisions, rep)
    assert rep.converted == slimgrad.report(ref).converted
    assert rep.skipped == slimgrad.report(ref).skipped
    got = [(n, type(m)) for n, m in model.named_modules(remove_duplicate=False)]
    assert got == [(n, type(m)) for n, m in ref.named_modules(remove_duplicate=False)]
    assert model[1] is model[2][1]  # the shared module is one replacement in both places
    x = torch.randn(3, 8)
    model.eval(), ref.eval()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


def test_apply_hands_the_hooks_over():
    model = nn.Sequential(nn.GELU())
    calls = []
    handle = model[0].register_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    _, decisions = _decided(model)
    model[0](torch.randn(2))  # hooks fire on the original until apply
    cv.apply(decisions)
    model(torch.randn(2))
    assert calls == ["GELU", "GELU"] and type(model[0]) is slimgrad.nn.GELU
    handle.remove()
    model(torch.randn(2))
    assert len(calls) == 2


def test_each_module_is_read_once_per_convert(monkeypatch):
    seen: list[int] = []
    real = cv._module_facts

    def counted(m):
        seen.append(id(m))
        return real(m)

    monkeypatch.setattr(cv, "_module_facts", counted)
    model = _model()
    model.append(nn.Embedding(4, 8))  # left alone: the report reads its facts, not a new lookup
    slimgrad.convert_(model)
    assert len(seen) == len(set(seen))
    assert any("no handler" in r or "indices" in r for _, _, r in slimgrad.report(model).left_alone)


def _gpt2():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    return tf.GPT2LMHeadModel(cfg)


class _Block(nn.Module):  # not a Sequential: the fx pattern (inplace_abn) decides it
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + out)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(_Block(), nn.Flatten())


def _forwards(model):
    return [(n, m.__dict__.get("forward")) for n, m in model.named_modules()]


def _configs(model):
    return [(n, id(m.config)) for n, m in model.named_modules() if "config" in m.__dict__]


@pytest.mark.parametrize("build", [_cnn, _gpt2])
@pytest.mark.parametrize("abn", [False, True])
def test_patterns_decide_and_change_nothing(build, abn):
    # the neighbour patterns decide from the model as it is; apply then swaps and patches, and
    # the rows are convert_'s
    config = slimgrad.ConvertConfig(inplace_abn=abn)
    model, ref = build(), build()
    slimgrad.convert_(ref, config)
    facts = cv.analyse(model, (("cpu", None),))
    facts.read_modules()
    before = (_tree(model), _forwards(model), _configs(model))
    decisions = cv.decide_patterns(model, config, lambda m, n: True, facts)
    decisions += cv.decide(model, config, lambda m, n: True, facts)
    assert (_tree(model), _forwards(model), _configs(model)) == before
    assert any(d.patch is not None or d.new is not None for d in decisions)
    cv.apply(decisions)
    rep = slimgrad.ConvertReport()
    cv.record(decisions, rep)
    assert rep.converted == slimgrad.report(ref).converted
    assert rep.skipped == slimgrad.report(ref).skipped
    got = [(n, type(m)) for n, m in model.named_modules(remove_duplicate=False)]
    assert got == [(n, type(m)) for n, m in ref.named_modules(remove_duplicate=False)]


def test_hf_attention_is_analysed_once_per_convert(monkeypatch):
    from slimgrad.convert_handlers import hf_attention

    calls = []
    real = hf_attention._analyse
    monkeypatch.setattr(hf_attention, "_analyse", lambda m: calls.append(m) or real(m))
    model = _gpt2()
    slimgrad.convert_(model)
    assert len(calls) == 1
    assert any("slimgrad attention" in to for _, _, to in slimgrad.report(model).converted)


def test_the_guard_reads_the_model_before_the_patterns_swap():
    # ReLU(inplace=True) writes over the LayerNorm's output; the BatchNorm beside it makes the
    # batch_norm pattern take that ReLU (a forward whose order the pattern does not read: in a
    # plain Sequential it takes an activation only after a BatchNorm). Read after the swap, the
    # guard saw a slimgrad module there and let the LayerNorm keep its output: backward raised
    # where eager trains.
    class Chain(nn.Module):
        def __init__(self, *mods):
            super().__init__()
            for i, m in enumerate(mods):
                self.add_module(str(i), m)

        def forward(self, x):
            for m in self._modules.values():
                x = m(x)
            return x

        def __getitem__(self, i):
            return self._modules[str(i)]

    def build():
        torch.manual_seed(0)
        return Chain(
            nn.Linear(8, 8),
            nn.BatchNorm1d(8),
            nn.Linear(8, 8),
            nn.LayerNorm(8),
            nn.ReLU(inplace=True),
            nn.Linear(8, 2),
        )

    model, ref = build(), build()
    slimgrad.convert_(model)
    assert type(model[4]) is slimgrad.nn.batch_norm.ReLUAfterNorm
    assert type(model[3]) is nn.LayerNorm
    assert any(n == "3" and "in-place write" in r for n, _, r in slimgrad.report(model).skipped)
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_a_claimed_child_of_a_rebuilt_module_takes_the_pattern_replacement():
    # timm's BatchNormAct2d: the table rebuilds it with its own copy of its children, and the
    # batch_norm pattern decided its act; the act slot of the replacement gets that decision
    from tests.conformance._timm_shim import timm

    if timm is None:
        pytest.skip("timm (and torchvision) not installed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), timm.layers.BatchNormAct2d(4), nn.Conv2d(4, 2, 1))
    ref = copy.deepcopy(model)
    slimgrad.convert_(model)
    assert type(model[1].act) is slimgrad.nn.batch_norm.ReLUAfterNorm
    rows = slimgrad.report(model).converted
    assert ("1.act", "ReLU", "ReLUAfterNorm") in rows
    x = torch.randn(2, 3, 9, 9)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)

"""convert_ as analyse -> decide -> apply -> record (the stages in slimgrad/convert.py's docstring).

``decide`` builds every replacement and reason without touching the model; ``apply`` swaps; the
report's rows come from the decisions; each module's facts are read once per ``convert_``.
"""

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

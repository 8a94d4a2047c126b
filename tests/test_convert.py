import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad import convert as conv


class _LeanTanh(nn.Module):
    """A stand-in slimgrad module for testing the table mechanics (same function as nn.Tanh)."""

    def forward(self, x):
        return torch.tanh(x)


_LeanTanh.__module__ = "slimgrad.nn._test"


def _to_lean(m: nn.Tanh) -> nn.Module:
    if getattr(m, "_refuse", False):
        raise NotImplementedError("refused for the test")
    return _LeanTanh()


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setitem(conv._TABLE, conv._qualname(nn.Tanh), ("activations", _to_lean))


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))


def test_converts_in_place_and_reports(table):
    m = _model()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    params = [id(p) for p in m.parameters()]
    out = slimgrad.convert_(m)
    assert out is m
    assert isinstance(m[1], _LeanTanh) and isinstance(m[2][1], _LeanTanh)
    assert [id(p) for p in m.parameters()] == params  # shared, not copied
    assert m.state_dict().keys() == sd.keys()
    rep = slimgrad.report(m)
    # the Linears convert too (slimgrad.nn.Linear, NOTE [Which Linears convert])
    assert [c[0] for c in rep.converted] == ["0", "1", "2.0", "2.1"]
    assert "converted 4 modules" in str(rep)


def test_idempotent(table):
    m = slimgrad.convert_(_model())
    again = slimgrad.convert_(m)
    assert slimgrad.report(again).converted == []


def test_filter_fn_and_config_and_refusal(table):
    m = _model()
    slimgrad.convert_(m, filter_fn=lambda mod, name: name != "2.1")
    rep = slimgrad.report(m)
    assert [c[0] for c in rep.converted] == ["0", "1", "2.0"]
    assert rep.skipped == [("2.1", "Tanh", "filter_fn returned False")]

    m = _model()
    slimgrad.convert_(m, slimgrad.ConvertConfig(activations=False))
    assert all("ConvertConfig.activations is False" in r for *_, r in slimgrad.report(m).skipped)

    m = _model()
    m[1]._refuse = True
    slimgrad.convert_(m)
    assert ("1", "Tanh", "refused for the test") in slimgrad.report(m).skipped


def test_report_prints_one_line_per_type_and_reason(table):
    m = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(5)])
    slimgrad.convert_(m, filter_fn=lambda mod, name: name not in ("3.1", "4.1"))
    lines = str(slimgrad.report(m)).splitlines()
    assert lines[0] == "converted 8 modules, skipped 2 (decided for cpu float32)"
    assert lines[1:] == [
        "  + Linear x5 (0.0, 1.0, 2.0, +2 more) -> Linear",
        "  + Tanh x3 (0.1, 1.1, 2.1) -> _LeanTanh",
        "  - Tanh x2 (3.1, 4.1): filter_fn returned False",
    ]


def test_verify_after_convert(table):
    torch.manual_seed(0)
    m = _model()
    c = slimgrad.convert_(copy.deepcopy(m))
    assert slimgrad.verify(m, c, torch.randn(3, 4)).ok


def test_bad_arguments():
    with pytest.raises(TypeError, match="slimgrad.convert_: model must be a torch.nn.Module"):
        slimgrad.convert_(lambda x: x)
    with pytest.raises(
        TypeError, match="slimgrad.convert_: config must be a slimgrad.ConvertConfig"
    ):
        slimgrad.convert_(nn.Linear(2, 2), {"activations": True})
    with pytest.raises(TypeError, match="slimgrad.ConvertConfig: activations must be a bool"):
        slimgrad.ConvertConfig(activations=1)
    with pytest.raises(ValueError, match="leaky_relu_slope must be positive"):
        slimgrad.ConvertConfig(leaky_relu_slope=0.0)
    with pytest.raises(RuntimeError, match="slimgrad.report: this model was not converted"):
        slimgrad.report(nn.Linear(2, 2))
    with pytest.raises(dataclasses_error()):
        slimgrad.ConvertConfig().activations = False  # frozen


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_import_is_lean():
    import subprocess
    import sys

    code = (
        "import sys, slimgrad, torch; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert 'transformers' not in sys.modules, 'transformers imported'; "
        "assert not torch.cuda.is_initialized(), 'cuda initialised'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_module_shared_by_two_parents_stays_one_module():
    gelu, ln = nn.GELU(), nn.LayerNorm(6)
    ln.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    seen: list = []
    model = nn.Sequential(nn.Sequential(nn.Linear(6, 6), gelu, ln), nn.Sequential(ln, gelu, gelu))
    ref = copy.deepcopy(model)
    slimgrad.convert_(model)
    assert model[0][1] is model[1][1] is model[1][2]
    assert model[0][2] is model[1][0]
    assert type(model[0][2]).__module__.startswith("slimgrad.")
    names = [n for n, _, _ in slimgrad.report(model).converted]
    assert names == ["0.0", "0.1", "0.2"]  # each instance converted and reported once
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), ref(x))
    assert len(seen) == 4  # the hook kept on the one converted LayerNorm fires at both call sites
    torch.testing.assert_close(seen[2], seen[0])
    torch.testing.assert_close(seen[3], seen[1])


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(6),
        lambda: nn.GELU(approximate="tanh"),
        lambda: nn.SiLU(),
        lambda: nn.ReLU(),
        lambda: nn.Tanh(),
        lambda: nn.Dropout(0.2),
        lambda: nn.RMSNorm(6),
        lambda: nn.GroupNorm(2, 6),
    ],
)
def test_hooks_registered_before_conversion_are_kept(make):
    calls: list = []
    m = make()
    keep = m.register_forward_hook(lambda mod, i, o: calls.append(("fwd", o.detach().clone())))
    m.register_forward_pre_hook(lambda mod, i: calls.append(("pre", i[0].detach().clone())))
    m.register_full_backward_hook(lambda mod, gi, go: calls.append(("bwd", go[0].clone())))
    model = nn.Sequential(nn.Linear(6, 6), m)
    ref = copy.deepcopy(model)
    slimgrad.convert_(model)
    assert type(model[1]).__module__.startswith("slimgrad.")
    x = torch.randn(3, 6)
    for net in (ref, model):
        torch.manual_seed(0)
        net(x).square().sum().backward()
    assert [k for k, _ in calls] == ["pre", "fwd", "bwd"] * 2
    for (_, a), (_, b) in zip(calls[:3], calls[3:]):
        torch.testing.assert_close(b, a)
    keep.remove()  # the handle taken before conversion still removes the hook
    calls.clear()
    model(x)
    assert [k for k, _ in calls] == ["pre"]


def test_report_follows_wrappers_made_after_convert():
    import slimgrad

    model = slimgrad.convert_(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    rep = slimgrad.report(model)
    assert slimgrad.report(torch.compile(model)) is rep
    assert slimgrad.report(torch.nn.DataParallel(model)) is rep
    assert slimgrad.report(torch.compile(torch.nn.DataParallel(model))) is rep
    with pytest.raises(RuntimeError, match="this model was not converted"):
        slimgrad.report(torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4))))


def test_report_follows_a_peft_model():
    peft = pytest.importorskip("peft")
    import slimgrad

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.act = torch.nn.GELU()

        def forward(self, x):
            return self.act(self.fc(x))

    model = slimgrad.convert_(Net())
    rep = slimgrad.report(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["fc"]))
    assert slimgrad.report(wrapped) is rep

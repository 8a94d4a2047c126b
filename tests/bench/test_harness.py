import copy
import json

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.bench import harness
from slimgrad.bench.harness import Case, check_grads, run_case
from slimgrad.kernels._backend import get_backend
from slimgrad.memory import measure
from slimgrad.testing import DEFAULT_ATOL

MEMORY_KEYS = ("saved_bytes", "saved_input_bytes", "peak_bytes", "floor_bytes", "retained_bytes")


class _ScaledGrad(torch.autograd.Function):
    # Identity whose backward is off by a relative 1e-3: a "saving" with wrong gradients.
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.001


class _Wrong(nn.Module):
    def forward(self, x):
        return _ScaledGrad.apply(x)


def _linear_relu_case(slim_fn=copy.deepcopy, requires_grad=False):
    def build(device, dtype, small=False):
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(7, 5), nn.ReLU()).to(device, dtype)
        slim = slim_fn(eager)

        def make_inputs():
            return torch.randn(3, 7, device=device, dtype=dtype, requires_grad=requires_grad)

        return eager, slim, make_inputs

    return Case(name="linear_relu", build=build, repeat=3)


def test_record_fields_and_hand_computed_bytes(tmp_path):
    rec = run_case(_linear_relu_case(), out_dir=tmp_path, repeat=3)
    for side in ("eager", "slimgrad"):
        # Non-scalar output: the harness backpropagates a fixed gradient, no loss is added.
        # ReLU keeps its output (3*5 floats); Linear keeps its input x, which existed before.
        assert rec[side]["saved_bytes"] == 3 * 5 * 4
        assert rec[side]["saved_input_bytes"] == 3 * 7 * 4
        assert rec[side]["floor_bytes"] == 0
        assert rec[side]["step_ms"] > 0
    assert rec["saved_ratio"] == 1.0 and rec["peak_ratio"] == 1.0
    # No matmul input created in the step (x existed before): no floor to compare with.
    assert rec["saved_over_eager_floor"] is None and rec["eager_saved_over_floor"] is None
    assert rec["kernel_backend"] == get_backend() and rec["grad_buffer_reuses"] == 0
    assert rec["shapes"] == [[3, 7]] and rec["dtype"] == "float32" and rec["device"] == "cpu"
    assert len(rec["step_ms_all"]["eager"]) == len(rec["step_ms_all"]["slimgrad"]) == 3
    for side in ("eager", "slimgrad"):  # per timed step, the process's minor page faults
        counts = rec["minor_faults_all"][side]
        assert len(counts) == 3 and all(isinstance(c, int) and c >= 0 for c in counts)
    assert rec["time_ratio_min"] <= rec["time_ratio"] <= rec["time_ratio_max"]
    assert rec["grad"]["ok"] and rec["grad"]["n_tensors"] == 2
    assert rec["versions"]["torch"] == torch.__version__
    assert rec["versions"]["slimgrad"] == slimgrad.__version__
    lines = (tmp_path / "linear_relu.jsonl").read_text().splitlines()
    assert len(lines) == 1
    stored = json.loads(lines[0])
    assert stored["eager"] == rec["eager"] and stored["case"] == "linear_relu"
    run_case(_linear_relu_case(), out_dir=tmp_path, repeat=1)
    assert len((tmp_path / "linear_relu.jsonl").read_text().splitlines()) == 2


def test_bytes_agree_with_a_direct_measure_and_are_deterministic():
    case = _linear_relu_case(requires_grad=True)
    r1 = run_case(case, out_dir=None, repeat=1, grad_check=False)
    r2 = run_case(case, out_dir=None, repeat=1, grad_check=False)
    eager, _, make_inputs = case.build("cpu", torch.float32)
    x = make_inputs()
    m = measure(lambda: eager(x), grad=torch.ones(3, 5), module=eager)
    for k in MEMORY_KEYS:
        assert r1["eager"][k] == r2["eager"][k] == getattr(m, k), k
    assert r1["grad"] is None


def _append_wrong(eager):
    slim = copy.deepcopy(eager)
    slim.append(_Wrong())  # same parameter names, gradients off by 1e-3
    return slim


def test_grad_check_catches_a_wrong_gradient():
    rec = run_case(_linear_relu_case(slim_fn=_append_wrong), out_dir=None, repeat=1)
    g = rec["grad"]
    assert not g["ok"] and g["n_violations"] == 2 and g["unmatched"] == []
    assert g["max_abs_err"] > 2 * g["eager_max_abs_err"] + g["atol"]
    assert sorted(v["name"] for v in g["violations"]) == ["0.bias", "0.weight"]
    assert all(v["err"] > v["bound"] for v in g["violations"])


def test_grad_check_reports_unmatched_parameters():
    case = _linear_relu_case(slim_fn=lambda e: nn.Sequential(copy.deepcopy(e)))
    g = run_case(case, out_dir=None, repeat=1)["grad"]
    # Names differ ("0.weight" vs "0.0.weight"): reported, and not a pass.
    assert not g["ok"] and g["unmatched"] == ["0.bias", "0.weight"] and g["n_tensors"] == 0


def test_grad_check_catches_a_wrong_input_gradient():
    eager = nn.Identity()
    slim = _Wrong()

    def fresh():
        torch.manual_seed(3)
        return (torch.randn(4, 5, requires_grad=True),)

    g = check_grads(eager, slim, fresh, torch.ones(4, 5), torch.float32)
    assert g["n_tensors"] == 1 and not g["ok"] and g["worst"] == "input0"
    g = check_grads(eager, nn.Identity(), fresh, torch.ones(4, 5), torch.float32)
    assert g["ok"] and g["max_abs_err"] == 0.0


def test_grad_check_turns_dropout_off_and_restores_it():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
    slim = copy.deepcopy(eager)

    def fresh():
        return (torch.randn(5, 6),)

    g = check_grads(eager, slim, fresh, torch.ones(5, 6), torch.float32)
    assert g["ok"]
    assert eager[1].p == slim[1].p == 0.5


def test_missing_requirement_and_bad_counts():
    case = Case(name="needs_x", build=_linear_relu_case().build, requires=("no_such_module_xq",))
    assert case.missing() == ["no_such_module_xq"]
    with pytest.raises(RuntimeError, match="needs \\['no_such_module_xq'\\]"):
        run_case(case, out_dir=None)
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        run_case(_linear_relu_case(), out_dir=None, repeat=0)
    with pytest.raises(ValueError, match="unknown case; expected one of"):
        run_case("no_such_case")


def test_builtin_cases_are_registered():
    names = harness.case_names()
    for n in ("resnet50", "gpt2", "conv_chain", "hf_gpt2"):
        assert n in names
    assert harness.get_case("hf_gpt2").requires == ("transformers",)
    assert harness.broken_case_modules() == {}


def _small_case_ids():
    return [n for n in ("conv_chain", "gpt2", "resnet50", "hf_gpt2", "hf_gpt2_fast_loss")]


@pytest.mark.parametrize("name", _small_case_ids())
def test_builtin_cases_small(name, tmp_path):
    case = harness.get_case(name)
    if case.missing():
        pytest.skip(f"needs {case.missing()}")
    rec = run_case(case, small=True, repeat=1, out_dir=tmp_path)
    assert rec["grad"]["ok"], rec["grad"]
    assert rec["grad"]["unmatched"] == []
    assert rec["eager"]["saved_bytes"] > 0 and rec["eager"]["floor_bytes"] > 0
    assert rec["eager"]["floor_bytes"] <= rec["eager"]["saved_bytes"]
    assert rec["slimgrad"]["saved_bytes"] < rec["eager"]["saved_bytes"]
    assert (tmp_path / f"{name}.jsonl").exists()


def test_hf_gpt2_fast_loss_case_converts_with_fast_loss():
    # the case's slimgrad side is convert_(..., ConvertConfig(fast_loss=True)): it keeps the LM
    # head's parameter-sized dW from forward to backward, which the default conversion does not
    pytest.importorskip("transformers")
    saved = {}
    for name in ("hf_gpt2", "hf_gpt2_fast_loss"):
        torch.manual_seed(0)
        _, slim, make_inputs = harness.get_case(name).build("cpu", torch.float32, small=True)
        ids = make_inputs()
        slim(ids).backward()  # warm-up
        saved[name] = measure(lambda slim=slim, ids=ids: slim(ids), module=slim).saved_bytes
    head = slim.model.lm_head.weight
    assert saved["hf_gpt2_fast_loss"] - saved["hf_gpt2"] >= head.numel() * head.element_size()


@pytest.fixture
def scratch_registry(monkeypatch, tmp_path):
    import slimgrad.bench.cases as pkg

    monkeypatch.setattr(harness, "_REGISTRY", {})
    monkeypatch.setattr(harness, "_BROKEN", {})
    monkeypatch.setattr(harness, "_DISCOVERED", False)
    monkeypatch.setattr(pkg, "__path__", [str(tmp_path)])
    yield tmp_path
    import sys

    for mod in [m for m in sys.modules if m.startswith("slimgrad.bench.cases.zz_")]:
        del sys.modules[mod]


def test_discovery_of_build_decorator_cases_list_and_broken(scratch_registry):
    body = (
        "import torch\n"
        "def build(device, dtype, small=False):\n"
        "    '''a plain build function'''\n"
        "    m = torch.nn.Linear(3, 3)\n"
        "    return m, m, lambda: torch.randn(2, 3)\n"
    )
    (scratch_registry / "zz_plain.py").write_text(body)
    (scratch_registry / "zz_deco.py").write_text(
        "from slimgrad.bench.harness import register_case\n"
        + body.replace("def build", "@register_case('zz_one', repeat=2)\ndef build")
        + "@register_case('zz_two', description='second')\n"
        "def build2(device, dtype, small=False):\n"
        "    return build(device, dtype, small)\n"
    )
    (scratch_registry / "zz_list.py").write_text(
        body + "from slimgrad.bench.harness import Case\nCASES = [Case('zz_listed', build)]\n"
    )
    (scratch_registry / "zz_broken.py").write_text("raise ImportError('no kernel here')\n")
    (scratch_registry / "_zz_private.py").write_text("raise RuntimeError('never imported')\n")
    assert harness.case_names() == ["zz_listed", "zz_one", "zz_plain", "zz_two"]
    assert harness.get_case("zz_plain").description == "a plain build function"
    assert harness.get_case("zz_one").repeat == 2
    assert harness.get_case("zz_two").description == "second"
    assert harness.broken_case_modules() == {
        "slimgrad.bench.cases.zz_broken": "ImportError: no kernel here"
    }
    rec = run_case("zz_plain", out_dir=None, repeat=1)
    assert rec["grad"]["ok"]


def test_duplicate_case_name_is_rejected(scratch_registry):
    def build_a(device, dtype, small=False):
        raise NotImplementedError

    def build_b(device, dtype, small=False):
        raise NotImplementedError

    harness.register_case("dup")(build_a)
    harness.register_case("dup")(build_a)  # the same function again (a reload): fine
    with pytest.raises(ValueError, match="case name 'dup' is taken"):
        harness.register_case("dup")(build_b)
    with pytest.raises(TypeError, match="CASES must hold"):
        harness._add(("dup2", build_a))


def test_contract_errors_name_the_case():
    def build(device, dtype, small=False):
        m = nn.Linear(3, 3)
        return m, m, lambda: (torch.randn(2, 3), torch.randn(2, 3))  # one input too many

    with pytest.raises(
        TypeError, match="case 'two_inputs': model\\(\\*make_inputs\\(\\)\\) failed"
    ):
        run_case(Case("two_inputs", build), out_dir=None, repeat=1)

    def build_tuple(device, dtype, small=False):
        m = nn.Linear(3, 3)
        return (lambda x: (m(x),)), m, lambda: torch.randn(2, 3)

    with pytest.raises(TypeError, match="must return a tensor that requires grad"):
        run_case(Case("returns_tuple", build_tuple), out_dir=None, repeat=1)


def test_cases_list_with_functools_partial(scratch_registry):
    (scratch_registry / "zz_partial.py").write_text(
        "import functools, torch\n"
        "from slimgrad.bench.harness import Case\n"
        "def _build(n, device, dtype, small=False):\n"
        "    m = torch.nn.Linear(n, n)\n"
        "    return m, m, lambda: torch.randn(2, n)\n"
        "CASES = [Case(f'zz_p{n}', functools.partial(_build, n)) for n in (2, 3)]\n"
    )
    assert harness.case_names() == ["zz_p2", "zz_p3"]
    assert harness.get_case("zz_p3").source == "slimgrad.bench.cases.zz_partial"
    assert run_case("zz_p3", out_dir=None, repeat=1)["shapes"] == [[2, 3]]


def test_dtypes_scale_the_saved_bytes_and_keep_the_rule():
    # Every tensor conv_chain saves is a floating activation: bytes scale with the element size.
    saved = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        rec = run_case("conv_chain", small=True, dtype=dtype, out_dir=None, repeat=1)
        assert rec["dtype"] == str(dtype).removeprefix("torch.")
        assert rec["grad"]["n_tensors"] == 8 and rec["grad"]["atol"] == DEFAULT_ATOL[dtype]
        if dtype != torch.bfloat16:  # bf16: the verdict is the converted ops' (see the report)
            assert rec["grad"]["ok"], rec["grad"]
        saved[dtype] = rec["eager"]["saved_bytes"]
    assert saved[torch.float64] == 2 * saved[torch.float32] == 4 * saved[torch.bfloat16]

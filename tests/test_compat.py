"""slimgrad._compat: declared versions, the messages outside them, the feature registry."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import torch

from slimgrad import _compat

ROOT = Path(__file__).resolve().parent.parent


def test_parse_version():
    assert _compat.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert _compat.parse_version("2.15.0.dev20261101") == (2, 15, 0)
    assert _compat.parse_version("5.24") == (5, 24, 0)


def _bounds(spec: str) -> tuple[tuple[int, int], tuple[int, int]]:
    lo = re.search(r">=(\d+)\.(\d+)", spec)
    hi = re.search(r"<(\d+)\.(\d+)", spec)
    assert lo and hi, spec
    return (int(lo[1]), int(lo[2])), (int(hi[1]), int(hi[2]) - 1)


def test_pyproject_declares_the_tested_ranges():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_spec,) = [d for d in meta["dependencies"] if d.startswith("torch")]
    assert _bounds(torch_spec) == (_compat.TORCH_MIN, _compat.TORCH_MAX_TESTED)
    (hf_spec,) = meta["optional-dependencies"]["hf"]
    assert _bounds(hf_spec) == (_compat.TRANSFORMERS_MIN, _compat.TRANSFORMERS_MAX_TESTED)


def test_version_matrix_rows_are_the_declared_ends():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import version_matrix
    finally:
        sys.path.pop(0)
    torches = {_compat.parse_version(t)[:2] for t, *_ in version_matrix.MATRIX.values()}
    hfs = {_compat.parse_version(h)[:2] for _, h, *_ in version_matrix.MATRIX.values()}
    assert min(torches) == _compat.TORCH_MIN and max(torches) == _compat.TORCH_MAX_TESTED
    assert min(hfs) == _compat.TRANSFORMERS_MIN and max(hfs) == _compat.TRANSFORMERS_MAX_TESTED


def test_running_torch_is_in_range():
    assert _compat.torch_version_problem(torch.__version__) is None


@pytest.mark.parametrize("version", ["2.4.0", "2.10.0+cu128", "1.13.1"])
def test_old_torch_is_one_clear_error(version):
    kind, msg = _compat.torch_version_problem(version)
    assert kind == "error"
    assert msg.startswith("slimgrad: torch ")
    assert version in msg and ">=2.11" in msg and "pip install" in msg


def test_newer_torch_warns():
    kind, msg = _compat.torch_version_problem("2.16.0")
    assert kind == "warning" and "2.16.0" in msg and "slimgrad env" in msg


def test_import_with_an_old_torch_says_so(tmp_path):
    # a fake torch package of an old release ahead on the path: import slimgrad must stop at the
    # version check with one message, not with a traceback from a private import
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.8.0'\n")
    code = "import slimgrad"
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT / 'src'}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: slimgrad: torch 2.8.0 is not supported"), r.stderr


@pytest.mark.parametrize(
    "version,warns", [("5.23.0", False), ("5.24.1", False), ("5.25.0", True), ("4.57.6", True)]
)
def test_transformers_range(version, warns):
    msg = _compat.transformers_version_problem(version)
    assert (msg is not None) == warns
    if warns:
        assert msg.startswith("slimgrad.convert_: transformers ") and "pip install" in msg


def test_check_transformers_warns_once(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(_compat, "_hf_checked", False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    with pytest.warns(UserWarning, match="transformers 9.0.0 is newer"):
        _compat.check_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_transformers()  # once per process


def test_features_are_named_with_reasons():
    feats = _compat.features()
    names = [f.name for f in feats]
    assert len(names) == len(set(names))
    assert "buffer reuse (ownership)" in names
    for f in feats:
        assert isinstance(f.on, bool) and f.detail


def test_ctx_fields_feature_states_the_straight_paths_choice(monkeypatch):
    # NOTE [Saving through ctx's fields]: whether the straight paths assign ctx's fields is a
    # private-API choice, so `slimgrad env` and `report` name it with its reason
    from slimgrad import _autograd

    def feat():
        return {f.name: f for f in _compat.features()}["direct ctx fields (straight paths)"]

    assert feat().on is _autograd.CTX_FIELDS
    monkeypatch.setattr(_autograd, "CTX_FIELDS", False)
    off = feat()
    assert not off.on and "save_for_backward" in off.detail
    assert "direct ctx fields (straight paths)" in [f.name for f in _compat.features_off()]


def test_calibration_outside_modes_is_a_named_feature(monkeypatch):
    # NOTE [Calibration outside dispatch modes] in slimgrad/ownership.py: the private import it
    # needs is guarded; without it `slimgrad env` and `report` say what is lost
    import sys

    name = "ownership calibration outside dispatch modes"
    assert {f.name: f for f in _compat.features()}[name].on
    fake = type(sys)("torch.utils._python_dispatch")  # a module without _disable_current_modes
    monkeypatch.setitem(sys.modules, "torch.utils._python_dispatch", fake)
    off = {f.name: f for f in _compat.features()}[name]
    assert not off.on and "missing" in off.detail and "memory.estimate" in off.detail
    assert name in [f.name for f in _compat.features_off()]


def test_env_lists_features_and_ranges(capsys):
    # `slimgrad env --json` in this process (`python -m slimgrad` is the same command:
    # tests/test_cli.py::test_python_dash_m_slimgrad_is_the_slimgrad_command)
    from slimgrad import cli

    assert cli.main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tested torch"] == "2.11 .. 2.15"
    assert info["features"]["buffer reuse (ownership)"]["detail"]
    assert info["torch"] == torch.__version__


def _layouts():
    base = torch.zeros(4, 5, 6)
    yield base
    yield base.transpose(0, 2)
    yield base[:, ::2]
    yield base[:, :, 1:]
    yield base.permute(1, 2, 0)
    yield torch.zeros(3, 1, 4).expand(3, 2, 4)
    yield torch.zeros(0, 3)
    yield torch.zeros(1, 7)[:, ::2]
    yield torch.zeros(6)[::2]
    yield torch.zeros(5, 1).t()
    yield torch.zeros(())
    yield torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    yield torch.as_strided(torch.zeros(20), (3, 4), (4, 1), 2)
    yield torch.as_strided(torch.zeros(20), (3, 4), (2, 1))  # overlapping


@pytest.mark.skipif(_compat._prims_dense is None, reason="torch._prims_common lacks the check")
def test_public_dense_check_agrees_with_torchs():
    for t in _layouts():
        assert _compat._dense_public(t) == bool(_compat._prims_dense(t)), (t.shape, t.stride())
    for shape in itertools.product((1, 2, 3), repeat=3):
        x = torch.zeros(shape)
        for perm in itertools.permutations(range(3)):
            v = x.permute(perm)
            assert _compat._dense_public(v) == bool(_compat._prims_dense(v))
            w = v[..., ::2]
            assert _compat._dense_public(w) == bool(_compat._prims_dense(w))


def test_convert_warns_once_on_an_untested_transformers(monkeypatch):
    pytest.importorskip("transformers")
    import importlib.metadata

    from transformers import GPT2Config, GPT2LMHeadModel

    import slimgrad

    real = importlib.metadata.version
    monkeypatch.setattr(_compat, "_hf_checked", False)
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "5.30.0" if name == "transformers" else real(name),
    )
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    with pytest.warns(UserWarning, match="transformers 5.30.0 is newer") as rec:
        slimgrad.convert_(GPT2LMHeadModel(cfg))
    assert sum("transformers 5.30.0" in str(w.message) for w in rec) == 1
    assert rec[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        slimgrad.convert_(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # not HF: no check
        slimgrad.convert_(GPT2LMHeadModel(cfg))  # once per process


def test_no_numpy_no_torch_numpy_warning_from_slimgrad():
    # numpy hidden: torch's own import warns "Failed to initialize NumPy"; slimgrad's first import
    # of torch (the CLI's path) stays quiet, and a converted step runs
    code = (
        "import sys, warnings; sys.modules['numpy'] = None; warnings.simplefilter('error');"
        "import slimgrad, torch;"
        "m = slimgrad.convert_(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()));"
        "m(torch.randn(2, 4)).sum().backward(); print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert "NumPy" not in r.stderr


def test_report_names_features_that_are_off(monkeypatch):
    import slimgrad

    off = _compat.Feature("buffer reuse (ownership)", False, "no C++ compiler here")
    monkeypatch.setattr(_compat, "features", lambda: [off, _compat.Feature("numpy", False, "x")])
    rep = slimgrad.report(slimgrad.convert_(torch.nn.Sequential(torch.nn.Linear(3, 3))))
    text = str(rep)
    assert "! buffer reuse (ownership): no C++ compiler here" in text
    assert "numpy" not in text
    monkeypatch.undo()
    rep = slimgrad.report(slimgrad.convert_(torch.nn.Sequential(torch.nn.Linear(3, 3))))
    assert [n for n, _ in rep.features_off] == [f.name for f in _compat.features_off()]


def test_checkpoint_forward_is_a_named_feature(monkeypatch):
    # NOTE [A recipe made in a checkpoint's forward]: the hook's name is torch's, not a stated
    # API; where it differs `slimgrad env` and `report` say what is lost
    from slimgrad.ops import _derived

    name = "conv recipes in a checkpoint's forward"
    assert {f.name: f for f in _compat.features()}[name].on
    monkeypatch.setattr(_derived, "_FORWARD_HOOK", "renamed_in_a_later_torch.")
    off = {f.name: f for f in _compat.features()}[name]
    assert not off.on and "one input above eager" in off.detail
    assert name in [f.name for f in _compat.features_off()]

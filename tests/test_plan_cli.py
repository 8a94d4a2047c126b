"""`slimgrad plan TARGET --budget ...` (issue 33): the plan, the curve, progress, errors."""

from __future__ import annotations

import json

import pytest

import slimgrad
from slimgrad.cli import main

pytest.importorskip("transformers")

_TINY = ["plan", "llama", "--size", "tiny", "--seq", "32", "--batch", "2"]
_MEASURED: dict[str, slimgrad.Plan] = {}


@pytest.fixture(autouse=True)
def _measured_once(monkeypatch):
    # every command here plans the same model (_TINY): its blocks are measured once per device,
    # dtype and choices, and the other budgets reuse those measurements, which gives the plan a
    # fresh measurement gives (tests/test_plan.py::test_reuse_plans_a_second_budget_from_the_
    # same_measurements); what is tested here is the command around slimgrad.plan
    real = slimgrad.plan

    def plan(make, budget, **kw):
        key = repr(sorted((k, v) for k, v in kw.items() if k not in ("verify", "progress")))
        p = real(make, budget, reuse=_MEASURED.get(key), **kw)
        _MEASURED.setdefault(key, p)
        return p

    monkeypatch.setattr(slimgrad, "plan", plan)


def test_plan_json_fits_its_budget_and_reports_progress(capsys):
    assert main([*_TINY, "--budget", "1GiB", "--json"]) == 0
    out, err = capsys.readouterr()
    rec = json.loads(out)
    assert rec["budget_bytes"] == 2**30
    assert rec["peak_bytes"] <= rec["budget_bytes"] and rec["verified"]
    assert set(rec["choices"]) == {"model.layers.0", "model.layers.1"}
    assert rec["recompute_flops"] == 0  # everything fits: nothing recomputed
    assert {"eager", "checkpoint-all", "sac"} <= set(rec["baselines"])
    assert rec["curve"][0]["recompute_flops"] == 0 and rec["curve"][-1]["recompute_flops"] > 0
    assert "slimgrad plan: measuring model.layers.0 and model.layers.1 as lean" in err

    # a budget between the ends of the curve: a plan that recomputes, printed as text
    mid = (rec["curve"][0]["peak_bytes"] + rec["curve"][-1]["peak_bytes"]) // 2
    assert main([*_TINY, "--budget", str(mid)]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out and "(full estimate)" in out and "checkpoint-all" in out
    # and the curve, one line per point after its header (Plan.curve_text)
    curve = out.split("peak (composed)   recompute (x forward)\n", 1)
    assert len(curve) == 2 and len(curve[1].strip().splitlines()) == len(rec["curve"]), out


def test_plan_budget_too_low_and_bad_budget(capsys):
    assert main([*_TINY, "--budget", "1KiB", "--no-verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("slimgrad plan: the budget is below the lowest peak")
    assert "expected a budget of at least" in err
    assert main([*_TINY, "--budget", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("slimgrad plan: budget must be a size")


def test_plan_targets_labels_a_record_with_the_commit_it_imported(monkeypatch):
    # benchmarks/plan_targets.py ran 5-10 minutes and read HEAD at the end: a commit made
    # meanwhile labelled a record of code it did not run
    import importlib.util
    from pathlib import Path

    import slimgrad.bench.harness as harness

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_targets.py"
    monkeypatch.setattr(harness, "git_commit", lambda: "at-import")
    spec = importlib.util.spec_from_file_location("_plan_targets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(harness, "git_commit", lambda: "later")
    assert mod.COMMIT == "at-import"
    assert mod._stamp()["commit"] == "at-import"


def test_plan_plot_and_cuda_kernels(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    # one choice: the CUDA measurement is of the lean blocks only (the command is what is tested)
    # (the composed plan: the command prints and plots it alike without the full estimate)
    cmd = [*_TINY, "--budget", "6GiB", "--device", "cuda", "--choices", "lean", "--no-verify"]
    assert main([*cmd, "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "(cuda)" in out and f"curve: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "slimgrad plan: planning" in err and "(cuda kernels)" in err


def test_plan_help_lists_the_choices_and_choices_narrows_the_plan(capsys):
    from slimgrad.plan import CHOICE_HELP

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for c in CHOICE_HELP:
        assert f"  {c} " in out, c
    assert "lean+recompute:mlp-activation" in out and "--choices" in out
    only = "lean,lean+recompute:mlp-activation"
    assert main([*_TINY, "--budget", "1GiB", "--json", "--choices", only, "--no-verify"]) == 0
    rec = json.loads(capsys.readouterr().out)
    kept = rec["blocks"]["model.layers.0"]["kept_bytes"]
    # + the SAC baseline and eager, what recompute is counted against (both measured, not chosen)
    assert set(kept) == {"lean", "lean+recompute:mlp-activation", "eager+sac", "eager"}
    assert set(rec["choices"].values()) <= set(only.split(","))
    assert main([*_TINY, "--budget", "1GiB", "--choices", "lean,nonsense"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("slimgrad plan: unknown choices") and "'nonsense'" in err
    assert "<child>" not in err  # a placeholder is not a name to pass

"""slimgrad.bench.gpu_check and the kernel bench's records: the logic, on any machine (CUDA is
hidden, so the CUDA parts take their skip paths; the end-to-end step runs a small case on CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from slimgrad.bench import gpu_check as G
from slimgrad.bench import kernels as B


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fake_run_writes_records(tmp_path, no_cuda):
    out = tmp_path / "gpu_check.jsonl"
    argv = ["--out", str(out), "--results-dir", str(tmp_path), "--device", "cpu", "--no-estimate",
            "--cases", "dropout", "--small", "--repeat", "1"]  # fmt: skip
    assert G.main([*argv, "--steps", "tests,kernels,e2e"]) == 0
    recs = _records(out)
    assert [r["step"] for r in recs] == ["tests", "kernels", "e2e:dropout"]
    for r in recs:
        assert r["device"] == "cpu" and r["versions"]["torch"] == torch.__version__
        assert {"device_name", "commit", "backend", "triton_available", "time_utc"} <= set(r)
    tests, kernels, e2e = recs
    assert tests["ok"] is None and "no CUDA device" in tests["skipped"]
    assert kernels["ok"] is None and kernels["skipped"]
    assert e2e["ok"] is True and e2e["grad_ok"] is True and e2e["time_ratio"] > 0
    assert e2e["allocator"] is None and "not a CUDA device" in e2e["allocator_skipped"]
    (h,) = _records(tmp_path / "dropout.jsonl")  # the harness's own record, next to it
    assert h["device"] == "cpu" and h["time_ratio"] == e2e["time_ratio"]
    assert G.main(argv[:2] + ["--steps", "tests"]) == 0
    assert len(_records(out)) == 4  # appended


def test_speed_step_records_time_against_its_target(tmp_path, no_cuda):
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_check.jsonl"
    argv = ["--out", str(out), "--device", "cpu", "--small", "--repeat", "2", "--steps", "speed",
            "--speed-cases", "hf_gpt2_16x1024,hf_llama_1b_autocast"]  # fmt: skip
    assert G.main(argv) == 0
    recs = _records(out)
    assert [r["step"] for r in recs] == ["speed:hf_gpt2_16x1024", "speed:hf_llama_1b_autocast"]
    for r in recs:
        assert r["time_target"] == 1.05 and r["time_ok"] == (r["time_ratio"] <= 1.05)
        assert r["peak_bytes"]["slimgrad"] < r["peak_bytes"]["eager"]
        assert r["ok"] is True and r["grad_ok"] is None and r["small"] is True
    names = [c.name for c, _, _ in G.speed_cases()]
    assert names == ["hf_gpt2", "resnet50", "hf_gpt2_16x1024", "hf_llama_1b_autocast"]


def test_failed_step_sets_exit_status(tmp_path, no_cuda, monkeypatch):
    monkeypatch.setattr(G, "run_tests", lambda *a, **k: {"step": "tests", "ok": False})
    out = tmp_path / "g.jsonl"
    assert G.main(["--out", str(out), "--steps", "tests"]) == 1
    assert _records(out)[0]["ok"] is False
    with pytest.raises(SystemExit):
        G.main(["--out", str(out), "--steps", "tests,bench"])


def test_compare_peaks_splits_rounding_and_untracked():
    # allocated 10_240 = requested 9_000 + rounding 1_240; the tracker saw all 9_000 requested
    ok = G.compare_peaks(9_000, 10_240, 9_000)
    assert ok["agrees"] and ok["rounding_bytes"] == 1_240 and ok["untracked_bytes"] == 0
    # 500 requested bytes the tracker never saw (an op's workspace): not rounding
    bad = G.compare_peaks(8_500, 10_240, 9_000)
    assert not bad["agrees"] and bad["untracked_bytes"] == 500
    assert G.compare_peaks(8_500, 10_240, 9_000, tol=500)["agrees"]
    assert not G.compare_peaks(11_000, 10_240, 10_240)["agrees"]  # tracker above the allocator
    assert G.compare_peaks(9_000, 10_240, None)["agrees"] is None


def test_allocator_vs_tracker_on_cpu_gives_tracker_figures():
    from slimgrad.bench.harness import get_case

    res = G.allocator_vs_tracker(get_case("dropout").build, torch.device("cpu"), torch.float32,
                                 small=True, warmup=1)  # fmt: skip
    assert set(res) == {"eager", "slimgrad"}
    for side in res.values():
        assert side["tracker_peak_bytes"] > 0 and "cuda_max_allocated_bytes" not in side
    assert res["slimgrad"]["tracker_saved_bytes"] < res["eager"]["tracker_saved_bytes"]


def test_parse_junit(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4">'
        '<testcase classname="tests.ops.test_x" name="test_a[cuda]"/>'
        '<testcase classname="tests.ops.test_x" name="test_b[cuda]"><failure message="m"/>'
        "</testcase>"
        '<testcase classname="tests.ops.test_x" name="test_c[cuda]"><skipped message="s"/>'
        "</testcase>"
        '<testcase classname="tests.test_y" name="test_d"><error message="e"/></testcase>'
        "</testsuite></testsuites>"
    )
    s = G.parse_junit(xml)
    assert (s["collected"], s["passed"], s["failed"], s["skipped"]) == (4, 1, 2, 1)
    assert s["failed_ids"] == ["tests.ops.test_x::test_b[cuda]", "tests.test_y::test_d"]


def test_bench_record_and_kernel_summary():
    # 2 GB moved in 1 ms at a copy bandwidth of 4 TB/s: half of copy
    ms = {"triton_fwd": 1.0, "triton_bwd": 2.0, "torch_fwd": 2.0, "torch_bwd": 4.0,
          "eager_fwd_bwd": 4.0, "op_fwd_bwd": 3.2}  # fmt: skip
    r = B.record("relu", 10, "float32", ms, (2e9, 6e9), 4e12, device="cuda")
    assert r["fwd_fraction_of_copy"] == pytest.approx(0.5)
    assert r["bwd_fraction_of_copy"] == pytest.approx(0.75)
    assert r["triton_over_eager"] == pytest.approx(0.75)
    assert r["torch_path_over_eager"] == pytest.approx(1.5)
    assert r["op_over_eager"] == pytest.approx(0.8)
    assert r["device"] == "cuda"
    fast = B.record("sigmoid", 10, "float32", {**ms, "triton_fwd": 0.5}, (1.8e9, 6e9), 4e12)
    s = G.summarize_kernels([r, fast])
    assert s["below_bandwidth_target"] == ["relu@10", "sigmoid@10"]
    assert s["worst"]["fraction_case"] == "relu@10"
    assert s["worst"]["fraction_of_copy"] == pytest.approx(0.5)
    assert G.summarize_kernels([]) == {"n_records": 0}


def test_estimate_step_matches_the_cpu_tracker_and_models_cuda():
    # the estimate the GPU check sets beside max_memory_allocated: on CPU kernels it must give the
    # tracker's own figures for the same step; for CUDA it runs without a GPU
    from slimgrad.bench.harness import get_case

    build = get_case("dropout").build
    res = G.allocator_vs_tracker(build, torch.device("cpu"), torch.float32, small=True, warmup=1)
    for side in ("eager", "slimgrad"):
        cpu = G.estimate_step(build, torch.float32, small=True, side=side, device="cpu")
        assert cpu["estimate_saved_bytes"] == res[side]["tracker_saved_bytes"], side
        cuda = G.estimate_step(build, torch.float32, small=True, side=side, device="cuda")
        assert cuda["estimate_peak_bytes"] > 0
    # on CUDA, eager's dropout keeps native_dropout's bool mask (1 B/elt), not CPU's float noise
    eager_cpu = G.estimate_step(build, torch.float32, small=True, side="eager", device="cpu")
    eager_cuda = G.estimate_step(build, torch.float32, small=True, side="eager", device="cuda")
    assert eager_cuda["estimate_saved_bytes"] < eager_cpu["estimate_saved_bytes"]


def test_case_step_of_the_eager_side_builds_no_slimgrad_copy(monkeypatch):
    # the eager side's step (an estimate builds it up to three times) makes no converted copy:
    # that convert_ was most of a model case's build; the slimgrad side still converts, and the
    # eager model and inputs are the ones a full build gives
    import slimgrad
    from slimgrad.bench.cases.models import slim_copy

    def build(device, dtype, small=False):
        eager = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU()).to(device, dtype)
        return eager, slim_copy(eager), lambda: torch.randn(2, 3, device=device, dtype=dtype)

    converted, convert = [], slimgrad.convert_
    monkeypatch.setattr(
        slimgrad, "convert_", lambda m, c=None: converted.append(m) or convert(m, c)
    )
    runs = {}
    for side in ("eager", "slimgrad", "eager"):
        n = len(converted)
        forward, module = G.case_step(build, torch.float32, small=True, side=side)()
        runs.setdefault(side, []).append((forward(), [p.clone() for p in module.parameters()]))
        assert len(converted) == n + (side == "slimgrad"), side
    (y0, p0), (y1, p1) = runs["eager"]
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.testing.assert_close(runs["slimgrad"][0][0], y0)


def test_estimate_isolated_runs_in_a_child_and_a_crash_costs_only_its_fields(monkeypatch):
    from slimgrad.bench.harness import get_case

    build = get_case("dropout").build
    here = G.estimate_step(build, torch.float32, small=True, side="slimgrad")
    assert G.estimate_isolated("dropout", torch.float32, small=True, side="slimgrad") == here
    # the child died of a signal (the first GPU run's segfaults): recorded, not raised
    import subprocess

    def died(cmd, **kw):
        assert kw["env"]["CUDA_VISIBLE_DEVICES"] == "" and "--estimate-case" in cmd
        return subprocess.CompletedProcess(cmd, -11, stdout="", stderr="Fatal Python error")

    monkeypatch.setattr(G.subprocess, "run", died)
    err = G.estimate_isolated("dropout", torch.float32, small=True, side="eager")
    assert set(err) == {"estimate_error"} and "signal 11" in err["estimate_error"]


def test_workspace_fields_compare_the_peak_with_workspace_against_the_allocator():
    from slimgrad.memory import measure

    class Alloc:  # requested bytes as CUDA's allocator counts them: 4 KiB scratch in every op
        def current(self):
            return 0

        def peak(self):
            return 4096

        def reset_peak(self):
            pass

    def step():
        w = torch.randn(64, requires_grad=True)
        return lambda: (w * 2).exp().sum()

    m = measure(step(), workspace=Alloc())
    assert set(m.workspace_bytes.values()) == {4096} and "aten.exp" in m.workspace_bytes
    assert m.peak_with_workspace_bytes == m.peak_bytes + 4096
    # an allocator peak of tracker peak + workspace + 300 B of rounding agrees with the refined
    # peak only
    req = m.peak_with_workspace_bytes
    rec = G.workspace_fields(m, req + 300, req)
    assert rec["agrees_with_workspace"] is True and rec["untracked_with_workspace_bytes"] == 0
    assert G.compare_peaks(m.peak_bytes, req + 300, req)["agrees"] is False
    assert G._side_agrees({"agrees": False, **rec}) is True
    assert G._side_agrees({"agrees": False, "agrees_with_workspace": False}) is False
    assert G._side_agrees({"agrees": None, "agrees_with_workspace": None}) is None


def test_allocator_path_runs_with_faked_cuda_counters(monkeypatch):
    # the CUDA-only branch of allocator_vs_tracker, on CPU: CUDA's counters faked (every op
    # holds 512 B of scratch), the estimate in this process
    from slimgrad.bench.harness import get_case

    c = torch.cuda
    monkeypatch.setattr(c, "synchronize", lambda *a: None)
    monkeypatch.setattr(c, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(c, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(c, "max_memory_allocated", lambda *a: 10**9)
    monkeypatch.setattr(
        c,
        "memory_stats",
        lambda *a: {"requested_bytes.all.current": 0, "requested_bytes.all.peak": 10**9},
    )
    monkeypatch.setattr(c, "current_device", lambda: 0)
    nested = {"requested_bytes": {"all": {"current": 0, "peak": 512}}}
    monkeypatch.setattr(c, "memory_stats_as_nested_dict", lambda *a: nested)
    res = G.allocator_vs_tracker(get_case("dropout").build, torch.device("cpu"), torch.float32,
                                 small=True, warmup=1, allocator=True)  # fmt: skip
    for side in res.values():
        assert side["estimate_saved_bytes"] > 0 and "estimate_error" not in side
        assert side["peak_with_workspace_bytes"] == side["tracker_peak_bytes"] + 512
        assert set(side["workspace_bytes"].values()) == {512}
        assert side["agrees"] is False and side["agrees_with_workspace"] is False
        assert side["untracked_with_workspace_bytes"] == 10**9 - side["peak_with_workspace_bytes"]
    res = G.allocator_vs_tracker(get_case("dropout").build, torch.device("cpu"), torch.float32,
                                 small=True, warmup=1, allocator=True, estimate=False)  # fmt: skip
    assert all(s["estimate_error"] == "not run (--no-estimate)" for s in res.values())
    assert all("peak_with_workspace_bytes" in s for s in res.values())

import gc
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from slimgrad import cli
from slimgrad.bench import harness


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "bench", "profile", "estimate", "env"):
        assert name in out


@pytest.mark.parametrize("name", ["demo", "bench", "profile", "estimate", "env"])
def test_each_subcommand_has_a_description_and_examples(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    sub = cli.SUBCOMMANDS[name]
    assert sub.description and sub.examples
    assert "examples:" in out and f"slimgrad {name}" in out.split("examples:")[1]


def test_profile_help_states_the_factory_contract(capsys):
    for name in ("profile", "estimate"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        out = capsys.readouterr().out
        assert "called with no arguments" in out and "returns (model, make_inputs)" in out
        assert "make_inputs(batch: int)" in out and "current" in out and "--hf-config" in out
    assert "fake tensors" in cli.SUBCOMMANDS["estimate"].description


def _one_line_error(capsys, argv, match=None):
    # exit status 2 and one line on stderr in the slimgrad form, nothing on stdout
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slimgrad "), err
    assert "Traceback" not in err and out == ""
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage: slimgrad" in capsys.readouterr().out


def test_bench_list(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("resnet50", "gpt2", "conv_chain", "hf_gpt2"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name


def test_bench_small_json_record(tmp_path, capsys):
    code = cli.main(
        ["bench", "conv_chain", "--small", "--json", "--repeat", "2", "--out", str(tmp_path)]
    )
    assert code == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["case"] == "conv_chain" and rec["repeat"] == 2 and rec["grad"]["ok"]
    stored = (tmp_path / "conv_chain.jsonl").read_text().splitlines()
    assert len(stored) == 1 and json.loads(stored[0])["eager"] == rec["eager"]


def test_bench_human_output_no_record(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "gpt2", "--small", "--repeat", "1", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "saved MiB" in out and "peak MiB" in out and "gradients" in out and ": OK" in out
    assert not (tmp_path / "benchmarks").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["bench"], "no case given"),
        (["bench", "nope"], "unknown case; expected one of"),
        (["bench", "conv_chain", "--dtype", "float8"], "unknown --dtype"),
        (["bench", "conv_chain", "--small", "--repeat", "0", "--no-record"], "repeat must be"),
        (["demo", "--steps", "0"], "--steps must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, match, capsys):
    _one_line_error(capsys, argv, match)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["bench", "conv_chain", "--warmup", "-1"], "--warmup must be >= 0"),
        (["bench", "conv_chain", "--repeat", "x"], "invalid int value"),
        (["bench", "conv_chain", "--no-record", "--out", "d"], "--no-record and --out"),
        (["bench", "conv_chain", "--device", "nodevice"], "bad --device"),
        (["bench", "conv_chain", "--all"], "--all takes no case"),
        (["bench", "conv_chain", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bench_bad_arguments_before_any_work(argv, match, capsys, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("a bad argument must stop the command before any case runs")

    monkeypatch.setattr(harness, "run_case", no_run)
    _one_line_error(capsys, argv, match)


def test_bench_out_must_be_a_folder(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    _one_line_error(capsys, ["bench", "conv_chain", "--out", str(tmp_path / "f")], "a folder")


def test_bench_default_writes_no_record_outside_the_checkout(tmp_path, capsys, monkeypatch):
    # Issue 34: `slimgrad bench` wrote ./benchmarks/results/*.jsonl into the user's directory.
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "conv_chain", "--small", "--repeat", "1", "--no-grad-check", "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "record_path" not in json.loads(out)
    assert "no record written" in err and "--out DIR" in err
    assert list(tmp_path.iterdir()) == []


def test_repo_results_dir_only_inside_the_checkout(tmp_path):
    root = Path(harness.__file__).resolve().parents[3]
    if not (root / "benchmarks" / "results").is_dir():
        pytest.skip("slimgrad is not imported from a source checkout")
    assert harness.repo_results_dir(root) == root / "benchmarks" / "results"
    assert harness.repo_results_dir(root / "src" / "slimgrad") == root / "benchmarks" / "results"
    assert harness.repo_results_dir(tmp_path) is None
    assert harness.repo_results_dir(root.parent) is None


def test_bench_prints_where_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "recs"
    argv = ["bench", "conv_chain", "--small", "--repeat", "1", "--no-grad-check"]
    assert cli.main([*argv, "--json", "--out", str(out_dir)]) == 0
    err = capsys.readouterr().err
    assert f"record appended to {out_dir / 'conv_chain.jsonl'}" in err
    assert cli.main([*argv, "--out", str(out_dir)]) == 0
    assert f"record appended to {out_dir / 'conv_chain.jsonl'}" in capsys.readouterr().out
    assert len((out_dir / "conv_chain.jsonl").read_text().splitlines()) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recs"]


def _record(eager_ms, slim_ms):
    ratios = [s / e for e, s in zip(eager_ms, slim_ms, strict=True)]
    q1, q3 = harness._quartiles(ratios)
    side = {"saved_bytes": 2**20, "peak_bytes": 2**21, "floor_bytes": 2**20}
    return {
        "case": "c", "dtype": "float32", "device": "cpu", "device_name": "cpu", "shapes": [[2]],
        "eager": {**side, "step_ms": sorted(eager_ms)[len(eager_ms) // 2]},
        "slimgrad": {**side, "step_ms": sorted(slim_ms)[len(slim_ms) // 2]},
        "saved_ratio": 1.0, "peak_ratio": 1.0, "time_ratio": sorted(ratios)[len(ratios) // 2],
        "time_ratio_min": min(ratios), "time_ratio_max": max(ratios),
        "time_ratio_q1": q1, "time_ratio_q3": q3, "repeat": len(ratios),
        "step_ms_all": {"eager": eager_ms, "slimgrad": slim_ms}, "grad": None,
    }  # fmt: skip


def test_spread_of_short_steps_is_reported_robustly():
    # Issue 34: "0.009 .. 1195.578": a 0.5 ms step interrupted once on either side. The summary
    # gives the middle half of the pairs (and says the pairs disagree), not just min .. max.
    eager = [0.50, 0.52, 0.49, 0.51, 55.0, 0.50, 0.50, 0.51]
    slim = [0.52, 0.53, 0.51, 598.0, 0.52, 0.52, 0.51, 0.53]
    text = cli.format_record(_record(eager, slim))
    line = next(ln for ln in text.splitlines() if ln.startswith("time ratio"))
    assert line.startswith("time ratio over 8 pairs: median 1.0")
    assert "middle half 1.0" in line and "min .. max 0.009 .. 1172.549" in line
    assert "the pairs disagree" not in text  # the middle half agrees
    noisy = cli.format_record(
        _record([0.5, 0.5, 3.0, 0.5, 4.0, 0.5], [0.5, 2.0, 0.5, 3.0, 0.5, 0.5])
    )
    assert "the pairs disagree: a 0.50 ms step" in noisy
    few = cli.format_record(_record([1.0, 2.0], [1.1, 2.0]))
    assert "over 2 pairs" in few and "each pair: 1.000, 1.100" in few


def test_timed_pairs_run_without_gc_and_record_quartiles():
    seen = []

    class _Probe(nn.Linear):
        def forward(self, x):
            seen.append(gc.isenabled())
            return super().forward(x)

    def build(device, dtype, small=False):
        eager = _Probe(3, 2)
        return eager, _Probe(3, 2), lambda: torch.randn(4, 3)

    case = harness.Case(name="gc_probe", build=build, grad_check=False)
    assert gc.isenabled()
    rec = harness.run_case(case, repeat=5, warmup=0)
    assert gc.isenabled()
    assert seen[-10:] == [False] * 10  # the 5 timed pairs (the memory passes before: their own)
    assert rec["time_ratio_min"] <= rec["time_ratio_q1"] <= rec["time_ratio"]
    assert rec["time_ratio"] <= rec["time_ratio_q3"] <= rec["time_ratio_max"]
    assert "record_path" not in rec  # run_case writes nothing by default


def test_env(capsys):
    assert cli.main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    assert cli.main(["env"]) == 0
    assert "torch" in capsys.readouterr().out


def test_subcommand_table_is_extensible(monkeypatch, capsys):
    def add(p):
        p.add_argument("--n", type=int, default=1)

    def run(args):
        print(f"ran with {args.n}")
        return 0

    monkeypatch.setitem(cli.SUBCOMMANDS, "profile", cli.Subcommand("profile a step", add, run))
    assert cli.main(["profile", "--n", "3"]) == 0
    assert "ran with 3" in capsys.readouterr().out


def test_bench_all_small(tmp_path, capsys, monkeypatch):
    from slimgrad.bench import harness
    from slimgrad.bench.harness import list_cases

    # --all's plumbing over three built-in model cases (a conv chain, a module-level GPT-2, an HF
    # one): each case's own small run is tested with its case; all 29 here took 30 s of CI
    builtin = {c.name: c for c in list_cases() if c.source == "slimgrad.bench.cases.models"}
    some = {n: builtin[n] for n in ("conv_chain", "gpt2", "hf_gpt2")}
    monkeypatch.setattr(harness, "_REGISTRY", some)
    argv = ["bench", "--all", "--small", "--repeat", "1", "--no-grad-check", "--json"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = sorted(c.name for c in list_cases() if not c.missing())
    assert sorted(r["case"] for r in recs) == expected
    assert sorted(p.stem for p in tmp_path.glob("*.jsonl")) == expected
    assert all(r["grad"] is None for r in recs)
    assert cli.main(["bench", "gpt2", "--all"]) == 2
    assert "--all takes no case" in capsys.readouterr().err


def test_python_dash_m_slimgrad_is_the_slimgrad_command(capsys, monkeypatch):
    # Issue 15: `python -m slimgrad` works like the `slimgrad` console script (same parser, same
    # exit status): slimgrad/__main__.py run as `-m` runs it (in this process: an interpreter's
    # start was most of the test). No command prints the parser's help, with every subcommand,
    # and exits 2 (test_no_command_prints_help, test_help_lists_subcommands: the parser's own)
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["slimgrad"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("slimgrad", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert e.value.code == 2 and "usage: slimgrad" in out
    for name in ("demo", "bench", "env"):
        assert name in out

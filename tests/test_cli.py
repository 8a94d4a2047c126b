import json

import pytest
import torch

from slimgrad import cli


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "bench", "env"):
        assert name in out


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
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err


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

    # Only the built-in model cases, so this test does not grow with every op's case.
    builtin = {c.name: c for c in list_cases() if c.source == "slimgrad.bench.cases.models"}
    monkeypatch.setattr(harness, "_REGISTRY", builtin)
    argv = ["bench", "--all", "--small", "--repeat", "1", "--no-grad-check", "--json"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = sorted(c.name for c in list_cases() if not c.missing())
    assert sorted(r["case"] for r in recs) == expected
    assert sorted(p.stem for p in tmp_path.glob("*.jsonl")) == expected
    assert all(r["grad"] is None for r in recs)
    assert cli.main(["bench", "gpt2", "--all"]) == 2
    assert "--all takes no case" in capsys.readouterr().err


def test_python_dash_m_slimgrad_is_the_slimgrad_command():
    # Issue 15: `python -m slimgrad` works like the `slimgrad` console script (same parser, same
    # exit status).
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "slimgrad", "--help"], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "usage: slimgrad" in r.stdout
    for name in ("demo", "bench", "env"):
        assert name in r.stdout
    r = subprocess.run([sys.executable, "-m", "slimgrad"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 2 and "usage: slimgrad" in r.stdout

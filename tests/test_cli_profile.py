import json

import pytest

from slimgrad.cli import main

pytest.importorskip("transformers")


def test_profile_json_and_verify(capsys):
    assert main(["profile", "gpt2", "--size", "tiny", "--seq", "16", "--batch", "2", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["target"] == "hf:gpt2" and rec["batch"] == 2 and not rec["estimated"]
    assert 0 < rec["slimgrad"]["saved_bytes"] < rec["eager"]["saved_bytes"]
    assert (
        main(["profile", "gpt2", "--size", "tiny", "--seq", "16", "--batch", "2", "--verify"]) == 0
    )
    assert "verify: OK" in capsys.readouterr().out


def test_estimate_matches_profile_and_plot(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert main(["estimate", "bert", "--size", "tiny", "--seq", "16", "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        main(["profile", "bert", "--size", "tiny", "--seq", "16", "--json", "--plot", str(png)])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    real = json.loads(lines[-2])
    assert est["estimated"] and est["eager"]["peak_bytes"] == real["eager"]["peak_bytes"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fit_and_errors(capsys):
    assert main(["profile", "gpt2", "--size", "tiny", "--seq", "16", "--fit-gib", "0.01"]) == 0
    assert "largest batch fitting" in capsys.readouterr().out
    assert main(["profile", "nope"]) == 2
    assert "unknown target" in capsys.readouterr().err


def test_bench_verify_flag(capsys):
    assert main(["bench", "resnet50", "--small", "--no-record", "--repeat", "1", "--verify"]) == 0
    assert "verify: OK" in capsys.readouterr().out

from slimgrad import cli
from slimgrad.demo import run_demo


def test_demo_small_one_step(tmp_path, capsys):
    png = tmp_path / "timelines.png"
    res = run_demo(steps=1, small=True, out=str(png))
    assert res["ok"]
    assert res["png"] == str(png) and png.stat().st_size > 0
    out = capsys.readouterr().out
    assert "peak MiB" in out and f"memory timelines written to {png}" in out
    for name in ("cnn", "transformer"):
        r = res["models"][name]
        assert r["grad"]["ok"] and r["loss_agree"]
        for side in ("eager", "slimgrad"):
            assert r[side]["peak_bytes"] > 0 and r[side]["saved_bytes"] > 0
            assert len(r[side]["losses"]) == 1
            assert max(r[side]["timeline"]) == r[side]["peak_bytes"]
        assert r["slimgrad"]["peak_bytes"] < r["eager"]["peak_bytes"]
        assert r["converted"]  # convert_ swapped something in both models


def test_demo_cli_no_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--small", "--steps", "2", "--no-plot"]) == 0
    assert "memory timelines written" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_quickstart_example_runs(capsys):
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert "gradients within the rule: True" in out and out.count(" peak ") == 2

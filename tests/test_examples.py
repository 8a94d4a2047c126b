"""The runnable examples run (CI runs them through this test)."""

from tests._examples import run_example


def test_revnet_example_runs():
    out = run_example("revnet.py", "--steps", "1", "--batch", "4")
    assert "step 0: loss" in out and "reversible: saved" in out

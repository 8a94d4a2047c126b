"""The runnable examples run (CI runs them through this test)."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_revnet_example_runs():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "revnet.py"), "--steps", "1", "--batch", "4"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "step 0: loss" in out and "reversible: saved" in out

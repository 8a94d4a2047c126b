"""The integration examples run and their assertions hold (each example asserts against eager and a
float64 reference itself; a failed assertion fails the test: its exception in this process, or the
child's non-zero exit for the two that spawn workers)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests._examples import run_example

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TESTS = Path(__file__).resolve().parent


def _run(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _needs(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"needs {m} (the [hf] extra and accelerate)")


def test_hf_trainer_example_losses_within_rule():
    _needs("transformers", "accelerate", "peft")
    # HF gradient checkpointing and LoRA adapters on the converted model, in the one run
    out = run_example("hf_trainer.py", "--steps", "3", "--gradient-checkpointing", "--peft")
    assert "trainer: 3 step losses within the error rule against float64" in out
    assert out.count("step ") >= 3


def test_accelerate_example_losses_within_rule_and_peak_below_eager():
    _needs("transformers", "accelerate")
    out = run_example("accelerate_loop.py", "--steps", "2")
    assert "accelerate: 2 step losses within the error rule; peak below eager's" in out


@pytest.mark.distributed
def test_ddp_example_two_gloo_ranks():
    out = _run("ddp_gloo.py", "--steps", "2")
    assert out.count("parameters within the error rule") == 2  # one line per rank
    assert "ddp: 2 processes, 2 steps" in out


@pytest.mark.distributed
def test_fsdp2_example_two_gloo_ranks():
    pytest.importorskip("torch.distributed.fsdp")
    out = _run("fsdp2_gloo.py", "--steps", "2")
    assert out.count("parameters within the error rule") == 2  # one line per rank
    assert "fsdp2: 2 processes, 2 steps" in out


def test_every_example_is_run_by_a_test():
    """A new example needs a test that runs it (CI runs the examples through the suite)."""
    tests = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    missing = [p.name for p in sorted(EXAMPLES.glob("*.py")) if p.name not in tests]
    assert not missing, f"examples no test runs: {missing}"

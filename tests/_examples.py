"""Run an example script of examples/ in this process, as `python examples/<name> <args>` runs it
(``__name__ == "__main__"``, its arguments in ``sys.argv``), and return what it printed.

In this process, not a child: a child spent more CPU importing torch, transformers and slimgrad
(~8 s for the HF examples) than most examples spend running, and a failed assertion of the example
comes back as its own traceback. The examples that spawn processes (ddp_gloo.py, fsdp2_gloo.py:
their workers import ``__main__``) still run as a child.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import warnings
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _reset_accelerate() -> None:
    # Accelerator() (accelerate_loop.py, and HF's Trainer) keeps its process-wide state in
    # singletons; cleared so the tests after this one see the state a fresh process has
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def run_example(name: str, *args: str) -> str:
    out = io.StringIO()
    argv, threads, environ = sys.argv, torch.get_num_threads(), dict(os.environ)
    sys.argv = [str(EXAMPLES / name), *args]
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        # what an example (or the libraries it drives) sets for its process stays with it
        sys.argv = argv
        torch.set_num_threads(threads)
        _reset_accelerate()
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
    return out.getvalue()

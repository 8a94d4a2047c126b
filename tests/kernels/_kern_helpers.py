"""Loading slimgrad's Triton kernels under the interpreter, for tests/kernels/test_*.py.

NOTE [Kernels under the interpreter] in ``slimgrad/kernels/_common.py``: ``triton.jit`` picks the
interpreter when a kernel is decorated, so the flag is set first and the kernel modules are
(re)imported; afterwards the flag is restored and the modules are dropped, so that nothing decorated
in interpreter mode outlives the test module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace

SHARED = ("slimgrad.kernels._common", "slimgrad.kernels._output_act")


@contextlib.contextmanager
def interpreted(*stems: str) -> Iterator[SimpleNamespace]:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    names = [*SHARED, *(f"slimgrad.kernels.{s}" for s in stems)]
    try:
        mods = {}
        for name in names:
            mod = sys.modules.get(name)
            mods[name] = importlib.reload(mod) if mod is not None else importlib.import_module(name)
        yield SimpleNamespace(**{s: mods[f"slimgrad.kernels.{s}"] for s in stems})
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
        for name in names:
            sys.modules.pop(name, None)

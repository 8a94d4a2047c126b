"""Python calls slimgrad's own code makes (issue 32's host overhead, per op): deterministic counts,
not times. Counted with ``sys.setprofile``: every Python frame in ``src/slimgrad`` entered, and
every Python or C function called from one (``Module.__getattr__``, ``ctx.save_for_backward``,
``Tensor.numel``); what torch's own frames call in turn is not counted, so the count moves little
with torch's Python internals. The budgets are counted with slimgrad's C++ extension loaded (the
default build): without it (``SLIMGRAD_NO_EXT=1``, ``make test-no-reuse``) the gate and ownership
answer the same questions in more Python calls, so a budget test skips there, saying why."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

_SRC = "/src/slimgrad/"


def slimgrad_calls(fn: Callable[[], object], *, needs_ext: bool = True) -> int:
    """Calls of and from slimgrad's frames while ``fn()`` runs (forward and backward alike);
    skips the calling test when ``needs_ext`` and the C++ extension is not loaded."""
    import pytest

    from slimgrad import _ext

    if needs_ext and not _ext.available():
        pytest.skip(
            "call budgets are counted with slimgrad's C++ extension loaded; it is not here "
            f"({_ext.error()}), and the pure-Python gate makes more calls for the same answers"
        )
    n = [0]

    def prof(frame, event, arg):
        if event == "c_call":
            if _SRC in frame.f_code.co_filename:
                n[0] += 1
        elif event == "call":
            caller = frame.f_back
            if _SRC in frame.f_code.co_filename or (
                caller is not None and _SRC in caller.f_code.co_filename
            ):
                n[0] += 1

    # A cyclic collection that starts inside fn() runs finalizers and weakref callbacks of earlier
    # tests' garbage from whichever frame allocated last: counted as slimgrad's calls where that
    # frame is slimgrad's (a weakref.remove called from ops/conv.py took one budget from 9 to 10,
    # and to 17 in one full run). So garbage is collected first and none is collected meanwhile.
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return n[0]

"""Python calls slimgrad's own code makes (issue 32's host overhead, per op): deterministic counts,
not times. Counted with ``sys.setprofile``: every Python frame in ``src/slimgrad`` entered, and
every Python or C function called from one (``Module.__getattr__``, ``ctx.save_for_backward``,
``Tensor.numel``); what torch's own frames call in turn is not counted, so the count moves little
with torch's Python internals."""

from __future__ import annotations

import sys
from collections.abc import Callable

_SRC = "/src/slimgrad/"


def slimgrad_calls(fn: Callable[[], object]) -> int:
    """Calls of and from slimgrad's frames while ``fn()`` runs (forward and backward alike)."""
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

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]

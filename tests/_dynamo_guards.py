"""What Dynamo guards on: the guard managers of every compiled frame's cache entries, read for the
tests of what a compiled converted model costs per call (tests/test_compile_graph_breaks.py,
tests/test_compile_rms_norm_guards.py). Torch-private API: a test skips where it is missing."""

from __future__ import annotations

import pytest


def guards() -> list[tuple[str, int]]:
    """(source, number of leaf guards) of every guard manager that holds a leaf guard, over every
    compiled frame's cache entries; the calling test skips where this torch lacks the API."""
    try:
        from torch._C._dynamo.guards import DictGuardManager
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        pytest.skip("this torch has no cache-entry debug API")
    out: list[tuple[str, int]] = []

    def walk(mgr):
        if mgr.get_leaf_guards():
            out.append((mgr.get_source(), len(mgr.get_leaf_guards())))
        kids = list(mgr.get_child_managers())
        if isinstance(mgr, DictGuardManager):
            kids += [m for kv in mgr.get_key_value_managers().values() for m in kv if m]
        for k in kids:
            walk(k)

    for ref in input_codes.seen:
        code = ref()
        for entry in _debug_get_cache_entry_list(code) if code is not None else ():
            walk(entry.guard_manager.root)
    return out

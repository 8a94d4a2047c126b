"""What Dynamo guards on in a compiled converted HF model: every guard is checked on every compiled
call, so a guard on a constant slimgrad decided once is host time spent per step for nothing.

The fused LM loss reads its spec (the forward's template) through ``_layout`` and ``_plan``,
whose results Dynamo takes as constants (NOTE [The spec is a constant under torch.compile] in
``convert_handlers/hf_loss.py``): none of the spec's plain-data fields is guarded.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import slimgrad

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import _hf_families as H  # noqa: E402

pytest.importorskip("transformers")


def _guarded_sources() -> list[str]:
    # the source of every guard manager holding a leaf guard, over every compiled frame's cache
    # entries (torch-private API; skipped where it is missing)
    try:
        from torch._C._dynamo.guards import DictGuardManager
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        pytest.skip("this torch has no cache-entry debug API")
    out: list[str] = []

    def walk(mgr):
        if mgr.get_leaf_guards():
            out.append(mgr.get_source())
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


_SPEC_FIELDS = re.compile(
    r"_CACHE.*\]\.(causal|router|base|hidden|head|transform|loss|vocab_from|out|varkw|binds"
    r"|signature)\b"
)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_fused_loss_does_not_guard_on_its_spec(name):
    fam = H.FAMILIES[name]
    model = H.build(fam)
    batch = H.inputs(fam, model, labels=True)
    slimgrad.convert_(model)
    assert type(model.__dict__.get("forward")).__name__ == "_FusedLMForward"
    torch._dynamo.reset()
    try:
        f = torch.compile(model, backend="eager")
        f(**batch).loss.backward()
        sources = _guarded_sources()
    finally:
        torch._dynamo.reset()
    assert sources  # the walk sees the compiled frame's guards
    on_spec = [s for s in sources if _SPEC_FIELDS.search(s)]
    assert not on_spec, on_spec[:5]

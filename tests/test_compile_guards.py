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
from tests._dynamo_guards import guards

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import _hf_families as H  # noqa: E402

pytest.importorskip("transformers")


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
        sources = [s for s, _ in guards()]
    finally:
        torch._dynamo.reset()
    assert sources  # the walk sees the compiled frame's guards
    on_spec = [s for s in sources if _SPEC_FIELDS.search(s)]
    assert not on_spec, on_spec[:5]

"""torch.compile keeps what a converted model keeps (issue 32; NOTE [slimgrad ops under
torch.compile] in ``slimgrad/_compile.py``).

A tiny converted HF GPT-2 / Llama compiled with ``aot_eager_decomp_partition`` (inductor's
decompositions and its min-cut partitioner, without inductor's C++ builds: the same choice of
saved values, minutes faster) keeps, after forward, at most 1.05x the bytes the uncompiled
converted model keeps; no graph break comes from slimgrad; and its gradients meet the error rule
with the uncompiled converted model as the baseline.

Kept bytes: the unique storages the autograd graph holds at the end of forward, walked from the
loss (``slimgrad.memory``'s walk: a compiled region is one ``CompiledFunctionBackward`` node whose
saved tensors are what the partitioner chose), parameters excluded. Exact, not an allocator
estimate.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch

import slimgrad
from slimgrad.memory import _storage, _walk_savers
from slimgrad.testing import assert_within_rule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import _hf_families as H  # noqa: E402

pytest.importorskip("transformers")

BACKEND = "aot_eager_decomp_partition"  # inductor's partitioner and decompositions, no codegen


def _family(name: str, dropout: bool) -> H.Family:
    fam = H.FAMILIES[name]
    if dropout:
        return fam
    off = {k: 0.0 for k in fam.overrides if "drop" in k}
    return dataclasses.replace(fam, overrides={**fam.overrides, **off})


def _kept_bytes(model: torch.nn.Module, loss: torch.Tensor) -> int:
    params = {_storage(p)._cdata for p in model.parameters()}
    found = _walk_savers([loss.grad_fn])
    return sum(_storage(t).nbytes() for key, (t, _) in found.items() if key not in params)


def _forward(model, batch, compiled: bool):
    fwd = torch.compile(model, backend=BACKEND) if compiled else model
    torch.manual_seed(0)
    fwd(**batch).loss.backward()  # the first step compiles backward too
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    return fwd(**batch).loss


@pytest.mark.slow  # 50-100 s on two loaded CPU cores (compiles)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_converted_keeps_what_uncompiled_keeps(name):
    fam = _family(name, dropout=True)
    conv = H.build(fam)
    batch = H.inputs(fam, conv, labels=True)
    slimgrad.convert_(conv)
    kept = _kept_bytes(conv, _forward(conv, batch, compiled=False))
    torch._dynamo.reset()
    try:
        kept_compiled = _kept_bytes(conv, _forward(conv, batch, compiled=True))
    finally:
        torch._dynamo.reset()
    assert kept_compiled <= 1.05 * kept, (kept_compiled, kept, kept_compiled / kept)


def _site(reason) -> str:
    frames = list(reason.user_stack or [])
    for f in reversed(frames):
        if "/slimgrad/" in f.filename:
            return f.filename.split("/slimgrad/")[-1]
    return ""


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_no_graph_break_in_slimgrad(name):
    fam = _family(name, dropout=True)
    conv = H.build(fam)
    batch = H.inputs(fam, conv, labels=True)
    slimgrad.convert_(conv)
    torch._dynamo.reset()
    try:
        out = torch._dynamo.explain(conv)(**batch)
    finally:
        torch._dynamo.reset()
    sites = [_site(r) for r in out.break_reasons]
    assert [s for s in sites if s] == [], [r.reason.splitlines()[0] for r in out.break_reasons]


def _grads(model, batch, compiled: bool):
    loss = _forward(model, batch, compiled)
    loss.backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.slow  # 80-140 s on two loaded CPU cores (compiles)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_converted_gradients_within_rule(name):
    # dropout off: the float64 reference cannot draw the same masks
    fam = _family(name, dropout=False)
    model = H.build(fam)
    batch = H.inputs(fam, model, labels=True)
    ref = _grads(copy.deepcopy(model).double(), batch, compiled=False)
    slimgrad.convert_(model)
    base = _grads(model, batch, compiled=False)
    torch._dynamo.reset()
    try:
        got = _grads(model, batch, compiled=True)
    finally:
        torch._dynamo.reset()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert_within_rule(got, ref, base, names=names)

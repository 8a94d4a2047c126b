"""A converted HF model with ``attn_implementation="eager"`` under ``torch.compile`` (issue 32).

NOTE [The eager default, decided at convert_] in ``slimgrad/convert_handlers/hf_attention.py``:
what the slimgrad eager attention needs to know about a class (its eager default, that function's
signature, HF's cast order, the keywords slimgrad does not implement) is decided when
``convert_`` checks the class. Read per call, it cost an ``inspect.signature`` per eager-attention
call and, under ``torch.compile``, a graph break at each call (``inspect.getsource``): a
converted tiny Llama compiled in 10 graphs where the eager model compiles in one.

- No ``inspect.signature`` of the family's eager function during a converted forward.
- One compile of a converted one-layer Llama (eager attention, Llama's default dropout 0): one
  graph, kept bytes after forward (``slimgrad.memory``'s walk of the autograd graph, parameters
  excluded) at most the uncompiled eager model's, and gradients within the error rule against
  eager and float64.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import sys

import pytest
import torch

import slimgrad
from slimgrad.convert_handlers import hf_attention
from slimgrad.memory import _storage, _walk_savers
from slimgrad.testing import assert_within_rule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import _hf_families as H  # noqa: E402

pytest.importorskip("transformers")

BACKEND = "aot_eager_decomp_partition"  # inductor's partitioner and decompositions, no codegen


def _tiny_llama(dropout: float):
    fam = H.FAMILIES["llama_eager"]
    over = {**fam.overrides, "num_hidden_layers": 1, "attention_dropout": dropout}
    fam = dataclasses.replace(fam, overrides=over)
    model = H.build(fam)
    ids = H.inputs(fam, model, labels=True)["input_ids"][:1, :8]
    return model, {"input_ids": ids, "labels": ids.clone()}


def _kept_bytes(model: torch.nn.Module, loss: torch.Tensor) -> int:
    params = {_storage(p)._cdata for p in model.parameters()}
    found = _walk_savers([loss.grad_fn])
    return sum(_storage(t).nbytes() for key, (t, _) in found.items() if key not in params)


def test_no_signature_read_per_call(monkeypatch):
    model, batch = _tiny_llama(0.1)
    slimgrad.convert_(model)
    attn = model.model.layers[0].self_attn
    eager_fn = hf_attention._EAGER_PLANS[type(attn)].original
    seen = []
    real = inspect.signature

    def counting(fn, *a, **k):
        seen.append(fn)
        return real(fn, *a, **k)

    monkeypatch.setattr(inspect, "signature", counting)
    calls = []
    monkeypatch.setattr(
        hf_attention,
        "_eager_compute",
        lambda *a, real=hf_attention._eager_compute: calls.append(1) or real(*a),
    )
    torch.manual_seed(0)
    model(**batch).loss.backward()
    assert calls, "the slimgrad eager attention did not run"
    assert not [f for f in seen if f is eager_fn]


def test_compiled_converted_is_one_graph():
    # Llama's default attention_dropout=0: compiled code draws dropout masks its own way, so
    # without dropout the uncompiled eager model is the rule's baseline (no second compile)
    model, batch = _tiny_llama(0.0)
    ref = copy.deepcopy(model).to(torch.float64)
    eager = copy.deepcopy(model)
    slimgrad.convert_(model)

    graphs = []

    def counting(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend(BACKEND)(gm, example_inputs)

    torch.manual_seed(0)
    eager_loss = eager(**batch).loss
    eager_kept = _kept_bytes(eager, eager_loss)
    eager_loss.backward()
    torch.manual_seed(0)
    ref(**batch).loss.backward()
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        loss = torch.compile(model, backend=counting)(**batch).loss
        kept = _kept_bytes(model, loss)
        loss.backward()
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, [g.code[:200] for g in graphs]
    assert kept <= eager_kept, (kept, eager_kept)
    names = [n for n, _ in model.named_parameters()]
    assert_within_rule(
        [p.grad for p in model.parameters()],
        [p.grad for p in ref.parameters()],
        [p.grad for p in eager.parameters()],
        names=names,
    )


def test_a_class_without_a_plan_gets_one_at_its_call():
    # a converted model unpickled in a fresh process: its classes were never checked there
    model, batch = _tiny_llama(0.1)
    eager = copy.deepcopy(model)
    slimgrad.convert_(model)
    cls = type(model.model.layers[0].self_attn)
    plan = hf_attention._EAGER_PLANS.pop(cls)
    torch.manual_seed(0)
    loss = model(**batch).loss
    assert hf_attention._EAGER_PLANS[cls] == plan
    torch.manual_seed(0)
    torch.testing.assert_close(loss, eager(**batch).loss)

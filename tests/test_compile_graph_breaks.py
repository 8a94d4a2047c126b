"""torch.compile of converted HF models: graph breaks and guards (issue 16).

``torch._dynamo.explain`` of a converted tiny GPT-2 / Llama forward must count no more graph breaks
than the eager model's (HF's GPT-2 breaks once in its own code; Llama not at all). Slimgrad ops
with data-dependent side tables used to break at each call ("Dynamic shape operator"); NOTE [Side
tables under FakeTensorMode and torch.compile] in ``slimgrad/_math/tables.py``. What Dynamo guards
on in the same compiled converted models: every guard is checked on every compiled call, so a guard
on a constant slimgrad decided once is host time spent per step for nothing; the fused LM loss
reads its spec (the forward's template) through ``_layout`` and ``_plan``, whose results Dynamo
takes as constants (NOTE [The spec is a constant under torch.compile] in
``convert_handlers/hf_loss.py``): none of the spec's plain-data fields is guarded. Compiled train
steps of the same converted models meet the error rule in ``tests/test_compile_saved.py``.

Each model is traced once per module (the ``traced`` fixture) and every test of breaks, guards and
counts reads that trace. Every model here has one layer: the layers of these models are converted
alike (the same classes and decisions), so one layer traces every op kind of a layer once.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys

import pytest
import torch

import slimgrad
from slimgrad._compat import parse_version
from tests._dynamo_guards import guards

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import _hf_families as H  # noqa: E402

pytest.importorskip("transformers")

# Every slimgrad frame that breaks a graph fails test_no_break_inside_these_ops.
OTHERS: tuple[str, ...] = ()


def _family(name: str, dropout: bool, layers: int = 1) -> H.Family:
    fam = H.FAMILIES[name]  # with one layer (the module docstring says why)
    over = {**fam.overrides, ("n_layer" if name == "gpt2" else "num_hidden_layers"): layers}
    if not dropout:
        over.update({k: 0.0 for k in fam.overrides if "drop" in k})
    return dataclasses.replace(fam, overrides=over)


@dataclasses.dataclass
class _Trace:
    graph_break_count: int  # graphs - 1, as torch._dynamo.explain counts them
    break_reasons: list  # the GraphCompileReason of each graph that ended at a break
    compiled_breaks: int  # torch.compile's own count (benchmarks/compile_step.py records it)
    guards: list | None  # (source, leaf guards) of the compiled frames; None: no debug API


def _trace(model, batch) -> _Trace:
    # torch._dynamo.explain's backend (graphs and break reasons, its count: graphs - 1) in one
    # torch.compile of a training forward with labels and its backward; Dynamo only, no AOT or
    # inductor. The guards are read before the reset drops the cache entries.
    graphs, reasons = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        if gm.compile_subgraph_reason.graph_break:
            reasons.append(gm.compile_subgraph_reason)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        torch.compile(model, backend=backend)(**batch).loss.backward()
        n = sum(torch._dynamo.utils.counters["graph_break"].values())
        try:
            seen = guards()
        except pytest.skip.Exception:  # this torch lacks the debug API: that test skips
            seen = None
    finally:
        torch._dynamo.reset()
    return _Trace(len(graphs) - 1, reasons, n, seen)


def _site(reason) -> str:
    # the innermost slimgrad source frame of a break, or the innermost frame outside slimgrad
    frames = list(reason.user_stack or [])
    for f in reversed(frames):
        if "/slimgrad/" in f.filename:
            return f.filename.split("/slimgrad/")[-1]
    return frames[-1].filename if frames else "?"


# With and without the fused LM loss (convert_handlers/hf_loss.py, ops/linear_cross_entropy.py),
# a converted GPT-2 (layer_norm, GELU, dropout, the attention's softmax-dropout-matmul, linear)
# breaks no more than eager (without it, both models with a known loss_type: HF's own break at
# its loss_function property is the with-fused-loss trace's).
WITHOUT_OTHERS = slimgrad.ConvertConfig(fused_loss=False)


@pytest.fixture(scope="module")
def traced():
    # (eager, converted) traces of each model, dropout on; the converted model's forward is the
    # fused loss's (checked here: the guard test is about it)
    out = {}
    for name in ("gpt2", "llama"):
        fam = _family(name, dropout=True)
        model = H.build(fam)
        batch = H.inputs(fam, model, labels=True)
        conv = copy.deepcopy(model)
        slimgrad.convert_(conv)
        assert type(conv.__dict__.get("forward")).__name__ == "_FusedLMForward"
        eager = _trace(model, batch)
        out[name] = (eager, _trace(conv, batch))
        if name == "gpt2":
            # a known loss_type: HF's loss_function property does not warn, so neither model
            # breaks at it (with the break, Dynamo traces the whole converted model a second
            # time, up to the break: 2.5x the CPU time of this trace)
            model.loss_type = "ForCausalLM"
            conv = copy.deepcopy(model)
            slimgrad.convert_(conv, WITHOUT_OTHERS)
            out["gpt2_without_others"] = (_trace(model, batch), _trace(conv, batch))
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_no_break_has_a_slimgrad_frame(traced, name):
    # no break reason with a slimgrad frame, on every release (from the trace the other tests
    # read; tests/test_compile_saved.py ran its own of the same converted models until merged)
    _, conv = traced[name]
    inside = [
        r.reason.splitlines()[0]
        for r in conv.break_reasons
        if any("/slimgrad/" in f.filename for f in r.user_stack or [])
    ]
    assert inside == []


# Graph-break counts are Dynamo's, which changes between releases: torch 2.11 breaks at
# slimgrad's attention call (convert_handlers/hf_attention.py) and at its eager-only wrappers
# (9-10 breaks where 2.13/2.15 have 0-1). Correctness under compile is checked on every release
# by tests/test_compile_saved.py's
# test_compiled_converted_train_steps_within_rule.
_BREAKS_AS_2_13 = pytest.mark.skipif(
    parse_version(torch.__version__)[:2] < (2, 13),
    reason="torch < 2.13: Dynamo breaks the graph at slimgrad's attention and eager-only calls",
)


@_BREAKS_AS_2_13
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_no_break_inside_these_ops(traced, name):
    eager, conv = traced[name]
    sites = [_site(r) for r in conv.break_reasons]
    eager_sites = [_site(r) for r in eager.break_reasons]
    ours = [s for s in sites if s not in eager_sites and not s.endswith(OTHERS)]
    assert ours == [], [r.reason.splitlines()[0] for r in conv.break_reasons]


@_BREAKS_AS_2_13
def test_llama_breaks_no_more_than_eager(traced):
    eager, conv = traced["llama"]
    assert eager.graph_break_count == 0
    assert conv.graph_break_count <= eager.graph_break_count


@_BREAKS_AS_2_13
def test_gpt2_without_others_parts_breaks_no_more_than_eager(traced):
    eager, conv = traced["gpt2_without_others"]
    assert eager.graph_break_count == 0  # loss_type set: no break at HF's loss_function
    assert conv.graph_break_count <= eager.graph_break_count


@_BREAKS_AS_2_13
def test_gpt2_breaks_no_more_than_eager(traced):
    eager, conv = traced["gpt2"]
    assert eager.graph_break_count == 1
    assert conv.graph_break_count <= eager.graph_break_count


# HF's GPT-2 (loss_type unset) breaks 2 times here, at the ``logger.warning_once`` inside its
# ``loss_function`` property; the converted model's fused loss read that property before running
# the model (3 breaks) until it read it without the logger while Dynamo traces
# (convert_handlers/hf_loss.py ``_loss_function``).
@_BREAKS_AS_2_13
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_converted_train_forward_does_not_break(traced, name):
    # torch.compile's own count over the training forward with labels and its backward
    assert traced[name][1].compiled_breaks == 0


_SPEC_FIELDS = re.compile(
    r"_CACHE.*\]\.(causal|router|base|hidden|head|transform|loss|vocab_from|out|varkw|binds"
    r"|signature)\b"
)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_fused_loss_does_not_guard_on_its_spec(traced, name):
    # (tests/test_compile_guards.py compiled the same converted models again until merged)
    seen = traced[name][1].guards
    if seen is None:
        pytest.skip("this torch has no cache-entry debug API")
    sources = [s for s, _ in seen]
    assert sources  # the walk sees the compiled frame's guards
    on_spec = [s for s in sources if _SPEC_FIELDS.search(s)]
    assert not on_spec, on_spec[:5]


def _doubled_causal_loss(logits, labels, vocab_size, **kwargs):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)


# no layers: the loss read is the fused forward's, around the body (a 0-layer GPT-2 has no
# attention to convert, which convert_ warns about)
@pytest.mark.filterwarnings("ignore:slimgrad.convert_. a model family slimgrad supports")
@pytest.mark.parametrize("how", ["loss_function", "loss_type"])
def test_compiled_converted_gpt2_reads_the_loss_its_forward_would(how):
    # the traced read of ``loss_function`` (hf_loss._loss_function) sees what the property sees:
    # a loss set on the instance (the fused loss then steps aside: HF's forward with that loss)
    # and a known ``loss_type`` (the fused loss runs)
    fam = _family("gpt2", dropout=False, layers=0)
    model = H.build(fam)
    batch = H.inputs(fam, model, labels=True)
    if how == "loss_function":
        model.loss_function = _doubled_causal_loss
    else:
        model.loss_type = "ForCausalLM"
    ref = model(**batch).loss
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    assert type(conv.__dict__.get("forward")).__name__ == "_FusedLMForward"
    torch._dynamo.reset()
    got = torch.compile(conv, backend="eager")(**batch).loss
    torch._dynamo.reset()
    torch.testing.assert_close(got, ref)


def test_compiled_op_second_call_does_not_recompile(monkeypatch):
    # a trace kept the DTensor class in slimgrad._dtensor's list and guarded on the list being
    # empty: the second call traced and compiled again (every converted model, once); a whole
    # converted model: test_compiled_converted_llama_second_call_does_not_recompile
    import torch.distributed.tensor  # noqa: F401  (loaded, as Dynamo and inductor load it)

    from slimgrad import _dtensor
    from slimgrad.ops import dropout

    monkeypatch.setattr(_dtensor, "_CLS", [])
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda x: dropout(x, 0.25) * 2, backend="eager", fullgraph=True)
        x = torch.randn(5, 7, requires_grad=True)
        f(x).sum().backward()
        with torch._dynamo.config.patch(error_on_recompile=True):
            f(x).sum().backward()
    finally:
        torch._dynamo.reset()


_FRESH_PROCESS = """
import dataclasses
import sys

import torch

sys.path.insert(0, {conformance!r})
import _hf_families as H

import slimgrad

fam = H.FAMILIES["llama"]  # one layer: the gated MLP and the fused loss, once
fam = dataclasses.replace(fam, overrides={{**fam.overrides, "num_hidden_layers": 1}})
model = H.build(fam)
batch = H.inputs(fam, model, labels=True)
slimgrad.convert_(model)
assert any(type(m).__name__ == "GatedMLP" for m in model.modules())
assert type(model.__dict__.get("forward")).__name__ == "_FusedLMForward"  # the fused loss
f = torch.compile(model, backend="eager")
f(**batch).loss.backward()
with torch._dynamo.config.patch(error_on_recompile=True):
    f(**batch).loss.backward()
print(torch._dynamo.utils.counters["frames"]["total"])
"""


def test_compiled_converted_llama_second_call_does_not_recompile():
    # in a fresh process (tables a first call fills are empty there): a converted Llama (gated
    # MLP, fused loss) traced with the gated MLP's activation and Linear classes read from a
    # table its first call filled, and the fused loss reading the kernel backend's name before
    # the first call resolved it; each guard failed at the second call, which compiled again
    import subprocess

    src = os.path.dirname(os.path.dirname(slimgrad.__file__))
    env = dict(os.environ, PYTHONPATH=src)
    code = _FRESH_PROCESS.format(conformance=os.path.join(os.path.dirname(__file__), "conformance"))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "1"  # one frame compiled, over both calls

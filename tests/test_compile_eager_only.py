"""Many ``eager_only`` functions inside one compiled model (NOTE [Eager-only code under
torch.compile] in slimgrad/_compile.py): every wrapper shares one code object, so had Dynamo traced
it, each wrapped function and each call signature would have added a cache entry to that code
object, and one more than ``recompile_limit`` (torch 2.13: 8) would have hit it. Here, with the
limit lowered to 2 while compiling (every count scales with it), one more distinct function than
that limit, with three signatures, made before Dynamo is loaded (the usual case:
``import slimgrad`` and then ``torch.compile``) and after: the wrapper is never compiled, Dynamo
compiles the model's frame and one resume frame per graph break and nothing else, every model
segment is compiled (no fallback to eager), every wrapped function runs eagerly, and values and
gradients are eager's.

The same holds after ``torch.compiler.reset()`` between compiles, and in a process that imported
slimgrad before ``torch._dynamo`` (its own wrappers wait for Dynamo too): there the wrapper's
shared code used to be compiled at the first lazy call, and a reset then wiped the skip mark
from it, so every later wrapper call was compiled (1 and 6 cache entries; the order
``tests/test_compile_dispatch.py`` then this file hit it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from slimgrad._compat import parse_version
from slimgrad._compile import eager_only

LIMIT = 2  # Dynamo's recompile_limit while these tests compile
K = LIMIT + 1  # wrapped functions: more than the limit, one per signature
SIGNATURES = ("(x)", "(x, k)", "(x, *, k)")


def _functions(seen: list) -> list:
    # K distinct code objects, as K decorated functions in a library (not K closures of one def)
    funcs = []
    for k in range(K):
        ns = {"torch": torch, "seen": seen}
        params = SIGNATURES[k % 3][1:-1].replace("k", f"k={k}")
        exec(
            f"def f{k}({params}):\n"
            f"    seen.append(({k}, torch.compiler.is_compiling()))\n"
            f"    return x * {k + 2}\n",
            ns,
        )
        funcs.append(ns[f"f{k}"])
    return funcs


def _model(wrapped: list):
    # unrolled (a graph break inside a loop makes Dynamo run the whole frame eagerly)
    calls = ["(x.sin())", "(x.sin(), {k})", "(x.sin(), k={k})"]
    body = "".join(f"    x = w[{k}]{calls[k % 3].format(k=k)}\n" for k in range(K))
    ns = {"w": wrapped}
    exec(f"def model(x):\n{body}    return x\n", ns)
    return ns["model"]


_NEEDS_2_13 = pytest.mark.skipif(
    parse_version(torch.__version__)[:2] < (2, 13),
    reason="torch < 2.13: Dynamo keeps one more cache entry for the skipped wrapper (14 vs 13) "
    "and its skip() reports 'Bad import result'; a count of Dynamo's, not a result",
)
_WHEN = pytest.mark.parametrize(
    "before_dynamo", [True, False], ids=["made_before_dynamo", "made_after"]
)


def _wrapped(before_dynamo: bool, seen: list) -> list:
    funcs = _functions(seen)
    with pytest.MonkeyPatch.context() as mp:
        if before_dynamo:  # as at ``import slimgrad``: the wrappers wait for Dynamo
            mp.delitem(sys.modules, "torch._dynamo")
        return [eager_only(f) for f in funcs]


def _compile_and_check(model, wrapped: list, seen: list, extra_frames: int):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counters.clear()
    seen.clear()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with torch._dynamo.config.patch(recompile_limit=LIMIT, fail_on_recompile_limit_hit=True):
        outs = [compiled(x) for _ in range(2)]
    frames = counters["frames"]["total"]

    assert not any(_debug_get_cache_entry_list(w) for w in wrapped)  # never compiled
    # the model's frame and one resume frame per graph break, and ``extra_frames`` others
    assert frames == K + 1 + extra_frames
    assert len(graphs) == K  # one per segment with ops, once: the second run compiled nothing
    sins = sum(n.op == "call_method" and n.target == "sin" for g in graphs for n in g.graph.nodes)
    assert sins == K  # every segment between the wrapped calls compiled: no eager fallback
    assert seen == [(k, False) for _ in outs for k in range(K)]  # each ran, eagerly

    ref = model(x)
    (grad,) = torch.autograd.grad(outs[-1].sum(), x)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(outs[-1], ref)
    torch.testing.assert_close(grad, ref_grad)


@_NEEDS_2_13
@_WHEN
def test_wrappers_stay_skipped_after_a_reset(before_dynamo):
    # the first compile, then compiles after torch.compiler.reset(), which drops Dynamo's state for
    # every code object it has seen a frame of, the skip mark included; the wrappers' code must
    # never be one of them
    seen: list = []
    wrapped = _wrapped(before_dynamo, seen)
    model = _model(wrapped)
    torch._dynamo.reset()
    # made before Dynamo, the first call (which disables every wrapper) calls
    # torch.compiler.disable: Dynamo sees its functools.wraps and update_wrapper frames (frames
    # called from a skipped one are still Dynamo's) and skips them, no tensors in them
    _compile_and_check(model, wrapped, seen, extra_frames=2 if before_dynamo else 0)
    for _ in range(2):
        torch.compiler.reset()
        _compile_and_check(model, wrapped, seen, extra_frames=0)


_ROOT = Path(__file__).resolve().parents[1]

_FRESH = f"""
import sys
sys.path.insert(0, {str(_ROOT)!r})
import slimgrad  # first, as a user's script: its own eager-only wrappers wait for Dynamo
assert "torch._dynamo" not in sys.modules, "import slimgrad loaded torch._dynamo"
from tests import test_compile_eager_only as t
for before in (True, False):  # the first compile, then compiles after resets
    t.test_wrappers_stay_skipped_after_a_reset(before)
print("ok")
"""


@_NEEDS_2_13
def test_in_a_process_that_imported_slimgrad_before_dynamo():
    # the order that failed in one pytest process (tests/test_compile_dispatch.py, which imports
    # slimgrad first, then this file): slimgrad's lazy wrappers left the shared code unmarked
    # until the first call, whose frame Dynamo then compiled; a reset afterwards wiped the mark
    r = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, cwd=_ROOT, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]

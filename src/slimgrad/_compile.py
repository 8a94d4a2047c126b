"""``eager_only``: ``torch.compiler.disable`` without importing Dynamo at ``import slimgrad``.

# NOTE [Eager-only code under torch.compile]
Some slimgrad code must run eagerly inside a compiled model (it reads version counters, keeps weak
registries, or calls ``autograd.grad`` on recomputes, which Dynamo cannot trace). The usual
``@torch.compiler.disable`` imports ``torch._dynamo`` (and with it Triton: seconds) at decoration
time, that is at ``import slimgrad``. ``eager_only`` builds the disabled wrapper only once Dynamo
is loaded (nothing can be compiling before that): at decoration when it already is, else at the
first call after it is.

Every ``eager_only`` wrapper shares one code object (``call`` below), and Dynamo keeps at most
``recompile_limit`` (8) compiled entries per code object. Traced, ``call`` needed an entry per
wrapped function (tracing the lazy ``torch.compiler.disable(fn)`` guards on ``fn.__code__``) and
per call signature (``*args, **kwargs`` guards on their number): 12 wrapped functions in one
compiled model hit the limit (torch 2.13; ``tests/test_compile_eager_only.py``). So once Dynamo
is loaded, every wrapper is disabled and marked skipped together (``torch._dynamo``'s ``skip``:
Dynamo neither inlines ``call`` nor compiles its frames; the disabled ``fn`` runs eagerly): at
decoration when Dynamo is already loaded, else at the first call after it is, outside any trace
(``_disable_lazy``). Afterwards a call costs its caller one graph break, as a
``torch.compiler.disable`` function does.

``call``'s code is also marked skipped when ``eager_only`` runs, with the C setter
:func:`never_compiled` uses (no ``torch._dynamo`` import), so no frame of it is ever compiled, the
lazy first call's included. That first frame used to be compiled once (an entry and two resume
frames), and it left a state a later reset undid: ``torch._dynamo.reset()``
(``torch.compiler.reset()``) clears Dynamo's per-code state, the skip mark with it, of every code
Dynamo has been handed a frame of, and a code marked skipped before its first frame never is one.
Unmarked after a reset, every wrapper call was compiled again: 6 entries on ``call`` per compile
of 12 wrapped functions, 19 frames for 13. A process that imported slimgrad before
``torch._dynamo`` met it (slimgrad's own wrappers were lazy; ``tests/test_compile_eager_only.py``
after ``tests/test_compile_dispatch.py`` in one pytest process); one that loaded Dynamo first had
the mark from slimgrad's import, before any compile.

# NOTE [slimgrad ops under torch.compile]
Compiled, a slimgrad op keeps its contract only where every value its backward recomputes is
made inside a custom op. Dynamo traces a slimgrad autograd Function's forward
and backward (it inlines ``Function.apply``); AOTAutograd joins both into one graph, runs CSE on
it and lets the partitioner (inductor's min-cut) choose which forward values backward reads. What
the Function's ``save_for_backward`` names is no constraint there: the partitioner keeps whatever
forward value the traced backward reads. Two things lose slimgrad's saving that way:

- a recompute in backward written as plain torch ops (S = q @ k^T and softmax in the attention,
  act(g) in the gated MLP) is merged by CSE with the forward's identical ops, so backward reads
  the forward's S, P or act(g) * u and the partitioner keeps them (tiny HF Llama, 1 layer:
  the gated MLP's h was kept, 32 KiB);
- a path that hands the call to eager's ops under compile (HF SDPA attention did: P, the bool
  dropout mask and the dropped P kept, T x T each).

So under compile every value slimgrad's backward recomputes is made inside a custom op
(``slimgrad::<name>``, ``slimgrad._library.custom_op``, with a fake kernel): the joint graph
cannot merge it with the forward, and the min-cut partitioner never recomputes a custom op's
output (not in its recomputable allowlist), so what backward reads is exactly the op's contract:
the custom op's inputs that came from forward. An op whose Function cannot be traced as it is
(eager-only decisions, ``autograd.grad`` on recomputes) runs, while compiling, as one custom op
with ``register_autograd`` whose ``setup_context`` saves the contract and whose backward is one
more custom op (``ops/softmax_dropout.py``: ``scores_softmax_dropout_matmul``); the eager path
keeps its Function and its bits. Dropout inside such an op draws from the global generator at
run time, as the uncompiled op does: the same masks for the same seed (compiled eager draws with
inductor's RNG instead). A backward that recomputes nothing from the forward's inputs, only
rebuilds values from what the op saved, may stay traced torch ops, which inductor fuses: the
LayerNorm's (NOTE [LayerNorm's backward traced under torch.compile] in ``ops/layer_norm.py``). The
other way round, a ``torch.utils.checkpoint`` around eager's own ops tags them "recompute", and the
partitioner keeps only the checkpoint's inputs: the HF RMSNorm keeps x, not y (NOTE [RMSNorm's
backward traced under torch.compile] in ``ops/rms_norm.py``), and the fused loss (outside
autocast and ``precompute_grads``) keeps hidden, weight and target, no logits (NOTE [The fused
loss traced under torch.compile] in ``_math/linear_cross_entropy.py``).
``tests/test_compile_saved.py`` holds compiled converted HF GPT-2 and
Llama to the uncompiled converted models' saved bytes (x 1.05) and each op above to its Memory
line.

# NOTE [Recompute tags under torch.export]
Those checkpoints, and the attention core's (NOTE [The attention core, recomputed] in
``slimgrad/attention_core.py``), go through :func:`recompute_in_backward`. ``torch.export`` traces
forward only
(no partitioner, no backward), so the tags have nothing to tell it, and strict export of a
vanilla non-reentrant checkpoint fails in torch 2.13: Dynamo captures it as the
``tag_activation_checkpoint`` higher-order op, and export's pre-dispatch trace of that op reads a
``_checkpoint_context_fn`` entry Dynamo records only for a checkpoint given a ``context_fn``
(``KeyError: '_checkpoint_context_fn'``, from any model with such a checkpoint). While exporting
(``torch.compiler.is_exporting()``, True for strict export's Dynamo pass and for non-strict's
trace) the function runs as it is: the exported graph holds the eager ops themselves
(``tests/test_compile_export.py``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

F = TypeVar("F", bound=Callable)


_compiler = torch.compiler
# the flag is_exporting returns, read in this frame (as slimgrad._autograd.compiling reads
# is_compiling's, NOTE [One-frame compile check]); a torch without it asks is_exporting
_FLAG = hasattr(_compiler, "_is_exporting_flag")


def exporting() -> bool:
    """``torch.compiler.is_exporting()``, a constant to Dynamo (no guard, no side-effect mark)."""
    return _compiler._is_exporting_flag if _FLAG else _compiler.is_exporting()


exporting._dynamo_marked_constant = True  # type: ignore[attr-defined]


def recompute_in_backward(fn: Callable, *args, preserve_rng_state: bool = False, **kwargs):
    """``fn(*args, **kwargs)``, every value it makes tagged for recompute in backward: a
    non-reentrant ``torch.utils.checkpoint`` (NOTE [slimgrad ops under torch.compile]); while
    exporting, ``fn(*args, **kwargs)`` itself (NOTE [Recompute tags under torch.export]).
    ``preserve_rng_state``: the recompute draws what the first call drew (``fn``'s dropout;
    checkpoint's option of that name); without it ``fn`` must draw no random numbers."""
    if exporting():
        return fn(*args, **kwargs)
    return _checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
    )


# NOTE [Kernels Dynamo never compiles]
# A Python kernel slimgrad registers with the dispatcher (NOTE [Lean dispatcher kernels] in
# slimgrad/_library.py) runs wherever its op runs eagerly. Where that happens while a Dynamo frame
# callback is active (a function Dynamo skips or a graph break's eager call, inside a compiled
# one), Dynamo took the kernel's frame as a new frame to compile: it traced it up to the C calls it
# cannot trace (``get_eval_frame_callback``, torch's aliasing check), graph-broke there, warned
# ("Dynamo does not know how to trace the builtin ...") and compiled the pieces and their resume
# functions: 6 frames for one op call (tests/test_compile_dispatch.py). :func:`never_compiled`
# marks a function's code as Dynamo's ``skip`` does (the frame runs as Python; frames it calls
# are still Dynamo's), with torch's C setter, so nothing imports ``torch._dynamo``; a torch
# without the setter keeps the old behaviour.
try:  # private: the C setter behind torch._dynamo.decorators.skip
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    _SKIP = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)
except (ImportError, AttributeError):
    _SKIP = None


def never_compiled(fn: F) -> F:
    """Dynamo never compiles ``fn``'s own frames (NOTE [Kernels Dynamo never compiles])."""
    if _SKIP is not None:
        set_code_exec_strategy(fn.__code__, _SKIP)
    return fn


# (fn, its slot, its wrapper) for every wrapper made before Dynamo was loaded
_LAZY: list[tuple[Callable, list, Callable]] = []


def _disable(fn: Callable, slot: list, call: Callable) -> None:
    from torch._dynamo.decorators import skip

    slot[0] = torch.compiler.disable(fn)
    skip(call)


def _disable_lazy() -> None:
    for fn, slot, call in _LAZY:
        if slot[0] is None:
            _disable(fn, slot, call)


def eager_only(fn: F) -> F:
    """Like ``torch.compiler.disable(fn)``, but Dynamo is imported lazily (see the NOTE)."""
    disabled: list[Callable | None] = [None]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if disabled[0] is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            # every wrapper at once, never traced: a trace meets this once (see the NOTE)
            torch.compiler.disable(_disable_lazy)()
        return disabled[0](*args, **kwargs)

    # never compiled from the start, the lazy first call included (NOTE [Eager-only code under
    # torch.compile], last paragraph)
    never_compiled(call)
    if "torch._dynamo" in sys.modules:
        _disable(fn, disabled, call)
    else:
        _LAZY.append((fn, disabled, call))
    return call  # type: ignore[return-value]

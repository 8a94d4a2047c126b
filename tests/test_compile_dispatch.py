"""slimgrad custom ops called through the dispatcher, as a compiled graph calls them (NOTE [Lean
dispatcher kernels] in ``slimgrad/_library.py``): few Python frames per call, and the same
results, checks and errors as ``torch.library.custom_op``'s own kernels."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import slimgrad  # noqa: F401  (registers the ops)
from slimgrad._library import custom_op, python_impl


@custom_op("_test_dispatch_alias", mutates_args=())
def _alias(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape)  # an alias: custom ops must not return one


@_alias.register_fake
def _(x):
    return torch.empty_like(x)


@custom_op("_test_dispatch_twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


_twice.register_autograd(lambda ctx, g: g * 2)


def _python_calls(fn) -> int:
    n = [0]

    def count(frame, event, arg):
        if event == "call":
            n[0] += 1

    gc.collect()  # no collection (finalizers, weakref callbacks) counted: tests/_host_calls.py
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return n[0]


def test_dispatcher_call_adds_few_python_frames():
    # torch.library.custom_op's kernels added 14 Python frames to the implementation's own (its
    # Autograd kernel: a metadata dataclass, is_out, forward_no_grad, redispatch; its backend
    # kernel: the per-device lookup, the aliasing check's wrapper); the lean kernels added 7, 3 of
    # them torch.compiler.disable's, which is skipped where no Dynamo callback is active: 4
    import torch._dynamo  # noqa: F401  (loaded, as when a compiled graph runs)

    x = torch.randn(5, 7)
    _, bits = torch.ops.slimgrad.dropout_fwd.default(x, 0.25)
    op = torch.ops.slimgrad.dropout_apply_mask.default
    impl = python_impl("slimgrad::dropout_apply_mask")
    with torch.no_grad():
        for _ in range(2):  # the second count: nothing left to set up
            direct = _python_calls(lambda: impl(x, bits, 0.25, False))
            through = _python_calls(lambda: op(x, bits, 0.25, False))
        torch.testing.assert_close(op(x, bits, 0.25, False), impl(x, bits, 0.25, False))
    assert through - direct <= 4, (through, direct)


def test_output_aliasing_an_input_still_raises():
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match="may not alias any inputs"):
        torch.ops.slimgrad._test_dispatch_alias.default(x)


def test_backward_without_formula_still_raises():
    x = torch.randn(5, 7, requires_grad=True)
    _, bits = torch.ops.slimgrad.dropout_fwd.default(x.detach(), 0.25)
    out = torch.ops.slimgrad.dropout_apply_mask.default(x, bits, 0.25, False)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        out.sum().backward()


def test_registered_autograd_still_runs():
    x = torch.randn(4, requires_grad=True)
    y = torch.ops.slimgrad._test_dispatch_twice.default(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
    with torch.no_grad():
        assert not torch.ops.slimgrad._test_dispatch_twice.default(x).requires_grad


_BELOW: list[bool] = []
_NEG: list[bool] = []  # whether the implementation was handed a tensor with the negative bit


@custom_op("_test_dispatch_probe", mutates_args=())
def _probe(x: torch.Tensor) -> torch.Tensor:
    # whether the implementation runs below autograd (the redispatch) or was called directly
    _BELOW.append(
        torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradOther)
    )
    _NEG.append(x.is_neg())
    return x * 2


@_probe.register_fake
def _(x):
    return torch.empty_like(x)


def test_grad_off_plain_call_skips_the_redispatch():
    # grad off, plain CPU tensors, no mode: the Autograd kernel calls the backend kernel itself
    # (NOTE [Lean dispatcher kernels]): the same result, one argument boxing round fewer
    x = torch.randn(3)
    _BELOW.clear()
    with torch.no_grad():
        y = torch.ops.slimgrad._test_dispatch_probe.default(x)
    torch.testing.assert_close(y, x * 2)
    assert _BELOW == [False]


def test_grad_off_call_under_a_mode_still_reaches_the_mode():
    # a dispatch mode's Python key (or a subclass's, negative, conjugate or sparse keys) takes the
    # redispatch: the mode sees the op (its own call of the op then runs plainly); a negative
    # view is resolved before the implementation sees it
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(3)
    _BELOW.clear()
    with torch.no_grad(), Seen() as mode:
        torch.ops.slimgrad._test_dispatch_probe.default(x)
    assert mode.ops[0] == "slimgrad._test_dispatch_probe.default"
    _NEG.clear()
    with torch.no_grad():
        y = torch.ops.slimgrad._test_dispatch_probe.default(torch._neg_view(x))
    torch.testing.assert_close(y, x * -2)
    # the value alone cannot tell (ATen resolves the bit itself); C kernels read raw memory
    assert _NEG == [False]


@custom_op("_test_dispatch_callback", mutates_args=())
def _callback_probe(x: torch.Tensor) -> torch.Tensor:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    _SEEN.append(get_eval_frame_callback())
    return x + 1


@_callback_probe.register_fake
def _(x):
    return torch.empty_like(x)


_SEEN: list = []


def _op_in_a_skipped_function_inside_a_compiled_one():
    # the test op called eagerly under an active Dynamo callback: from a function Dynamo skips,
    # inside a compiled one; returns (op, compiled outer)
    from torch._dynamo.decorators import skip

    op = torch.ops.slimgrad._test_dispatch_callback.default

    def inner(x):
        return op(x)

    skip(inner)

    @torch.compile(backend="eager")
    def outer(x):
        return inner(x) * 2

    return op, outer


def test_implementation_never_runs_under_a_dynamo_callback():
    # the implementation runs itself only where no Dynamo callback is active; called eagerly
    # while one is (a function Dynamo skips, inside a compiled one), it runs through
    # torch.compiler.disable, so Dynamo never compiles its frames
    import torch._dynamo

    op, outer = _op_in_a_skipped_function_inside_a_compiled_one()

    x = torch.randn(3)
    _SEEN.clear()
    with torch.no_grad():
        torch.testing.assert_close(op(x), x + 1)
        torch._dynamo.reset()
        try:
            torch.testing.assert_close(outer(x), (x + 1) * 2)
        finally:
            torch._dynamo.reset()
    assert len(_SEEN) == 2 and all(cb is None for cb in _SEEN), _SEEN


def test_dynamo_never_compiles_the_lean_kernels():
    # NOTE [Kernels Dynamo never compiles] in slimgrad/_compile.py: an op called eagerly under an
    # active Dynamo callback (here from a skipped function inside a compiled one) used to have
    # its kernels' frames compiled by Dynamo, graph-breaking at get_eval_frame_callback and
    # torch's aliasing check (6 frames more, and a warning per builtin)
    import types

    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from slimgrad import _library

    kernels = [
        c
        for c in _library._lean_kernels.__code__.co_consts
        if isinstance(c, types.CodeType) and c.co_name in ("autograd_kernel", "backend_kernel")
    ]
    assert len(kernels) == 2
    op, outer = _op_in_a_skipped_function_inside_a_compiled_one()

    x = torch.randn(3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with torch.no_grad():
            torch.testing.assert_close(outer(x), (x + 1) * 2)
            breaks = list(torch._dynamo.utils.counters["graph_break"])
            compiled = [c.co_name for c in kernels if _debug_get_cache_entry_list(c)]
    finally:
        torch._dynamo.reset()
    assert not compiled, compiled
    assert not [b for b in breaks if "get_eval_frame_callback" in b or "_any_output_is" in b]

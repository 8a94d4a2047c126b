"""Helpers for slimgrad's error messages (form: see CONTRIBUTING.md)."""

from __future__ import annotations

from weakref import ref as _ref

import torch


def internal_error(what: str) -> RuntimeError:
    """An internal invariant broke: not the user's fault."""
    return RuntimeError(
        f"slimgrad internal error: {what}; this is a slimgrad bug; please report it."
    )


_WRITTEN = "modified by an inplace operation"


def raise_if_written(e: RuntimeError, api: str, why: str) -> None:
    """Re-raise autograd's in-place error ``e`` (from ``ctx.saved_tensors``) as slimgrad's: ``api``,
    autograd's first sentence, then ``why`` (what the op keeps and the fixes); return for any other
    error (the caller re-raises it). Called inline from an ``except`` clause: nothing is added where
    nothing raises."""
    msg = str(e)
    if _WRITTEN not in msg:
        return
    first = msg.split(" Hint:")[0]
    raise RuntimeError(f"slimgrad.{api}: {first} {why}") from e


# NOTE [A kept output written under saved-tensor hooks]
# Without hooks, autograd's SavedVariable compares a saved tensor's version at unpack with the one
# it had at save, and an op that keeps its output y (where eager keeps x) turns that error into
# its own (NOTE [An output written after forward] in ops/_output_act.py). Inside a
# ``saved_tensors_hooks`` region autograd skips that check: what unpack returns is the hook's
# business. A hook that hands back y itself (identity hooks; ``save_on_cpu`` on a CPU tensor,
# whose pack is ``tensor.cpu()``, y itself) then gives backward the written values, and the
# gradient rebuilt from them is wrong where eager, keeping x, is right. So a forward that keeps y
# asks, once, whether hooks are active (``hooks_top(False)``, one C call; never while compiling:
# torch.compile's own saved outputs are beyond a forward's reach, and compiled eager reads a
# written output under identity hooks as well) and only then records a weak reference to y and
# its version (:func:`seen`); unhooked forwards record None (an attribute store). Backward
# compares (:func:`check_seen`): y still alive, its version moved, and the unpacked tensor y
# itself or sharing its storage (a hook that keeps an alias, ``t.detach()``) is the write
# autograd would have caught: slimgrad's error. A hook that copied y at pack (offload to another
# device, a clone, bytes) hands back the old values: the gradient is right, no error. Not seen:
# a hook that copies at unpack (it reads the written values) and an alias-keeping hook whose y
# the caller dropped after the write (the weak reference is dead); both are documented limits.
# Ops whose eager op keeps y as well (relu, sigmoid, tanh, in-place leaky_relu/hardtanh) record
# nothing: eager reads the written y through such hooks too, and their gradient is eager's, bit
# for bit. Under torch.compile the traced forward cannot ask (the hooks apply where the compiled
# Function saves at run time), and compiled eager itself reads the written output: with identity
# hooks and a write after forward, compiled eager's gradient moved by 23.4 (LeakyReLU), 21.1
# (LayerNorm), 18.5 (GELU) from the unwritten one on a 32x64 Linear-op-Linear (issue 30's probe).
try:
    hooks_top = torch._C._autograd._top_saved_tensors_default_hooks
except AttributeError:  # a torch without it: every forward records (correct, a little slower)

    def hooks_top(ignore_is_tracing: bool) -> tuple:
        return ()


# A tensor a Function's forward marks dirty gets one more version bump from autograd when the
# forward returns (after anything the forward can read); tests/conformance/
# test_output_written_hooks.py pins it
DIRTY_BUMP = 1


def seen(y: torch.Tensor, dirty: bool = False) -> tuple | None:
    """What backward compares under saved-tensor hooks (NOTE [A kept output written under
    saved-tensor hooks]): a weak reference to y and the version it has once the forward returned
    (``dirty``: y was marked dirty); None for a tensor without a version counter (an inference
    tensor: nothing is saved for backward then)."""
    try:
        return _ref(y), y._version + (DIRTY_BUMP if dirty else 0)
    except RuntimeError:
        return None


def check_seen(record: tuple, u: torch.Tensor | None, api: str, why: str) -> None:
    """Raise slimgrad's error when the output ``u`` unpacked for backward is the y :func:`seen`
    recorded (or shares its storage) and y was written since (NOTE [A kept output written under
    saved-tensor hooks]); ``why``: what the op keeps and the fixes."""
    ref, v = record
    y = ref()
    if y is None or u is None or y._version == v or u.numel() == 0:
        return
    if u is not y and (
        u.device != y.device or u.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    ):
        return  # a copy made at pack: the values of forward
    raise RuntimeError(
        f"slimgrad.{api}: one of the variables needed for gradient computation has been modified "
        f"by an inplace operation: its output, handed back unchanged by a saved-tensor hook, is at "
        f"version {y._version}; expected version {v}. {why}"
    )

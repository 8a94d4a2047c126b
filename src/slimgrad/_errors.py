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
# the traced forward cannot ask, see below) and only then records a weak reference to y and
# its version (:func:`seen`); unhooked forwards record None (an attribute store). Backward
# compares (:func:`check_seen`): y still alive, its version moved, and the unpacked tensor y
# itself or sharing its storage is the write autograd would have caught: slimgrad's error. When
# the caller dropped y before backward (the usual case: a module's local output dies when its
# forward returns) the weak reference is dead; a hook that kept an alias (``t.detach()``) still
# holds y's storage and shares y's version counter, so :func:`seen` also records a weak reference
# to y's storage, its address and device: that storage still alive, the unpacked tensor on it and
# its version past y's recorded one is the same write. The storage's weak reference, not the
# address alone, rules out a later tensor (one a hook allocates at unpack) at the address y's
# freed storage had. A hook that copied y at pack (offload to another device, a clone, bytes)
# hands back the old values on a storage of its own (made while y was alive, so never at y's
# address; y's storage dies with y): the gradient is right, no error. Limits: a hook that copies
# at unpack reads the written values and is not seen (documented); a hook that rebuilds a tensor
# on y's storage with its own version counter (``empty(0).set_(storage)``) is compared by y's
# version while y lives, and once y is gone by its own counter, which ``set_`` already moved:
# it raises even unwritten (a refusal, never a wrong gradient; the message says so and names
# the fixes: keep y until backward, or copy at pack).
# Ops whose eager op keeps y as well (relu, sigmoid, tanh, in-place leaky_relu/hardtanh) record
# nothing: eager reads the written y through such hooks too, and their gradient is eager's, bit
# for bit. Under torch.compile the traced forward cannot ask (the hooks apply where the compiled
# Function saves at run time), and it need not: measured, with identity hooks and a write of
# the op's output h after forward, the compiled gradients (x and every parameter) of
# Linear-op-(h * c) are the unwritten ones (aot_eager), for compiled eager and compiled
# slimgrad alike (LeakyReLU, LayerNorm, GELU; review27a's probe; LeakyReLU pinned by
# tests/conformance/test_output_written_hooks_dropped.py). What moves when a Linear follows the
# op is that Linear's weight gradient: it keeps the written h as its input, in compiled and
# uncompiled eager alike (eager's own behaviour, not the op's).
try:  # a weak reference to a storage: it tells y's storage from a later one at its address
    from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef
except ImportError:  # a torch without it: only a live y is compared
    _StorageWeakRef = None
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
    saved-tensor hooks]): a weak reference to y, the version it has once the forward returned
    (``dirty``: y was marked dirty), and y's storage (a weak reference to it, its address, its
    device) for when y itself is gone by backward; None for a tensor without a version counter
    (an inference tensor: nothing is saved for backward then)."""
    try:
        v = y._version + (DIRTY_BUMP if dirty else 0)
    except RuntimeError:
        return None
    try:
        storage = y.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without a storage: y alone
        return _ref(y), v, None, 0, y.device
    held = None if _StorageWeakRef is None else _StorageWeakRef(storage)
    return _ref(y), v, held, storage.data_ptr(), y.device


def check_seen(record: tuple, u: torch.Tensor | None, api: str, why: str) -> None:
    """Raise slimgrad's error when the output ``u`` unpacked for backward is the y :func:`seen`
    recorded (or shares its storage) and y was written since (NOTE [A kept output written under
    saved-tensor hooks]); ``why``: what the op keeps and the fixes."""
    ref, v, held, ptr, device = record
    if u is None or u.numel() == 0:
        return
    y = ref()
    if y is not None:
        now = y._version
        if now == v:
            return
        if u is not y and (
            u.device != y.device or u.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
        ):
            return  # a copy made at pack: the values of forward
    else:
        # y is gone: only a hook that still holds y's storage (an alias, ``t.detach()``) can hand
        # back a tensor on it; that alias shares y's version counter
        if held is None or held.expired() or u.device != device:
            return
        if u.untyped_storage().data_ptr() != ptr or u._version <= v:
            return
        now = u._version
        why = (
            "(The output itself is gone by backward; a hook that rebuilds a tensor on its storage "
            "with a version counter of its own cannot be told from one that keeps an alias: keep "
            "a reference to the output until backward, or copy it at pack.) " + why
        )
    raise RuntimeError(
        f"slimgrad.{api}: one of the variables needed for gradient computation has been modified "
        f"by an inplace operation: its output, handed back unchanged by a saved-tensor hook, is at "
        f"version {now}; expected version {v}. {why}"
    )

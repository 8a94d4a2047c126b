"""Optimizer steps as the per-parameter-version caches see them (NOTE [Steps that skip the
version counter]).

# NOTE [Steps that skip the version counter]
BatchNorm's bad channels, In-Place ABN's side channels (``ParamChannels`` in ``_math/abn.py``) and
LayerNorm/RMSNorm's fallback channels (``_math/norms.py``) are decided once per parameter version:
every in-place write autograd can see bumps the parameter's version counter. ``torch.optim``'s
fused steps do not (measured, torch 2.13 CPU: SGD, Adam, AdamW, Adagrad with ``fused=True``
leave ``param._version`` unchanged), so a step that set a γ to 0 kept the previous step's
decision and the from-output backward divided by it (NaN where eager's gradients are finite;
tests/ops/test_bn_act_adversarial.py). So the caches also key on :func:`epoch`, the number of
optimizer steps taken in this process, counted by a global optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``, torch's public API; registered the
first time a cache asks, never removed; it only increments a counter). Every ``Optimizer.step``
calls it, fused or not; a step of any optimizer renews every decision once (one device read per
step on CUDA, as the version bump of a plain step already did). Writes outside an optimizer that
bypass the version counter (``p.data.mul_``) are still not seen: call
``torch.autograd.graph.increment_version(p)`` after them.

# NOTE [Caches that hold no reference to a parameter]
Those caches are tables ``{id(p): entry}``. ``torch.utils.swap_tensors`` refuses a tensor that any
weak reference points at (Python's, or torch's own C++ ``_WeakTensorRef``), and ``Module.to``,
``load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)`` and tensor
subclasses (DTensor under FSDP2) swap parameters with it; eager leaves none. So an entry holds no
reference to its parameters, weak or strong (strong would keep a deleted model's weights alive). It
is anchored instead on the storages of the tensors it was found from (:func:`anchor`: a weak
reference to each one's ``untyped_storage()``, the one Python object PyTorch keeps per StorageImpl
while it lives, whose callback drops the entry when the storage dies), and its key holds each
tensor's data pointer, version, dtype, shape and device as before. A hit then needs a tensor of the
same id over the same bytes of a storage that has lived since the entry was made (memory cannot be
handed to another allocation while its storage lives), at the same version. That is the tensor the
entry was found from, or a view or detached alias of it (one counter: every write autograd sees
moves the key). A tensor over those bytes with a version counter of its own (``p.data``, ``set_``,
``from_dlpack``) made afresh each call takes the id of the last one with the same count, 0, while
``p`` was written in between: so only a tensor something pins keeps an entry (:func:`pinned`: a
Parameter, or one that requires grad; the rest are searched each call), and one of those that dies
and leaves its id to such an alias is the write autograd cannot see, which the NOTE above already
leaves to ``increment_version``. ``swap_tensors`` to new memory, ``p.data = ...`` and a Parameter of
new memory move the data pointer and miss; the storage swapped out is freed with the tensor that
holds it. Code that needs the parameters themselves (the renewal at an optimizer step, deciding
every stale layer in one read) takes them from the optimizers that stepped
(:func:`stepped_optimizers`), which hold them; the rest are found again at their next call.
"""

from __future__ import annotations

import threading
import weakref
from functools import partial as _partial

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["anchor", "epoch", "pinned", "stepped_optimizers"]

_count = [0]
_hooked = [False]
_lock = threading.Lock()
_stepped: weakref.WeakSet = weakref.WeakSet()  # the live optimizers that have stepped


def _bump(optimizer, args, kwargs) -> None:
    _count[0] += 1
    if optimizer not in _stepped:
        try:
            _stepped.add(optimizer)
        except TypeError:  # an optimizer that cannot be weakly referenced
            pass


def stepped_optimizers() -> list:
    """The live optimizers whose steps :func:`epoch` has counted."""
    return list(_stepped)


def pinned(t) -> bool:
    """Whether a cache may keep an entry for ``t`` (None, a Parameter, or a tensor that requires
    grad): not a ``.data``-like alias made afresh each call, whose id a later one takes with a
    version counter of its own (NOTE [Caches that hold no reference to a parameter])."""
    if t is None:
        return True
    # an inference tensor has no version counter: decided per call (NOTE [Inference tensors
    # take eager's cast] in ops/linear.py)
    return (type(t) is torch.nn.Parameter or t.requires_grad) and not t.is_inference()


def anchor(table: dict, slot: int, t) -> weakref.ref | None:
    """A weak reference to ``t``'s storage that drops ``table[slot]`` when the storage dies (NOTE
    [Caches that hold no reference to a parameter]); None for ``t`` None. The callers cache plain
    strided tensors only (a tensor without storage raises here)."""
    if t is None:
        return None
    # NOTE [A registry entry dropped in C] in ops/_derived.py: the callback is table.pop(slot, r).
    # An entry replaced at slot drops its weak references (and their callbacks) with it; one a
    # snapshot still holds can only drop a newer entry, which is a miss, never a wrong hit
    return weakref.ref(t.untyped_storage(), _partial(table.pop, slot))


def epoch() -> int:
    """Optimizer steps taken in this process since the first call (NOTE above)."""
    if not _hooked[0]:
        with _lock:
            if not _hooked[0]:
                register_optimizer_step_post_hook(_bump)
                _hooked[0] = True
    return _count[0]

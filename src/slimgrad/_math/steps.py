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
"""

from __future__ import annotations

import threading

from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["epoch"]

_count = [0]
_hooked = [False]
_lock = threading.Lock()


def _bump(optimizer, args, kwargs) -> None:
    _count[0] += 1


def epoch() -> int:
    """Optimizer steps taken in this process since the first call (NOTE above)."""
    if not _hooked[0]:
        with _lock:
            if not _hooked[0]:
                register_optimizer_step_post_hook(_bump)
                _hooked[0] = True
    return _count[0]

"""Registration of slimgrad's custom ops with ``torch.library``.

# NOTE [Custom ops and the memory tracker]
Every slimgrad op that torch.compile must trace is registered as ``slimgrad::<name>`` through
:func:`custom_op` below, which also records the op's Python implementation. ``slimgrad.memory``'s
dispatch mode sees a custom op as one call; to account exactly for the temporaries the op allocates
inside, the tracker runs the recorded Python implementation itself, with the mode still active,
instead of the opaque kernel. Hence the rule: a slimgrad kernel that is plain PyTorch goes through
this wrapper, never ``torch.library`` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

NAMESPACE = "slimgrad"
_PYTHON_IMPLS: dict[str, Callable] = {}


def custom_op(
    name: str,
    *,
    mutates_args: Iterable[str] | str = (),
    device_types: str | Iterable[str] | None = None,
    schema: str | None = None,
):
    """``torch.library.custom_op`` in the ``slimgrad`` namespace, visible to the memory tracker.

    Args:
        name: op name without namespace, e.g. ``"gelu_fwd"``.
        mutates_args, device_types, schema: as for ``torch.library.custom_op``.
    """
    qualname = f"{NAMESPACE}::{name}"

    def deco(fn: Callable) -> torch.library.CustomOpDef:
        op = torch.library.custom_op(
            qualname, mutates_args=mutates_args, device_types=device_types, schema=schema
        )(fn)
        _PYTHON_IMPLS[qualname] = fn
        return op

    return deco


def python_impl(qualname: str) -> Callable | None:
    """The Python implementation recorded for ``slimgrad::<name>``, or None."""
    return _PYTHON_IMPLS.get(qualname)

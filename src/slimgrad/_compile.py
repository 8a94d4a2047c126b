"""``eager_only``: ``torch.compiler.disable`` without importing Dynamo at ``import slimgrad``.

# NOTE [Eager-only code under torch.compile]
Some slimgrad code must run eagerly inside a compiled model (it reads version counters, keeps weak
registries, or calls ``autograd.grad`` on recomputes, which Dynamo cannot trace). The usual
``@torch.compiler.disable`` imports ``torch._dynamo`` (and with it Triton) at decoration time, that
is at ``import slimgrad``. ``eager_only`` builds the disabled wrapper only once Dynamo is loaded:
nothing can be compiling before that. When the first call happens inside a trace, Dynamo also
breaks at the wrapper's creation, once.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """Like ``torch.compiler.disable(fn)``, but Dynamo is imported lazily (see the NOTE)."""
    disabled: list[Callable | None] = [None]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if disabled[0] is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled[0] = torch.compiler.disable(fn)
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]

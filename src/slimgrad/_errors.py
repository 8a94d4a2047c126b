"""Helpers for slimgrad's error messages (form: see CONTRIBUTING.md)."""

from __future__ import annotations


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

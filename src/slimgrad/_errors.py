"""Helpers for slimgrad's error messages (form: see CONTRIBUTING.md)."""

from __future__ import annotations


def internal_error(what: str) -> RuntimeError:
    """An internal invariant broke: not the user's fault."""
    return RuntimeError(
        f"slimgrad internal error: {what}; this is a slimgrad bug; please report it."
    )

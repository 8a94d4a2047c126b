"""Count the calls that reach one attribute of a module (a test seam, e.g. a node's ``apply``)."""

from __future__ import annotations


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Wrap ``owner.<name>`` for the test; the returned one-element list counts its calls."""
    n = [0]
    real = getattr(owner, name)

    def counting(*a):
        n[0] += 1
        return real(*a)

    monkeypatch.setattr(owner, name, counting)
    return n

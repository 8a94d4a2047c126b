"""``features_off`` runs at every ``convert_``; the transformers probe reads the installed
distribution's version once per process (reading the metadata costs milliseconds), and says what
it said."""

from __future__ import annotations

import importlib.metadata

from slimgrad import _compat


def test_the_transformers_version_is_read_once(monkeypatch):
    first = _compat.features_off(), _compat._transformers()
    read = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: read.append(name) or "0")
    assert (_compat.features_off(), _compat._transformers()) == first
    assert read == []

"""The fallback channels' key (NOTE [Fallback channels, once per weight version] in
slimgrad/_math/norms.py): the extension's ``norm_key`` and the Python key tell the same parameter
states apart, so ``fallback_or_none`` and ``fallback_channels`` hit, miss and answer the same."""

from __future__ import annotations

import pytest
import torch

from slimgrad import _ext
from slimgrad._math import norms


@pytest.fixture(scope="module")
def ext_key():
    mod = _ext.load()
    if mod is None:
        pytest.fail(f"the C++ extension did not build: {_ext.error()}")
    return mod.norm_key


def _states():
    # (label, weight, bias): parameter states a norm can meet between two calls, several of them
    # changes that the version counter does not see (``.data =``)
    w = torch.nn.Parameter(torch.ones(4, 3))
    b = torch.nn.Parameter(torch.zeros(4, 3))
    out = []

    def snap(label, weight=w, bias=b):
        out.append((label, weight, bias))
        return (label, weight, bias)

    snap("start")
    snap("weight only", bias=None)
    snap("bias only", weight=None)
    with torch.no_grad():
        w.mul_(2)  # in place: the version moves
    snap("in place")
    w.data = torch.ones(4, 3)  # a new storage, the same version
    snap("data swapped")
    w.data = w.data.t()  # the same storage, transposed: only shape and strides differ
    snap("data transposed")
    w.data = w.data.t().double()  # another dtype
    snap("data double")
    w.data = w.data.float().reshape(12)  # the same values, another shape
    snap("data flat")
    return out


def _parts(key):
    return key if key is None else tuple(key)


def test_ext_key_tells_apart_exactly_what_the_python_key_does(ext_key):
    states = _states()
    # each state's keys, read when it was current and again now (a later state changed w)
    seen = []
    for label, w, b in states:
        seen.append((label, norms._py_norm_key(w, b), ext_key(w, b)))
    for i, (la, pa, ea) in enumerate(seen):
        assert ea[0] is None or ea[0][0] == pa[0][0]  # the version first, as before
        for lb, pb, eb in seen[i:]:
            assert (pa == pb) == (ea == eb), (la, lb)


def test_ext_key_raises_as_python_for_an_inference_tensor(ext_key):
    with torch.inference_mode():
        w = torch.ones(3)
    with pytest.raises(RuntimeError, match="version counter"):
        norms._py_norm_key(w, None)
    with pytest.raises(RuntimeError, match="version counter"):
        ext_key(w, None)
    with pytest.raises(TypeError, match="expected Tensors"):
        ext_key([1.0], None)


@pytest.mark.parametrize("key", ["python", "ext"])
def test_the_same_channels_through_changes_the_version_counter_misses(key, ext_key, monkeypatch):
    # fallback_or_none and fallback_channels under either key: the channels found afresh after
    # each change, including `.data =` swaps that keep the version (the key must see them)
    monkeypatch.setattr(norms, "_norm_key", ext_key if key == "ext" else norms._py_norm_key)
    monkeypatch.setattr(norms, "_FB_CACHE", {})
    w = torch.nn.Parameter(torch.ones(6))
    b = torch.nn.Parameter(torch.zeros(6))
    calls = []
    real = norms._find_scaled
    monkeypatch.setattr(norms, "_find_scaled", lambda *a: calls.append(1) or real(*a))
    steps = [
        ("start", lambda: None),
        ("a zero gamma, in place", lambda: _inplace(w, 2)),
        ("a new storage with two zeros", lambda: setattr(w, "data", _zeros_at(6, 0, 5))),
        ("no zero, same version", lambda: setattr(w, "data", torch.ones(6))),
        ("bias far above gamma", lambda: setattr(b, "data", torch.full((6,), 9.0))),
    ]
    found = []
    for label, change in steps:
        change()
        for _ in range(2):  # the second call hits the cache
            got = norms.fallback_or_none(w, b, torch.float32)
            fresh = norms._find_fallback_channels(w, b, torch.float32)
            assert (got is None) == (fresh.numel() == 0), label
            if got is not None:
                assert torch.equal(got, fresh), label
            assert torch.equal(norms.fallback_channels(w, b, torch.float32), fresh), label
        found.append(fresh.tolist())
    assert found == [[], [2], [0, 5], [], [0, 1, 2, 3, 4, 5]]
    assert len(calls) == len(steps)  # one search per state, none on a hit


def _inplace(w, i):
    with torch.no_grad():
        w[i] = 0.0


def _zeros_at(n, *idx):
    t = torch.ones(n)
    t[list(idx)] = 0.0
    return t

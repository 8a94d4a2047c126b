"""LayerNorm's fallback channels renewed at an optimizer step (NOTE [One mask per kind of norm] in
``slimgrad/_math/norms.py``): a fixed number of ATen ops per renewal whatever the number of
LayerNorms (every HF GPT-2 training step, compiled or not, pays it in its optimizer step), and
the same channels a fresh search finds."""

from __future__ import annotations

import math

import pytest
import torch

from slimgrad._math import norms
from tests._counting import OpCounts


def _gpt2_norms(n, d=64, dtype=torch.float32, seed=0):
    # HF GPT-2's LayerNorms near their init (weight ~1, bias ~0): no fallback channel
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.nn.Parameter((1 + 0.1 * torch.randn(d, generator=g)).to(dtype)),
            torch.nn.Parameter((0.1 * torch.randn(d, generator=g)).to(dtype)),
        )
        for _ in range(n)
    ]


@pytest.fixture(autouse=True)
def _fresh_cache():
    norms._FB_CACHE.clear()
    yield
    norms._FB_CACHE.clear()


@pytest.mark.parametrize("n", [1, 5, 25])
def test_layer_norm_renewal_is_a_fixed_number_of_ops(n):
    # before: layer_norm_gamma per LayerNorm (8 ATen ops each): 1 LayerNorm 24 ops, 5: 58, 25:
    # 218; now 23, 25 and 25
    ps = _gpt2_norms(n)
    opt = torch.optim.SGD([p for pair in ps for p in pair], lr=0.1)
    for w, b in ps:
        assert norms.fallback_or_none(w, b, torch.float32, norms.layer_norm_gamma) is None
    norms._renew(opt)
    with OpCounts() as ops:
        norms._renew(opt)
    assert "aten.nonzero" not in ops.count, dict(ops.count)
    assert ops.count["aten.any"] == 1
    assert sum(ops.count.values()) <= 26, dict(ops.count)
    for w, b in ps:  # renewed: the next forward's key hits and finds no channel
        assert norms._FB_CACHE[id(w)][1][0][0] == w._version
        assert norms.fallback_or_none(w, b, torch.float32, norms.layer_norm_gamma) is None


_BAD = [0.0, 1e-42, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("widths", [(17, 17, 17, 17), (17, 9, 17, 5)])
@pytest.mark.parametrize("bad", _BAD)
def test_layer_norm_renewal_finds_what_a_fresh_search_finds(dtype, widths, bad):
    # one length (the rows of one view) and mixed lengths (per entry): the channels of each
    # LayerNorm are those layer_norm_gamma and a fresh search give, a non-finite weight entry
    # making every channel of its own LayerNorm (and of no other) a fallback channel
    ps = [_gpt2_norms(1, d, dtype, seed=i)[0] for i, d in enumerate(widths)]
    rms = torch.nn.Parameter(torch.ones(widths[0], dtype=dtype))  # another kind beside them
    opt = torch.optim.SGD([p for pair in ps for p in pair] + [rms], lr=0.1)
    out = torch.float32 if dtype == torch.float64 else dtype
    for w, b in ps:
        norms.fallback_or_none(w, b, out, norms.layer_norm_gamma)
    norms.fallback_or_none(rms, None, out)
    with torch.no_grad():  # visible writes (version counters move), as an optimizer step's
        ps[1][0][3] = bad
        ps[3][0][0] = bad
        ps[3][1][1] = 1e30
    norms._renew(opt)
    for w, b in ps + [(rms, None)]:
        gamma_of = norms.layer_norm_gamma if b is not None else None
        entry = norms._FB_CACHE[id(w)]
        fresh = norms._find_scaled(w, b, out, gamma_of)
        assert torch.equal(entry[2], fresh), (w, entry[2], fresh)
        assert entry[4] == (fresh.shape[0] > 0)
        assert entry[1][0][0] == w._version  # renewed under the weight's current version
    if not math.isfinite(bad):  # every channel of those two, and only theirs
        assert norms._FB_CACHE[id(ps[1][0])][2].shape[0] == widths[1]
        assert norms._FB_CACHE[id(ps[3][0])][2].shape[0] == widths[3]
    assert norms._FB_CACHE[id(ps[0][0])][2].shape[0] == 0
    assert norms._FB_CACHE[id(ps[2][0])][2].shape[0] == 0

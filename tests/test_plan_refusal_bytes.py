"""Issue 33: a budget just below the lowest reachable peak was refused with two sizes that read
alike ("expected a budget of at least 238.88 KiB ..., got 238.88 KiB"); then both are given in
exact bytes too."""

from __future__ import annotations

import re
import warnings

import pytest

import slimgrad
from slimgrad.plan import _estimate_with, _fmt
from tests import _plan_cache
from tests.test_plan import _make


def test_a_budget_one_byte_below_the_lowest_peak_names_both_in_bytes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = _plan_cache.toy()
        with pytest.raises(ValueError) as first:  # far below: the lowest peak it names
            slimgrad.plan(_make(), top.curve[-1].peak_bytes // 2, reuse=top)
    # the lowest peak, as tests/test_plan_budgets.py finds it (the lower full estimate of the
    # composed curve's lowest plan and its most recomputed one)
    blocks, _, kind_of, p0, allowed, _ = top._measured
    from slimgrad.plan import _Model, _walk

    composed = _Model(blocks, kind_of, p0, allowed)
    path = _walk(composed)
    lowest = min(path, key=lambda x: (composed.peak(x), composed.flops(x)))
    peak = min(
        _estimate_with(_make(), "t", "cpu", x, (), {}).peak_bytes for x in (lowest, path[-1])
    )
    assert f"at least {_fmt(peak)} (the applied" in str(first.value)
    assert _fmt(peak - 1) == _fmt(peak)  # the case: sizes that round alike
    with warnings.catch_warnings(), pytest.raises(ValueError) as e:
        warnings.simplefilter("ignore")
        slimgrad.plan(_make(), peak - 1, reuse=top)
    m = re.fullmatch(
        r"slimgrad\.plan: the budget is below the lowest peak this model can reach; expected a "
        r"budget of at least (.+) \(the applied plan's full estimate; recompute ([0-9.]+) x the "
        r"forward's matmul FLOPs\), got (.+)\. Raise the budget or shrink the batch\.",
        str(e.value),
    )
    assert m is not None, str(e.value)
    assert m.group(1) == f"{_fmt(peak)} ({peak:,} B)"
    assert m.group(3) == f"{_fmt(peak - 1)} ({peak - 1:,} B)"

"""One measured plan per model and options, shared by the planner's test files.

``slimgrad.plan(make, "1TiB", verify=False)`` measures every choice of every kind of block (an
estimate per choice or group of choices); a test plans other budgets from it with ``reuse=``,
which runs only the choice and its full estimates again and gives the plan a fresh measurement
gives (tests/test_plan.py::test_reuse_plans_a_second_budget_from_the_same_measurements). A plan
here is made once per process and shared: a test that edits one edits a copy
(``copy.deepcopy``, ``dataclasses.replace``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import slimgrad

_TOPS: dict[tuple, slimgrad.Plan] = {}


def top(key: str, make: Callable[[], Any], **kw: Any) -> slimgrad.Plan:
    """The plan of ``make`` (named ``key``) at a budget everything fits, measured once."""
    k = (key, tuple(sorted((n, repr(v)) for n, v in kw.items())))
    if k not in _TOPS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _TOPS[k] = slimgrad.plan(make, "1TiB", verify=False, **kw)
    return _TOPS[k]


def toy() -> slimgrad.Plan:
    """The toy MLP net of tests/test_plan.py (4 blocks, dropout 0.2)."""
    from tests.test_plan import _make

    return top("toy", _make())

"""A module-scoped fixture for the step_in_backward tests: what is alive before them is frozen.

``step_in_backward`` looks for live GradScalers and DDP/FSDP wrappers by walking the objects the
garbage collector tracks (``gc.get_referrers``; NOTE [GradScaler] in
``slimgrad/step_in_backward.py``), once per handle and again where a class's reference count
moved. tests/conftest.py freezes what collection made, so that walk and every gc pass see only
what the tests made since; in a full run that is every earlier module's models and caches too,
which each of these modules' handles walked again. Frozen once here (after one collection, so
that no garbage of theirs is kept), the walks see only what this module's tests make: every
scaler and wrapper these tests count on is made inside a test.

Use: ``from tests._gc_frozen import older_objects_frozen  # noqa: F401`` (autouse).
"""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def older_objects_frozen():
    gc.collect()
    gc.freeze()
    yield

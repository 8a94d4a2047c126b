"""PyTorch OpInfo samples through slimgrad: conv1d/2d/3d, conv_transpose1d/2d/3d.

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

import pytest

from tests.opinfo._harness import case_test

GROUPS = ("conv",)

# aten's note on OpInfo's own padding='same' samples with even kernels (eager and slimgrad alike)
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")

test_sample = case_test("sample", GROUPS)
test_f64_gradcheck_double = case_test("f64", GROUPS)
test_error_input = case_test("error", GROUPS)
test_noncontiguous = case_test("noncontig", GROUPS)
test_channels_last = case_test("channels_last", GROUPS)

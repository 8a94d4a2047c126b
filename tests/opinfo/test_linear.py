"""PyTorch OpInfo samples through slimgrad: linear, matmul.

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

from tests.opinfo._harness import case_test

GROUPS = ("linear",)

test_sample = case_test("sample", GROUPS)
test_f64_gradcheck_double = case_test("f64", GROUPS)
test_noncontiguous = case_test("noncontig", GROUPS)

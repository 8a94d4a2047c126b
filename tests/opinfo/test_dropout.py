"""PyTorch OpInfo samples through slimgrad: dropout (both sides draw from one
seed).

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

from tests.opinfo._harness import case_test

GROUPS = ("dropout",)

test_sample = case_test("sample", GROUPS)
test_f64_gradcheck_double = case_test("f64", GROUPS)
test_inplace = case_test("inplace", GROUPS)

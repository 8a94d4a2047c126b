"""PyTorch OpInfo samples through slimgrad: relu, sigmoid, tanh, hardtanh, relu6, leaky_relu,
elu, gelu, silu, mish.

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

from tests.opinfo._harness import case_test

GROUPS = ("act",)

test_sample = case_test("sample", GROUPS)
test_f64_gradcheck_double = case_test("f64", GROUPS)
test_inplace = case_test("inplace", GROUPS)
test_error_input = case_test("error", GROUPS)

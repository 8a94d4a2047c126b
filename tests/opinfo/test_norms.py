"""PyTorch OpInfo samples through slimgrad: layer_norm, rms_norm, group_norm,
batch_norm.

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

from tests.opinfo._harness import case_test

GROUPS = ("norm",)

test_sample = case_test("sample", GROUPS)
test_f64_gradcheck_double = case_test("f64", GROUPS)
test_error_input = case_test("error", GROUPS)
test_noncontiguous = case_test("noncontig", GROUPS)
test_channels_last = case_test("channels_last", GROUPS)

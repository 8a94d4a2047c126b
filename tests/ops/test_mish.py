from tests.ops._silu_mish_helpers import SmoothUnaryTests, cases


class TestMish(SmoothUnaryTests):
    STEM = "mish"
    CASES = cases("mish")

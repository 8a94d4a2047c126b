from tests.ops._silu_mish_helpers import SmoothUnaryTests, cases


class TestSilu(SmoothUnaryTests):
    STEM = "silu"
    CASES = cases("silu")

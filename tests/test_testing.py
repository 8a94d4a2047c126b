"""slimgrad.testing.max_abs_err: the one error helper the tests, bench and verify share."""

import pytest
import torch

from slimgrad.testing import assert_within_rule, max_abs_err, rule_ok


def test_complex_imaginary_part_counts():
    a = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    b = torch.tensor([1 + 2j, 3 + 0.5j], dtype=torch.complex64)
    assert max_abs_err(a, b) == 1.5
    assert max_abs_err(a, a) == 0.0
    # the larger of the two parts' differences, in float64
    c = torch.tensor([1.25 + 2j, 3 - 1.5j], dtype=torch.complex128)
    assert max_abs_err(a, c) == 0.5
    # a real tensor against a complex one: imaginary part 0
    assert max_abs_err(torch.tensor([1.0, 3.0]), a) == 2.0


def test_complex_rule_sees_imaginary_error():
    ref = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex128)
    eager = ref.to(torch.complex64)
    out = eager + 1e-3j
    ok, err, _ = rule_ok(out, ref, eager)
    assert not ok and err == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(AssertionError, match="error rule violated"):
        assert_within_rule(out, ref, eager)


def test_complex_conj_view():
    a = torch.tensor([1 + 2j, 3 - 1j])
    assert max_abs_err(a.conj(), a) == 4.0


def _masked(a, b):  # max_abs_err before its one-subtraction path: float64 copies and a mask
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a64.numel() == 0:
        return 0.0
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    diff = torch.where(same, torch.zeros_like(a64), (a64 - b64).abs())
    return float(diff.max().nan_to_num(nan=float("inf")))


def test_fast_path_is_the_masked_error():
    # one float64 subtraction when every difference is finite, the masked comparison otherwise:
    # the same number in every case (verify compares every gradient with it)
    torch.manual_seed(0)
    x = torch.randn(257)
    x64 = x.double() + 1e-7 * torch.randn(257, dtype=torch.float64)
    nan, inf = float("nan"), float("inf")
    special = torch.tensor([1.0, nan, inf, -inf, 0.0, -0.0, 3.0])
    pairs = [
        (x, x64),  # float32 against its float64 reference
        (x64, x),
        (x, x + 1e-3),
        (torch.tensor([1e8, 3.0]), torch.tensor([1e-3, 1.0])),  # float32 would round: 1e8 - 1e-3
        (torch.tensor([3e38, -1.0]), torch.tensor([-3e38, 1.0])),  # float32 would overflow
        (x.bfloat16(), x64),
        (x.half(), x.bfloat16()),
        (special, special.clone()),  # NaN and inf where both agree: equal
        (special, torch.tensor([1.0, nan, inf, inf, 0.0, 0.0, 3.0])),  # inf against -inf
        (special, torch.tensor([1.0, 2.0, inf, -inf, 0.0, 0.0, 3.0])),  # NaN against 2
        (special.double(), torch.tensor([1.0, nan, 5.0, -inf, 0.0, 0.0, 3.5])),  # inf against 5
        (torch.empty(0), torch.empty(0, dtype=torch.float64)),
        (torch.arange(5), torch.arange(5) + 1),  # integers
        (None, None),
        (x, None),
    ]
    for a, b in pairs:
        want, got = _masked(a, b), max_abs_err(a, b)
        assert got == want, (a, b, got, want)
    assert max_abs_err(x, x64) > 0
    assert max_abs_err(torch.tensor([1e8]), torch.tensor([1e-3])) != 1e8


def test_nonfinite():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([1.0, nan, inf, -inf])
    assert max_abs_err(a, a.clone()) == 0.0  # NaN/inf where both agree count as equal
    assert max_abs_err(a, torch.tensor([1.5, nan, inf, -inf])) == 0.5
    huge = torch.finfo(torch.float64).max  # inf differences come back as at least this
    assert max_abs_err(a, torch.tensor([1.0, 0.0, inf, -inf])) >= huge
    assert max_abs_err(a, torch.tensor([1.0, nan, -inf, -inf])) >= huge
    assert max_abs_err(a, torch.tensor([1.0, nan, 7.0, -inf])) >= huge
    assert max_abs_err(torch.tensor([complex(nan, 0.0)]), torch.tensor([complex(nan, 1.0)])) == 1.0


def test_edges():
    assert max_abs_err(None, None) == 0.0
    assert max_abs_err(torch.ones(2), None) == float("inf")
    assert max_abs_err(torch.ones(0), torch.ones(0)) == 0.0
    assert max_abs_err(torch.tensor([1, 5]), torch.tensor([2, 2])) == 3.0
    with pytest.raises(ValueError, match="slimgrad.testing.max_abs_err: shapes differ"):
        max_abs_err(torch.ones(2), torch.ones(3))

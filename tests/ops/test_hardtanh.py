import pytest
import torch
import torch.nn.functional as F

from slimgrad.ops.hardtanh import hardtanh, hardtanh_, relu6, relu6_
from tests.ops._output_act_helpers import Case, OutputActTests


class TestHardtanh(OutputActTests):
    CASES = [
        Case(
            "hardtanh", lambda x, ip: hardtanh(x, -0.5, 0.7, ip), lambda x: F.hardtanh(x, -0.5, 0.7)
        ),
        Case("relu6", relu6, F.relu6, scale=5.0),
        Case("hardtanh_default", lambda x, ip: hardtanh(x, inplace=ip), F.hardtanh),
    ]


def test_boundary_values_match_eager():
    # x exactly at the bounds: eager's gradient is 0 there; y == bound iff x <= bound.
    x0 = torch.tensor([-0.5, 0.7, -0.50000006, 0.70000005, -0.49999997, 0.69999999, 0.0])
    res = []
    for fn in (lambda t: hardtanh(t, -0.5, 0.7), lambda t: F.hardtanh(t, -0.5, 0.7)):
        x = x0.clone().requires_grad_()
        fn(x).sum().backward()
        res.append(x.grad)
    torch.testing.assert_close(res[0], res[1], rtol=0, atol=0)


def test_inplace_aliases():
    x = torch.randn(5, requires_grad=True)
    h = x * 1
    assert hardtanh_(h, -0.1, 0.1) is h
    h2 = x * 1
    assert relu6_(h2) is h2


def test_bad_bounds():
    with pytest.raises(ValueError, match=r"slimgrad.hardtanh: max_val must be >= min_val"):
        hardtanh(torch.randn(3), 1.0, -1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unrepresentable_bound_low_precision(dtype):
    # 0.7 is not a bfloat16/float16: y = round(0.7) on both sides of the bound, so 1 bit is kept.
    x0 = torch.tensor([0.69921875, 0.703125, 0.6992, 0.7002, -0.5, 2.0, 0.0]).to(dtype)
    res = []
    for fn in (lambda t: hardtanh(t, -0.5, 0.7), lambda t: F.hardtanh(t, -0.5, 0.7)):
        x = x0.clone().requires_grad_()
        fn(x).sum().backward()
        res.append(x.grad)
    torch.testing.assert_close(res[0], res[1], rtol=0, atol=0)


@pytest.mark.parametrize("inplace", [False, True])
def test_bits_path_second_derivative_without_cotangent_history(inplace):
    # bfloat16 with bounds it cannot represent: the 1-bit path; eager's hardtanh_backward
    # differentiates to zeros in x, also when g has no history
    x0 = torch.randn(5, 7).to(torch.bfloat16)
    g = torch.randn(5, 7).to(torch.bfloat16)
    res = []
    for fn in (lambda t: hardtanh(t, -0.3, 0.7, inplace), lambda t: F.hardtanh(t, -0.3, 0.7)):
        x = x0.clone().requires_grad_()
        (dx,) = torch.autograd.grad(fn(x * 1), x, g, create_graph=True)
        (gg,) = torch.autograd.grad(dx.float().sum(), x)
        res.append((dx, gg))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=0, atol=0)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=0, atol=0)

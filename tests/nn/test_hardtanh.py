import pytest
import torch

from slimgrad.nn.hardtanh import Hardtanh, ReLU6
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize(
    "make", [lambda: torch.nn.Hardtanh(), lambda: torch.nn.Hardtanh(-0.5, 2.0, inplace=True)]
)
def test_hardtanh_matches_torch(make):
    check_module(Hardtanh, make())


def test_relu6_matches_torch():
    check_module(ReLU6, torch.nn.ReLU6(), scale=5.0)
    check_module(ReLU6, torch.nn.ReLU6(inplace=True), scale=5.0)
    assert type(Hardtanh.from_torch(torch.nn.ReLU6())) is ReLU6


def test_wrong_type():
    check_wrong_type(Hardtanh)
    check_wrong_type(ReLU6)

import pytest
import torch

from slimgrad.nn.leaky_relu import LeakyReLU
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize(
    "make", [lambda: torch.nn.LeakyReLU(0.2), lambda: torch.nn.LeakyReLU(0.1, inplace=True)]
)
def test_matches_torch_module(make):
    check_module(LeakyReLU, make())


def test_wrong_type():
    check_wrong_type(LeakyReLU)

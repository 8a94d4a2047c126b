import pytest
import torch

from slimgrad.nn.tanh import Tanh
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize("make", [lambda: torch.nn.Tanh(), lambda: torch.nn.Tanh()])
def test_matches_torch_module(make):
    check_module(Tanh, make())


def test_wrong_type():
    check_wrong_type(Tanh)

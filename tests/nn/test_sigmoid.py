import pytest
import torch

from slimgrad.nn.sigmoid import Sigmoid
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize("make", [lambda: torch.nn.Sigmoid(), lambda: torch.nn.Sigmoid()])
def test_matches_torch_module(make):
    check_module(Sigmoid, make())


def test_wrong_type():
    check_wrong_type(Sigmoid)

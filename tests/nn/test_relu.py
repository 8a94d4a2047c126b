import pytest
import torch

from slimgrad.nn.relu import ReLU
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize("make", [lambda: torch.nn.ReLU(), lambda: torch.nn.ReLU(inplace=True)])
def test_matches_torch_module(make):
    check_module(ReLU, make())


def test_wrong_type():
    check_wrong_type(ReLU)

import pytest
import torch

from slimgrad.nn.elu import ELU
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize(
    "make", [lambda: torch.nn.ELU(0.5), lambda: torch.nn.ELU(0.5, inplace=True)]
)
def test_matches_torch_module(make):
    check_module(ELU, make())


def test_wrong_type():
    check_wrong_type(ELU)

import pytest
import torch

from slimgrad.nn.mish import Mish
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize("make", [lambda: torch.nn.Mish(), lambda: torch.nn.Mish(inplace=True)])
def test_matches_torch_module(make):
    check_module(Mish, make())


def test_wrong_type():
    check_wrong_type(Mish)


def test_from_hf():
    import transformers.activations as A

    m = Mish.from_torch(A.ACT2FN["mish"])
    assert type(m) is Mish

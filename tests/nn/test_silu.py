import pytest
import torch

from slimgrad.nn.silu import SiLU
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize("make", [lambda: torch.nn.SiLU(), lambda: torch.nn.SiLU(inplace=True)])
def test_matches_torch_module(make):
    check_module(SiLU, make())


def test_wrong_type():
    check_wrong_type(SiLU)


def test_from_hf():
    import transformers.activations as A

    m = SiLU.from_torch(A.ACT2FN["silu"])
    assert type(m) is SiLU and not m.inplace

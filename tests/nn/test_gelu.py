import pytest
import torch

from slimgrad.nn.gelu import GELU
from tests.nn._output_act_helpers import check_module, check_wrong_type


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_matches_torch_module(approximate):
    check_module(GELU, torch.nn.GELU(approximate))


@pytest.mark.parametrize(
    ("name", "approximate"),
    [("gelu", "none"), ("gelu_new", "tanh"), ("gelu_fast", "tanh"), ("gelu_pytorch_tanh", "tanh")],
)
def test_from_hf(name, approximate):
    import transformers.activations as A

    m = GELU.from_torch(A.ACT2FN[name])
    assert type(m) is GELU and m.approximate == approximate


def test_inplace_flag_and_errors():
    m = GELU("tanh", inplace=True)
    x = torch.randn(4, 5, requires_grad=True)
    h = x * 1
    assert m(h) is h
    with pytest.raises(ValueError, match=r"slimgrad.gelu: unknown approximate"):
        GELU("erf")
    check_wrong_type(GELU)

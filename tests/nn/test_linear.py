import pytest
import torch

from slimgrad.memory import measure
from slimgrad.nn.linear import Conv1D, Linear


def test_linear_same_state_dict_values_from_torch():
    ref = torch.nn.Linear(7, 5)
    ours = Linear.from_torch(ref)
    assert ours.weight is ref.weight and ours.bias is ref.bias
    assert list(ours.state_dict()) == list(ref.state_dict()) and repr(ours) == repr(ref)
    x = torch.randn(3, 7)
    torch.testing.assert_close(ours(x), ref(x))
    fresh = Linear(7, 5, bias=False)
    assert list(fresh.state_dict()) == ["weight"]
    with pytest.raises(TypeError, match="slimgrad.nn.Linear.from_torch"):
        Linear.from_torch(torch.nn.Conv1d(1, 1, 1))


def test_conv1d_matches_transformers_and_frozen_weight_keeps_no_input():
    hf = pytest.importorskip("transformers.pytorch_utils")
    ref = hf.Conv1D(6, 4)
    ours = Conv1D.from_torch(ref)
    assert ours.weight is ref.weight and list(ours.state_dict()) == list(ref.state_dict())
    fresh = Conv1D(6, 4)
    assert fresh.weight.shape == ref.weight.shape and fresh.bias.shape == ref.bias.shape
    x = torch.randn(2, 3, 4, requires_grad=True)
    torch.testing.assert_close(ours(x), ref(x))
    ref.weight.requires_grad_(False)
    ref.bias.requires_grad_(False)
    m = measure(lambda: ours(x * 1).sum())
    assert m.saved_bytes == 0
    with pytest.raises(TypeError, match="slimgrad.nn.Conv1D.from_torch"):
        Conv1D.from_torch(torch.nn.Linear(2, 2))

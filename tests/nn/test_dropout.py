import pytest
import torch

from slimgrad.nn.dropout import Dropout


@pytest.mark.parametrize("inplace", [False, True])
def test_matches_torch_module(inplace):
    ref, ours = torch.nn.Dropout(0.3, inplace), Dropout(0.3, inplace)
    assert repr(ours) == repr(ref) and list(ours.state_dict()) == []
    x0 = torch.randn(6, 11)
    outs = []
    for m in (ours, ref):
        x = x0.clone().requires_grad_()
        torch.manual_seed(2)
        y = m(x * 1)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ours.eval()
    assert ours(x0) is x0


def test_validation_in_init_and_from_torch():
    with pytest.raises(ValueError, match="slimgrad.nn.Dropout: .*expected 0 <= p <= 1"):
        Dropout(1.5)
    ref = torch.nn.Dropout(0.2, inplace=True).eval()
    ours = Dropout.from_torch(ref)
    assert ours.p == 0.2 and ours.inplace and not ours.training
    with pytest.raises(TypeError, match="slimgrad.nn.Dropout.from_torch"):
        Dropout.from_torch(torch.nn.ReLU())

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


def test_converted_inplace_dropout_on_a_slice_view_matches_eager():
    # Issue 15: a converted nn.Dropout(inplace=True) applied to a slice view crashed ("Function
    # cannot return more than one Tensor"). Same mask as eager from the same seed.
    import copy

    import slimgrad

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.3, inplace=True)

        def forward(self, x):
            h = self.lin(x)
            self.drop(h[:, 2:6])
            return h

    torch.manual_seed(0)
    eager = M()
    ours = copy.deepcopy(eager)
    slimgrad.convert_(ours)
    assert type(ours.drop).__module__ == "slimgrad.nn.dropout"
    x = torch.randn(5, 8)
    res = []
    for m in (eager, ours):
        torch.manual_seed(4)
        y = m(x)
        y.backward(torch.arange(40.0).view(5, 8))
        res.append([y.detach()] + [p.grad for p in m.parameters()])
    for o, e in zip(res[1], res[0], strict=True):
        assert torch.equal(o, e)

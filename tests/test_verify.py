import copy

import pytest
import torch
import torch.nn as nn

import slimgrad


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.001  # a wrong gradient, 0.1% off


class _Wrong(nn.Module):
    def forward(self, x):
        return _ScaleGrad.apply(x)


def _model():
    return nn.Sequential(nn.Linear(7, 11), nn.Dropout(0.3), nn.GELU(), nn.Linear(11, 3))


def test_identical_copy_passes_with_dropout():
    torch.manual_seed(0)
    m = _model()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(5, 7))
    assert rep.ok, str(rep)
    assert len(rep.grads) == 4
    assert rep.max_grad_err < 1e-5


def test_wrong_gradient_is_caught():
    torch.manual_seed(0)
    m = _model()
    bad = copy.deepcopy(m)
    bad[2] = nn.Sequential(nn.GELU(), _Wrong())
    # parameter names are unchanged (GELU has none), the first layer's grads are 0.1% off
    rep = slimgrad.verify(m, bad, torch.randn(5, 7))
    assert not rep.ok
    assert {g.name for g in rep.grads if not g.ok} >= {"0.weight"}
    assert "FAILED" in str(rep)


def test_different_parameters_are_refused():
    m = _model()
    other = nn.Sequential(nn.Linear(7, 3))
    with pytest.raises(
        ValueError, match="slimgrad.verify: the models' trainable parameters differ"
    ):
        slimgrad.verify(m, other, torch.randn(5, 7))


def test_loss_fn_and_kwargs_inputs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, *, x):
            return self.lin(x)

    m = KW()
    rep = slimgrad.verify(m, copy.deepcopy(m), {"x": torch.randn(3, 4)}, loss_fn=lambda o: o.sum())
    assert rep.ok


def test_unusable_output_needs_loss_fn():
    class Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return {"y": self.lin(x)}

    m = Dict()
    with pytest.raises(TypeError, match="slimgrad.verify: cannot make a loss"):
        slimgrad.verify(m, copy.deepcopy(m), torch.randn(3, 4))
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(3, 4), loss_fn=lambda o: o["y"].sum())
    assert rep.ok

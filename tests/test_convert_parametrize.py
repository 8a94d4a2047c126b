"""convert_ of modules whose weight is computed from other Parameters (issue 30).

``nn.utils.spectral_norm``/``weight_norm`` (hook API) on a Linear crashed convert_ ("cannot
assign 'torch.FloatTensor' as parameter 'weight'"); on a Conv2d the hook was carried along. Every
parametrization API on every converted module type now stays eager with the reason in the report
(NOTE [Parametrized weights stay eager] in convert_handlers/parametrized.py), also next to a
BatchNorm's activation, and trains exactly as eager: outputs and the gradients of
weight_g/weight_v/weight_orig/original0/original1 equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import slimgrad


class _Double(nn.Module):
    def forward(self, w):
        return w * 2.0


MODULES = {
    "Linear": (lambda: nn.Linear(6, 5), (4, 3, 6)),
    "Conv1d": (lambda: nn.Conv1d(6, 4, 3), (2, 6, 9)),
    "Conv2d": (lambda: nn.Conv2d(6, 4, 3), (2, 6, 7, 5)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(6, 4, 3), (2, 6, 5, 4)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(6), (8, 6)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(6), (2, 6, 5, 4)),
    "LayerNorm": (lambda: nn.LayerNorm(6), (4, 3, 6)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 6), (2, 6, 5)),
}
APIS = {
    "utils.spectral_norm": lambda m: nn.utils.spectral_norm(m),
    "utils.weight_norm": lambda m: nn.utils.weight_norm(m),
    "parametrizations.weight_norm": lambda m: parametrizations.weight_norm(m),
    "parametrizations.spectral_norm": lambda m: parametrizations.spectral_norm(m),
    "parametrizations.orthogonal": lambda m: parametrizations.orthogonal(m),
    "register_parametrization": lambda m: parametrize.register_parametrization(
        m, "weight", _Double()
    ),
}


def _build(kind: str, api: str) -> nn.Module | None:
    make, _ = MODULES[kind]
    torch.manual_seed(0)
    m = make()
    if kind.startswith(("BatchNorm", "LayerNorm", "GroupNorm")):
        with torch.no_grad():  # a non-trivial affine weight (ones would hide the parametrization)
            m.weight.uniform_(0.5, 1.5)
    if api.endswith("orthogonal") and m.weight.dim() < 2:
        return None  # torch refuses: orthogonal needs a matrix
    with torch.no_grad():
        return APIS[api](m)


def _step(model: nn.Module, x: torch.Tensor):
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    y = model(x)
    y.square().sum().backward()
    named = sorted((n, p.grad) for n, p in model.named_parameters())
    return y.detach(), x.grad, named


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch deprecates nn.utils.weight_norm
@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("kind", list(MODULES))
def test_parametrized_module_stays_eager_and_trains_as_eager(kind, api):
    inner = _build(kind, api)
    if inner is None:
        pytest.skip("torch refuses this parametrization on a 1-D weight")
    _, shape = MODULES[kind]
    eager = nn.Sequential(inner, nn.ReLU())
    conv = slimgrad.convert_(copy.deepcopy(eager))  # crashed for Linear/LayerNorm/GroupNorm
    assert type(conv[0]) is type(eager[0])
    reasons = {n: r for n, _, r in slimgrad.report(conv).skipped}
    assert "NOTE [Parametrized weights stay eager]" in reasons["0"], reasons
    x = torch.randn(*shape)
    for train in (True, False):
        conv.train(train), eager.train(train)
        (yc, xc, gc), (ye, xe, ge) = _step(conv, x), _step(eager, x)
        torch.testing.assert_close(yc, ye, rtol=0, atol=0)
        torch.testing.assert_close(xc, xe, rtol=0, atol=0)
        assert [n for n, _ in gc] == [n for n, _ in ge]
        assert any(
            ("orig" in n or "weight_g" in n or "weight_v" in n or "original" in n) for n, _ in ge
        )
        for (n, a), (_, b) in zip(gc, ge, strict=True):
            if train or b is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
        conv.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("api", ["utils.spectral_norm", "parametrizations.weight_norm"])
@pytest.mark.parametrize("abn", [False, True])
def test_parametrized_batch_norm_next_to_its_activation_stays_eager(api, abn):
    # the BN + act passes (bn_act_pattern, inplace_abn) run before the table pass
    eager = nn.Sequential(nn.Conv2d(3, 6, 3), _build("BatchNorm2d", api), nn.ReLU())
    cfg = slimgrad.ConvertConfig(inplace_abn=abn)
    conv = slimgrad.convert_(copy.deepcopy(eager), cfg)
    assert type(conv[1]) is type(eager[1]), slimgrad.report(conv)
    x = torch.randn(2, 3, 7, 6)
    (yc, xc, gc), (ye, xe, ge) = _step(conv, x), _step(eager, x)
    torch.testing.assert_close(yc, ye)
    torch.testing.assert_close(xc, xe)
    for (n, a), (_, b) in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_plain_modules_still_convert():
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    slimgrad.convert_(model)
    assert type(model[0]) is slimgrad.nn.Linear
    assert type(model[1]) is slimgrad.nn.LayerNorm

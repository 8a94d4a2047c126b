"""verify's float64 reference is the same function as the original (adv25 F2): it cannot be fooled
by lazy modules or by random numbers drawn in the forward.

NOTE [Lazy modules and a float64 reference] and NOTE [The same random numbers in float64]
(src/slimgrad/verify.py). Before the fix, a float64 copy initialised lazy parameters and drew
forward noise (``randn_like``, ``rand``, ``normal_``, ``bernoulli(p)``, ...) from other numbers
than the float32 model from the same seed, so the rule's bound was wide and a converted model
with a LayerNorm weight scaled by 1.02 passed. Now: lazy models are refused (GUIDE form), every
kind of forward noise draws eager's numbers in the reference (its loss agrees with eager's to
float32 rounding), correct conversions pass and corrupted ones fail.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad


def _noise(kind: str, mu: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    if kind == "randn_like":
        return mu + torch.randn_like(mu) * std
    if kind == "rand_like":
        return mu + torch.rand_like(mu) * std
    if kind == "randn_dtype":
        return mu + torch.randn(mu.shape, dtype=mu.dtype) * std
    if kind == "rand_dtype":
        return mu + torch.rand(*mu.shape, dtype=mu.dtype) * std
    if kind == "normal_":
        return mu + torch.empty_like(mu).normal_(0.0, 1.0) * std
    if kind == "normal_scaled":
        return mu + torch.empty_like(mu).normal_(0.5, 2.0) * std
    if kind == "uniform_":
        return mu + torch.empty_like(mu).uniform_(-1.0, 1.0) * std
    if kind == "exponential_":
        return mu + torch.empty_like(mu).exponential_() * std
    if kind == "bernoulli_tensor":
        return mu * torch.bernoulli(torch.sigmoid(std.detach()))
    if kind == "bernoulli_method":
        return mu * torch.sigmoid(std.detach()).bernoulli()
    if kind == "bernoulli_inplace_p":
        return mu * torch.empty_like(mu).bernoulli_(torch.sigmoid(std.detach()))
    if kind == "normal_tensor_tensor":
        return torch.normal(mu, std)
    if kind == "normal_tensor_float":
        return torch.normal(mu, 0.7)
    if kind == "normal_float_tensor":
        return mu + torch.normal(0.0, std)
    raise AssertionError(kind)


_KINDS = [
    "randn_like",
    "rand_like",
    "randn_dtype",
    "rand_dtype",
    "normal_",
    "normal_scaled",
    "uniform_",
    "exponential_",
    "bernoulli_tensor",
    "bernoulli_method",
    "bernoulli_inplace_p",
    "normal_tensor_tensor",
    "normal_tensor_float",
    "normal_float_tensor",
]


class _Noisy(nn.Module):
    """A VAE-style reparameterisation (64 noise numbers a step: the samplers' vectorised path)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.enc = nn.Linear(6, 32)
        self.ln = nn.LayerNorm(32)
        self.dec = nn.Linear(16, 6)

    def forward(self, x):
        h = F.gelu(self.ln(self.enc(x)))
        mu, logvar = h.chunk(2, -1)
        return self.dec(_noise(self.kind, mu, (0.5 * logvar).exp()))


@pytest.mark.parametrize("kind", _KINDS)
def test_forward_noise_draws_eagers_numbers_in_the_reference(kind):
    torch.manual_seed(0)
    model = _Noisy(kind)
    x = torch.randn(4, 6)
    good = slimgrad.convert_(copy.deepcopy(model))
    rep = slimgrad.verify(model, good, x)
    assert rep.ok, str(rep)
    for run in rep.runs:  # the same sample: the reference loss is eager's up to float32 rounding
        assert abs(run.loss_eager - run.loss_ref64) <= 1e-5 * max(1.0, abs(run.loss_ref64)), run
    for scale in (1.05, 1.02):
        bad = slimgrad.convert_(copy.deepcopy(model))
        with torch.no_grad():
            bad.ln.weight.mul_(scale)
        rep = slimgrad.verify(model, bad, x)
        assert not rep.ok, (kind, scale, str(rep))


def test_caller_rng_and_model_untouched_by_the_reference_draws():
    torch.manual_seed(0)
    model = _Noisy("randn_like")
    conv = slimgrad.convert_(copy.deepcopy(model))
    torch.manual_seed(5)
    x = torch.randn(4, 6)
    want = torch.randn(3)
    torch.manual_seed(5)
    x = torch.randn(4, 6)
    assert slimgrad.verify(model, conv, x).ok
    assert torch.equal(torch.randn(3), want)  # the caller's stream continues as without verify
    # outside verify a float64 draw is torch's own again (the mode is not left on)
    torch.manual_seed(1)
    a = torch.randn(32, dtype=torch.float64)
    torch.manual_seed(1)
    b = torch.randn(32).double()
    assert not torch.equal(a, b)


class _Lazy(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear":
            self.a = nn.LazyLinear(8)
        elif kind == "conv":
            self.a = nn.Sequential(nn.LazyConv1d(8, 1), nn.Flatten(1), nn.LazyLinear(8))
        else:  # one lazy module deep inside an initialised model
            self.a = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LazyLinear(8))
        self.n = nn.LayerNorm(8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        if self.kind == "conv":
            x = x.unsqueeze(-1)
        return self.b(F.gelu(self.n(self.a(x))))


@pytest.mark.parametrize("kind", ["linear", "conv", "inner"])
def test_lazy_modules_refused_then_materialised_ones_judged(kind):
    torch.manual_seed(0)
    model = _Lazy(kind)
    x = torch.randn(4, 6)
    bad = slimgrad.convert_(copy.deepcopy(model))
    with torch.no_grad():
        bad.n.weight.mul_(1.3)
    with pytest.raises(ValueError, match=r"slimgrad\.verify: model has uninitialized lazy .*"):
        slimgrad.verify(model, bad, x)
    # never run: still lazy
    assert any(nn.parameter.is_lazy(t) for t in [*model.parameters(), *model.buffers()])
    # a converted model still lazy next to a materialised original is refused too
    lazy_conv = slimgrad.convert_(copy.deepcopy(model))
    model(x)
    with pytest.raises(ValueError, match=r"slimgrad\.verify: converted has uninitialized lazy"):
        slimgrad.verify(model, lazy_conv, x)
    # the fix the message names: a forward of the original, then convert a copy
    good = slimgrad.convert_(copy.deepcopy(model))
    assert slimgrad.verify(model, good, x).ok
    bad = slimgrad.convert_(copy.deepcopy(model))
    with torch.no_grad():
        bad.n.weight.mul_(1.3)
    assert not slimgrad.verify(model, bad, x).ok

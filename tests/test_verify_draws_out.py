"""verify's float64 reference draws eager's random numbers for every sampler with ``out=`` and for
the integer-valued samplers too (adv26 F6).

NOTE [Random draws into out=] and NOTE [The same random numbers in float64]
(src/slimgrad/verify.py). Before the fix ``torch.randn(shape, out=buf)`` into the reference's
float64 buffer (and ``rand``/``normal``/``bernoulli``/``randint`` with ``out=``, ``random_()``,
``normal(0., 1., size, dtype=...)``) drew float64's numbers, other than eager's float32 ones from
the same seed: the rule's bound grew with that gap and a converted model with a LayerNorm weight
x1.05 passed. Now each draws eager's numbers (the reference loss agrees with eager's to float32
rounding), correct conversions pass and corrupted ones fail.
"""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.verify import _SameDraws


def _draw(kind: str, h: torch.Tensor) -> torch.Tensor:
    buf = torch.empty_like(h)
    if kind == "randn_out":
        torch.randn(h.shape, out=buf)
    elif kind == "rand_out":
        torch.rand(h.shape, out=buf)
    elif kind == "randint_out":
        torch.randint(0, 2**30, h.shape, out=buf)
        buf = buf / 2**30
    elif kind == "normal_out_tensors":
        torch.normal(torch.zeros_like(h), torch.ones_like(h), out=buf)
    elif kind == "normal_out_floats":
        torch.normal(0.0, 1.0, h.shape, out=buf)
    elif kind == "normal_floats_dtype":
        buf = torch.normal(0.0, 1.0, h.shape, dtype=h.dtype)
    elif kind == "bernoulli_out":
        torch.bernoulli(torch.full_like(h, 0.5), out=buf)
    elif kind == "random_":
        buf = buf.random_() / 2**24
    elif kind == "random_range":
        buf = buf.random_(0, 2**40) / 2**40
    elif kind == "randint_like":
        buf = torch.randint_like(h, 0, 2**30) / 2**30
    elif kind == "init_normal_":
        buf = nn.init.normal_(buf)
    elif kind == "randint_dtype":
        buf = torch.randint(0, 2**30, h.shape, dtype=h.dtype) / 2**30
    else:
        raise AssertionError(kind)
    return buf


_KINDS = [
    "randn_out",
    "rand_out",
    "randint_out",
    "normal_out_tensors",
    "normal_out_floats",
    "normal_floats_dtype",
    "bernoulli_out",
    "random_",
    "random_range",
    "randint_like",
    "randint_dtype",
    "init_normal_",
]


class _Noisy(nn.Module):
    """Multiplicative noise after a LayerNorm (48 numbers a step: the samplers' vectorised path)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.l1 = nn.Linear(6, 16)
        self.n = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.n(self.l1(x))
        return self.l2(h * _draw(self.kind, h))


@pytest.mark.filterwarnings("ignore:.*out of bounds")
@pytest.mark.parametrize("kind", _KINDS)
def test_out_and_integer_draws_are_eagers_in_the_reference(kind):
    torch.manual_seed(0)
    model = _Noisy(kind)
    x = torch.randn(4, 3, 6)
    rep = slimgrad.verify(model, slimgrad.convert_(copy.deepcopy(model)), x)
    assert rep.ok, str(rep)
    for run in rep.runs:  # the same sample: the reference loss is eager's up to float32 rounding
        assert abs(run.loss_eager - run.loss_ref64) <= 1e-5 * max(1.0, abs(run.loss_ref64)), run
    for scale in (1.05, 1.01):
        bad = slimgrad.convert_(copy.deepcopy(model))
        with torch.no_grad():
            bad.n.weight.mul_(scale)
        rep = slimgrad.verify(model, bad, x)
        assert not rep.ok, (kind, scale, str(rep))


_S = (4, 3, 16)


def _calls():
    # every random function that takes out=, in each form, and the in-place/integer samplers
    def out(f):
        def g(dt):
            buf = torch.empty(_S, dtype=dt)
            got = f(buf)
            assert got is buf  # out= hands back out itself, as eager does
            return buf

        return g

    p = torch.rand(12, 16)
    yield "randn_out", out(lambda b: torch.randn(_S, out=b))
    gen = torch.Generator()
    yield "randn_out_generator", out(lambda b: torch.randn(_S, generator=gen.manual_seed(3), out=b))
    yield "rand_out", out(lambda b: torch.rand(_S, out=b))
    yield "randint_out", out(lambda b: torch.randint(0, 2**30, _S, out=b))
    yield "randint_low_out", out(lambda b: torch.randint(7, _S, out=b))
    zeros = torch.zeros
    yield "normal_out_tensors", out(lambda b: torch.normal(zeros(_S, dtype=b.dtype), 2.0, out=b))
    yield "normal_out_floats", out(lambda b: torch.normal(0.5, 2.0, _S, out=b))
    yield "bernoulli_out", out(lambda b: torch.bernoulli(torch.full(_S, 0.3, dtype=b.dtype), out=b))
    yield "randperm_out", lambda dt: torch.randperm(40, out=torch.empty(40, dtype=dt))

    def idx():  # a fresh out per call: eager's and the reference's results stay apart
        return torch.empty(12, 8, dtype=torch.long)

    yield "multinomial_out", lambda dt: torch.multinomial(p.to(dt), 8, out=idx())
    yield "normal_floats_dtype", lambda dt: torch.normal(0.0, 1.0, _S, dtype=dt)
    yield "randint_dtype", lambda dt: torch.randint(0, 2**30, _S, dtype=dt)
    yield "randint_like", lambda dt: torch.randint_like(torch.empty(_S, dtype=dt), 0, 2**30)
    yield "randperm_dtype", lambda dt: torch.randperm(40, dtype=dt)
    yield "random_", lambda dt: torch.empty(_S, dtype=dt).random_()
    yield "random_range", lambda dt: torch.empty(_S, dtype=dt).random_(0, 2**40)
    yield "random_to", lambda dt: torch.empty(_S, dtype=dt).random_(5)
    init = nn.init
    yield "init.normal_", lambda dt: init.normal_(torch.empty(_S, dtype=dt), 0.5, 2.0)
    yield "init.uniform_", lambda dt: init.uniform_(torch.empty(_S, dtype=dt))
    yield "init.trunc_normal_", lambda dt: init.trunc_normal_(torch.empty(_S, dtype=dt))
    yield "init.kaiming_uniform_", lambda dt: init.kaiming_uniform_(torch.empty(_S, dtype=dt))
    yield "init.xavier_normal_", lambda dt: init.xavier_normal_(torch.empty(_S, dtype=dt))


@pytest.mark.filterwarnings("ignore:.*out of bounds")
@pytest.mark.parametrize("name,call", list(_calls()), ids=[n for n, _ in _calls()])
def test_every_out_and_integer_sampler_draws_the_narrow_numbers(name, call):
    torch.manual_seed(0)
    eager = call(torch.float32)
    torch.manual_seed(0)
    with _SameDraws(torch.float32):
        ref = call(torch.float64)
    after = torch.rand(4)  # the RNG consumed as eager's draw consumed it
    torch.manual_seed(0)
    call(torch.float32)
    assert torch.equal(torch.rand(4), after), name
    assert ref.dtype == (torch.long if name == "multinomial_out" else torch.float64), name
    assert torch.equal(ref, eager.to(ref.dtype)), name

"""InPlaceABN at few values per channel (issue 30, class 6; the BatchNorm sweep is
tests/ops/test_bn_few_values.py): at 2 to 8 values per channel the BatchNorm gradient rebuilt from
the output is where BatchNorm broke the error rule (NOTE [Few values per channel] in
slimgrad/ops/batch_norm.py). The same sweep for slimgrad.ops.inplace_abn: a per-channel affine
before it (a stand-in for the preceding conv, so its weight and bias gradients are checked), each
invertible activation, 2 to 8 values per channel, float32 and bfloat16, gammas 1e-3 to 10, against
eager (F.batch_norm then the activation) and float64.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from slimgrad.ops.inplace_abn import inplace_abn
from slimgrad.testing import assert_within_rule
from tests._threads import one_thread
from tests.ops._few_values_helpers import EPS, GAMMAS, SEEDS, SHAPES, few_values_case

ACTS = [("identity", 0.0), ("leaky_relu", 0.01), ("leaky_relu", 0.1), ("elu", 1.0)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _eager_act(h, name, param):
    if name == "identity":
        return h
    if name == "leaky_relu":
        return F.leaky_relu(h, param)
    return F.elu(h, param)


def _run(shape, gamma, seed, act, dtype, slim, ref_dtype=None):
    # loss = Σ r * act(BN(s z + t)); returns the gradients of z, γ, β, s, t and the output
    dt = ref_dtype or dtype
    (z, w, b, s, t), x, r = few_values_case(shape, gamma, seed, dt)
    c = shape[1]
    rm, rv = torch.zeros(c, dtype=dt), torch.ones(c, dtype=dt)
    name, param = act
    if slim:
        y = inplace_abn(x, rm, rv, w, b, True, 0.1, EPS, name, param)
    else:
        y = _eager_act(F.batch_norm(x, rm, rv, w, b, True, 0.1, EPS), name, param)
    (y * r).sum().backward()
    return [z.grad, w.grad, b.grad, s.grad, t.grad], y.detach(), (rm, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("act", ACTS, ids=[f"{a}-{p}" for a, p in ACTS])
def test_few_values_per_channel_within_rule(act, dtype):
    for shape, gamma, seed in itertools.product(SHAPES, GAMMAS, SEEDS):
        got, y, stats = _run(shape, gamma, seed, act, dtype, True)
        ref, y64, _ = _run(shape, gamma, seed, act, dtype, False, torch.float64)
        eager, ye, estats = _run(shape, gamma, seed, act, dtype, False)
        try:
            assert_within_rule(
                [y, *got], [y64, *ref], [ye, *eager],
                names=["out", "dz", "dgamma", "dbeta", "ds", "dt"],
            )  # fmt: skip
            for a, e in zip(stats, estats, strict=True):
                torch.testing.assert_close(a, e)
        except AssertionError as e:
            raise AssertionError(f"{shape}, gamma {gamma}, seed {seed}: {e}") from None


@pytest.mark.parametrize("shape", [(1, 5), (1, 5, 1, 1)])
def test_one_value_per_channel_in_training_is_refused_as_eager(shape):
    x = torch.randn(shape)
    w, b = torch.ones(5), torch.zeros(5)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(x.clone(), None, None, w, b, True)
    with pytest.raises(ValueError, match="1 value per channel|one value per channel"):
        inplace_abn(x.clone(), None, None, w, b, True)


def test_count_decides_the_path():
    # up to 32 values per channel: eager's ops, out of place (x untouched); from 33: over x
    for shape, over_x in [((32, 3), False), ((2, 3, 4, 4), False), ((33, 3), True),
                          ((1, 3, 3, 11), True)]:  # fmt: skip
        x = torch.randn(shape, requires_grad=True) * 1
        w = torch.ones(shape[1], requires_grad=True)
        b = torch.zeros(shape[1], requires_grad=True)
        before = x.detach().clone()
        z = inplace_abn(x, None, None, w, b, True)
        assert (z is x) is over_x, shape
        if not over_x:
            assert torch.equal(x.detach(), before)

"""timm's ``GroupNorm`` and ``GroupNorm1`` (PoolFormer's norms, subclasses of ``nn.GroupNorm``
with their own forward) convert to slimgrad's GroupNorm (``convert_handlers.timm``'s
``group_norm_from_timm``) exactly, and keep less; with timm's fast norm on they stay, with the
reason in the report.

A conv stack on an odd image size, train and eval, contiguous and channels_last: the norms' outputs
are bit for bit timm's, ``slimgrad.verify`` passes and the exact tracker's saved bytes drop.
Skipped without timm (tests/conformance/_timm_shim.py imports it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests._threads import one_thread
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _stack():
    torch.manual_seed(0)
    norms = timm.layers.norm
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3), norms.GroupNorm1(6), nn.GELU(), nn.Conv2d(6, 6, 1),
        norms.GroupNorm(6, num_groups=3), nn.Conv2d(6, 2, 1),
    )  # fmt: skip
    for m in model.modules():
        if isinstance(m, nn.GroupNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model


def _timm_norms(model):
    return [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("timm.")]


def test_timm_group_norms_convert_exactly_and_save():
    model = _stack()
    slim = slimgrad.convert_(copy.deepcopy(model))
    assert not _timm_norms(slim), slimgrad.report(slim)
    assert list(slim.state_dict()) == list(model.state_dict())
    x = torch.randn(2, 3, 9, 11)
    for inp in (x, x.to(memory_format=torch.channels_last)):
        for i in (1, 4):
            h = torch.randn(2, 6, 5, 7, requires_grad=True)
            torch.testing.assert_close(slim[i](h), model[i](h), rtol=0, atol=0)
        res = slimgrad.verify(model, slim, inp)
        assert res.ok, str(res)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    # saved bytes only: at these tiny shapes the peak is backward's float64 dgamma transient (16 B
    # per element up to ops.group_norm.CHUNK_ELEMS, its module docstring), as for any converted
    # nn.GroupNorm; poolformer_s12 at 8x3x128x128 peaks at 0.655x eager (0.773x with these left)
    assert ms.saved_bytes < me.saved_bytes, (ms.saved_bytes, me.saved_bytes)


def test_timm_group_norm_with_fast_norm_stays():
    model = _stack()
    model[1]._fast_norm = True
    slimgrad.convert_(model)
    assert type(model[1]).__name__ == "GroupNorm1" and type(model[4]).__module__.startswith("slim")
    why = {n: r for n, _, r in slimgrad.report(model).skipped}
    assert "fast norm is on" in why["1"], why

"""The OpInfo harness itself catches each failure class (so a passing suite means something)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.opinfo import _harness as H
from tests.opinfo import _tables


class _WrongGradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x) * 1.01  # drops a term and scales


class _NoGraphFn(torch.autograd.Function):
    # a backward that computes without history: double backward sees a constant
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            s = torch.sigmoid(x)
            return g * s * (1 + x * (1 - s))


def _crash(x, *a, **k):
    raise IndexError("boom")


def _refuse(x, *a, **k):
    raise NotImplementedError("slimgrad.ops.fake: not supported; expected X, got Y. Do Z.")


def _contig_conv2d(*a, **k):
    return F.conv2d(*a, **k).contiguous()


def _bad_error(x, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise ValueError("nope")
    return F.gelu(x, approximate=approximate)


@pytest.fixture
def fake(monkeypatch, request):
    # a unique key per test: the harness caches per key
    def make(base: str, fn, **changes):
        key = f"fake_{request.node.name}"
        spec = dataclasses.replace(H.SPEC[base], key=key, fn=fn, **changes)
        monkeypatch.setitem(H.SPEC, key, spec)
        return key

    return make


def _first(key, dtype, pred):
    return next(i for i, s in enumerate(H.samples(key, dtype)) if pred(s))


def test_wrong_gradient_is_a_mismatch(fake):
    key = fake("silu", _WrongGradFn.apply)
    i = _first(key, torch.float32, lambda s: s is not None and s.input.numel() > 4)
    with pytest.raises(H.Mismatch, match="grad input"):
        H.check_sample(key, torch.float32, i)


def test_silent_none_in_double_backward(fake):
    key = fake("silu", _NoGraphFn.apply)
    i = _first(key, torch.float64, lambda s: s is not None and 4 < s.input.numel() < 100)
    with pytest.raises(H.SilentNone):
        H.check_f64(key, i)


def test_internal_crash(fake):
    key = fake("silu", _crash)
    with pytest.raises(H.Crash, match="IndexError: boom"):
        H.check_sample(key, torch.float32, 0)


def test_refusal_must_be_listed(fake, monkeypatch):
    key = fake("silu", _refuse)
    with pytest.raises(H.UnlistedRefusal):
        H.check_sample(key, torch.float32, 0)
    monkeypatch.setitem(
        _tables.REFUSED, key, [(rf"^forward {key} f32 #0 ", r"^slimgrad\.ops\.fake")]
    )
    assert H.check_sample(key, torch.float32, 0) == "refused"


def test_stale_refusal(fake, monkeypatch):
    key = fake("silu", F.silu)
    monkeypatch.setitem(_tables.REFUSED, key, [(rf"^forward {key} f32 #0 ", r"^slimgrad")])
    with pytest.raises(H.StaleRefusal):
        H.check_sample(key, torch.float32, 0)


def test_layout(fake):
    key = fake("conv2d", _contig_conv2d)
    i = _first(key, torch.float32, lambda s: s.input.dim() == 4)
    assert H.check_sample(key, torch.float32, i) == "ok"
    with pytest.raises(H.Layout):  # eager's output keeps channels_last
        H.check_sample(key, torch.float32, i, "channels_last")


def test_error_type(fake):
    key = fake("gelu", _bad_error)
    with pytest.raises(H.ErrorMismatch, match="got ValueError: nope"):
        H.check_error(key, 0)


def test_eager_itself_passes(fake):
    # the harness with eager on both sides: nothing to report (no false positives)
    key = fake("silu", F.silu, inplace=lambda x: F.silu(x, inplace=True))
    for i in range(len(H.samples(key, torch.bfloat16))):
        if H.meta(key, torch.bfloat16)[i][0] <= H.BIG_NUMEL:
            assert H.check_sample(key, torch.bfloat16, i) == "ok"
            assert H.check_inplace(key, torch.bfloat16, i) == "ok"


def test_known_ids_exist():
    ids = set()
    for kind in ("sample", "f64", "inplace", "error", "noncontig", "channels_last"):
        groups = tuple({s.group for s in H.SPECS})
        ids |= {H.case_id(kind, k, d, i) for k, d, i in H.cases(kind, groups)}
    assert not set(_tables.KNOWN) - ids, "KNOWN lists cases the suite does not run"
    assert set(_tables.REFUSED) <= set(H.SPEC)

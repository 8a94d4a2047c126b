"""Conformance, round 36: plain-torch patterns and vision models the suites had not seen.

A LayerNorm whose output a traced forward hands only to modules that keep none of it (a
``MultiheadAttention(batch_first=True)``, whose query transpose makes its in-projection keep a
copy; the forward's output where the caller's next module keeps nothing, a Softmax) runs eager's
op: a LayerNorm on the model's input then kept y where eager's x was free, above eager's saved
bytes (NOTE [A LayerNorm whose output nobody keeps runs eager's op] in
slimgrad/nn/_output_act.py). Each row: ``slimgrad.verify`` passes and the exact tracker's saved
and peak bytes are never above eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests._threads import one_thread_each_test  # noqa: F401  (autouse fixture)


class _AttnOnNorm(nn.Module):
    # LayerNorm of the model's input -> self-attention with batch_first (its only user)
    def __init__(self, batch_first, pre=False):
        super().__init__()
        self.pre = nn.Linear(16, 16) if pre else nn.Identity()
        self.ln = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.ln(self.pre(x))
        y, _ = self.attn(h, h, h, need_weights=False)
        return self.fc(F.gelu(y))


class _NormOut(nn.Module):
    # the LayerNorm's output is this forward's output; the caller's next module keeps none of it
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(x)


def _models():
    return {
        "mha_batch_first": (lambda: _AttnOnNorm(True), (2, 6, 16)),
        "forward_output_then_softmax": (
            lambda: nn.Sequential(_NormOut(), nn.Softmax(-1), nn.Linear(16, 4)),
            (3, 5, 16),
        ),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_layer_norm_whose_traced_consumers_keep_nothing_is_never_above_eager(name):
    make, shape = _models()[name]
    torch.manual_seed(0)
    model = make()
    slim = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(*shape)
    res = slimgrad.verify(model, slim, x)
    assert res.ok, str(res)
    torch.manual_seed(1)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    torch.manual_seed(1)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    assert ms.saved_bytes <= me.saved_bytes, (ms.saved_bytes, me.saved_bytes)
    assert ms.peak_bytes <= me.peak_bytes, (ms.peak_bytes, me.peak_bytes)


def test_layer_norm_before_a_query_viewed_as_a_matrix_still_keeps_y():
    # batch_first=False: the in-projection keeps y itself, so keeping y saves x's bytes (x is a
    # Linear's output here, not the model's input)
    torch.manual_seed(0)
    model = _AttnOnNorm(False, pre=True)
    slim = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(6, 2, 16)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    assert me.saved_bytes - ms.saved_bytes == 6 * 2 * 16 * 4, (ms.saved_bytes, me.saved_bytes)


# The hook API of nn.utils.weight_norm / spectral_norm sets the weight as a tensor with autograd
# history (weight_norm at registration, spectral_norm at each training forward): deepcopy refuses
# it, and verify (which steps copies) raised. It copies the Parameters and lets each copy's hook
# recompute the weight, as eager's forward does.
def _hooked_reparam(kind):
    torch.manual_seed(0)
    reparam = nn.utils.weight_norm if kind == "weight_norm" else nn.utils.spectral_norm
    model = nn.Sequential(
        reparam(nn.Conv2d(3, 6, 3)), nn.BatchNorm2d(6), nn.SiLU(), nn.Flatten(),
        reparam(nn.Linear(6 * 5 * 5, 8)), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3),
    )  # fmt: skip
    model(torch.randn(2, 3, 7, 7))  # a training forward (spectral_norm's weight gets history)
    return model


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*:FutureWarning")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_verify_steps_copies_of_hook_api_reparametrizations(kind):
    model, slim = _hooked_reparam(kind), slimgrad.convert_(_hooked_reparam(kind))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = slimgrad.verify(model, slim, torch.randn(2, 3, 7, 7))
    assert res.ok, str(res)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# An RMSNorm on the model's input (no input gradient, only the weight's): the backward made the
# rebuilt xhat and then a product of dy and xhat beside it; the product is now made over xhat
# (its last use; the same bits). What remains above eager's peak is y itself, which the converted
# norm keeps where eager's x is the caller's tensor (counted by neither side's saved bytes).
@pytest.mark.parametrize("shape", [(8, 16), (64, 256)])
def test_rms_norm_weight_only_backward_peak(shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(shape[-1]), nn.Linear(shape[-1], 4))
    nn.init.uniform_(model[0].weight, 0.5, 1.5)
    slim = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(*shape)
    me = measure(lambda: model(x).square().mean(), timeline=False)
    ms = measure(lambda: slim(x).square().mean(), timeline=False)
    y_bytes = x.numel() * x.element_size()
    assert ms.saved_bytes < me.saved_bytes, (ms.saved_bytes, me.saved_bytes)
    assert ms.peak_bytes <= me.peak_bytes + y_bytes, (ms.peak_bytes, me.peak_bytes, y_bytes)
    slim(x).square().mean().backward()
    model(x).square().mean().backward()
    torch.testing.assert_close(slim[0].weight.grad, model[0].weight.grad)

"""torch.export of models using slimgrad ops (issue 8: registered through torch.library so export
traces them): the ops' custom ops appear in the exported graph as single opaque nodes, traced with
their fake kernels, and the exported program computes what the model computes (CPU)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.export import Dim

import slimgrad
from slimgrad.nn.inplace_abn import InPlaceABN

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

gelu = importlib.import_module("slimgrad.ops.gelu").gelu
layer_norm = importlib.import_module("slimgrad.ops.layer_norm").layer_norm
rms_norm = importlib.import_module("slimgrad.ops.rms_norm").rms_norm


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 17), nn.Linear(17, 5)
        self.w, self.b = nn.Parameter(torch.rand(17) + 0.5), nn.Parameter(torch.randn(17))

    def forward(self, x):
        h = layer_norm(self.fc1(x), (17,), self.w, self.b)
        h = rms_norm(gelu(h, "tanh"), (17,), self.w)
        return self.fc2(h)


def _slimgrad_ops(ep) -> set[str]:
    return {
        str(n.target)
        for n in ep.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("slimgrad.")
    }


def test_export_keeps_the_custom_ops():
    m = _Mlp()
    x = torch.randn(7, 12)
    ep = torch.export.export(m, (x,))
    want = {"slimgrad.layer_norm_fwd.default", "slimgrad.gelu_fwd.default",
            "slimgrad.rms_norm_fwd.default"}  # fmt: skip
    assert _slimgrad_ops(ep) == want
    torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
    # opaque to decompositions too: the custom ops stay single nodes
    assert _slimgrad_ops(ep.run_decompositions()) == want


def test_export_dynamic_batch():
    m = _Mlp()
    ep = torch.export.export(m, (torch.randn(7, 12),), dynamic_shapes={"x": {0: Dim("b", max=64)}})
    x = torch.randn(23, 12)
    torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize("training", [True, False])
def test_export_inplace_abn(training):
    torch.manual_seed(0)
    conv, abn = nn.Conv2d(3, 8, 3, padding=1), InPlaceABN(8, activation="leaky_relu")
    m = nn.Sequential(conv, abn).train(training)
    with torch.no_grad():
        abn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 5, 6)
    ep = torch.export.export(m, (x,))
    assert {"slimgrad.inplace_abn_stats.default", "slimgrad.inplace_abn_apply_.default"} <= (
        _slimgrad_ops(ep)
    )
    exported = ep.module()
    got = exported(x)
    want = m(x)  # eager updates m's running statistics once, the exported module its own copy
    torch.testing.assert_close(got, want)
    if training:  # the buffer mutation is part of the exported program
        torch.testing.assert_close(exported.state_dict()["1.running_mean"], abn.running_mean)
        torch.testing.assert_close(exported.state_dict()["1.running_var"], abn.running_var)


def test_export_converted_model():
    torch.manual_seed(0)
    # LayerNorm -> Linear: the Linear keeps the norm's output, so slimgrad's LayerNorm runs (one
    # whose output nobody keeps runs eager's op: NOTE [A LayerNorm whose output nobody keeps runs
    # eager's op])
    m = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 16),
                      nn.GELU(approximate="tanh"), nn.Linear(16, 3))  # fmt: skip
    x = torch.randn(5, 12)
    ref = m(x)
    slimgrad.convert_(m)
    ep = torch.export.export(m, (x,))
    assert {"slimgrad.layer_norm_fwd.default", "slimgrad.gelu_fwd.default"} <= _slimgrad_ops(ep)
    torch.testing.assert_close(ep.module()(x), ref, rtol=0, atol=0)


def test_exported_program_has_no_backward_through_the_ops():
    # export keeps the forward custom ops; their backward lives in the ops' autograd.Function,
    # which export inlines, so training through an exported program needs register_autograd on
    # the forward ops (not done): autograd says so instead of giving a wrong gradient
    m = _Mlp()
    x = torch.randn(4, 12)
    out = torch.export.export(m, (x,)).module()(x).sum()
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        out.backward()

"""``torch.export`` of converted models: strict and non-strict export the eager ops.

Under torch.compile slimgrad puts some eager ops inside a non-reentrant checkpoint so that the
partitioner recomputes them (the HF RMSNorm, the gated MLP); strict export of such a checkpoint
failed in torch 2.13 (``KeyError: '_checkpoint_context_fn'``). While exporting the ops run as they
are (NOTE [Recompute tags under torch.export] in ``slimgrad/_compile.py``): the exported graph has
no checkpoint and computes what the converted model computes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad

transformers = pytest.importorskip("transformers")


class _NormThenLinear(torch.nn.Module):
    # the norm's output feeds a linear, so convert_ gives it the lean (checkpointed) path
    def __init__(self) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(16)
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(self.norm(x))


def _no_checkpoint(ep) -> None:
    names = {str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("checkpoint" in n for n in names), names


@pytest.mark.parametrize("strict", [True, False])
def test_export_converted_rms_norm_under_grad(strict):
    torch.manual_seed(0)
    model = _NormThenLinear()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    assert type(conv.norm).__name__ == "HFRMSNorm"
    x = torch.randn(2, 5, 16, requires_grad=True)
    ep = torch.export.export(conv, (x,), strict=strict)
    _no_checkpoint(ep)
    y = ep.module()(x)
    assert torch.equal(y, model(x))


def test_export_converted_tiny_llama_strict():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).float()
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    ids = torch.randint(0, 64, (1, 8))
    ep = torch.export.export(conv, (ids,), strict=True)
    _no_checkpoint(ep)
    out = ep.module()(ids)
    ref = model(ids).last_hidden_state
    got = out[0] if isinstance(out, tuple) else out.last_hidden_state
    torch.testing.assert_close(got, ref, rtol=0, atol=0)

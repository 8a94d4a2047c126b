"""Issue 30, class 7: HF Llama's gated MLP with an input that needs no gradient keeps and peaks at
no more than eager, whichever projections are frozen.

x without grad (the first layer of a model fed embeddings computed under no_grad, a frozen
trunk's features) and every subset of gate/up/down frozen (a frozen projection freezes its bias
too), with and without biases, float32 and bf16 autocast, 1 and 64 tokens; one warm-up step of
the converted model, then ``slimgrad.memory.measure`` of ``m(x).float().sum()`` on both sides.
At 64 tokens, 64 wide, intermediate 128, fp32 the lean op peaked 16-32 KiB above eager where
gate or up was frozen or only down trainable (NOTE [The gated MLP wins only where g and u both
need gradients] in slimgrad/nn/gated_mlp.py), and with biases the converted children it ran
instead kept 168 B more (NOTE [The gated MLP's eager ops are eager's bytes]).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import slimgrad
from slimgrad.memory import measure

transformers = pytest.importorskip("transformers")

_NAMES = ("gate_proj", "up_proj", "down_proj")


def _mlp(width: int, inter: int, bias: bool) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=width, intermediate_size=inter, num_attention_heads=1,
        num_hidden_layers=1, head_dim=2, mlp_bias=bias,
    )  # fmt: skip
    return torch.nn.Sequential(LlamaMLP(cfg))


def _measure(m, x0, dtype):
    def fwd():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            return m(x0.clone()).float().sum()

    r = measure(fwd, timeline=False)
    for p in m.parameters():
        p.grad = None
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, inter, bias", [(8, 16, True), (64, 128, False), (16, 40, True)])
def test_input_without_grad_never_above_eager(width, inter, bias, dtype):
    over = []
    for frozen in itertools.product((False, True), repeat=3):
        if all(frozen):
            continue  # nothing to differentiate
        eager = _mlp(width, inter, bias)
        for name, f in zip(_NAMES, frozen, strict=True):
            if f:
                for p in getattr(eager[0], name).parameters():
                    p.requires_grad_(False)
        conv = copy.deepcopy(eager)
        slimgrad.convert_(conv)
        for tokens in (1, 64):
            x0 = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(tokens))
            _measure(conv, x0, dtype)  # first-use caches
            ours, ref = _measure(conv, x0, dtype), _measure(eager, x0, dtype)
            if ours.saved_bytes > ref.saved_bytes or ours.peak_bytes > ref.peak_bytes:
                names = [n for n, f in zip(_NAMES, frozen, strict=True) if f]
                over.append(
                    (names, tokens, ours.saved_bytes - ref.saved_bytes,
                     ours.peak_bytes - ref.peak_bytes)
                )  # fmt: skip
    assert not over, f"(frozen, tokens, saved over, peak over): {over}"


def test_input_without_grad_gradients_are_eager():
    # the eager-ops path is eager's composition: the same gradients, bit for bit
    eager = _mlp(16, 40, True)
    eager[0].gate_proj.requires_grad_(False)
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    for m in (eager, conv):
        m(x).square().sum().backward()
    for p, q in zip(eager.parameters(), conv.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)

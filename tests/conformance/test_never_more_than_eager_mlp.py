"""Issue 30, class 7: converted HF MLPs (Llama's gated MLP, GPT-2's) keep and peak at no more
than eager at tiny token counts.

1, 2 and 3 tokens, a leaf input and a non-leaf one (a step tensor: ``x * 1``), every projection
trainable or one of them frozen or all frozen, float32 and bf16 autocast; one warm-up step of the
converted model first, then ``slimgrad.memory.measure`` of ``m(x).float().sum()`` on both sides.
A frozen ``down_proj`` under autocast on a non-leaf x peaked 2 B per element of x above eager (16
B at 1 token of 8 features; NOTE [The gated MLP's children under autocast] in
slimgrad/nn/gated_mlp.py). With ``mlp_bias=True`` (``llama_bias``; frozen projections freeze
their biases too) and an input without grad as well: the bias casts' order peaked 16-192 B above
eager (review26b).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import slimgrad
from slimgrad.memory import measure

transformers = pytest.importorskip("transformers")

_FROZEN = {
    "llama": {
        "none": (),
        "first": ("gate_proj", "up_proj"),
        "last": ("down_proj",),
        "all": ("gate_proj", "up_proj", "down_proj"),
    },
    "llama_bias": {
        "none": (),
        "first": ("gate_proj", "up_proj"),
        "last": ("down_proj",),
        "all": ("gate_proj", "up_proj", "down_proj"),
    },
    "gpt2": {"none": (), "first": ("c_fc",), "last": ("c_proj",), "all": ("c_fc", "c_proj")},
}


def _mlp(family: str, width: int, inter: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if family.startswith("llama"):
        from transformers.models.llama.modeling_llama import LlamaMLP

        cfg = transformers.LlamaConfig(
            hidden_size=width, intermediate_size=inter, num_attention_heads=1,
            num_hidden_layers=1, head_dim=2, mlp_bias=family == "llama_bias",
        )  # fmt: skip
        return torch.nn.Sequential(LlamaMLP(cfg))
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=width, n_head=1, activation_function="gelu_new", resid_pdrop=0.1,
        n_inner=inter,
    )  # fmt: skip
    return torch.nn.Sequential(GPT2MLP(inter, cfg))


def _measure(m, x0, leaf: bool | None, dtype):
    def fwd():
        x = x0.clone()
        if leaf is not None:  # None: an input without grad
            x = x.requires_grad_() if leaf else x.requires_grad_() * 1
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            return m(x).float().sum()

    torch.manual_seed(5)  # the dropout masks
    r = measure(fwd, timeline=False)
    for p in m.parameters():
        p.grad = None
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "family, width, inter",
    [
        ("llama", 8, 16),
        ("llama", 8, 4),
        ("llama_bias", 8, 16),
        ("llama_bias", 16, 40),
        ("gpt2", 8, 32),
        ("gpt2", 6, 7),
    ],
)
def test_tiny_token_counts_never_above_eager(family, width, inter, dtype):
    over = []
    for frozen in _FROZEN[family]:
        eager = _mlp(family, width, inter)
        for name in _FROZEN[family][frozen]:
            proj = getattr(eager[0], name)
            for p in proj.parameters() if family == "llama_bias" else (proj.weight,):
                p.requires_grad_(False)
        conv = copy.deepcopy(eager)
        slimgrad.convert_(conv)
        for tokens, leaf in itertools.product((1, 2, 3), (True, False, None)):
            if leaf is None and frozen == "all":
                continue  # nothing to differentiate
            x0 = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(tokens))
            _measure(conv, x0, leaf, dtype)  # first-use caches
            ours, ref = _measure(conv, x0, leaf, dtype), _measure(eager, x0, leaf, dtype)
            if ours.saved_bytes > ref.saved_bytes or ours.peak_bytes > ref.peak_bytes:
                over.append(
                    (frozen, tokens, {True: "leaf", False: "non-leaf", None: "no grad"}[leaf],
                     ours.saved_bytes - ref.saved_bytes, ours.peak_bytes - ref.peak_bytes)
                )  # fmt: skip
    assert not over, f"(frozen, tokens, input, saved over, peak over): {over}"

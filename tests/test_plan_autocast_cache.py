"""slimgrad.plan under bf16 autocast: autocast's cache of a block's weight casts is live until the
forward returns, not in backward (NOTE [Autocast's cache is not kept for backward] in
slimgrad/plan.py). Checkpoint-all (every layer ``eager+recompute``) of a small HF Llama composes
to the real CPU step's peak; with the cache counted as kept into backward it composed above it."""

from __future__ import annotations

import warnings

import pytest
import torch

import slimgrad
from slimgrad.memory import measure
from slimgrad.plan import _Model, apply_choices

transformers = pytest.importorskip("transformers")

LAYERS = 5


def _model():
    cfg = transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=64,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _step(m, ids):
    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(input_ids=ids, labels=ids).loss

    return fwd


def make():
    m = _model()
    return _step(m, torch.randint(0, 64, (2, 128))), m


def test_checkpoint_all_composes_to_the_real_step_under_autocast():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = slimgrad.plan(make, "1TiB", verify=False, choices=("eager+recompute",))
    blocks, _, kind_of, p0, allowed, _ = top._measured
    x = dict.fromkeys(blocks, "eager+recompute")
    composed = _Model(blocks, kind_of, p0, allowed).peak(x)

    model = _model()
    ids = torch.randint(0, 64, (2, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_choices(model, x)
    step = _step(model, ids)
    step().backward()  # first calls create lookup tables and caches
    model.zero_grad(set_to_none=True)
    real = measure(step, module=model, timeline=False)
    assert composed == real.peak_bytes
    k = kind_of[blocks[0]]
    weights = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    # the block keeps its input (a hidden state, float32) into backward; in forward also the
    # bf16 casts of its weights, which autocast's cache holds until the forward returns
    hidden = 2 * 128 * 64 * 4
    assert k.rb["eager+recompute"] == hidden
    assert k.r["eager+recompute"] == hidden + 2 * weights

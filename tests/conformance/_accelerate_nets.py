"""Models and hook builders shared by the accelerate-hook suites (test_accelerate_hooks_convert.py,
test_writes_by_hooks_accelerate.py): the small net each row hooks, and a tiny Llama."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn


def net() -> nn.Sequential:
    """Linear -> LayerNorm (in a block), Linear, GELU, Linear: 5 modules the table converts."""
    block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    return nn.Sequential(block, nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))


def each(make):
    """An attach function: ``add_hook_to_module(c, make())`` on every module but the root."""
    from accelerate.hooks import add_hook_to_module

    def attach(m):
        for c in m.modules():
            if c is not m:
                add_hook_to_module(c, make())

    return attach


def llama(num_hidden_layers: int = 1):
    """A tiny LlamaForCausalLM in train mode, seeded (the same weights on every call)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=num_hidden_layers,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` without warnings or log lines below ERROR (accelerate's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return fn(*args, **kwargs)
        finally:
            logging.disable(logging.NOTSET)

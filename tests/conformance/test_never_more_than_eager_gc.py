"""Issue 30 class 7 / issue 33: HF Persimmon never keeps or peaks above eager, with gradient
checkpointing too.

Persimmon's attention normalizes q and k with ``nn.LayerNorm`` over views of the fused qkv output
and hands the result to the partial rotary embedding and a cat, which keep none of it. slimgrad's
LayerNorm kept y there (eager keeps x, a view of a tensor the attention keeps anyway through its
value slice): one batch x seq x hidden tensor above eager's at the recomputed layer's peak under
``gradient_checkpointing_enable()`` (1.020x eager's on this config), and a peak equal to eager's
without checkpointing and without a cache. Now those norms run eager's op (NOTE [A LayerNorm whose
output nobody keeps runs eager's op] in slimgrad/nn/_output_act.py). Each step runs once before
it is measured (lazily built tables out of the measured step).
"""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
from slimgrad.memory import measure

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _config():
    return T.PersimmonConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=99,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _inputs(use_cache=None):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 99, (2, 8), generator=g)
    d = {"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)}
    if use_cache is not None:
        d["use_cache"] = use_cache
    return d


def _step(fn, params):
    torch.manual_seed(0)
    fn().backward()
    for p in params:
        p.grad = None
    torch.manual_seed(0)
    st = measure(fn, timeline=False)
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return st, grads


def _compare(eager, conv, fn_e, fn_c):
    e, ge = _step(fn_e, list(eager.parameters()))
    c, gc = _step(fn_c, list(conv.parameters()))
    assert c.peak_bytes <= e.peak_bytes, (c.peak_bytes, e.peak_bytes, c.peak_op)
    assert c.saved_bytes <= e.saved_bytes, (c.saved_bytes, e.saved_bytes)
    for a, b in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b)
    return e, c


@pytest.mark.parametrize("when", ["before", "after", "none-no-cache"])
def test_persimmon_causal_lm(when):
    torch.manual_seed(0)
    m = T.AutoModelForCausalLM.from_config(_config())
    if when == "before":
        m.gradient_checkpointing_enable()
    s = slimgrad.convert_(copy.deepcopy(m))
    if when == "after":
        m.gradient_checkpointing_enable()
        s.gradient_checkpointing_enable()
    inp = _inputs(use_cache=False if when == "none-no-cache" else None)
    e, c = _compare(m, s, lambda: m(**inp).loss, lambda: s(**inp).loss)
    # the q/k norms run eager's op; the pre-norms still keep y (a Linear keeps it after them)
    attn = s.model.layers[0].self_attn
    assert attn.q_layernorm.keep_y is False and attn.k_layernorm.keep_y is False
    assert s.model.layers[0].input_layernorm.keep_y is True
    if when == "none-no-cache":  # before: the same peak as eager's, nothing won
        assert c.peak_bytes < e.peak_bytes


@pytest.mark.parametrize("checkpointed", [True, False])
def test_persimmon_attention_alone(checkpointed):
    # the attention module alone (its q/k norms on views of the fused qkv output, the partial
    # rotary embedding, SDPA), after a Linear so its input is a layer's output
    from transformers.models.persimmon import modeling_persimmon as P

    cfg = _config()
    cfg._attn_implementation = "sdpa"  # the model's default: v is a view of the fused qkv output
    torch.manual_seed(0)
    rot = P.PersimmonRotaryEmbedding(cfg)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)
            self.attn = P.PersimmonAttention(cfg, layer_idx=0)

        def forward(self, x, pos):
            return self.attn(self.proj(x), position_embeddings=pos)[0]

    eager = Block()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv.attn.q_layernorm).__module__.startswith("slimgrad.")
    x = torch.randn(2, 8, 32)
    pos = rot(x, torch.arange(8)[None].expand(2, 8))
    w = torch.randn(2, 8, 32)

    def fn(mod):
        if checkpointed:
            from torch.utils.checkpoint import checkpoint

            return lambda: (checkpoint(mod, x, pos, use_reentrant=False) * w).sum()
        return lambda: (mod(x, pos) * w).sum()

    _compare(eager, conv, fn(eager), fn(conv))

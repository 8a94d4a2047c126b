"""``slimgrad.memory.estimate(..., device="cuda")`` of checkpointed models (issue 33, finding 3).

A checkpointed region recomputes its forward in backward; the estimate's CUDA routing (SDPA,
dropout) must reach that recompute too, or the region saves other tensors than in forward and
torch raises "CheckpointError: A different number of tensors was saved" (NOTE [Routing in
backward] in ``slimgrad/memory.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import estimate


class _Attn(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return x + self.drop(self.out(y.transpose(1, 2).reshape(b, t, d)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attn() for _ in range(2))

    def forward(self, x):
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return x.float().square().mean()


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("convert", [False, True], ids=["eager", "slimgrad"])
def test_cuda_estimate_of_checkpointed_model_routes_the_recompute(amp, convert):
    def make():
        m = _Net()
        if convert:
            slimgrad.convert_(m)
        x = torch.randn(2, 16, 32)

        def fwd():
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                return m(x)

        return fwd, m

    r = estimate(make, device="cuda")
    fwd_ops = {op for i, op, _ in r.timeline if i <= r.backward_start}
    bwd_ops = {op for i, op, _ in r.timeline if i > r.backward_start}
    # the recompute in backward ran CUDA's kernels, as the forward did
    if not convert:  # slimgrad's dropout keeps its own packed mask on every device
        assert "aten.native_dropout" in fwd_ops and "aten.native_dropout" in bwd_ops
    sdpa = {op for op in fwd_ops if "scaled_dot_product" in op and "backward" not in op}
    assert sdpa and sdpa <= bwd_ops
    assert r.peak_bytes > 0


def test_cuda_estimate_of_hf_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")

    def make():
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            # one kv head per query head: HF calls SDPA without a mask and without enable_gqa,
            # which fp32 CUDA runs as the efficient kernel (grouped-query fp32 runs the math one)
            num_key_value_heads=4,
            intermediate_size=128,
            vocab_size=512,
            attention_dropout=0.1,
        )
        m = transformers.LlamaForCausalLM(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        ids = torch.randint(0, 512, (2, 32))
        return (lambda: m(input_ids=ids, labels=ids).loss), m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = estimate(make, device="cuda")
    bwd_ops = {op for i, op, _ in r.timeline if i > r.backward_start}
    assert "aten._scaled_dot_product_efficient_attention" in bwd_ops

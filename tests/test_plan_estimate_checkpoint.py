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


def _hf_model(family: str, dropout: float):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).train()
    # one kv head per query head: fp32 CUDA runs HF's SDPA call as the efficient kernel
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=256, attention_dropout=dropout,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


def _checkpoint_each(model, how: str) -> None:
    import functools

    if how.startswith("hf"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": how == "hf_reentrant"}
            )
        return
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    for blk in blocks:  # torch.utils.checkpoint around each block, as written in a model

        def fwd(*args, _inner=blk.forward, **kwargs):
            if how.endswith("reentrant"):
                return checkpoint(functools.partial(_inner, **kwargs), *args, use_reentrant=True)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        blk.forward = fwd


# every pair of values of any two of family, how, convert and dtype, in 8 rows of the 32: each
# way of checkpointing for both families, converted and not, in fp32 and under autocast; GPT-2
# unconverted (its fused dropout counted) both non-reentrant and reentrant
_ROWS = [
    ("llama", "hf", True, "autocast_bf16"),
    ("gpt2", "hf", False, "fp32"),
    ("llama", "hf_reentrant", False, "fp32"),
    ("gpt2", "hf_reentrant", True, "autocast_bf16"),
    ("llama", "torch_per_block", False, "autocast_bf16"),
    ("gpt2", "torch_per_block", True, "fp32"),
    ("llama", "torch_per_block_reentrant", True, "fp32"),
    ("gpt2", "torch_per_block_reentrant", False, "autocast_bf16"),
]


@pytest.mark.parametrize(
    "family, how, convert, amp",
    [(f, h, c, {"fp32": None, "autocast_bf16": torch.bfloat16}[a]) for f, h, c, a in _ROWS],
    ids=[f"{f}-{h}-{'slimgrad' if c else 'eager'}-{a}" for f, h, c, a in _ROWS],
)
def test_cuda_estimate_of_checkpointed_hf_models(family, how, convert, amp):
    # finding (3): every way of checkpointing an HF decoder, converted or not, estimates under
    # device="cuda", and each block's recompute runs the attention kernel its forward ran (a
    # reentrant checkpoint saves nothing in forward, so a recompute routed elsewhere would not
    # raise: it would count CPU's kernels), dropout on
    def make():
        m = _hf_model(family, 0.1)
        if convert:
            slimgrad.convert_(m, **({"dtype": amp} if amp is not None else {}))
        _checkpoint_each(m, how)
        ids = torch.randint(0, 256, (2, 32))

        def fwd():
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                return m(input_ids=ids, labels=ids, use_cache=False).loss

        return fwd, m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = estimate(make, device="cuda")
    assert r.peak_bytes > 0

    def calls(in_backward: bool, pick) -> list[str]:
        # the ops that ran (the timeline also records frees, as "free:<op>")
        return [
            op
            for i, op, _ in r.timeline
            if (i > r.backward_start) == in_backward and not op.startswith("free:") and pick(op)
        ]

    def attention(op: str) -> bool:
        return "scaled_dot_product" in op and "backward" not in op

    fwd_attn, bwd_attn = calls(False, attention), calls(True, attention)
    # one attention call per block in forward, the same kernel once per block's recompute
    assert len(fwd_attn) == 2 and sorted(bwd_attn) == sorted(fwd_attn), (fwd_attn, bwd_attn)
    assert all("_cpu" not in op for op in fwd_attn + bwd_attn), fwd_attn
    # CUDA's fused dropout (GPT-2's dropout modules; Llama's attention dropout is SDPA's), in
    # forward and in every recompute: each block's, not the embeddings'
    if family == "gpt2" and not convert:
        fused = calls(False, lambda op: op == "aten.native_dropout")
        assert len(fused) == 5  # the embeddings' and two per block
        assert len(calls(True, lambda op: op == "aten.native_dropout")) == 4


def test_a_cuda_plan_measures_recomputed_attention_and_is_the_applied_models_estimate():
    # finding (3) inside the planner: slimgrad.plan(device="cuda") measures each choice that
    # recomputes the attention (a checkpointed child under the estimate's CUDA routing, dropout
    # on) instead of refusing it with the CheckpointError, and the plan at the curve's lowest
    # point is the device="cuda" estimate of the model convert_(model, plan=p) makes
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=64, attention_dropout=0.1,
    )  # fmt: skip

    def make():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 64, (2, 64))
        return (lambda: m(input_ids=ids, labels=ids, use_cache=False).loss), m

    choices = ("lean", "lean+recompute:self_attn", "lean+recompute:attention-core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = slimgrad.plan(make, "1TiB", device="cuda", verify=False, choices=choices)
        measured = top.blocks["model.layers.0"]
        assert measured["refused"] == {}, measured["refused"]
        assert set(choices) <= set(measured["kept_bytes"])
        budget = top.curve[-1].peak_bytes
        p = slimgrad.plan(make, budget, device="cuda", reuse=top)

        def applied():
            fwd, m = make()
            slimgrad.convert_(m, plan=p)
            return fwd, m

        r = estimate(applied, device="cuda")
    assert p.verified and p.peak_bytes <= budget and p.recompute_flops > 0
    assert set(p.choices.values()) - {"lean"}, p.choices
    assert r.peak_bytes == p.peak_bytes
    # the recompute in backward runs the kernel CUDA's forward ran
    bwd = {op for i, op, _ in r.timeline if i > r.backward_start}
    assert "aten._scaled_dot_product_efficient_attention" in bwd

"""slimgrad + checkpointing never keeps more than checkpointing alone, in every dtype (issue 33).

Over HF Llama and GPT-2 (tiny configs, each family's defaults otherwise: GPT-2's dropout on),
float32, bf16 and fp16 autocast and bf16 weights, checkpointed four ways: HF's
``gradient_checkpointing_enable()`` non-reentrant and reentrant, and ``torch.utils.checkpoint``
around each decoder block written in the model's code (a forward set on each block before or after
``convert_``), non-reentrant and reentrant; 16 rows that hold every pair of these (not the 64 of
every combination). After a warm-up step (caches made on first use), the
converted and checkpointed model keeps no more bytes after forward and peaks no higher in the step
than the same model checkpointed alone, and where ``convert_`` ran first its gradients are the
converted model's without checkpointing, bit for bit (the recompute is exact, dropout included).
On the tree before NOTE [Probes bypass saved-tensor hooks] (ops/linear.py; issue 33's finding
(2): every converted Linear's autocast probe unpacked the checkpoint's packed object in forward,
which ran the block's recompute there and kept it until backward) the non-reentrant bf16-autocast
Llama rows fail: 428,292 B kept after forward against checkpointing's 82,952.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import measure

transformers = pytest.importorskip("transformers")

DTYPES = {
    "fp32": (None, None),
    "autocast_bf16": (torch.bfloat16, None),
    "autocast_fp16": (torch.float16, None),
    "bf16_weights": (None, torch.bfloat16),
}
_IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))


@functools.cache
def _base(family: str, weights):
    # built once per family and weights' dtype; every case takes deep copies
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32
        )
        m = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=128, max_position_embeddings=32,
        )  # fmt: skip
        m = transformers.LlamaForCausalLM(cfg)
    return (m.to(weights) if weights is not None else m).train()


def _blocks(m):
    return m.transformer.h if hasattr(m, "transformer") else m.model.layers


def _checkpoint_each_block(m, reentrant: bool) -> None:
    # what a user writes: each block's forward through torch.utils.checkpoint (the reentrant form
    # takes no keyword arguments: they are bound first)
    for blk in _blocks(m):

        def fwd(*args, _inner=blk.forward, **kwargs):
            if reentrant:
                return checkpoint(functools.partial(_inner, **kwargs), *args, use_reentrant=True)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        blk.forward = fwd


def _checkpoint(m, how: str) -> None:
    if how.startswith("hf"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": how == "hf_reentrant"}
            )
    else:
        _checkpoint_each_block(m, how.endswith("reentrant"))


def _step(m, amp, ids):
    def fwd():
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            return m(input_ids=ids, labels=ids, use_cache=False).loss

    return fwd


def _warm_then_measure(m, step):
    # first calls make lookup tables and caches; the measured step's dropout masks are seeded
    step().backward()
    m.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    return measure(step, timeline=False)


@functools.cache
def _alone(family: str, dtype: str, how: str) -> tuple[int, int]:
    # the model checkpointed alone: (retained, peak) bytes of its step, once per case but order
    amp, weights = DTYPES[dtype]
    alone = copy.deepcopy(_base(family, weights))
    _checkpoint(alone, how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = _warm_then_measure(alone, _step(alone, amp, _IDS))
    return ck.retained_bytes, ck.peak_bytes


@functools.cache
def _lean_grads(family: str, dtype: str) -> list:
    # the converted model's gradients without checkpointing, once per family and dtype
    amp, weights = DTYPES[dtype]
    lean = copy.deepcopy(_base(family, weights))
    step = _step(lean, amp, _IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slimgrad.convert_(lean, **({"dtype": amp} if amp is not None else {}))
        step().backward()  # as the checkpointed model: a warm-up step first
        lean.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        step().backward()
    return [(n, p.grad) for n, p in lean.named_parameters()]


# 16 rows of the 64: every family x dtype x order, each dtype under the four ways of
# checkpointing, and every pair of family, how and order (the non-reentrant bf16-autocast Llama
# rows, both orders, are the ones that failed before the NOTE)
_ROWS = [
    ("llama", "fp32", "torch_per_block_reentrant", "convert_first"),
    ("llama", "fp32", "hf", "checkpoint_first"),
    ("gpt2", "fp32", "torch_per_block", "convert_first"),
    ("gpt2", "fp32", "hf_reentrant", "checkpoint_first"),
    ("llama", "autocast_bf16", "hf", "convert_first"),
    ("llama", "autocast_bf16", "torch_per_block", "checkpoint_first"),
    ("gpt2", "autocast_bf16", "hf_reentrant", "convert_first"),
    ("gpt2", "autocast_bf16", "torch_per_block_reentrant", "checkpoint_first"),
    ("llama", "autocast_fp16", "hf_reentrant", "convert_first"),
    ("llama", "autocast_fp16", "torch_per_block_reentrant", "checkpoint_first"),
    ("gpt2", "autocast_fp16", "hf", "convert_first"),
    ("gpt2", "autocast_fp16", "torch_per_block", "checkpoint_first"),
    ("llama", "bf16_weights", "torch_per_block", "convert_first"),
    ("llama", "bf16_weights", "hf_reentrant", "checkpoint_first"),
    ("gpt2", "bf16_weights", "torch_per_block_reentrant", "convert_first"),
    ("gpt2", "bf16_weights", "hf", "checkpoint_first"),
]


@pytest.mark.parametrize("family, dtype, how, order", _ROWS, ids=["-".join(r) for r in _ROWS])
def test_slimgrad_and_checkpointing_keep_no_more_than_checkpointing(family, dtype, how, order):
    amp, weights = DTYPES[dtype]
    kw = {"dtype": amp} if amp is not None else {}
    both = copy.deepcopy(_base(family, weights))
    ck_retained, ck_peak = _alone(family, dtype, how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if order == "convert_first":
            slimgrad.convert_(both, **kw)
            _checkpoint(both, how)
        else:
            _checkpoint(both, how)
            slimgrad.convert_(both, **kw)
        sg = _warm_then_measure(both, _step(both, amp, _IDS))
    assert sg.retained_bytes <= ck_retained, (sg.retained_bytes, ck_retained)
    assert sg.peak_bytes <= ck_peak, (sg.peak_bytes, ck_peak)
    if order == "checkpoint_first":
        # a block whose forward is set on the instance may be left partly unconverted (the
        # report says why): its bits are not the lean model's
        return
    lean = _lean_grads(family, dtype)
    both.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(both, amp, _IDS)().backward()
    for (n, p), (_, q) in zip(both.named_parameters(), lean, strict=True):
        assert (p.grad is None) == (q is None), n
        assert p.grad is None or torch.equal(p.grad, q), n

"""slimgrad inside torch checkpointing under autocast (issue 33, finding 2).

Before the fix, every converted Linear under autocast read autocast's cached cast back from a
throwaway matmul node; inside a non-reentrant checkpoint region that read was an unpack of the
checkpoint's packed object, which ran the region's recompute during forward and kept its tensors
until backward: slimgrad + checkpointing kept more than eager (NOTE [Probes bypass saved-tensor
hooks] in ``slimgrad/ops/linear.py``). Here: slimgrad + checkpointing never keeps more than
checkpointing alone, in every dtype, runs each block's forward once in forward, and gives the
gradients slimgrad gives without checkpointing, bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import measure

DTYPES = pytest.mark.parametrize(
    "amp", [None, torch.bfloat16, torch.float16], ids=["fp32", "autocast_bf16", "autocast_fp16"]
)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(self.act(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)
        self.ckpt = False

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x).float().square().mean()


def _step(model, x, amp):
    def fwd():
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            return model(x)

    return fwd


@DTYPES
def test_torch_checkpoint_keeps_no_more_than_checkpointing_alone(amp):
    torch.manual_seed(0)
    eager = _Net()
    x = torch.randn(4, 16, 32)
    lean = slimgrad.convert_(copy.deepcopy(eager))
    eager.ckpt = True
    both = copy.deepcopy(lean)
    both.ckpt = True
    for m in (eager, both):  # first calls create lookup tables and caches
        _step(m, x, amp)().backward()
        m.zero_grad(set_to_none=True)
    ck = measure(_step(eager, x, amp), module=None)
    for b in both.blocks:
        b.calls = 0
    sg = measure(_step(both, x, amp), module=None)
    # each block ran once in forward and once in backward's recompute, never in forward twice
    assert [b.calls for b in both.blocks] == [2, 2, 2]
    assert sg.retained_bytes <= ck.retained_bytes, (sg.retained_bytes, ck.retained_bytes)
    # the same bits as the lean model without checkpointing
    both.zero_grad(set_to_none=True)
    lean.zero_grad(set_to_none=True)
    _step(both, x, amp)().backward()
    _step(lean, x, amp)().backward()
    for (n, p), q in zip(both.named_parameters(), lean.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    )
    return transformers.LlamaForCausalLM(cfg)


def _warm_then_not_above(step, eager, both, *others):
    # one warm-up step each (caches made on first use count there), then slimgrad + HF
    # checkpointing (`both`) retains and peaks at no more than HF checkpointing alone (`eager`)
    for m in (eager, both, *others):
        m.train()
        step(m)().backward()
        m.zero_grad(set_to_none=True)
    ck = measure(step(eager))
    sg = measure(step(both))
    assert sg.retained_bytes <= ck.retained_bytes, (sg.retained_bytes, ck.retained_bytes)
    assert sg.peak_bytes <= ck.peak_bytes, (sg.peak_bytes, ck.peak_bytes)


def _enable(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@DTYPES
def test_hf_gradient_checkpointing_keeps_no_more_than_checkpointing_alone(amp):
    base = _llama()
    ids = torch.randint(0, 512, (2, 64))
    eager, both, lean = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    slimgrad.convert_(both)
    slimgrad.convert_(lean)
    _enable(eager)
    _enable(both)

    def step(m):
        def fwd():
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                return m(input_ids=ids, labels=ids).loss

        return fwd

    _warm_then_not_above(step, eager, both, lean)
    both.zero_grad(set_to_none=True)
    step(both)().backward()
    step(lean)().backward()
    for (n, p), q in zip(both.named_parameters(), lean.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hf_gradient_checkpointing_in_low_precision_weights(dtype):
    # "in every dtype": the model itself in bf16 / fp16 (no autocast)
    base = _llama().to(dtype)
    ids = torch.randint(0, 512, (2, 64))
    eager, both = copy.deepcopy(base), copy.deepcopy(base)
    slimgrad.convert_(both)
    _enable(eager)
    _enable(both)

    def step(m):
        return lambda: m(input_ids=ids, labels=ids).loss

    _warm_then_not_above(step, eager, both)

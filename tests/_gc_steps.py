"""One training step of an HF causal LM's copies, converted or not, with HF gradient checkpointing
(non-reentrant) or not, each counted by ``slimgrad.bench.recompute_count.BackwardCounts`` over the
whole step: what the rows of "a checkpointed converted model recomputes what eager does" compare
(NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py)."""

from __future__ import annotations

import copy
import warnings

import torch

import slimgrad
from slimgrad.bench.recompute_count import BackwardCounts


def counted_step(m, ids, amp: bool) -> tuple[int, list]:
    """(matmul FLOPs of one step, the parameters' gradients), bf16 autocast where ``amp``."""
    m.zero_grad(set_to_none=True)
    with BackwardCounts() as c, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return c.matmul_flops, [p.grad for p in m.parameters()]


def checkpointed(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.gradient_checkpointing_enable({"use_reentrant": False})
    return m


def steps(base, ids, amp: bool) -> dict:
    """{(converted, checkpointed): counted_step(...)} over copies of ``base``."""
    got = {}
    for conv in (False, True):
        for gc in (False, True):
            m = copy.deepcopy(base)
            if conv:
                slimgrad.convert_(m)
            if gc:
                checkpointed(m)
            got[conv, gc] = counted_step(m, ids, amp)
    return got


def assert_recomputes_what_eager_does(got: dict) -> int:
    """The converted model's recomputed FLOPs under checkpointing equal eager's (> 0), and its
    gradients are those of the converted model without checkpointing; returns eager's."""
    eager = got[False, True][0] - got[False, False][0]
    assert eager > 0 and got[True, True][0] - got[True, False][0] == eager
    for a, b in zip(got[True, False][1], got[True, True][1], strict=True):
        assert torch.equal(a, b)
    return eager

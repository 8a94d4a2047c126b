"""The fused loss under torch's selective checkpointing with a policy that saves matmul outputs
(NOTE [The fused loss under a mode that stores results] in slimgrad/ops/linear_cross_entropy.py):
it wrote in place into logits the mode had stored, so the recompute raised or, with
``allow_cache_entry_mutation=True``, got overwritten logits and every gradient was wrong."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import slimgrad
from slimgrad.ops import linear_cross_entropy

_aten = torch.ops.aten


def _policy(ctx, op, *args, **kwargs):
    saved = op in (_aten.mm.default, _aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mutation", [False, True])
def test_the_op_under_selective_checkpointing_saving_matmuls(mutation):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(200, 32, generator=g) * 0.1)
    t = torch.randint(0, 200, (64,), generator=g)
    t[::7] = -100
    ctx = functools.partial(
        create_selective_checkpoint_contexts, _policy, allow_cache_entry_mutation=mutation
    )
    got = []
    for sac in (False, True):
        h.grad = w.grad = None

        def loss(x):
            return linear_cross_entropy(torch.tanh(x), w, t)

        out = checkpoint(loss, h, use_reentrant=False, context_fn=ctx) if sac else loss(h)
        out.backward()
        got.append((out.detach(), h.grad.clone(), w.grad.clone()))
    for a, b in zip(got[0], got[1], strict=True):
        assert _max_rel(b, a) < 1e-5


@pytest.mark.parametrize("mutation", [False, True])
def test_a_converted_gpt2_checkpointed_whole_under_such_a_policy(mutation):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=4, vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slimgrad.convert_(m)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    ctx = functools.partial(
        create_selective_checkpoint_contexts, _policy, allow_cache_entry_mutation=mutation
    )

    def run(i):
        return m(input_ids=i, labels=i, use_cache=False).loss

    grads = []
    for sac in (False, True):
        m.zero_grad(set_to_none=True)
        (checkpoint(run, ids, use_reentrant=False, context_fn=ctx) if sac else run(ids)).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert _max_rel(b, a) < 1e-5

"""Issue 32's compile target at ``benchmarks/compile_step.py``'s "small" GPT-2 (width 128, vocab
2048, 4 x 128 tokens, GPT-2's default dropout 0.1 everywhere, attention included; 1 of its 4
layers, the same blocks: the kept ratio is a per-block one plus the embedding and loss ends):
``torch.compile(convert_(m))`` keeps at most 1.05x what the uncompiled converted model keeps after
forward, and its loss is the uncompiled converted model's.

Compiled with ``aot_eager_decomp_partition`` (inductor's decompositions and min-cut partitioner
without its C++ builds: the same choice of saved values as inductor's, as
``tests/test_compile_saved.py``). Kept bytes: the unique storages the autograd graph holds at
the end of forward, walked from the loss, parameters excluded (``slimgrad.memory``'s walk).
"""

from __future__ import annotations

import pytest
import torch

import slimgrad
from slimgrad.memory import _storage, _walk_savers

transformers = pytest.importorskip("transformers")

BACKEND = "aot_eager_decomp_partition"


def _small_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=2048, n_embd=128, n_layer=1, n_head=4, n_positions=128,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).float().train()
    ids = torch.randint(4, 2048, (4, 128), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _kept_after_forward(model, fwd, batch) -> tuple[int, float]:
    params = {_storage(p)._cdata for p in model.parameters()}
    torch.manual_seed(0)
    loss = fwd(**batch).loss
    found = _walk_savers([loss.grad_fn])
    kept = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in params)
    value = float(loss)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept, value


@pytest.mark.slow  # compiles
def test_small_gpt2_compiled_keeps_what_uncompiled_keeps():
    model, batch = _small_gpt2()
    slimgrad.convert_(model)
    kept, loss = _kept_after_forward(model, model, batch)
    torch._dynamo.reset()
    try:
        fwd = torch.compile(model, backend=BACKEND)
        _kept_after_forward(model, fwd, batch)  # compiles forward and backward
        kept_compiled, loss_compiled = _kept_after_forward(model, fwd, batch)
    finally:
        torch._dynamo.reset()
    assert kept_compiled <= 1.05 * kept, (kept_compiled, kept, kept_compiled / kept)
    # the same dropout draws (eager's, from the global generator) and the same ops up to the
    # compiled graph's reassociations
    assert loss_compiled == pytest.approx(loss, rel=1e-5, abs=1e-6)

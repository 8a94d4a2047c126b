"""A tied weight's two gradients are summed in place by autograd in a converted model.

Without a dispatch mode, autograd's engine adds the second gradient meeting at a tensor into the
first when it holds the last reference to it; NOTE [How live bytes are counted]
(``slimgrad/memory.py``) says how the tracker, under whose mode the engine sums out of place,
counts such sums as a real run does them, and ``tests/test_memory_truth.py`` checks the tracker's
peaks against the allocator. This test checks the real-run fact itself for HF GPT-2 (tied
``wte``/``lm_head``), without any dispatch mode: the gradient left in ``wte.grad`` is the buffer
of the first gradient to arrive (the fused loss's), i.e. the embedding's gradient was added into
it. It fails if slimgrad's fused loss (or anything between it and the weight) keeps a reference to
the gradient it returns, which would force the out-of-place sum and a third buffer.
"""

from __future__ import annotations

import pytest
import torch

import slimgrad

transformers = pytest.importorskip("transformers")


def _accumulate_grad_node(root, param):
    """(wte's AccumulateGrad node, every node of the graph)."""
    seen, stack, acc = set(), [root], None
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "AccumulateGrad" and fn.variable is param:
            acc = fn
        stack.extend(nxt for nxt, _ in fn.next_functions)
    assert acc is not None, "no AccumulateGrad node for the parameter"
    return acc, seen


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_tied_embedding_gradients_are_summed_in_place(autocast):
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=1000,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = slimgrad.convert_(transformers.GPT2LMHeadModel(cfg))
    assert slimgrad.report(model).converted, slimgrad.report(model)  # not eager vs eager
    wte = model.transformer.wte.weight
    assert wte is model.lm_head.weight
    ids = torch.randint(0, 1000, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    acc, nodes = _accumulate_grad_node(loss.grad_fn, wte)
    arrived = []  # (node name, data_ptr) of each gradient sent to wte's AccumulateGrad
    for fn in nodes:
        name = type(fn).__name__
        for i, (nxt, _) in enumerate(fn.next_functions):
            if nxt is acc:

                def record(grad_inputs, grad_outputs, i=i, name=name):
                    arrived.append((name, grad_inputs[i].data_ptr()))

                fn.register_hook(record)
    loss.backward()
    assert len(arrived) == 2, arrived  # the loss's head gradient and the embedding's
    assert arrived[0][0] != "EmbeddingBackward0"  # the head's arrives first
    assert wte.grad.data_ptr() == arrived[0][1], (arrived, wte.grad.data_ptr())

"""Set-up shared by the tests of GPT-2's one-node attention and MLP
(tests/ops/test_gpt2_attention.py, tests/ops/test_gpt2_attention_ext.py,
tests/ops/test_gpt2_mlp_ext.py): a small HF GPT-2, one training step's loss and gradients, their
bit-for-bit comparison, the C++ extension."""

from __future__ import annotations

import pytest
import torch

from slimgrad import _ext


def ext_or_skip():
    """The C++ extension; the test skips where it is not here (the Python bodies run there)."""
    if _ext.load() is None:
        pytest.skip(f"the C++ extension is not here ({_ext.error()}): the Python body runs")
    return _ext.load()


def gpt2_model(layers=2, pdrop=0.1, width=32, **kw):
    """``GPT2LMHeadModel`` with 4 heads, 97 tokens, 64 positions, every dropout ``pdrop`` and
    ``kw`` on its config; its weights drawn from seed 0."""
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=97, n_positions=64,
        resid_pdrop=pdrop, attn_pdrop=pdrop, embd_pdrop=pdrop, bos_token_id=0, eos_token_id=0,
        **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_step(model, ids, **kw):
    """One language-model step on ``ids`` (the dropout masks from seed 5): the loss and the
    gradients by parameter name (those that got one); the gradients are taken off the model."""
    torch.manual_seed(5)  # the dropout masks
    loss = model(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def assert_same_step(a, b):
    """Two ``gpt2_step`` results: the same loss and the same gradients, bit for bit."""
    (loss, grads), (loss_p, grads_p) = a, b
    assert torch.equal(loss, loss_p)
    assert grads.keys() == grads_p.keys()
    for k in grads:
        assert torch.equal(grads[k], grads_p[k]), k


def assert_equal_each(got, expected):
    """Two sequences of tensors (a node's gradients): equal one by one, bit for bit."""
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def under_a_function_mode(ext_fn):
    """``ext_fn`` called with a torch function mode on (autograd's engine runs backward with the
    caller's modes off, so the mode is entered around the extension's call itself): the wrapper,
    and the list of what each call handed back."""
    results = []

    def under_mode(*a):
        with _PassThrough():
            results.append(ext_fn(*a))
        return results[-1]

    return under_mode, results


def measure_step(model, ids):
    """``slimgrad.memory.measure`` of one language-model step on ``ids`` (the dropout masks from
    seed 5); the gradients are taken off the model."""
    from slimgrad import memory

    torch.manual_seed(5)
    r = memory.measure(lambda: model(input_ids=ids, labels=ids).loss)
    for p in model.parameters():
        p.grad = None
    return r

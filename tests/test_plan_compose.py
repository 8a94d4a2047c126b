"""A planned model composes with what users already do (issue 33): activation offloading
(``torch.autograd.graph.save_on_cpu``, ``saved_tensors_hooks``), ``step_in_backward`` and FSDP2
give the bits of the same model without them, and recompute stays exact (the lean model's bits).
HF ``gradient_checkpointing_enable()``, ``torch.utils.checkpoint`` in the model and autocast are
in tests/test_plan_checkpoint_autocast.py."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

import slimgrad
from slimgrad import step_in_backward
from tests import _plan_cache
from tests.test_plan import _data, _make

# every kind of choice on the toy net of tests/test_plan.py (dropout 0.2: the masks must repeat)
_MIXED = {
    "blocks.0": "lean+recompute",
    "blocks.1": "lean+recompute:fc1",
    "blocks.2": "eager+recompute",
    "blocks.3": "lean",
}


@pytest.fixture(scope="module")
def mixed_plan():
    return dataclasses.replace(_plan_cache.toy(), choices=dict(_MIXED))


def _model(p=None):
    fwd, m = _make()()
    if p is not None:
        slimgrad.convert_(m, plan=p)
    return m


def _step(m, hooks=None, seed: int = 3):
    x, y = _data()
    torch.manual_seed(seed)
    m.zero_grad(set_to_none=True)
    ctx = hooks() if hooks is not None else torch.autograd.graph.saved_tensors_hooks(*_ID)
    with ctx:
        loss = m(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters()]


_ID = (lambda t: t, lambda t: t)


def _packing():
    # identity hooks that count the bytes of each distinct storage they are handed
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    return seen, (lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))


def test_a_planned_model_under_save_on_cpu_gives_its_bits_without_hooks(mixed_plan):
    m = _model(mixed_plan)
    plain = _step(m)
    offloaded = _step(m, torch.autograd.graph.save_on_cpu)
    torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)
    # and the lean model's bits: the recomputed blocks give what they give without recompute
    # (without user hooks: under hooks that pack each tensor a block outside a checkpoint keeps
    # its GELU's input, as eager, and gets eager's GELU bits, NOTE [Under hooks that pack each
    # tensor] in slimgrad/ops/_output_act.py, while inside a checkpoint it keeps y)
    same = {**_MIXED, "blocks.0": "lean", "blocks.1": "lean", "blocks.2": "eager"}
    ref = _model(dataclasses.replace(mixed_plan, choices=same))
    unhooked = _step(m, contextlib.nullcontext)
    torch.testing.assert_close(_step(ref, contextlib.nullcontext), unhooked, rtol=0, atol=0)


def test_offloading_a_planned_model_moves_fewer_bytes_than_offloading_eager(mixed_plan):
    # what an offloading hook is handed is what it copies: slimgrad's blocks hand it fewer bytes
    # than eager's, with and without checkpointing, and the planned model fewer than the eager
    # one; the same loss bits as without hooks
    sizes = {}
    for label, choices in (
        ("eager", dict.fromkeys(_MIXED, "eager")),
        ("lean", dict.fromkeys(_MIXED, "lean")),
        ("checkpoint-all", dict.fromkeys(_MIXED, "eager+recompute")),
        ("lean+checkpoint", dict.fromkeys(_MIXED, "lean+recompute")),
        ("planned", _MIXED),
    ):
        p = dataclasses.replace(mixed_plan, choices=choices)
        m = _model(p)
        seen, hooks = _packing()
        loss, _ = _step(m, hooks)
        assert torch.equal(loss, _step(m)[0])
        sizes[label] = sum(seen.values())
    assert sizes["lean"] < sizes["eager"], sizes
    assert sizes["lean+checkpoint"] <= sizes["checkpoint-all"], sizes
    assert sizes["planned"] < sizes["eager"], sizes


def test_step_in_backward_on_a_planned_model_is_the_plain_loop(mixed_plan):
    a, b = _model(mixed_plan), _model(mixed_plan)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    handle = step_in_backward(b, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        for m, o in ((a, opt), (b, handle)):
            x, y = _data(seed=10 + step)
            torch.manual_seed(step)  # the same dropout masks on both
            m(x, y).backward()
            o.step()
            o.zero_grad()
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda s, n=n: f"{n}: {s}")
    assert all(p.grad is None for p in b.parameters())


# --- FSDP2 (2 gloo processes) -----------------------------------------------------------------

_FSDP_CHOICES = {"model.layers.0": "lean+recompute", "model.layers.1": "lean+recompute:mlp"}


def _fsdp_run(choices: dict, rank: int) -> dict:
    from torch.distributed import fsdp

    from slimgrad.plan import apply_choices
    from tests.distributed._gloo import VOCAB, tiny_llama

    model = tiny_llama()
    apply_choices(model, choices)
    for block in model.model.layers:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(100 + 10 * rank + step)
        ids = torch.randint(1, VOCAB, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "grad": grads}


def _fsdp_both(rank: int) -> dict:
    lean = dict.fromkeys(_FSDP_CHOICES, "lean")
    return {"planned": _fsdp_run(_FSDP_CHOICES, rank), "lean": _fsdp_run(lean, rank)}


@pytest.mark.distributed
def test_a_planned_model_under_fsdp2_gives_the_lean_models_bits(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch.distributed.fsdp")
    from tests.distributed._gloo import run_on_two_ranks

    for res in run_on_two_ranks(functools.partial(_fsdp_both), tmp_path):
        torch.testing.assert_close(res["planned"], res["lean"], rtol=0, atol=0)

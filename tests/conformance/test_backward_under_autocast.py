"""A backward called inside an autocast region (NOTE [Backward without autocast] in
slimgrad/_autograd.py).

``with torch.autocast(...): loss = model(x); loss.backward()`` ran every slimgrad backward with
autocast on: a recomputed product came back in bf16 beside float32 operands (RuntimeError on
converted GPT-2, BERT, Llama, OPT, ViT ...) and the attention's dropout C kernel wrote float32
elements over a bf16 recompute (heap corruption), where eager runs. Each slimgrad backward now runs
with autocast off: the gradients of the same step with the backward outside autocast, bit for bit
wherever every backward op of the model is slimgrad's, and finite elsewhere (eager's own ops in
the model follow autocast, as in eager).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import slimgrad
from slimgrad import ownership
from slimgrad.ops.softmax_dropout import scores_softmax_dropout_matmul
from tests.conformance._hf_families import FAMILIES, build, inputs

_BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_the_scores_op_backward_under_autocast(p):
    # the forward's straight path in float32, the backward inside bf16 autocast: heap corruption
    # before (the dropout C kernel's float32 pass over a bf16 recompute)
    torch.manual_seed(0)
    q, k_t, v = (torch.randn(12, 16, 8), torch.randn(12, 8, 16), torch.randn(12, 16, 8))
    leaves = [t.requires_grad_() for t in (q, k_t, v)]
    got = []
    for under in (False, True):
        for t in leaves:
            t.grad = None
        torch.manual_seed(1)
        out = scores_softmax_dropout_matmul(q, k_t, v, p)
        with torch.autocast(**_BF16, enabled=under):
            out.square().sum().backward()
        got.append(_grads(leaves))
    for a, b in zip(*got, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def _step(model, batch, forward_in: bool, backward_in: bool):
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    with torch.autocast(**_BF16, enabled=forward_in):
        loss = model(**batch).loss
    with torch.autocast(**_BF16, enabled=backward_in):
        loss.backward()
    return _grads(model.parameters())


@pytest.mark.parametrize("forward_in", [False, True])
@pytest.mark.parametrize("fam", ["gpt2", "bert", "llama", "opt", "vit", "bart"])
def test_a_converted_models_backward_inside_autocast(fam, forward_in):
    base = build(FAMILIES[fam]).train()
    batch = inputs(FAMILIES[fam], base, labels=True)
    slim = slimgrad.convert_(copy.deepcopy(base))
    ref = _step(slim, batch, forward_in, False)
    got = _step(slim, batch, forward_in, True)  # raised (or aborted) before
    for a, b in zip(got, ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and bool(torch.isfinite(a).all())
            if fam == "gpt2" or (forward_in and fam in ("bert", "opt", "vit", "bart")):
                assert torch.equal(a, b)  # every backward op there is slimgrad's


def test_conv_blocks_backward_inside_autocast():
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Conv2d(8, 4, 1),
    ).train()
    slim = slimgrad.convert_(copy.deepcopy(net))
    x = torch.randn(2, 3, 8, 8)
    got = []
    for under in (False, True):
        slim.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = slim(x).square().mean()
        with torch.autocast(**_BF16, enabled=under):
            loss.backward()
        got.append(_grads(slim.parameters()))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


def test_a_compiled_step_under_autocast_compiles_once():
    # Dynamo guards on the backward's code of a Function a compiled forward applies; an answer
    # that changed with autocast outside a backward recompiled every step (the review)
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    nn = torch.nn
    torch.manual_seed(0)
    slim = slimgrad.convert_(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
    x = torch.randn(4, 16)
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(slim, backend="aot_eager")
    new = []
    for _ in range(4):
        before = counters["stats"]["unique_graphs"]
        with torch.autocast(**_BF16):
            compiled(x).float().square().mean().backward()
        new.append(counters["stats"]["unique_graphs"] - before)
    dynamo.reset()
    assert new[0] > 0 and new[1:] == [0, 0, 0]


def _conv_bn_relu():
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GELU(),
    ).train()


def _measured_step(slim, x, backward_in: bool, hook=None):
    from slimgrad.memory import measure

    def forward():
        with torch.autocast(**_BF16, enabled=False):
            out = slim(x)
            if hook is not None:
                out.register_hook(hook)
            return out.square().mean()

    slim.zero_grad(set_to_none=True)
    ownership.reset_reuse_count()
    torch.manual_seed(1)
    with torch.autocast(**_BF16, enabled=backward_in):
        m = measure(forward, timeline=False)
    return m, ownership.reuse_count("grad"), _grads(slim.parameters())


def test_a_backward_inside_autocast_keeps_the_buffer_grants():
    # NOTE [The chain through autocast's wrapper] in slimgrad/ownership.py: the wrapper that turns
    # autocast off holds one more reference to each incoming gradient, and every grant there was
    # refused (a conv -> BN -> ReLU -> conv backward peaked 2 MB above the same one outside)
    slim = slimgrad.convert_(_conv_bn_relu())
    x = torch.randn(4, 3, 16, 16)
    _measured_step(slim, x, False)  # first-use caches
    out_m, out_n, out_g = _measured_step(slim, x, False)
    in_m, in_n, in_g = _measured_step(slim, x, True)
    assert out_n > 0 and in_n == out_n
    assert in_m.peak_bytes == out_m.peak_bytes
    for a, b in zip(in_g, out_g, strict=True):
        assert torch.equal(a, b)


def test_a_kept_gradient_inside_autocast_is_never_written_over():
    # the chain's baseline counts the wrapper's reference, nothing more: a hook that keeps the
    # incoming gradient still refuses the grant, inside autocast as outside (bit for bit with
    # reuse off, the kept gradient unchanged)
    slim = slimgrad.convert_(_conv_bn_relu())
    x = torch.randn(4, 3, 16, 16)
    results = []
    for backward_in in (False, True):
        for off in (False, True):
            kept = []
            with ownership.reuse_disabled() if off else contextlib.nullcontext():
                _, _, grads = _measured_step(slim, x, backward_in, hook=kept.append)
            results.append((kept[0].clone(), grads, kept[0]))
    ref_kept, ref_grads, _ = results[1]
    for kept_copy, grads, kept in results:
        assert torch.equal(kept, kept_copy) and torch.equal(kept, ref_kept)
        for a, b in zip(grads, ref_grads, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fam", ["gpt2", "llama", "vit"])
def test_a_converted_models_grants_inside_autocast(fam):
    # as many grants as outside autocast, and the same bits as the backward inside autocast with
    # reuse off (eager's own backward ops there follow autocast, so not the bits of outside)
    base = build(FAMILIES[fam]).train()
    batch = inputs(FAMILIES[fam], base, labels=True)
    slim = slimgrad.convert_(copy.deepcopy(base))
    counts, got = [], []
    for backward_in, off in ((False, False), (False, False), (True, False), (True, True)):
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if off else contextlib.nullcontext():
            got.append(_step(slim, batch, False, backward_in))
        counts.append(ownership.reuse_count("grad"))
    assert counts[1] > 0 and counts[2] == counts[1] and counts[3] == 0
    for a, b in zip(got[2], got[3], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


_FIRST_QUESTION_INSIDE = """
import torch, slimgrad
from slimgrad import ownership
from tests.conformance.test_backward_under_autocast import _conv_bn_relu
slim = slimgrad.convert_(_conv_bn_relu())
x = torch.randn(2, 3, 8, 8)
counts = []
for inside in (True, False, True):
    ownership.reset_reuse_count()
    loss = slim(x).square().mean()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
        loss.backward()
    counts.append(ownership.reuse_count("grad"))
assert counts[0] > 0 and counts[0] == counts[1] == counts[2], counts
"""


def test_the_first_question_of_a_process_inside_autocast():
    # calibration then runs inside the wrapper of a node whose autocast is off: every chain still
    # gets its baseline, and the grants inside and outside match from the first step on
    from tests._child import run_checks

    res = run_checks({"first_inside": _FIRST_QUESTION_INSIDE})
    assert res["first_inside"] == "ok", res["first_inside"]
